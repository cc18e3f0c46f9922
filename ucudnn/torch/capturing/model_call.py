"""A model's call as the capture, the planner and the executor see it: an example input as the call's arguments,
each argument tensor by the name of the parameter it binds to, the tensors of the model's output, and the loss
a step backpropagates where the user gives none."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_leaves

from ucudnn.errors import InvalidInput

__all__ = ["batched_call", "call_args", "default_loss", "input_leaves", "tensors_in"]


def call_args(example: Any) -> tuple[tuple, dict]:
    """The model call for `example`: a tensor (one argument), a tuple or list (positional arguments)
    or a dict (keyword arguments)."""
    if isinstance(example, torch.Tensor):
        return (example,), {}
    if isinstance(example, (tuple, list)):
        return tuple(example), {}
    if isinstance(example, Mapping):
        if not all(isinstance(k, str) for k in example):
            raise InvalidInput(
                "example_input as a dict maps the model's argument names to values; got a non-string key"
            )
        return (), dict(example)
    raise InvalidInput(
        f"example_input must be a tensor, a tuple of positional arguments or a dict of keyword "
        f"arguments, got {type(example).__name__}"
    )


def batched_call(example: Any) -> tuple[tuple, dict, list[torch.Tensor]]:
    """`call_args(example)` and the tensors in it, the first of which must be batched (its first dimension)."""
    args, kwargs = call_args(example)
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors or tensors[0].dim() < 1:
        raise InvalidInput("example_input must hold a batched tensor (its first dimension is the batch)")
    return args, kwargs, tensors


def input_leaves(
    model: nn.Module, args: tuple, kwargs: dict, signature: inspect.Signature | None = None
) -> list[tuple[str, Any]]:
    """Each leaf of a call's arguments with the name of the parameter it binds to (and its place in a
    nested argument): a call with positional arguments and one with keywords name them alike. `signature`:
    the model's forward's, where the caller keeps it (a step's executor: making it costs tens of us)."""
    try:
        items = list((signature or inspect.signature(model.forward)).bind(*args, **kwargs).arguments.items())
    except (TypeError, ValueError):  # no signature to bind to: positions, then keywords
        items = [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []
    for name, value in items:
        leaves, _ = tree_flatten(value)
        out += [(name if len(leaves) == 1 else f"{name}.{i}", leaf) for i, leaf in enumerate(leaves)]
    return out


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors in a model's output: a tensor, tuples, lists, dicts and ModelOutputs of them."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in tensors_in(v)]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors_in(v)]
    return []


def default_loss(output: Any) -> torch.Tensor:
    """The output's ``loss`` where it has one (a Hugging Face model given labels), else the sum of
    every floating tensor of the output that requires a gradient."""
    given = output.get("loss") if isinstance(output, Mapping) else None
    if isinstance(given, torch.Tensor) and given.numel() == 1:
        return given
    parts = [t.float().sum() for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
    if not parts:
        raise InvalidInput("the model's output holds no floating tensor that requires grad; give loss=")
    return functools.reduce(torch.add, parts)
