"""The training graph: operations with forward and backward steps, and the tensors they read and write.

A `TrainingGraph` is one training step of one network at one batch size:

- **Operations** (`Op`): ``input``, ``conv``, ``relu``, ``pool``, ``batchnorm``, ``linear``, ``add``,
  ``concat``, ``view`` (flatten, reshape: no memory of its own), ``loss`` and ``other`` (any
  elementwise operation a traced model holds). Each op writes one feature map named after the op.
- **Tensors** (`Tensor`): feature maps (``feature``), their gradients (``gradient``, named
  ``grad:<storage>``), weights (``weight``, ``weight:<op>``) and weight gradients
  (``weight_grad``, ``wgrad:<op>``). Conv workspaces are not tensors of fixed size: their bytes
  depend on the configuration each kernel runs, so `Step.kernels` names the conv kernels a step
  runs and the timing model (`ucudnn.memory.timing`) gives their time and workspace.
- **Storage.** An op that writes in place (``relu(inplace=True)``, ``out += identity``, a view)
  writes into its input's memory: its feature map's `Tensor.storage` is the input's storage. Memory
  is accounted, and planned, per storage: a plan's `tensors` are the storages (`TrainingGraph.storages`).
- **Steps** (`Step`): the forward step of every op in network order, then the backward step of every
  op but the input in reverse order. A step lists the storages and gradients it reads and writes.
  What a backward step reads is what its operation saves for backward, as cuDNN and PyTorch do:
  conv its input (``bwd_filter``), relu its output, max-pool its input and output, batch-norm its
  input, linear its input, loss its input; add, concat, views and average pools save nothing.

Build one from the network zoo with `from_network(name, batch)` (the zoo's convolutions plus the
layers between them: activations, pooling, batch-norm, the classifier and the loss) or from a
PyTorch model with `trace(model, example_input)` (through `torch.fx`; a feature map is named after
the fx node that produces it, as ``layer1_0_conv1``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ucudnn.errors import InvalidInput
from ucudnn.network.zoo import canonical_name, layers
from ucudnn.problem import ConvProblem

__all__ = ["DTYPE_BYTES", "OP_TYPES", "TENSOR_KINDS", "Op", "Step", "Tensor", "TrainingGraph", "from_network", "trace"]

OP_TYPES = ("input", "conv", "relu", "pool", "batchnorm", "linear", "add", "concat", "view", "loss", "other")
TENSOR_KINDS = ("feature", "gradient", "weight", "weight_grad")
DTYPE_BYTES = 4  # float32 throughout: the zoo and the measurements are float32


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor: its bytes, the op that produces it, and the storage whose memory it uses."""

    name: str
    kind: str                     # one of TENSOR_KINDS
    bytes: int
    producer: str | None          # the op that writes it (forward for features, backward for gradients)
    storage: str                  # the feature map owning its memory (itself unless written in place)
    shape: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Op:
    """One operation. `inputs` are feature-map names; its own feature map is named `name`."""

    name: str
    type: str                     # one of OP_TYPES
    inputs: tuple[str, ...]
    shape: tuple[int, ...]        # of its output feature map
    inplace: bool = False         # writes into inputs[0]'s storage
    saves: tuple[str, ...] = ()   # feature maps its backward step reads
    flops: float = 0.0            # forward arithmetic (the backward step counts twice this)
    bytes_moved: float = 0.0      # forward device-memory traffic (the backward step counts twice)
    weight_bytes: int = 0
    conv: ConvProblem | None = None  # the forward problem of a conv
    module: str = ""              # traced from PyTorch: the qualified name of the module it calls
    measured_ms: float | None = None  # its forward pass timed on the planned device, where it was

    @property
    def bytes(self) -> int:
        return DTYPE_BYTES * math.prod(self.shape)


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the training iteration on the compute stream: an op's forward or backward pass."""

    index: int
    op: str
    phase: str                    # "fwd" or "bwd"
    reads: tuple[str, ...]        # storages and gradients that must be resident
    writes: tuple[str, ...]       # storages and gradients it produces (allocated at its start)
    kernels: tuple[str, ...] = ()  # conv kernels it runs: "fwd", or "bwd_data" and "bwd_filter"


@dataclass(frozen=True)
class TrainingGraph:
    """One training step: ops in network (topological) order, their tensors and steps."""

    network: str
    batch: int
    ops: tuple[Op, ...]
    _by_name: dict[str, Op] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name: dict[str, Op] = {}
        for op in self.ops:
            if op.type not in OP_TYPES:
                raise InvalidInput(f"op {op.name!r}: type must be one of {', '.join(OP_TYPES)}, got {op.type!r}")
            if op.name in by_name:
                raise InvalidInput(f"op name {op.name!r} appears twice")
            for name in op.inputs:
                if name not in by_name:
                    raise InvalidInput(f"op {op.name!r} reads {name!r}, which no earlier op produces")
            by_name[op.name] = op
        if not self.ops or self.ops[0].type != "input":
            raise InvalidInput("a training graph starts with its input op")
        object.__setattr__(self, "_by_name", by_name)

    # ---- ops and tensors -------------------------------------------------------------------
    def op(self, name: str) -> Op:
        try:
            return self._by_name[name]
        except KeyError:
            raise InvalidInput(f"graph {self.network!r} has no op {name!r}") from None

    @cached_property
    def _storage(self) -> dict[str, str]:
        storage: dict[str, str] = {}
        for op in self.ops:
            storage[op.name] = storage[op.inputs[0]] if op.inplace else op.name
        return storage

    def storage_of(self, feature: str) -> str:
        """The storage (feature map owning the memory) that feature map `feature` lives in."""
        try:
            return self._storage[feature]
        except KeyError:
            raise InvalidInput(f"graph {self.network!r} has no feature map {feature!r}") from None

    @cached_property
    def storages(self) -> tuple[str, ...]:
        """Feature maps that own memory, in production order: what a plan decides about."""
        return tuple(op.name for op in self.ops if not op.inplace)

    @cached_property
    def tensors(self) -> dict[str, Tensor]:
        """Every tensor by name: feature maps, gradients, weights and weight gradients."""
        out: dict[str, Tensor] = {}
        for op in self.ops:
            storage = self._storage[op.name]
            out[op.name] = Tensor(op.name, "feature", op.bytes, op.name, storage, op.shape)
            if op.weight_bytes:
                out[f"weight:{op.name}"] = Tensor(f"weight:{op.name}", "weight", op.weight_bytes, None,
                                                  f"weight:{op.name}")
            if op.weight_bytes and self._has_backward(op):
                out[f"wgrad:{op.name}"] = Tensor(f"wgrad:{op.name}", "weight_grad", op.weight_bytes, op.name,
                                                 f"wgrad:{op.name}")
        for s in self.storages:
            if self._needs_grad[s]:
                name = f"grad:{s}"
                out[name] = Tensor(name, "gradient", self._by_name[s].bytes, self._grad_producer[s], name,
                                   self._by_name[s].shape)
        return out

    def bytes_of(self, name: str) -> int:
        """Bytes of a tensor or storage by name."""
        try:
            return self.tensors[name].bytes
        except KeyError:
            raise InvalidInput(f"graph {self.network!r} has no tensor {name!r}") from None

    @property
    def feature_map_bytes(self) -> int:
        """Bytes of every storage-owning feature map (the input image included)."""
        return sum(self._by_name[s].bytes for s in self.storages)

    @property
    def weight_bytes(self) -> int:
        return sum(op.weight_bytes for op in self.ops)

    @property
    def conv_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.type == "conv")

    # ---- gradients ---------------------------------------------------------------------------
    @cached_property
    def _into_loss(self) -> set[str]:
        """The storages whose values flow into the loss: autograd runs no backward step for the others
        (a value computed and not used, an output the loss does not read)."""
        into: set[str] = set()
        for op in reversed(self.ops):  # consumers come after their producers
            if op.type == "loss" or self._storage[op.name] in into:
                into.update(self._storage[i] for i in op.inputs)
        return into

    def _has_backward(self, op: Op) -> bool:
        return op.type == "loss" or (op.type != "input" and self._storage[op.name] in self._into_loss)

    @cached_property
    def _needs_grad(self) -> dict[str, bool]:
        """A storage has a gradient when a weight, or anything with a gradient, flows into it and it
        flows into the loss; the input image has none, nor has the loss (backward starts there)."""
        needs: dict[str, bool] = {}
        for op in self.ops:
            s = self._storage[op.name]
            flows = op.type != "input" and (op.weight_bytes > 0 or any(needs[self._storage[i]] for i in op.inputs))
            needs[s] = needs.get(s, False) or (flows and s in self._into_loss)
        for op in self.ops:
            if op.type == "loss":
                needs[self._storage[op.name]] = False
        return needs

    @cached_property
    def _grad_producer(self) -> dict[str, str | None]:
        """The op whose backward step first writes each storage's gradient."""
        first: dict[str, str | None] = {}
        for step in self.steps:
            if step.phase != "bwd":
                continue
            for w in step.writes:
                if w.startswith("grad:"):
                    first.setdefault(w[5:], step.op)
        return first

    # ---- steps -------------------------------------------------------------------------------
    @cached_property
    def steps(self) -> tuple[Step, ...]:
        """Forward steps of every op in order, then backward steps of every op but the input, reversed."""
        steps: list[Step] = []
        for op in self.ops:
            reads = tuple(dict.fromkeys(self._storage[i] for i in op.inputs))
            steps.append(Step(len(steps), op.name, "fwd", reads, (self._storage[op.name],),
                              ("fwd",) if op.type == "conv" else ()))
        needs = self._needs_grad
        for op in reversed(self.ops):
            if not self._has_backward(op):
                continue
            out_storage = self._storage[op.name]
            reads = [self._storage[s] for s in op.saves]
            if needs.get(out_storage):
                reads.append(f"grad:{out_storage}")
            writes = [f"grad:{self._storage[i]}" for i in op.inputs if needs[self._storage[i]]]
            if op.weight_bytes:
                writes.append(f"wgrad:{op.name}")
            kernels: tuple[str, ...] = ()
            if op.type == "conv":
                takes_dx = needs[self._storage[op.inputs[0]]]
                kernels = ("bwd_data", "bwd_filter") if takes_dx else ("bwd_filter",)
            steps.append(Step(len(steps), op.name, "bwd", tuple(dict.fromkeys(reads)),
                              tuple(dict.fromkeys(writes)), kernels))
        return tuple(steps)

    @cached_property
    def op_index(self) -> dict[str, int]:
        """Each op's position in `ops`, which is also the index of its forward step."""
        return {op.name: i for i, op in enumerate(self.ops)}

    @cached_property
    def forward_steps(self) -> int:
        """How many steps the forward pass has (the backward steps follow)."""
        return len(self.ops)

    def consumers(self, name: str, phase: str | None = None) -> tuple[int, ...]:
        """Indices of the steps that read storage or gradient `name` (in `phase` when given)."""
        return tuple(s.index for s in self.steps if name in s.reads and (phase is None or s.phase == phase))

    def producers(self, storage: str) -> tuple[Op, ...]:
        """The ops whose forward steps write `storage`: its owner, then in-place writers, in order."""
        return tuple(op for op in self.ops if self._storage[op.name] == storage)


# ---- costs of the ops between convolutions ---------------------------------------------------------
def _elements(shape: Sequence[int]) -> int:
    return math.prod(shape)


class _Builder:
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

    def conv(self, name: str, x: str, problem: ConvProblem | None = None, module: str = "") -> str:
        p = problem if problem is not None else self.zoo[name]
        if p.x_shape != self.shapes[x]:
            raise AssertionError(f"{name}: input {self.shapes[x]} is not the zoo's {p.x_shape}")
        weight = DTYPE_BYTES * math.prod(p.w_shape)
        traffic = DTYPE_BYTES * (_elements(p.x_shape) + _elements(p.y_shape)) + weight
        return self._add(Op(name, "conv", (x,), p.y_shape, saves=(x,), flops=p.flops, bytes_moved=traffic,
                            weight_bytes=weight, conv=p.with_kind("fwd"), module=module))

    def relu(self, name: str, x: str, inplace: bool = True) -> str:
        shape = self.shapes[x]
        return self._add(Op(name, "relu", (x,), shape, inplace=inplace, saves=(name,), flops=_elements(shape),
                            bytes_moved=2 * DTYPE_BYTES * _elements(shape)))

    def other(self, name: str, inputs: tuple[str, ...], inplace: bool = False,
              shape: tuple[int, ...] | None = None) -> str:
        """An elementwise-costed op; its output has `shape` (fx knows it: a reduction such as
        ``mean`` shrinks it), else its first input's."""
        shape = self.shapes[inputs[0]] if shape is None or inplace else shape
        moved = sum(_elements(self.shapes[i]) for i in inputs) + _elements(shape)
        return self._add(Op(name, "other", inputs, shape, inplace=inplace, saves=inputs,
                            flops=max(_elements(shape), _elements(self.shapes[inputs[0]])),
                            bytes_moved=DTYPE_BYTES * moved))

    def batchnorm(self, name: str, x: str) -> str:
        shape = self.shapes[x]
        return self._add(Op(name, "batchnorm", (x,), shape, saves=(x,), flops=8 * _elements(shape),
                            bytes_moved=3 * DTYPE_BYTES * _elements(shape), weight_bytes=2 * DTYPE_BYTES * shape[1]))

    def pool(self, name: str, x: str, shape: tuple[int, ...], window: int, kind: str = "max") -> str:
        saves = (x, name) if kind == "max" else ()
        return self._add(Op(name, "pool", (x,), shape, saves=saves, flops=window * window * _elements(shape),
                            bytes_moved=DTYPE_BYTES * (_elements(self.shapes[x]) + _elements(shape))))

    def pooled(self, name: str, x: str, kernel: int, stride: int, pad: int = 0, *, ceil: bool = False,
               kind: str = "max") -> str:
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
        n, c, h, w = self.shapes[x]
        return self.pool(name, x, (n, c, 1, 1), h, kind="avg")

    def flatten(self, name: str, x: str) -> str:
        shape = self.shapes[x]
        return self._add(Op(name, "view", (x,), (shape[0], _elements(shape[1:])), inplace=True))

    def linear(self, name: str, x: str, out_features: int) -> str:
        *lead, in_features = self.shapes[x]  # nn.Linear maps the last dimension; the others are batch
        n = math.prod(lead)
        weight = DTYPE_BYTES * (in_features * out_features + out_features)
        return self._add(Op(name, "linear", (x,), (*lead, out_features), saves=(x,),
                            flops=2 * n * in_features * out_features,
                            bytes_moved=DTYPE_BYTES * n * (in_features + out_features) + weight, weight_bytes=weight))

    def add(self, name: str, a: str, b: str, inplace: bool = True) -> str:
        shape = self.shapes[a]
        if self.shapes[b] != shape:
            raise AssertionError(f"{name}: adding {shape} and {self.shapes[b]}")
        return self._add(Op(name, "add", (a, b), shape, inplace=inplace, flops=_elements(shape),
                            bytes_moved=3 * DTYPE_BYTES * _elements(shape)))

    def concat(self, name: str, inputs: Sequence[str]) -> str:
        shapes = [self.shapes[i] for i in inputs]
        n, _, h, w = shapes[0]
        shape = (n, sum(s[1] for s in shapes), h, w)
        return self._add(Op(name, "concat", tuple(inputs), shape, bytes_moved=2 * DTYPE_BYTES * _elements(shape)))

    def loss(self, *xs: str, name: str = "loss") -> str:
        """The loss over the network's outputs (a model may return several, e.g. auxiliary heads)."""
        elements = sum(_elements(self.shapes[x]) for x in xs)
        return self._add(Op(name, "loss", xs, (1,), saves=xs, flops=5 * elements,
                            bytes_moved=2 * DTYPE_BYTES * elements))


# ---- the zoo's networks with their layers between convolutions --------------------------------------
def _alexnet(b: _Builder) -> None:
    x = b.input("input", (b.batch, 3, 227, 227))
    x = b.pooled("pool1", b.relu("relu1", b.conv("conv1", x)), 3, 2)
    x = b.pooled("pool2", b.relu("relu2", b.conv("conv2", x)), 3, 2)
    x = b.relu("relu3", b.conv("conv3", x))
    x = b.relu("relu4", b.conv("conv4", x))
    x = b.pooled("pool5", b.relu("relu5", b.conv("conv5", x)), 3, 2)
    x = b.relu("relu6", b.linear("fc6", b.flatten("flatten", x), 4096))
    x = b.relu("relu7", b.linear("fc7", x, 4096))
    b.loss(b.linear("fc8", x, 1000))


def _vgg16(b: _Builder) -> None:
    x = b.input("input", (b.batch, 3, 224, 224))
    for stage, count in enumerate((2, 2, 3, 3, 3), start=1):
        for i in range(1, count + 1):
            x = b.relu(f"relu{stage}_{i}", b.conv(f"conv{stage}_{i}", x))
        x = b.pooled(f"pool{stage}", x, 2, 2)
    x = b.relu("relu6", b.linear("fc6", b.flatten("flatten", x), 4096))
    x = b.relu("relu7", b.linear("fc7", x, 4096))
    b.loss(b.linear("fc8", x, 1000))


def _resnet(b: _Builder, blocks: Sequence[int], bottleneck: bool) -> None:
    x = b.input("input", (b.batch, 3, 224, 224))
    x = b.relu("relu", b.batchnorm("bn1", b.conv("conv1", x)))
    x = b.pooled("maxpool", x, 3, 2, 1)
    convs = 3 if bottleneck else 2
    for stage, count in enumerate(blocks, start=1):
        for i in range(count):
            p = f"layer{stage}.{i}"
            identity, out = x, x
            for j in range(1, convs + 1):
                out = b.batchnorm(f"{p}.bn{j}", b.conv(f"{p}.conv{j}", out))
                if j < convs:
                    out = b.relu(f"{p}.relu{j}", out)
            if f"{p}.downsample" in b.zoo:
                identity = b.batchnorm(f"{p}.downsample.bn", b.conv(f"{p}.downsample", x))
            # a new tensor, as torch.fx sees `out += identity` (a Proxy has no __iadd__)
            x = b.relu(f"{p}.relu", b.add(f"{p}.add", out, identity, inplace=False))
    x = b.flatten("flatten", b.global_pool("avgpool", x))
    b.loss(b.linear("fc", x, 1000))


def _densenet40(b: _Builder) -> None:
    x = b.input("input", (b.batch, 3, 32, 32))
    x = b.conv("conv0", x)
    for block in range(1, 4):
        if block > 1:
            t = f"trans{block - 1}"
            x = b.conv(t, b.relu(f"{t}.relu", b.batchnorm(f"{t}.bn", x), inplace=False))
            x = b.pooled(f"{t}.pool", x, 2, 2, kind="avg")
        for i in range(12):
            p = f"dense{block}.{i}"
            # the branch's BN and ReLU write new memory: the concatenated input stays intact
            new = b.conv(p, b.relu(f"{p}.relu", b.batchnorm(f"{p}.bn", x), inplace=False))
            x = b.concat(f"{p}.cat", (x, new))
    x = b.relu("relu", b.batchnorm("bn", x), inplace=False)
    x = b.flatten("flatten", b.global_pool("avgpool", x))
    b.loss(b.linear("fc", x, 10))


def _googlenet(b: _Builder) -> None:
    x = b.input("input", (b.batch, 3, 224, 224))
    x = b.pooled("pool1", b.relu("conv1.relu", b.conv("conv1", x)), 3, 2, ceil=True)
    x = b.relu("conv2.3x3_reduce.relu", b.conv("conv2.3x3_reduce", x))
    x = b.pooled("pool2", b.relu("conv2.3x3.relu", b.conv("conv2.3x3", x)), 3, 2, ceil=True)
    for block in ("3a", "3b", "4a", "4b", "4c", "4d", "4e", "5a", "5b"):
        if block in ("4a", "5a"):
            x = b.pooled(f"pool{block[0]}", x, 3, 2, ceil=True)
        p = f"inception{block}"

        def cr(name: str, src: str) -> str:
            return b.relu(f"{name}.relu", b.conv(name, src))

        # the fork: four branches read the block input; the join: their concatenation
        branches = [cr(f"{p}.1x1", x),
                    cr(f"{p}.3x3", cr(f"{p}.3x3_reduce", x)),
                    cr(f"{p}.5x5", cr(f"{p}.5x5_reduce", x)),
                    cr(f"{p}.pool_proj", b.pooled(f"{p}.pool", x, 3, 1, 1))]
        x = b.concat(f"{p}.output", branches)
    x = b.flatten("flatten", b.global_pool("avgpool", x))
    b.loss(b.linear("fc", x, 1000))


_ZOO = {
    "alexnet": _alexnet,
    "vgg16": _vgg16,
    "resnet18": lambda b: _resnet(b, (2, 2, 2, 2), bottleneck=False),
    "resnet50": lambda b: _resnet(b, (3, 4, 6, 3), bottleneck=True),
    "resnet152": lambda b: _resnet(b, (3, 8, 36, 3), bottleneck=True),
    "densenet40": _densenet40,
    "googlenet": _googlenet,
}


def from_network(name: str, batch: int) -> TrainingGraph:
    """The training graph of zoo network `name` at `batch`: its convolutions (`ucudnn.network.zoo`) and
    the layers between them. Max-pools after ReLUs, classifiers (AlexNet/VGG fc6-fc8, the ResNets' and
    GoogLeNet's global average pool and fc), and a softmax cross-entropy loss. ReLUs write in place,
    as in Caffe and torchvision; dropout and LRN are left out (they change
    no shape, and vDNN's memory model counts them in place).
    """
    canonical = canonical_name(name)
    if canonical not in _ZOO:
        raise InvalidInput(f"network {name!r} has no training graph; choose one of {', '.join(_ZOO)}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidInput(f"batch must be a positive integer, got {batch!r}")
    builder = _Builder(batch, layers(canonical, batch))
    _ZOO[canonical](builder)
    built = {op.name for op in builder.ops if op.type == "conv"}
    missing = sorted(set(builder.zoo) - built)
    if missing:  # the graph must run every zoo convolution
        raise AssertionError(f"{canonical}: the graph leaves out convolutions {missing}")
    return TrainingGraph(canonical, batch, tuple(builder.ops))


def trace(model, example_input, *, name: str | None = None) -> TrainingGraph:
    """The training graph of a PyTorch model, traced with `torch.fx` on `example_input` (its batch is
    the graph's batch). A feature map is named after the fx node that produces it."""
    from ucudnn.memory.fx import trace_model

    ops = trace_model(model, example_input)
    return TrainingGraph(name or type(model).__name__, int(example_input.shape[0]), tuple(ops))


def _builder_for_fx(batch: int) -> _Builder:
    """The op constructors `ucudnn.memory.fx` uses (one place computes shapes, flops and traffic)."""
    return _Builder(batch)

