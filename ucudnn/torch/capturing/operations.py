"""ATen operations as a captured step reads them (`ucudnn.torch.capturing.capture`, and the executor and the timed steps
that follow one): which count as the step's, which storages one writes, its flops, which are convolutions, and
the bytes a reduction's real kernel holds its result in.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import flop_registry

from ucudnn.torch.converting import ops as _ops  # noqa: F401 - registers torch.ops.ucudnn, which a capture recognises
from ucudnn.torch.converting.launch import backward_copies, forward_copies

__all__ = [
    "CONVOLUTIONS",
    "conv_backward_copies",
    "conv_backward_kinds",
    "conv_spec",
    "counted",
    "flops",
    "reduction_bytes",
    "same_op",
    "storage_key",
    "written_keys",
]

aten = torch.ops.aten
# A convolution as one operation: torch's, or a converted layer's (`ucudnn.torch.converting.conv.through_operators`).
CONVOLUTIONS = frozenset({aten.convolution.default, torch.ops.ucudnn.convolution.default})
# ucudnn's operator takes aten.convolution's arguments, its layer's key where aten's takes the bias
_CONVOLUTION_ARGS = 9


def counted(func: Any, outputs: list) -> bool:
    """Whether an operation is one of the step's: it returns a tensor and is not a view. The capture, the
    executor and the timed steps count the same operations: views are left out because autograd makes
    some of its own (detaching what it saves; on fake tensors, replaying the views of a tensor changed in
    place), and queries (a fake tensor's device) return no tensor. Neither makes or writes memory."""
    return not getattr(func, "is_view", False) and any(isinstance(t, torch.Tensor) for t in outputs)


def storage_key(t: torch.Tensor) -> int:
    """The identity of `t`'s storage (its StorageImpl), the same for every view of it, fake or real."""
    return t.untyped_storage()._cdata


def same_op(func: Any, captured: Any) -> bool:
    """Whether `func` is the captured operation: the same, or a convolution for a convolution (torch's own
    and a converted layer's are one operation each, with one output)."""
    return func is captured or (func in CONVOLUTIONS and captured in CONVOLUTIONS)


def written_keys(func, args, kwargs) -> set[int]:
    """The storages an operation writes in place (its schema's mutable arguments)."""
    schema = func._schema
    if not schema.is_mutable:
        return set()
    keys = set()
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in tree_leaves(value):
            if isinstance(t, torch.Tensor):
                keys.add(storage_key(t))
    return keys


def flops(func, args, kwargs, out, out_bytes: int) -> float:
    """PyTorch's flop count of an operation (`torch.utils.flop_counter`), else one per output element."""
    count = flop_registry.get(func._overloadpacket)
    if func is torch.ops.ucudnn.convolution.default:
        count = flop_registry.get(aten.convolution.default._overloadpacket)
        args, kwargs = (*args[:2], None, *args[3:_CONVOLUTION_ARGS]), {}
    if count is not None:
        try:
            return float(count(*args, **kwargs, out_val=out))
        except Exception:  # noqa: BLE001, S110 - a formula that does not fit this overload: count elements instead
            pass
    return float(sum(t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)))


def conv_spec(func, args) -> tuple | None:
    """(x shape, w shape, stride, padding, dilation, transposed, output_padding, groups, copies) of a
    convolution's forward, torch's or ucudnn's. `copies`: what a converted layer's planned fwd kernel holds
    beside its workspace and output (`ucudnn.torch.converting.launch.forward_copies`: its operands' copies into its
    layout, and whether its output is copied into torch's format after it); torch's own, (0, False)."""
    if func not in CONVOLUTIONS:
        return None
    x, w, _, stride, padding, dilation, transposed, output_padding, groups = args[:_CONVOLUTION_ARGS]
    copies = (
        forward_copies(x, w, args[_CONVOLUTION_ARGS]) if func is torch.ops.ucudnn.convolution.default else (0, False)
    )
    return (
        tuple(x.shape),
        tuple(w.shape),
        tuple(stride),
        tuple(padding),
        tuple(dilation),
        bool(transposed),
        tuple(output_padding),
        groups,
        copies,
    )


def conv_backward_kinds(func, args, kwargs) -> tuple[str, ...]:
    if func is aten.convolution_backward.default:
        mask = args[10] if len(args) > 10 else kwargs["output_mask"]
        return tuple(kind for kind, on in zip(("bwd_data", "bwd_filter"), mask) if on)
    if func is torch.ops.ucudnn.convolution_backward.default:
        return ("bwd_data", "bwd_filter")
    if func is torch.ops.ucudnn.convolution_backward_data.default:
        return ("bwd_data",)
    if func is torch.ops.ucudnn.convolution_backward_filter.default:
        return ("bwd_filter",)
    return ()


def conv_backward_copies(func, args, kwargs) -> tuple[tuple[str, int, int], ...]:
    """What a converted layer's planned backward kernels of this backward operation hold beside their
    workspaces and results, per kind (`ucudnn.torch.converting.launch.backward_copies`; the operands as autograd passes
    them: a gradient arrives in the memory format the operations after the layer leave it in). Torch's own
    convolution's backward: nothing."""
    if func is torch.ops.ucudnn.convolution_backward.default:
        dy, x, w, layout = args[0], args[1], args[2], args[10]
        return backward_copies(dy, x, w, layout, ("bwd_data", "bwd_filter"), fused=True)
    if func is torch.ops.ucudnn.convolution_backward_data.default:
        return backward_copies(args[0], None, args[1], args[10], ("bwd_data",), fused=False)
    if func is torch.ops.ucudnn.convolution_backward_filter.default:
        return backward_copies(args[1], args[0], args[2], args[10], ("bwd_filter",), fused=False)
    return ()


def reduction_bytes(func: Any, args: tuple, kwargs: dict, outputs: list, cache: dict) -> dict[int, int]:
    """A reduction's outputs' real bytes where it ran on fake tensors: output leaf -> the bytes of its storage when
    `func` runs on real tensors of its arguments' geometry (zeros), once per geometry (`cache`). A fake tensor's
    storage is what the operation's meta function makes; the real kernel may return its result in a larger one:
    CPU `mse_loss`, `smooth_l1_loss` and `binary_cross_entropy` return a 0-dim view of their unreduced buffer (4
    bytes fake, their input's bytes real), held as long as the loss. `outputs`: the new ones. Only reductions run
    (every new output has fewer dimensions than an argument): a pass over their input, few in a step."""
    leaves = tree_leaves((args, kwargs))
    most = max((t.dim() for t in leaves if isinstance(t, torch.Tensor) and t.numel()), default=0)
    if (
        func._schema.is_mutable
        or torch.Tag.nondeterministic_seeded in func.tags
        or any(t.dim() >= most for t in outputs)
    ):  # (a factory reads no tensor)
        return {}
    key = (
        func,
        *((tuple(t.shape), t.stride(), t.dtype, t.device) if isinstance(t, torch.Tensor) else repr(t) for t in leaves),
    )
    if key not in cache:
        with unset_fake_temporarily():
            try:
                out = func(*tree_map(_zeros_of, args), **tree_map(_zeros_of, kwargs))
            except (RuntimeError, AssertionError, NotImplementedError):  # not runnable here (a device this machine
                out = ()  # lacks, values it checks): the meta function's bytes stand
        cache[key] = {
            leaf: t.untyped_storage().nbytes() for leaf, t in enumerate(tree_leaves(out)) if isinstance(t, torch.Tensor)
        }
    return cache[key]


def _zeros_of(t: Any) -> Any:
    """A real tensor of a fake one's geometry (zeros), anything else as it is."""
    if not isinstance(t, FakeTensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).zero_()
