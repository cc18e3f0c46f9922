"""Whether a step is its plan's captured one beyond the saves the plan acts on, seen without following its
operations: the model's own autograd nodes, and where `torch.autocast` is on.

The executor counts the nodes a forward pass made by sequence numbers (free) and walks the graph (`model_nodes`)
only where that count differs from the captured one, which happens where something watches the step: a module's
full backward hooks (Captum, loggers; PyTorch's MemTracker given an input that requires grad) pass its inputs and
outputs through nodes of their own, and an input that requires grad makes nodes for what reads it alone. Neither is
the model's, and neither changes what the plan does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["OBSERVER_NODES", "autocast_state", "model_nodes"]

# The kinds of autograd node that watchers of a step add to its forward pass (a full backward hook's).
OBSERVER_NODES = frozenset({"BackwardHookFunctionBackward"})


def model_nodes(outputs: Iterable[torch.Tensor], first: int, inputs: Iterable[Any] = ()) -> list[tuple[int, str]]:
    """The model's autograd nodes of a forward pass that began at sequence number `first`, as (sequence number,
    kind) in the order they were made: those a backward pass from `outputs` runs that lead to a parameter (not
    only to the model's `inputs`), less those observers add (`OBSERVER_NODES`). A walk in Python (about a
    microsecond a node)."""
    given = {id(t) for t in inputs}
    reaches: dict[int, bool] = {}  # node -> whether it leads to a parameter
    made: dict[int, tuple[int, str]] = {}
    stack: list[tuple[Any, bool]] = [(t.grad_fn, False) for t in outputs if t.grad_fn is not None]
    while stack:  # depth first; a node's verdict once its next functions have theirs (the graph has no cycle)
        node, expanded = stack.pop()
        key = id(node)
        if expanded:
            reaches[key] = any(reaches.get(id(fn), False) for fn, _ in node.next_functions if fn is not None)
        elif key not in reaches and key not in made:
            if type(node).__name__ == "AccumulateGrad":
                reaches[key] = id(node.variable) not in given
            elif node._sequence_nr() < first:  # made before the forward pass
                reaches[key] = False
            else:
                made[key] = (node._sequence_nr(), type(node).__name__)
                stack.append((node, True))
                stack.extend((fn, False) for fn, _ in node.next_functions if fn is not None)
    return sorted(seq_kind for key, seq_kind in made.items() if reaches[key] and seq_kind[1] not in OBSERVER_NODES)


def autocast_state() -> tuple[tuple[str, torch.dtype], ...]:
    """Where `torch.autocast` is on now: (device type, dtype) of each (CPU, CUDA). A step captured inside it runs
    other operations (casts) and saves other dtypes than one captured outside it."""
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))
