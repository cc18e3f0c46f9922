"""The training graph: operations with forward and backward steps, and the tensors they read and write.

A `TrainingGraph` is one training step of one network at one batch size:

- **Operations** (`Op`): ``input``, ``conv``, ``relu``, ``pool``, ``batchnorm``, ``linear``, ``add``,
  ``concat``, ``view`` (flatten, reshape: no memory of its own), ``loss`` and ``other``. Each op
  writes one feature map named after the op.
- **Tensors** (`Tensor`): feature maps (``feature``), their gradients (``gradient``, named
  ``grad:<storage>``), weights (``weight``, ``weight:<op>``) and weight gradients
  (``weight_grad``, ``wgrad:<op>``). Conv workspaces are not tensors of fixed size: their bytes
  depend on the configuration each kernel runs, so `Step.kernels` names the conv kernels a step
  runs and the timing model (`ucudnn.memory.timing`) gives their time and workspace.
- **Storage.** An op that writes in place (``relu(inplace=True)``, ``out += identity``, a view)
  writes into its input's memory: its feature map's `Tensor.storage` is the input's storage. Memory
  is accounted, and planned, per storage: a plan's `tensors` are the storages (`TrainingGraph.storages`).
- **Steps** (`Step`): the forward step of every op in network order, then the backward steps.
  A step lists the storages and gradients it reads and writes.

Two sources, one format:

- **The zoo** (`from_network(name, batch)`): the zoo's convolutions plus the layers between them
  (activations, pooling, batch-norm, the classifier and the loss). Their backward steps are modelled:
  every op but the input in reverse order, each reading what its operation saves for backward as
  cuDNN and PyTorch do (conv its input, relu its output, max-pool its input and output, batch-norm
  its input, linear its input, loss its input; add, concat, views and average pools nothing), its
  gradients as `ucudnn.memory.gradients` models autograd.
- **A captured PyTorch step** (`ucudnn.torch.capturing.capture`): the ops PyTorch ran, and what the step did that
  the zoo models, observed instead (`Captured`): the backward steps in the order autograd ran them,
  the storages each read (what autograd saved), every buffer the backward pass held (`Life`), and the
  storages the program itself held longer than their readers (a Python variable, a returned value).

An op and what it costs (`Op`, and the builder the zoo uses) are `ucudnn.memory.ops`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from ucudnn.errors import InvalidInput
from ucudnn.memory.ops import DTYPE_BYTES, OP_TYPES, Op, OpBuilder
from ucudnn.network.zoo import canonical_name, layers

__all__ = [
    "DTYPE_BYTES",
    "OP_TYPES",
    "TENSOR_KINDS",
    "WEIGHT_GRADS",
    "Captured",
    "Life",
    "Op",
    "Step",
    "Tensor",
    "TrainingGraph",
    "from_network",
]

TENSOR_KINDS = ("feature", "gradient", "weight", "weight_grad")
WEIGHT_GRADS = ("step", "backward")  # when weight gradients exist (`TrainingGraph.weight_grads`)


@dataclass(frozen=True, slots=True)
class Tensor:
    """One tensor: its bytes, the op that produces it, and the storage whose memory it uses."""

    name: str
    kind: str  # one of TENSOR_KINDS
    bytes: int
    producer: str | None  # the op that writes it (forward for features, backward for gradients)
    storage: str  # the feature map owning its memory (itself unless written in place)
    shape: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Step:
    """One step of the training iteration on the compute stream: an op's forward or backward pass."""

    index: int
    op: str
    phase: str  # "fwd" or "bwd"
    reads: tuple[str, ...]  # storages and gradients that must be resident
    writes: tuple[str, ...]  # storages and gradients it produces (allocated at its start)
    kernels: tuple[str, ...] = ()  # conv kernels it runs: "fwd", or "bwd_data" and "bwd_filter"
    part: int = 0  # a captured backward step's later part (see `Captured`): no time of its own


@dataclass(frozen=True, slots=True)
class Life:
    """A buffer the backward pass of a captured step held: allocated in backward step `start` and freed
    after backward step `end` (-1: held to the step's end), counted from the backward pass's first step.
    `weight_grad`: it became a parameter's ``.grad``."""

    name: str
    bytes: int
    start: int
    end: int
    weight_grad: bool = False


@dataclass(frozen=True, slots=True)
class Captured:
    """What a captured step did where a zoo graph models it (see the module docstring).

    The backward steps are autograd's nodes as they ran, each in one or more *parts*: where a node frees
    memory and then allocates (it releases what it saved, then sums a gradient into a new buffer), the
    allocation starts a new part, so that the simulator, which allocates at a step's start and frees at
    its end, sees the node's memory as it was. `order`: each backward step's op (a node's later parts
    repeat it; only its first part takes time). `reads`: per backward step, the feature maps it read
    (what autograd saved). `kernels`: per backward step, the conv kernels it ran. `lives`: the backward
    pass's buffers. `holds`: (storage, index in `TrainingGraph.steps`): the program held the storage
    through that step (a reader autograd does not know of: a Python variable, a returned value).
    `pinned`: storages every plan keeps (or releases, where nothing reads them later): those the program
    held into the backward pass whatever autograd saved (dropping autograd's copy frees nothing), an
    operation's extra outputs (only the operation can make them again) and storages made from a source
    that the step later changes in place (made again, they would read the new values).
    `weight_grad_bytes`: the parameters' gradients the backward pass made."""

    order: tuple[str, ...]
    reads: tuple[tuple[str, ...], ...] = ()
    kernels: tuple[tuple[str, ...], ...] = ()
    lives: tuple[Life, ...] = ()
    holds: tuple[tuple[str, int], ...] = ()
    pinned: frozenset[str] = frozenset()
    weight_grad_bytes: int = 0


@dataclass(frozen=True)
class TrainingGraph:
    """One training step: ops in network (topological) order, their tensors and steps.

    Two settings say how the training framework holds gradients (`ucudnn.memory.gradients`).
    `weight_grads` says when the weight gradients exist: ``"step"``, the whole step (they persist
    between steps: the papers' frameworks, `zero_grad(set_to_none=False)`, gradient accumulation), or
    ``"backward"``, each from its op's first backward step to the step's end (PyTorch's default
    `zero_grad()` frees them between steps and the optimizer reads them after the backward pass).
    `in_place_backward` is True where an in-place op's backward step writes its input's gradient over
    its output's (Caffe's and Torch7's in-place ReLU); PyTorch's autograd makes a new tensor.
    `captured`: what a captured PyTorch step observed (None: a zoo graph, modelled).
    `replay_host_ms`: the host time a recomputation costs beyond its operations' own, per operation
    replayed: what PyTorch's executor spends following the forward pass where a dropped map is made and
    rebuilding it (`ucudnn.torch.planning.replay_cost`, measured on the model by `plan_memory`; 0: not measured)."""

    network: str
    batch: int
    ops: tuple[Op, ...]
    weight_grads: str = "step"
    in_place_backward: bool = False
    captured: Captured | None = None
    replay_host_ms: float = 0.0
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
        if self.weight_grads not in WEIGHT_GRADS:
            raise InvalidInput(f"weight_grads must be one of {', '.join(WEIGHT_GRADS)}, got {self.weight_grads!r}")
        host = self.replay_host_ms
        if isinstance(host, bool) or not isinstance(host, (int, float)) or not 0 <= host < float("inf"):
            raise InvalidInput(f"replay_host_ms must be a non-negative number of milliseconds, got {host!r}")
        if self.captured is not None:
            cap = self.captured
            unknown = sorted(set(cap.order) - set(by_name))
            if unknown:
                raise InvalidInput(f"captured backward steps of ops {', '.join(unknown[:5])} that the graph lacks")
            if len(cap.reads) != len(cap.order) or len(cap.kernels) != len(cap.order):
                raise InvalidInput("captured backward steps: one reads and one kernels entry per step")
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
                out[f"weight:{op.name}"] = Tensor(
                    f"weight:{op.name}", "weight", op.weight_bytes, None, f"weight:{op.name}"
                )
            if op.weight_bytes and self.captured is None and self._has_backward(op):
                out[f"wgrad:{op.name}"] = Tensor(
                    f"wgrad:{op.name}", "weight_grad", op.weight_bytes, op.name, f"wgrad:{op.name}"
                )
        if self.captured is not None:
            for life in self.captured.lives:
                kind = "weight_grad" if life.weight_grad else "gradient"
                out[life.name] = Tensor(life.name, kind, life.bytes, self.captured.order[life.start], life.name)
            return out
        for s in self.storages:
            if self._needs_grad[s]:
                name = f"grad:{s}"
                out[name] = Tensor(
                    name, "gradient", self._by_name[s].bytes, self._grad_producer[s], name, self._by_name[s].shape
                )
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
    def persistent_bytes(self) -> int:
        """Bytes held for the whole step: the weights, and their gradients where `weight_grads` is "step"."""
        if self.weight_grads != "step":
            return self.weight_bytes
        grads = self.captured.weight_grad_bytes if self.captured is not None else self.weight_bytes
        return self.weight_bytes + grads

    @property
    def conv_ops(self) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.type == "conv")

    @cached_property
    def must_keep(self) -> frozenset[str]:
        """Storages every plan keeps: what the loss reads (the backward pass starts there at once) and
        what the program itself holds into the backward pass (`Captured.pinned`)."""
        keep = {self._storage[i] for op in self.ops if op.type == "loss" for i in op.inputs}
        if self.captured is not None:
            keep |= self.captured.pinned
        return frozenset(keep)

    # ---- gradients (modelled: zoo graphs) ------------------------------------------------------
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
        """Forward steps of every op in order, then the backward steps: every op's but the input's,
        reversed (a zoo graph), or as autograd ran them (a captured step)."""
        held: dict[int, list[str]] = {}
        if self.captured is not None:
            for storage, step in self.captured.holds:
                held.setdefault(step, []).append(storage)
        steps: list[Step] = []
        for op in self.ops:
            reads = tuple(dict.fromkeys([*(self._storage[i] for i in op.inputs), *held.get(len(steps), ())]))
            steps.append(
                Step(
                    len(steps), op.name, "fwd", reads, (self._storage[op.name],), ("fwd",) if op.type == "conv" else ()
                )
            )
        if self.captured is not None:
            return tuple(steps) + self._captured_backward(self.captured, len(steps), held)
        needs = self._needs_grad
        for op in reversed(self.ops):
            if not self._has_backward(op):
                continue
            out_storage = self._storage[op.name]
            saved = [self._storage[s] for s in op.saves]
            if needs.get(out_storage):
                saved.append(f"grad:{out_storage}")
            writes = [f"grad:{self._storage[i]}" for i in op.inputs if needs[self._storage[i]]]
            if op.weight_bytes:
                writes.append(f"wgrad:{op.name}")
            kernels: tuple[str, ...] = ()
            if op.type == "conv":
                takes_dx = needs[self._storage[op.inputs[0]]]
                kernels = ("bwd_data", "bwd_filter") if takes_dx else ("bwd_filter",)
            steps.append(
                Step(len(steps), op.name, "bwd", tuple(dict.fromkeys(saved)), tuple(dict.fromkeys(writes)), kernels)
            )
        return tuple(steps)

    def _captured_backward(self, cap: Captured, first: int, held: dict[int, list[str]]) -> tuple[Step, ...]:
        """The backward steps a captured step ran (`cap`, the graph's `captured`): each reads what autograd saved
        for it (and what the program held through it) and writes the buffers it allocated."""
        born: dict[int, list[str]] = {}
        for life in cap.lives:
            born.setdefault(life.start, []).append(life.name)
        steps, part = [], 0
        for k, name in enumerate(cap.order):
            part = part + 1 if k and cap.order[k - 1] == name else 0
            steps.append(
                Step(
                    first + k,
                    name,
                    "bwd",
                    tuple(dict.fromkeys([*cap.reads[k], *held.get(first + k, ())])),
                    tuple(born.get(k, ())),
                    cap.kernels[k],
                    part,
                )
            )
        return tuple(steps)

    @cached_property
    def op_index(self) -> dict[str, int]:
        """Each op's position in `ops`, which is also the index of its forward step."""
        return {op.name: i for i, op in enumerate(self.ops)}

    @cached_property
    def forward_steps(self) -> int:
        """How many steps the forward pass has (the backward steps follow)."""
        return len(self.ops)

    @cached_property
    def _readers(self) -> dict[str, list[int]]:
        readers: dict[str, list[int]] = {}
        for s in self.steps:
            for name in s.reads:
                readers.setdefault(name, []).append(s.index)
        return readers

    def consumers(self, name: str, phase: str | None = None) -> tuple[int, ...]:
        """Indices of the steps that read storage or gradient `name` (in `phase` when given)."""
        steps = self.steps
        return tuple(k for k in self._readers.get(name, ()) if phase is None or steps[k].phase == phase)

    @cached_property
    def _writers(self) -> dict[str, tuple[Op, ...]]:
        writers: dict[str, list[Op]] = {}
        for op in self.ops:
            writers.setdefault(self._storage[op.name], []).append(op)
        return {s: tuple(ops) for s, ops in writers.items()}

    def producers(self, storage: str) -> tuple[Op, ...]:
        """The ops whose forward steps write `storage`: its owner, then in-place writers, in order."""
        return self._writers.get(storage, ())


# ---- the zoo's networks with their layers between convolutions --------------------------------------
def _alexnet(b: OpBuilder) -> None:
    x = b.input("input", (b.batch, 3, 227, 227))
    x = b.pooled("pool1", b.relu("relu1", b.conv("conv1", x)), 3, 2)
    x = b.pooled("pool2", b.relu("relu2", b.conv("conv2", x)), 3, 2)
    x = b.relu("relu3", b.conv("conv3", x))
    x = b.relu("relu4", b.conv("conv4", x))
    x = b.pooled("pool5", b.relu("relu5", b.conv("conv5", x)), 3, 2)
    x = b.relu("relu6", b.linear("fc6", b.flatten("flatten", x), 4096))
    x = b.relu("relu7", b.linear("fc7", x, 4096))
    b.loss(b.linear("fc8", x, 1000))


def _vgg16(b: OpBuilder) -> None:
    x = b.input("input", (b.batch, 3, 224, 224))
    for stage, count in enumerate((2, 2, 3, 3, 3), start=1):
        for i in range(1, count + 1):
            x = b.relu(f"relu{stage}_{i}", b.conv(f"conv{stage}_{i}", x))
        x = b.pooled(f"pool{stage}", x, 2, 2)
    x = b.relu("relu6", b.linear("fc6", b.flatten("flatten", x), 4096))
    x = b.relu("relu7", b.linear("fc7", x, 4096))
    b.loss(b.linear("fc8", x, 1000))


def _resnet(b: OpBuilder, blocks: Sequence[int], bottleneck: bool) -> None:
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
            # a new tensor, as the papers' graphs have it (torchvision writes `out += identity` in place)
            x = b.relu(f"{p}.relu", b.add(f"{p}.add", out, identity, inplace=False))
    x = b.flatten("flatten", b.global_pool("avgpool", x))
    b.loss(b.linear("fc", x, 1000))


def _densenet40(b: OpBuilder) -> None:
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


def _googlenet(b: OpBuilder) -> None:
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
        branches = [
            cr(f"{p}.1x1", x),
            cr(f"{p}.3x3", cr(f"{p}.3x3_reduce", x)),
            cr(f"{p}.5x5", cr(f"{p}.5x5_reduce", x)),
            cr(f"{p}.pool_proj", b.pooled(f"{p}.pool", x, 3, 1, 1)),
        ]
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
    no shape, and vDNN's memory model counts them in place). Gradients are held as the papers'
    frameworks hold them: weight gradients for the whole step, in-place ReLUs' backward in place.
    """
    canonical = canonical_name(name)
    if canonical not in _ZOO:
        raise InvalidInput(f"network {name!r} has no training graph; choose one of {', '.join(_ZOO)}")
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise InvalidInput(f"batch must be a positive integer, got {batch!r}")
    builder = OpBuilder(batch, layers(canonical, batch))
    _ZOO[canonical](builder)
    built = {op.name for op in builder.ops if op.type == "conv"}
    missing = sorted(set(builder.zoo) - built)
    if missing:  # the graph must run every zoo convolution
        raise AssertionError(f"{canonical}: the graph leaves out convolutions {missing}")
    return TrainingGraph(canonical, batch, tuple(builder.ops), "step", in_place_backward=True)
