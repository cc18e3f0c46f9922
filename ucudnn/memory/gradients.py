"""Gradient buffers as PyTorch's autograd holds them over the backward pass.

A gradient is not always a buffer of its own: an add hands its output's gradient to both inputs, and a
second reader's gradient is summed into the first. Counting one buffer per gradient overstated a residual
block's backward pass by a feature map, and counting none for an in-place op's step understated it by one.
A captured step's graph needs no model: it carries the buffers its backward pass held (`Captured.lives`),
and they are placed on the schedule here. The simulator, the `optimal` program and dymem's allocation trace
take these lives from here.
"""

from __future__ import annotations

from collections.abc import Sequence

from ucudnn.memory.graph import TrainingGraph

__all__ = ["captured_lives", "gradient_lives"]

# Their backward passes hand the output's gradient on to each input (the same tensor, or views of it).
_PASSING_GRADIENT = ("add", "concat", "view")


def gradient_lives(graph: TrainingGraph, steps: Sequence) -> list[tuple[str, int, int, int]]:
    """Every gradient buffer of `steps` (a graph's steps, or the simulator's schedule) as PyTorch's autograd
    holds it: (label, bytes, step allocated at, step freed after), steps by their index in `steps`.

    A backward step allocates a new gradient for each input, except an add's, a concatenation's and a
    view's, which pass their output's gradient on (the same tensor, or a slice of it: no memory of
    their own). Where a second reader's backward step adds to a gradient, autograd's `InputBuffer`
    sums in place into whichever of the two it alone holds whole: the old one (the new part is held
    for that step only), else the new part (the old one goes); else the sum is a new buffer. An
    in-place op's step replaces its storage's gradient: the old one is freed after it (where the graph's
    `in_place_backward` is set, the step overwrites it instead). A buffer is
    freed after the last step that reads any gradient held in it. Where the graph's weight gradients
    are made in the backward pass (`TrainingGraph.weight_grads`), each lives from its first write to
    the step's end (the optimizer reads it after the backward pass). A captured graph's lives are its
    observed ones (`captured_lives`).

    (Under a `TorchDispatchMode`, such as `ucudnn.torch.StepTracker` or PyTorch's `MemTracker`,
    autograd always sums into a new buffer: the count holds one more buffer for that step.)"""
    if graph.captured is not None:
        return captured_lives(graph, steps)
    last_read: dict[str, int] = {}
    for k, s in enumerate(steps):
        if s.phase == "bwd":
            for r in s.reads:
                last_read[r] = k
    value: dict[str, str] = {}  # gradient -> the buffer holding it now
    sliced: set[str] = set()  # gradients that are a concatenation's slice of a larger buffer
    refs: dict[str, int] = {}  # buffer -> the gradients (and this step's parts) holding it
    born: dict[str, tuple[int, int]] = {}
    lives: list[tuple[str, int, int, int]] = []
    made: dict[str, int] = {}  # buffers made for each gradient so far (labels: grad:x, grad:x#2, ...)

    def new_buffer(name: str, k: int) -> str:
        made[name] = made.get(name, 0) + 1
        label = name if made[name] == 1 else f"{name}#{made[name]}"
        born[label] = (graph.bytes_of(name), k)
        refs[label] = 1
        return label

    for k, s in enumerate(steps):
        if s.phase != "bwd":
            continue
        op = graph.op(s.op)
        out = f"grad:{graph.storage_of(op.name)}"
        passed = value.get(out) if op.type in _PASSING_GRADIENT else None
        slices = passed is not None and (op.type == "concat" or out in sliced)
        in_place = graph.in_place_backward and op.inplace and passed is None
        ended: list[str] = []
        for name in s.writes:
            if not name.startswith("grad:") or (in_place and name in s.reads):
                continue  # a weight gradient, or a gradient overwritten where it is (`in_place_backward`)
            if passed is not None:
                part = passed
                refs[part] += 1
            else:
                part = new_buffer(name, k)
            old = value.get(name)
            if old is None or name in s.reads:  # a first gradient, or an in-place op's new one
                value[name] = part
                if old is not None:
                    ended.append(old)
                (sliced.add if slices else sliced.discard)(name)
            elif refs[old] == 1 and old != part and name not in sliced:
                ended.append(part)  # summed into the old buffer
            elif passed is None:  # summed into the new part
                value[name] = part
                ended.append(old)
                sliced.discard(name)
            else:  # both shared: the sum is a new buffer
                value[name] = new_buffer(name, k)
                ended += [old, part]
                sliced.discard(name)
        for name in dict.fromkeys((*s.reads, *s.writes)):
            if name in value and last_read.get(name, -1) <= k:
                ended.append(value.pop(name))
        for label in ended:
            refs[label] -= 1
            if refs[label] == 0:
                lives.append((label, *born.pop(label), k))
    wgrad_at: dict[str, int] = {}  # weight gradient -> its first write, where made in the backward pass
    if graph.weight_grads == "backward":
        for k, s in enumerate(steps):
            for name in s.writes:
                if name.startswith("wgrad:"):
                    wgrad_at.setdefault(name, k)
    lives += [(name, graph.bytes_of(name), k, len(steps) - 1) for name, k in wgrad_at.items()]
    return lives


def captured_lives(graph: TrainingGraph, steps: Sequence) -> list[tuple[str, int, int, int]]:
    """A captured graph's backward buffers (`Captured.lives`) on `steps`: each from the backward step that
    allocated it to the one after which it was freed (the last step: held to the end).
    Where weight gradients persist between steps (`weight_grads="step"`), a parameter's new gradient is
    added into the one it has, so the buffer lives in its own step only (the persistent gradient is in
    `TrainingGraph.persistent_bytes`)."""
    assert graph.captured is not None, "captured_lives reads a captured graph"
    at = [k for k, s in enumerate(steps) if s.phase == "bwd"]  # the captured backward steps, in order
    out = []
    for life in graph.captured.lives:
        start = at[life.start]
        if life.weight_grad and graph.weight_grads == "step":
            end = start
        else:
            end = at[life.end] if life.end >= 0 else len(steps) - 1
        out.append((life.name, life.bytes, start, max(start, end)))
    return out
