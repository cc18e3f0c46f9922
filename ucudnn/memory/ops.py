"""An op of the training graph and what it costs: one builder computes the zoo's ops' output shapes, flops,
traffic and weights (`ucudnn.memory.graph`); a captured PyTorch step (`ucudnn.torch.capturing.capture`) makes its ops
from what PyTorch ran.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ucudnn.problem import ConvProblem

__all__ = ["DTYPE_BYTES", "OP_TYPES", "Op", "OpBuilder"]

OP_TYPES = ("input", "conv", "relu", "pool", "batchnorm", "linear", "add", "concat", "view", "loss", "other")
DTYPE_BYTES = 4  # float32 throughout: the zoo and the measurements are float32


@dataclass(frozen=True, slots=True)
class Op:
    """One operation. `inputs` are feature-map names; its own feature map is named `name`."""

    name: str
    type: str  # one of OP_TYPES
    inputs: tuple[str, ...]
    shape: tuple[int, ...]  # of its output feature map
    inplace: bool = False  # writes into inputs[0]'s storage
    saves: tuple[str, ...] = ()  # feature maps its backward step reads
    flops: float = 0.0  # forward arithmetic (the backward step counts twice this)
    bytes_moved: float = 0.0  # forward device-memory traffic (the backward step counts twice)
    weight_bytes: int = 0
    conv: ConvProblem | None = None  # the forward problem of a conv
    module: str = ""  # traced from PyTorch: the qualified name of the module it calls
    measured_ms: float | None = None  # its forward step timed on the planned device, where it was
    measured_bwd_ms: float | None = None  # and its backward step (None: twice the forward's)
    nbytes: int | None = None  # its storage's bytes where known exactly (a captured op: any dtype, every output)
    # a captured converted conv: per kernel kind, (bytes of its operands' copies into the layout its planned kernels
    # run in, held while one runs; bytes of its result's copy into torch's memory format, made after it), where
    # an operand comes in another format (a channels-last map where they run NCHW): `ucudnn.torch.converting.launch`
    layout_copies: tuple[tuple[str, int, int], ...] = ()

    @property
    def bytes(self) -> int:
        return self.nbytes if self.nbytes is not None else DTYPE_BYTES * math.prod(self.shape)


def _elements(shape: Sequence[int]) -> int:
    return math.prod(shape)


class OpBuilder:
    """Appends ops with their shapes, flops and traffic; convolutions come from the zoo's layer list."""

    def __init__(self, batch: int, zoo: Iterable | None = None) -> None:
        self.batch = batch
        self.ops: list[Op] = []
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.zoo = {layer.name: layer.problem for layer in zoo} if zoo is not None else {}

    def _add(self, op: Op) -> str:
        self.ops.append(op)
        self.shapes[op.name] = op.shape
        return op.name

    def input(self, name: str, shape: tuple[int, ...]) -> str:
        return self._add(Op(name, "input", (), shape))

    def conv(self, name: str, x: str) -> str:
        p = self.zoo[name]
        if p.x_shape != self.shapes[x]:
            raise AssertionError(f"{name}: input {self.shapes[x]} is not the zoo's {p.x_shape}")
        weight = DTYPE_BYTES * math.prod(p.w_shape)
        traffic = DTYPE_BYTES * (_elements(p.x_shape) + _elements(p.y_shape)) + weight
        return self._add(
            Op(
                name,
                "conv",
                (x,),
                p.y_shape,
                saves=(x,),
                flops=p.flops,
                bytes_moved=traffic,
                weight_bytes=weight,
                conv=p.with_kind("fwd"),
            )
        )

    def relu(self, name: str, x: str, inplace: bool = True) -> str:
        shape = self.shapes[x]
        return self._add(
            Op(
                name,
                "relu",
                (x,),
                shape,
                inplace=inplace,
                saves=(name,),
                flops=_elements(shape),
                bytes_moved=2 * DTYPE_BYTES * _elements(shape),
            )
        )

    def batchnorm(self, name: str, x: str) -> str:
        shape = self.shapes[x]
        return self._add(
            Op(
                name,
                "batchnorm",
                (x,),
                shape,
                saves=(x,),
                flops=8 * _elements(shape),
                bytes_moved=3 * DTYPE_BYTES * _elements(shape),
                weight_bytes=2 * DTYPE_BYTES * shape[1],
            )
        )

    def pool(self, name: str, x: str, shape: tuple[int, ...], window: int, kind: str = "max") -> str:
        """A max or average pool. Its backward step reads what cuDNN's reads (the papers'
        frameworks): a max-pool's input and output, an average pool's nothing."""
        saves = (x, name) if kind == "max" else ()
        return self._add(
            Op(
                name,
                "pool",
                (x,),
                shape,
                saves=saves,
                flops=window * window * _elements(shape),
                bytes_moved=DTYPE_BYTES * (_elements(self.shapes[x]) + _elements(shape)),
            )
        )

    def pooled(
        self, name: str, x: str, kernel: int, stride: int, pad: int = 0, *, ceil: bool = False, kind: str = "max"
    ) -> str:
        n, c, h, w = self.shapes[x]

        def size(v: int) -> int:
            span = v + 2 * pad - kernel
            out = (math.ceil(span / stride) if ceil else span // stride) + 1
            # PyTorch and Caffe both drop a last window that starts inside the right padding
            if ceil and (out - 1) * stride >= v + pad:
                out -= 1
            return out

        return self.pool(name, x, (n, c, size(h), size(w)), kernel, kind)

    def global_pool(self, name: str, x: str) -> str:
        n, c, h, _w = self.shapes[x]
        return self.pool(name, x, (n, c, 1, 1), h, kind="avg")

    def flatten(self, name: str, x: str) -> str:
        shape = self.shapes[x]
        return self._add(Op(name, "view", (x,), (shape[0], _elements(shape[1:])), inplace=True))

    def linear(self, name: str, x: str, out_features: int) -> str:
        *lead, in_features = self.shapes[x]  # nn.Linear maps the last dimension; the others are batch
        n = math.prod(lead)
        weight = DTYPE_BYTES * (in_features * out_features + out_features)
        return self._add(
            Op(
                name,
                "linear",
                (x,),
                (*lead, out_features),
                saves=(x,),
                flops=2 * n * in_features * out_features,
                bytes_moved=DTYPE_BYTES * n * (in_features + out_features) + weight,
                weight_bytes=weight,
            )
        )

    def add(self, name: str, a: str, b: str, inplace: bool = True) -> str:
        shape = self.shapes[a]
        if self.shapes[b] != shape:
            raise AssertionError(f"{name}: adding {shape} and {self.shapes[b]}")
        return self._add(
            Op(
                name,
                "add",
                (a, b),
                shape,
                inplace=inplace,
                flops=_elements(shape),
                bytes_moved=3 * DTYPE_BYTES * _elements(shape),
            )
        )

    def concat(self, name: str, inputs: Sequence[str]) -> str:
        shapes = [self.shapes[i] for i in inputs]
        n, _, h, w = shapes[0]
        shape = (n, sum(s[1] for s in shapes), h, w)
        return self._add(Op(name, "concat", tuple(inputs), shape, bytes_moved=2 * DTYPE_BYTES * _elements(shape)))

    def loss(self, *xs: str, name: str = "loss") -> str:
        """The loss over the network's outputs (a model may return several, e.g. auxiliary heads)."""
        elements = sum(_elements(self.shapes[x]) for x in xs)
        return self._add(
            Op(name, "loss", xs, (1,), saves=xs, flops=5 * elements, bytes_moved=2 * DTYPE_BYTES * elements)
        )
