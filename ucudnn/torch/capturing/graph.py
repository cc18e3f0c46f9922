"""A captured step as the planner sees it: its operations (`CapturedStep`, which the executor follows) and its
`TrainingGraph`, built from what `ucudnn.torch.capturing.capture` recorded.

**Ops.** Each recorded operation that makes a storage, or writes one in place, is an op; a view, an
operation on parameters alone and an operation on no feature map change no memory the plan decides
about and are left out (the executor still counts them, to follow the step). An op that makes several
storages (a batch-norm's output and saved statistics, a max-pool's output and its int64 indices) makes
its first; each other is a feature map of its own (``<op>.<output>``), made by a costless op beside
it and kept (only the operation can make it again, which a plan would not charge). Names are the
module's qualified name and the operation's (``layer1.0.conv1:conv``, ``layer1.0.bn1:native_batch_norm``;
``#2`` for a second call), the model's inputs ``input`` (or ``input:<argument>``) and the loss's ops
``loss:<operation>``. Types: ``input``; ``conv`` for a 2-D convolution (torch's or a converted layer's,
with its `ConvProblem`); ``loss`` for everything the loss ran; a few kinds by name (``relu``,
``batchnorm``, ``pool``, ``linear``, ``add``, ``concat``); ``other``. Weights are the model's parameters
and buffers, and older tensors the step reads, each counted at its first reader.

**Backward steps** are the autograd nodes as they ran, each the step of the op whose forward made it;
a node of an op that is not a graph op (a view's) joins the step before it. Each reads the feature
maps whose saved tensors it unpacked, runs the conv kernels it called, and allocates the buffers it
made (`Life`: freed after the step in which they died, or held to the end: the parameters' gradients).

**Layout copies** (`Op.layout_copies`): a converted conv's planned kernels read their operands in their layout
(NCHW on the CPU) and copy those that come in another memory format (a channels-last map: SegFormer's
depthwise convolutions take a transposed view, and most of its convolutions get channels-last gradients),
then copy the result into torch's format; inside the operator the capture runs, so no storage of the step
shows them. Each conv records them per kernel kind from its operands as the step passed them (the forward
operation's, and each backward operation's gradient), and a plan holds them beside the kernel's workspace
where it picks one of the layer's own kernels (`ucudnn.torch.converting.launch.held_with_copies`).

**What the program held** (`Captured.holds`, `Captured.pinned`): a feature map that died after the op
reading it last (a Python variable until its function returned) is held through the op after which it
died; one alive into the backward pass whatever autograd saved (the model's input, a tensor kept in an
attribute) is pinned: every plan keeps it, as it keeps an operation's extra outputs and a map made
from a source that a later operation changes in place (made again, it would read the new values). On
real tensors a saved feature map's own death is autograd's, so only unsaved ones tell.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ucudnn.errors import InvalidInput
from ucudnn.memory.graph import Captured, Life, TrainingGraph
from ucudnn.memory.ops import Op
from ucudnn.problem import ConvProblem
from ucudnn.torch.capturing.operations import CONVOLUTIONS

__all__ = ["CapturedOp", "CapturedStep", "build_step"]


@dataclass(frozen=True, slots=True)
class CapturedOp:
    """One ATen operation of the forward pass (the model's, then the loss's), as the capture saw it.

    `name` is its graph op ("" where it makes no feature map and writes none: a view, an operation on
    parameters). `creates`: (output leaf, feature map) of each storage it makes: `name` for the first,
    ``<name>.<leaf>`` for the others (a batch-norm's saved statistics, a max-pool's indices). `writes`:
    the feature map it writes in place. `outputs`: (shape, dtype) per flattened output, None where not a tensor.
    `node`: the autograd node it made, as an offset from the step's first node (None: none). `args`: per
    tensor among its flattened arguments, the feature map it is (None: a parameter, buffer or constant)."""

    func: Any
    name: str
    module: str
    loss: bool
    outputs: tuple[tuple[tuple[int, ...], torch.dtype] | None, ...]
    creates: tuple[tuple[int, str], ...] = ()
    writes: str = ""
    random: bool = False
    node: int | None = None
    args: tuple[str | None, ...] = ()


@dataclass(frozen=True)
class CapturedStep:
    """A captured training step: its operations, its model inputs, and the planner's graph of it.

    `ops[:model_ops]` ran inside the model's forward pass, the rest in the loss. `inputs`: each
    tensor the model was called with, by the name `input_leaves` gives it: its feature map, shape and
    dtype. `writers`: the ops that make each feature
    map's storage and then write it in place, in order. `last_read`: the last model op reading each.
    `fake`: captured on fake tensors. `graph`: see `ucudnn.torch.capturing.graph`. `saves`: what autograd
    saved in the model's forward pass, in order, each as (feature map or None, shape, dtype, the op whose
    backward step unpacks it); `unread`: those of them no backward step unpacks (a node the loss does not reach
    saved them: diffusers' posterior clamps its log-variance, a view of the moments, for a sample this step
    does not draw). `calls`: the model's module calls in order (not the model's own), each as
    (module name, ops run before it, saves before it, ops run at its end). `model_nodes`: the autograd nodes
    the model's forward pass made; `node_kinds`: those its output reaches, less the ones observers add
    (`capturing.model_nodes`), each as (kind, the module whose operation made it, or ""). `autocast`: where
    `torch.autocast` was on (`capturing.autocast_state`)."""

    ops: tuple[CapturedOp, ...]
    model_ops: int
    inputs: Mapping[str, tuple[str, tuple[int, ...], torch.dtype]]
    writers: Mapping[str, tuple[int, ...]]
    last_read: Mapping[str, int]
    graph: Any
    fake: bool
    structure: tuple = ()  # the model's modules by name and class (`structure`)
    saves: tuple[tuple[str | None, tuple[int, ...], torch.dtype, int], ...] = ()
    unread: frozenset[int] = frozenset()
    calls: tuple[tuple[str, int, int, int], ...] = ()
    model_nodes: int = 0
    node_kinds: tuple[tuple[str, str], ...] = ()
    autocast: tuple[tuple[str, torch.dtype], ...] = ()


_TYPES = {
    "relu": "relu",
    "relu_": "relu",
    "threshold": "relu",
    "hardtanh": "relu",
    "hardtanh_": "relu",
    "native_batch_norm": "batchnorm",
    "_native_batch_norm_legit": "batchnorm",
    "_batch_norm_with_update": "batchnorm",
    "max_pool2d_with_indices": "pool",
    "avg_pool2d": "pool",
    "_adaptive_avg_pool2d": "pool",
    "adaptive_max_pool2d": "pool",
    "addmm": "linear",
    "mm": "linear",
    "add": "add",
    "cat": "concat",
}
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class _Names:
    """Unique names: the second use of a name gets ``#2``."""

    def __init__(self) -> None:
        self.used: Counter[str] = Counter()

    def new(self, name: str) -> str:
        self.used[name] += 1
        return name if self.used[name] == 1 else f"{name}#{self.used[name]}"


def _problem(spec: tuple | None, dtype: torch.dtype) -> ConvProblem | None:
    """The forward `ConvProblem` of a convolution of any form ucudnn runs (None: not a convolution, or one
    its kernels cannot express, planned as any other op)."""
    if spec is None or dtype not in _DTYPES:
        return None
    x, w, stride, padding, dilation, transposed, output_padding, groups = spec[:8]
    try:
        return ConvProblem.from_shapes(
            x,
            w,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            transposed=transposed,
            output_padding=output_padding,
            dtype=_DTYPES[dtype],
        )
    except InvalidInput:  # e.g. a transposed convolution's output padding not below its stride
        return None


def build_step(rec: Any, inputs: list, title: str, batch: int, weight_grads: str, fake: bool) -> CapturedStep:
    """The `CapturedStep` of a recorder that ran one step (`ucudnn.torch.capturing.capture._run`)."""
    if not rec.raw:
        raise InvalidInput(f"{title} ran no operation on its inputs")
    names = _Names()
    for path, act in inputs:
        act.name = names.new("input" if len(inputs) == 1 else f"input:{path}")
    specs: list[dict] = [
        {"name": act.name, "type": "input", "inputs": (), "shape": act.shape, "nbytes": act.nbytes} for _, act in inputs
    ]
    graph_of: list[str] = []  # per raw op: its graph op ("" none)
    upto: list[int] = []  # per raw op: the graph position of the latest graph op at or before it
    weight_bytes = dict(rec.persistent) | rec.constants
    pending, seen = 0, set()
    companions: set[str] = set()
    for raw in rec.raw:
        for key in raw.weights:
            if key not in seen:
                seen.add(key)
                pending += weight_bytes.get(key, 0)
        target = raw.made[0] if raw.made else raw.writes
        if target is None:
            graph_of.append("")
            upto.append(len(specs) - 1)
            continue
        short = "conv" if raw.func in CONVOLUTIONS else raw.func._overloadpacket.__name__
        prefix = "loss" if raw.loss else raw.module
        name = names.new(f"{prefix}:{short}" if prefix else short)
        problem = _problem(raw.conv, target.dtype) if raw.made else None
        kind = "loss" if raw.loss else "conv" if problem is not None else _TYPES.get(short, "other")
        reads = [a.name for a in raw.reads if a is not target]
        spec = {
            "name": name,
            "type": kind,
            "shape": target.shape,
            "nbytes": target.nbytes,
            "flops": raw.flops,
            "bytes_moved": raw.bytes_moved,
            "weight_bytes": pending,
            "module": raw.module,
            "conv": problem,
        }
        if problem is not None and any(raw.conv[8]):  # a converted layer's planned fwd kernel copies (`conv_spec`)
            copied, converts = raw.conv[8]
            spec.update(layout_copies=(("fwd", copied, target.nbytes if converts else 0),))
        pending = 0
        if raw.made:
            spec.update(inputs=tuple(dict.fromkeys(reads)))
        else:
            spec.update(inputs=tuple(dict.fromkeys([target.name, *reads])), inplace=True)
        specs.append(spec)
        for act in raw.made:  # the first output is the op's; the others ride along (costless, kept)
            act.name = name if act is target else f"{name}.{act.leaf}"
            if act is not target:
                companions.add(act.name)
                specs.append(
                    {
                        "name": act.name,
                        "type": "loss" if raw.loss else "other",
                        "inputs": (),
                        "shape": act.shape,
                        "nbytes": act.nbytes,
                        "module": raw.module,
                    }
                )
        graph_of.append(name)
        upto.append(len(specs) - 1)
    # parameters and buffers no op read, and what the last ops read, are held all the same
    specs[0]["weight_bytes"] = (
        specs[0].get("weight_bytes", 0)
        + pending
        + sum(b for key, b in weight_bytes.items() if key not in seen and key in rec.persistent)
    )
    ops = tuple(Op(**spec) for spec in specs)
    captured, copies = _backward(rec, graph_of, upto, ops, fake, title, companions)
    ops = tuple(
        dataclasses.replace(op, layout_copies=op.layout_copies + copies[op.name]) if op.name in copies else op
        for op in ops
    )
    graph = TrainingGraph(title, batch, ops, weight_grads, captured=captured)
    writers = {act.name: (act.owner, *act.writers) for act in rec.acts if act.name and act.owner >= 0}
    model_ops = rec.model_ops or len(rec.raw)
    last_read = {act.name: act.last_read for act in rec.acts if act.name and 0 <= act.last_read < model_ops}
    step_ops = tuple(
        CapturedOp(
            raw.func,
            graph_of[i],
            raw.module,
            raw.loss,
            raw.outputs,
            tuple((act.leaf, act.name) for act in raw.made),
            raw.writes.name if raw.writes is not None else "",
            torch.Tag.nondeterministic_seeded in raw.func.tags,
            raw.node - rec.first_seq if raw.node is not None else None,
            tuple(act.name if act is not None else None for act in raw.args),
        )
        for i, raw in enumerate(rec.raw)
    )
    step_inputs = {path: (act.name, act.shape, act.dtype) for path, act in inputs}
    # a save's op: the one that made its node (an input is saved before its op runs, an output after)
    saves = tuple(
        (act.name if act is not None and act.name else None, shape, dtype, rec.node_op.get(node, max(ran - 1, 0)))
        for act, shape, dtype, node, ran in rec.saves
    )
    unread = frozenset(k for k, (act, *_) in enumerate(rec.saves) if act is not None and k not in rec.unpacked)
    return CapturedStep(
        step_ops,
        model_ops,
        step_inputs,
        writers,
        last_read,
        graph,
        fake,
        saves=saves,
        unread=unread,
        calls=tuple(
            (name, start, saved, rec.model_ops if end is None else end) for name, start, saved, end in rec.calls
        ),
        model_nodes=rec.model_nodes,
        node_kinds=tuple(
            (kind, rec.raw[rec.node_op[seq]].module if seq in rec.node_op else "") for seq, kind in rec.node_kinds
        ),
    )


def _changed_sources(rec: Any, ops: tuple[Op, ...]) -> set[str]:
    """Feature maps an op made from a source that a later op of the forward pass changed in place: made
    again in the backward pass, they would read the new values, so they are kept."""
    written_after: dict[str, int] = {}  # feature map -> the last raw op writing it in place
    for i, raw in enumerate(rec.raw):
        if raw.writes is not None:
            written_after[raw.writes.name] = i
    out: set[str] = set()
    for i, raw in enumerate(rec.raw):
        target = raw.made[0] if raw.made else raw.writes
        if target is not None and any(written_after.get(a.name, -1) > i for a in raw.reads if a is not target):
            out.update(a.name for a in raw.made) if raw.made else out.add(target.name)
    return out


def _backward(
    rec: Any, graph_of: list[str], upto: list[int], ops: tuple[Op, ...], fake: bool, title: str, companions: set[str]
) -> tuple[Captured, dict[str, tuple[tuple[str, int, int], ...]]]:
    """The backward steps, their reads, kernels and buffers, and what the program held (module docstring); and
    per converted conv, what its planned backward kernels copy (`Op.layout_copies`, as the step's operands came)."""
    named = [graph_of[r] if r is not None else "" for r in rec.bsteps]
    first = next((g for g in named if g), "")
    if not first:
        raise InvalidInput(
            f"the backward pass of {title} ran no step of its operations: does the loss depend on "
            "the model's parameters?"
        )
    nodes, last = [], first
    for g in named:
        last = g or last
        nodes.append(last)  # a node of a view (no graph op) joins the step before it
    # the steps: each node's op, a new part where an allocation follows a free (see `Captured`)
    events: dict[int, list[tuple[str, Any]]] = {}
    for b, kind, what in rec.events:
        events.setdefault(b, []).append((kind, what))
    order: list[str] = []
    reads: list[list[str]] = []
    kernels: list[set[str]] = []
    born: dict[int, int] = {}
    died: dict[int, int] = {}
    end_of: list[int] = []  # per node: its op's last step so far
    convs = {o.name for o in ops if o.type == "conv"}
    copies: dict[str, dict[str, tuple[int, int]]] = {}

    def new_step(op: str) -> int:
        order.append(op)
        reads.append([])
        kernels.append(set())
        return len(order) - 1

    for b, op in enumerate(nodes):
        if b == 0 or op != nodes[b - 1]:
            start, freed = new_step(op), False
        for kind, what in events.get(b, ()):
            if kind == "birth" and freed:
                new_step(op)
                freed = False
            if kind == "birth":
                born[id(what)] = len(order) - 1
            elif kind == "death":
                died[id(what)] = len(order) - 1
            elif kind == "read":
                reads[-1].append(what.name)
            freed = freed or kind in ("death", "release")
        if op in convs:
            kernels[start] |= rec.bkernels.get(b, set())
            for kind, copied, converted in rec.bcopies.get(b, ()):
                if copied or converted:
                    held = copies.setdefault(op, {})
                    held[kind] = max(held.get(kind, (0, 0)), (copied, converted))
        end_of.append(len(order) - 1)
    grads = rec.grads
    labels = _Names()
    lives = []
    for buf in rec.buffers:  # (a storage's key is an address, reused once it died: only the living are grads)
        weight_grad = buf.died is None and buf.key in grads
        start = born[id(buf)]
        lives.append(
            Life(
                labels.new(f"{'wgrad' if weight_grad else 'grad'}:{order[start]}"),
                buf.nbytes,
                start,
                died.get(id(buf), -1),
                weight_grad,
            )
        )
    position = {op.name: k for k, op in enumerate(ops)}
    holds, pinned = [], set(companions)
    for act in rec.acts:
        if not act.name or (act.saved and not fake):
            continue  # on real tensors a saved map dies when autograd lets it go: its own death is unknown
        if act.died is None or act.died[0] == "bwd":
            pinned.add(act.name)
            last_step = end_of[act.died[1]] if act.died is not None else len(order) - 1
            holds.append((act.name, len(ops) + last_step))
            continue
        done = act.died[1] - 1  # the last op that ran while it lived
        if done < 0:
            continue
        used = max(position[act.name], upto[act.last_read] if act.last_read >= 0 else -1)
        if upto[done] > used:
            holds.append((act.name, upto[done]))
    pinned |= _changed_sources(rec, ops)
    return Captured(
        tuple(order),
        tuple(tuple(dict.fromkeys(r)) for r in reads),
        tuple(tuple(sorted(k)) for k in kernels),
        tuple(lives),
        tuple(holds),
        frozenset(pinned),
        sum(grads.values()),
    ), {op: tuple((kind, *c) for kind, c in sorted(held.items())) for op, held in copies.items()}
