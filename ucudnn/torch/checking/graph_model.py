"""A training graph (a zoo network's) as a PyTorch model, so that a plan can be checked against a real step.

`model_of(graph)` builds an `nn.Module` that runs `graph`'s operations in order: each conv from its
`ConvProblem` (no bias, as the zoo counts no bias), batch-norm, ReLU (in place where the graph's is),
pooling to the graph's output size (`nn.AdaptiveMaxPool2d` / `AdaptiveAvgPool2d`: the graph keeps
shapes, not windows), flatten, linear, add and concat; it returns what the graph's loss reads. Its
feature maps have the graph's shapes, so the plan `ucudnn.torch.plan_memory` makes for it is the zoo
network's, with names from its captured step (``layers.conv1:conv``).
"""

from __future__ import annotations

import torch
from torch import nn

from ucudnn.errors import UnsupportedProblem
from ucudnn.memory.graph import TrainingGraph

__all__ = ["model_of"]


def _key(name: str) -> str:
    return name.replace(".", "_")  # a ModuleDict key cannot hold a dot


class ZooModel(nn.Module):
    """The operations of a training graph, run in its order (see the module docstring)."""

    def __init__(self, graph: TrainingGraph) -> None:
        super().__init__()
        self.network = graph.network
        self.layers = nn.ModuleDict()
        self.program: list[tuple[str, str, tuple[str, ...]]] = []
        for op in graph.ops:
            if op.type == "conv":
                p = op.conv
                assert p is not None  # a conv op holds its problem
                self.layers[_key(op.name)] = nn.Conv2d(
                    p.c,
                    p.k,
                    (p.r, p.s),
                    stride=(p.stride_h, p.stride_w),
                    padding=(p.pad_h, p.pad_w),
                    dilation=(p.dilation_h, p.dilation_w),
                    groups=p.groups,
                    bias=False,
                )
            elif op.type == "batchnorm":
                self.layers[_key(op.name)] = nn.BatchNorm2d(op.shape[1])
            elif op.type == "relu":
                self.layers[_key(op.name)] = nn.ReLU(inplace=op.inplace)
            elif op.type == "pool":
                pool = nn.AdaptiveMaxPool2d if op.saves else nn.AdaptiveAvgPool2d
                self.layers[_key(op.name)] = pool(tuple(op.shape[2:]))
            elif op.type == "linear":
                self.layers[_key(op.name)] = nn.Linear(graph.op(op.inputs[0]).shape[1], op.shape[1])
            elif op.type not in ("input", "view", "add", "concat", "loss"):
                raise UnsupportedProblem(
                    f"{graph.network}: op {op.name!r} of type {op.type!r} has no PyTorch layer here"
                )
            self.program.append((op.type, op.name, op.inputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        values: dict[str, torch.Tensor] = {}
        for kind, name, inputs in self.program:
            if kind == "input":
                values[name] = x
            elif kind == "view":
                values[name] = torch.flatten(values[inputs[0]], 1)
            elif kind == "add":
                values[name] = values[inputs[0]] + values[inputs[1]]
            elif kind == "concat":
                values[name] = torch.cat([values[i] for i in inputs], 1)
            elif kind == "loss":
                return values[inputs[0]]
            else:
                values[name] = self.layers[_key(name)](values[inputs[0]])
        raise UnsupportedProblem(f"{self.network}: the graph has no loss")


def model_of(graph: TrainingGraph) -> nn.Module:
    """`graph` as a PyTorch model (see the module docstring)."""
    return ZooModel(graph)
