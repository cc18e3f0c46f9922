"""Training a model a few SGD steps, and plain PyTorch's result with its rounding noise: what test_models.py and
test_model_convs.py compare converted and planned training against.

Equality of training is judged as the model's own rounding noise allows: the norm of all parameters' difference
from plain training, against how far plain training's float32 result itself may land (`rounding_noise`: another
summation order's, one thread against two, or float64 training's, whichever lies further). Not per tensor: a bias
before a normalisation has a gradient that is zero in exact arithmetic and holds only noise."""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable

import torch
from torch.nn import functional as F
from torch.utils._pytree import tree_map

from ucudnn.torch import execute_plan

STEPS = 2


def loss(out, y) -> torch.Tensor:
    return F.cross_entropy(out.logits if hasattr(out, "logits") else out, y)


def train(model, batch: Callable[[int], tuple], plan=None, threads: int = 1, loss: Callable = loss) -> torch.Tensor:
    """Every parameter, flattened, after `STEPS` SGD steps on ``batch(step)`` (under `plan` if given; dropout
    drawing the same masks every run), ``loss(output, target)`` backpropagated. An input that is a dict is the
    model's keyword arguments."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        torch.manual_seed(1)
        for step in range(STEPS):
            x, y = batch(step)
            opt.zero_grad()
            with execute_plan(model, plan) if plan is not None else torch.enable_grad():
                loss(model(**x) if isinstance(x, dict) else model(x), y).backward()
            opt.step()
    finally:
        torch.set_num_threads(before)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rounding_noise(model, batch: Callable[[int], tuple], reference: torch.Tensor, loss: Callable = loss) -> float:
    """How far plain training's float32 parameters (`reference`) may lie from another float32 run's: the further of
    another summation order's (two threads against one) and float64 training's. A converted layer may run another
    algorithm (ucudnn picks by time, so by the machine's load), whose sums round otherwise: threads alone can say
    far too little (MONAI's 2-D UNet, two steps: two threads move the parameters 4e-9 of their norm, float64
    1.4e-6, and shift_gemm's convolutions as far as float64)."""
    threads = (reference - train(copy.deepcopy(model), batch, threads=2, loss=loss)).norm().item()
    exact = train(copy.deepcopy(model).double(), lambda step: tree_map(_double, batch(step)), loss=loss)
    return max(threads, (reference.double() - exact).norm().item())


def _double(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def plain_runs(tmp_path_factory, build: Callable[[str], torch.nn.Module], batch: Callable[[str, int], tuple]):
    """A getter: per model name, made once, the model, plain training's parameters, their rounding noise
    (`rounding_noise`) and a measurement cache URL its converted copies share."""
    made = {}

    def get(name: str):
        if name not in made:
            torch.manual_seed(0)
            model = build(name)
            reference = train(copy.deepcopy(model), lambda step: batch(name, step))
            noise = rounding_noise(model, lambda step: batch(name, step), reference)
            made[name] = (model, reference, noise, f"sqlite:///{tmp_path_factory.mktemp(name)}/cache.db")
        return made[name]

    return get


class _Unhooked:
    """A gradient hook's handle where MemTracker registers none (`_frozen_params_unhooked`)."""

    def remove(self) -> None:
        pass


def _frozen_params_unhooked(tracker, model) -> None:
    """MemTracker hooks every parameter's gradient as a module's call reaches it, and a parameter that requires
    no gradient (Whisper's encoder positions, a frozen layer) refuses a hook with "cannot register a hook on a
    tensor that doesn't require gradient": those are filed as hooked already (they have no gradient to count)."""
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_Unhooked(), _Unhooked())


def _unseen_bytes(tracker, arrays, pending: dict) -> int:
    """The bytes of the arrays a kernel writes and reads (NumPy views of torch tensors), and of those earlier
    kernels' that are still alive (`pending`: address -> (bytes, a weak reference to the storage viewed)), that
    lie in no storage MemTracker counts now (its private `_WINFO`): an operator's result and operand copies,
    made below dispatch, held until the operator returns."""
    for a in arrays:
        storage = a.base.untyped_storage() if isinstance(a.base, torch.Tensor) else None
        # (an address reused: the array there now)
        pending[a.__array_interface__["data"][0]] = (
            a.nbytes,
            weakref.ref(storage) if storage is not None else (lambda: None),
        )
    held = [(s.data_ptr(), s.nbytes()) for s in list(tracker._WINFO.keys())]
    out = 0
    for ptr, (nbytes, alive) in list(pending.items()):
        if alive() is None or any(p <= ptr and ptr + nbytes <= p + n for p, n in held):
            del pending[ptr]  # gone, or a storage MemTracker counts
        else:
            out += nbytes
    return out


def memtracker_peak(model, plan, x, y, loss: Callable = loss) -> int:
    """PyTorch's MemTracker's count of one step under `plan` (after a warm-up step), gradients freed before.
    `x`: the model's input, a tensor or a dict of keyword arguments.

    A converted conv's workspace is NumPy memory on the CPU, which MemTracker cannot see: its handle reports
    each workspace a plan's budget holds for one kernel as it takes it (`Handle.workspace_listener`), and the
    count at that moment is MemTracker's current total plus that workspace, plus the arrays the kernel writes
    and reads that no storage MemTracker counts holds (ucudnn's operator, as a plan's followed calls run a
    converted conv, allocates its result and its operands' copies into the kernel's layout below dispatch)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from ucudnn.torch.converting.layer import ConvLayer

    inputs = list(x.values()) if isinstance(x, dict) else [x]
    device = inputs[0].device

    handles = {id(m.handle): m.handle for m in model.modules() if isinstance(m, ConvLayer)}.values()
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        tracker, with_workspace = MemTracker(), [0]

        pending: dict = {}

        def taken(delta: int, out=None, reads=()) -> None:
            if out is not None:  # a kernel starts
                now = tracker.get_tracker_snapshot("current")[device]["Total"]  # noqa: B023
                unseen = _unseen_bytes(tracker, (out, *reads), pending)  # noqa: B023
                with_workspace[0] = max(with_workspace[0], now + delta + unseen)  # noqa: B023

        tracker.track_external(model, *inputs)
        _frozen_params_unhooked(tracker, model)
        for h in handles:
            h.workspace_listener = taken
        try:
            with tracker, execute_plan(model, plan):
                loss(model(**x) if isinstance(x, dict) else model(x), y).backward()
        finally:
            for h in handles:
                h.workspace_listener = None
    return max(tracker.get_tracker_snapshot("peak")[device]["Total"], with_workspace[0])


def trains_alike(trained: torch.Tensor, reference: torch.Tensor, noise: float) -> bool:
    """Within twice plain training's own noise, or a float32 rounding's worth of the parameters' norm (where
    threads barely change the sums, as without batch-norm, another algorithm's rounding still does)."""
    return (trained - reference).norm().item() <= 2 * noise + 1e-6 * reference.norm().item()


def assert_trains_alike(trained: torch.Tensor, reference: torch.Tensor, noise: float) -> None:
    assert trains_alike(trained, reference, noise), ((trained - reference).norm().item(), noise)
