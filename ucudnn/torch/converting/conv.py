"""PyTorch integration: drop-ins for torch's six convolution modules, and `convert(model)`.

    model = ucudnn.torch.convert(model, backend="cpu", workspace_limit="64MiB")

swaps every `torch.nn.Conv1d`, `Conv2d`, `Conv3d`, `ConvTranspose1d`, `ConvTranspose2d` and
`ConvTranspose3d` of `model` (and every subclass of them whose forward is torch's own) for its ucudnn
counterpart, which shares its parameters (the same `Parameter` objects and parametrizations, so an
optimizer built before the swap keeps working) and runs all three kernels through one shared
`ucudnn.Handle`: the forward pass with its `fwd` kernel, and the backward pass with `bwd_data` (only
when the input needs a gradient) and `bwd_filter`; the bias gradient is dy summed over all but its
channels. Layer ids are the modules' qualified names (``layer1.0.conv1``); a layer built by hand uses
``conv@<id(self) in hex>``. A 1-D convolution runs as the 2-D one of height 1; a transposed one as a
convolution's backward kernels (`ucudnn.problem`).

Each layer keeps a route per input signature, planned at its first call (`ucudnn.torch.converting.layer`). Where
a plan routes a layer through the handle rather than torch's own convolution, that costs host time
per kernel call that kernel measurements do not see: on the CPU, the handles this module makes charge
it when planning (`route_overhead_ms`, measured once per process, as ``Handle(call_overhead=...)``),
so a NumPy algorithm is chosen only where it beats torch's own convolution by more than the route
costs, and each one chosen is confirmed against torch's inside the first training steps.

WD (``total_workspace=...``) divides one workspace among all kernels of the network, so the handle
must know the layers before it solves. `convert` arranges that: the model's first forward pass
registers every layer (PyTorch's convolution computes it) and a forward hook ends the learning; the
next convolution solves once. ``announce(model, example)`` does the same explicitly with one
recording forward pass in eval mode (batch-norm statistics untouched); use it when the first forward
pass runs under ``torch.no_grad()`` (it would register no backward kernels).

Under torch.compile and torch.export (``torch.compiler.is_compiling()``) a layer traces to the
operators of `ucudnn.torch.converting.ops` instead: they look the layer up by an int key and plan, register
(WD's learning pass) and run when the graph runs, with the same route cache, so nothing is planned on
fake tensors and nothing about the handle is baked into a graph. So does a layer called on fake
tensors (`FakeTensorMode`: the operators' fake implementations give the shapes) and one inside
`through_operators` (a captured step and the executor of its plan see each convolution as one
dispatched operation). Other eager calls keep the autograd Function: going through the dispatcher and
the operators' autograd wrapper costs host time per call.

CPU tensors of float32 (or float64) go through ``.numpy()`` views without copies; CUDA tensors go to
a cudnn-backend handle through ``__cuda_array_interface__`` (``cupy.asarray``; bfloat16 as its 16-bit
words), on torch's current stream, with CuPy's allocations taken from PyTorch's caching allocator, so
``torch.cuda.max_memory_allocated`` sees every workspace and no CuPy pool holds memory. A cudnn
handle runs on the CUDA device current when it was made; a tensor on another device is refused.
Channels-last 4-D CUDA tensors run as NHWC problems. Under ``torch.autocast`` the convolution is cast
as autocast casts torch's; a dtype the backend cannot run (bfloat16 on the cpu backend) is refused
with `UnsupportedProblem` naming dtype and backend. An empty batch returns what torch returns. Double
backward (gradients of gradients) is not supported.

This module imports torch; ``import ucudnn`` does not import this module.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.lazy import LazyModuleMixin

from ucudnn.errors import InvalidInput
from ucudnn.handle import Handle
from ucudnn.torch.converting.layer import (
    ConvLayer,
    ConvTransposeLayer,
    _EndLearning,
    _Learning,
    as_torch,
    through_operators,
)
from ucudnn.torch.converting.route_cost import _new_handle, route_overhead_ms

__all__ = [
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "announce",
    "as_torch",
    "convert",
    "route_overhead_ms",
    "through_operators",
]

_TAKES = (
    "Takes exactly torch's arguments (its parameters, `state_dict`, `repr` and initialisation are torch's "
    "own), plus keyword-only `handle` (default: a new handle with the default options, charging "
    "`route_overhead_ms` on the CPU) and `layer` (the id under which the handle plans this layer; default "
    "``conv@<id>``)."
)


class Conv1d(ConvLayer, nn.Conv1d):
    __doc__ = f"""`torch.nn.Conv1d` whose convolutions run through a ucudnn `Handle`, as 2-D ones of height 1.
    {_TAKES} Every `padding_mode` and string padding is supported, as in `Conv2d`."""


class Conv2d(ConvLayer, nn.Conv2d):
    __doc__ = f"""`torch.nn.Conv2d` whose convolutions run through a ucudnn `Handle`.

    {_TAKES} Every `padding_mode` and string padding ("same", "valid") is supported: non-zero modes and
    asymmetric "same" padding pad the input with `F.pad` first, as nn.Conv2d itself does, and run the
    convolution unpadded."""


class Conv3d(ConvLayer, nn.Conv3d):
    __doc__ = f"""`torch.nn.Conv3d` whose convolutions run through a ucudnn `Handle`. {_TAKES}"""


class ConvTranspose1d(ConvTransposeLayer, nn.ConvTranspose1d):
    __doc__ = f"""`torch.nn.ConvTranspose1d` whose convolutions run through a ucudnn `Handle`. {_TAKES}"""


class ConvTranspose2d(ConvTransposeLayer, nn.ConvTranspose2d):
    __doc__ = f"""`torch.nn.ConvTranspose2d` whose convolutions run through a ucudnn `Handle`: its forward is a
    convolution's backward-data kernel, its backward-data a forward one. {_TAKES}"""


class ConvTranspose3d(ConvTransposeLayer, nn.ConvTranspose3d):
    __doc__ = f"""`torch.nn.ConvTranspose3d` whose convolutions run through a ucudnn `Handle`. {_TAKES}"""


# torch's classes and their ucudnn counterparts
SWAPS: dict[type, type] = {
    nn.Conv1d: Conv1d,
    nn.Conv2d: Conv2d,
    nn.Conv3d: Conv3d,
    nn.ConvTranspose1d: ConvTranspose1d,
    nn.ConvTranspose2d: ConvTranspose2d,
    nn.ConvTranspose3d: ConvTranspose3d,
}


def _counterpart(cls: type) -> tuple[type[ConvLayer] | None, str]:
    """The ucudnn class that takes over a module of torch class `cls` (or of a subclass of one), or None and
    why not. A subclass is taken over when its forward is torch's own: a class made of ucudnn's and it
    (`_swapped_class`) keeps everything else it adds (parametrizations, attributes, methods)."""
    if cls in SWAPS:
        return SWAPS[cls], ""
    torch_class = next((base for base in cls.__mro__ if base in SWAPS), None)
    if torch_class is None:
        return None, "not a subclass of torch's six convolution classes"
    if issubclass(cls, LazyModuleMixin):
        return None, "a lazy module, not yet initialised (convert after its first forward pass)"
    own = [
        name
        for name in ("forward", "_conv_forward")
        if getattr(cls, name, None) is not getattr(torch_class, name, None)
    ]
    if own:
        return None, f"overrides {' and '.join(own)}"
    # (the checker does not count a class as Hashable, which the cache asks of its arguments)
    return _swapped_class(SWAPS[torch_class], cls), ""  # type: ignore[arg-type]


@functools.cache
def _swapped_class(ours: type, theirs: type) -> type[ConvLayer]:
    """The class of a converted `theirs` (a subclass of a torch convolution class): ucudnn's class first,
    then theirs. Pickles and copies name the two classes, not this one (which exists only in this process)."""
    return type(theirs.__name__, (ours, theirs), {"__module__": theirs.__module__, "__reduce_ex__": _reduce_swapped})


def _reduce_swapped(self, protocol):
    cls = type(self)
    return _new_swapped, cls.__bases__, self.__getstate__()


def _new_swapped(ours: type, theirs: type) -> ConvLayer:
    cls = _swapped_class(ours, theirs)
    return cls.__new__(cls)


def _ucudnn_convs(model: nn.Module) -> Iterator[ConvLayer]:
    return (m for m in model.modules() if isinstance(m, ConvLayer))


def convert(model: nn.Module, *, handle: Handle | None = None, **handle_options) -> nn.Module:
    """Swap every convolution of `model`, in place, for its ucudnn counterpart; return `model`.

    Swapped: `torch.nn.Conv1d`, `Conv2d`, `Conv3d`, `ConvTranspose1d`, `ConvTranspose2d`, `ConvTranspose3d`,
    and subclasses of them whose `forward` (and `_conv_forward`) are torch's own, such as a parametrized
    module (`weight_norm`, `spectral_norm`) or a library's class that only adds an `__init__`. The new modules
    share the old ones' parameters (same objects: weights, bias, parametrizations, device, dtype and any
    optimizer state stay valid), hooks and training flag. All of them share one handle: `handle`, or a new
    ``Handle(**handle_options)`` (backend, policy, workspace_limit, total_workspace, db, reps, algos,
    call_overhead; on the CPU, call_overhead defaults to the measured `route_overhead_ms`, while a given
    `handle` keeps its own). Layer ids are qualified module names. ucudnn layers already in the model join the
    shared handle. Convolutions left unchanged (subclasses that override forward, lazy modules) are named in
    one warning with the reason. When `model` itself is a convolution, the converted module is returned (there
    is no parent to swap it in).
    """
    if not isinstance(model, nn.Module):
        raise InvalidInput(f"convert needs a torch.nn.Module, got {type(model).__name__}")
    if handle is None:
        handle = _new_handle(**handle_options)
    elif handle_options:
        raise InvalidInput(f"give a handle or handle options, not both (got handle and {', '.join(handle_options)})")
    names = {id(m): name for name, m in model.named_modules()}  # the first qualified name of each module
    if isinstance(model, ConvLayer):
        model._init_ucudnn(handle, model.layer or "conv")
        return _learn_first_forward(model, handle)
    if isinstance(model, nn.modules.conv._ConvNd):
        cls, why = _counterpart(type(model))
        if cls is None:
            raise InvalidInput(f"convert cannot take over a {type(model).__qualname__}: {why}")
        return _learn_first_forward(cls.from_conv(model, handle=handle, layer="conv"), handle)
    converted: dict[int, ConvLayer] = {}
    unchanged: dict[str, list[str]] = {}  # why -> module names
    for parent in list(model.modules()):
        for child_name, child in list(parent._modules.items()):
            if isinstance(child, ConvLayer):
                child._init_ucudnn(handle, names.get(id(child), child.layer))
            elif isinstance(child, nn.modules.conv._ConvNd):
                if id(child) not in converted:
                    cls, why = _counterpart(type(child))
                    if cls is None:
                        unchanged.setdefault(f"{type(child).__qualname__}: {why}", []).append(names[id(child)])
                        continue
                    converted[id(child)] = cls.from_conv(child, handle=handle, layer=names[id(child)])
                setattr(parent, child_name, converted[id(child)])
    if unchanged:
        listed = "; ".join(
            f"{', '.join(found[:5])}{f' and {len(found) - 5} more' if len(found) > 5 else ''} ({why})"
            for why, found in unchanged.items()
        )
        warnings.warn(
            f"ucudnn.torch.convert left {sum(map(len, unchanged.values()))} convolution(s) to PyTorch: {listed}",
            stacklevel=2,
        )
    return _learn_first_forward(model, handle)


def _learn_first_forward(model: nn.Module, handle: Handle) -> nn.Module:
    """WD, nothing announced yet: the model's first forward pass registers every layer (computing
    with torch's own convolution) and ends with a hook; the next convolution solves once."""
    if handle.mode != "WD" or handle.layers or handle.wd_solved:
        return model
    state = _Learning()
    for conv in _ucudnn_convs(model):
        conv._learning = state
    model.register_forward_hook(_EndLearning(state))
    return model


def announce(model: nn.Module, *inputs: Any, **kwargs: Any) -> None:
    """Announce every ucudnn convolution of `model` to its handle with one recording forward pass.

    Runs ``model(*inputs, **kwargs)`` once in eval mode (batch-norm statistics and dropout are
    left alone; every module's training flag is restored afterwards) with gradients enabled, so
    that each layer registers the kernels training will run: ``fwd``; ``bwd_data`` when its
    input requires a gradient; ``bwd_filter`` when its weight does. Torch's own convolution
    computes this pass and nothing is measured; the output is discarded. Needed in WD mode, where
    the first real convolution divides the workspace among the announced layers; harmless in WR.
    Call it with the training batch size (other batch sizes get their own plans later anyway).
    """
    convs = list(_ucudnn_convs(model))
    if not convs:
        raise InvalidInput("announce found no ucudnn convolution in the model; call ucudnn.torch.convert first")
    training = {m: m.training for m in model.modules()}
    try:
        model.eval()
        for conv in convs:
            conv._recording = True
        with torch.enable_grad():
            model(*inputs, **kwargs)
    finally:
        for conv in convs:
            conv._recording = False
            if conv._learning is not None:  # announced: the first real forward pass runs through the handle
                conv._learning.active = False
        for module, flag in training.items():
            module.training = flag
