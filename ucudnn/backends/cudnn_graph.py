"""The cuDNN frontend graph of one convolution kernel: tensors, strides, data types, the operation.

One graph describes one kernel at one micro-batch size: `conv_fprop` (fwd), `conv_dgrad`
(bwd_data) or `conv_wgrad` (bwd_filter), with explicit dims and element strides, padding, stride
and dilation per spatial axis: 4-D tensors (N, C, H, W) for a 2-D problem (a 1-D one is 2-D of
height 1, as cuDNN wants at least two spatial axes), 5-D (N, C, D, H, W) for a 3-D one, channels
first or last as the problem's layout says. Groups follow from the weight's channel count
(k, c/groups, ...). A transposed problem never reaches here: the backend declares the graph of
its `lowered` convolution (its forward is that convolution's dgrad, and so on).

API followed (nvidia-cudnn-frontend 1.32, read from its installed sources and NVIDIA/cudnn-frontend):
graph construction as in test/python/conv/graph/test_conv_fuzzer.py (`run_cudnn_conv`: dgrad and
wgrad outputs need `set_dim`); N-d convolutions take one padding, stride and dilation per spatial
axis (cudnn/_pygraph.py, `_conv_fprop_dims`: `len(x) - 2` spatial axes). Pure Python: no device
is touched until the backend validates the graph. The conventions tests/test_cudnn_api.py reads
by are in `ucudnn.backends.cudnn`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ucudnn.problem import ConvProblem


def _data_type(cudnn: Any, dtype: str) -> Any:
    return {
        "float32": cudnn.data_type.FLOAT,
        "float16": cudnn.data_type.HALF,
        "bfloat16": cudnn.data_type.BFLOAT16,
        "float64": cudnn.data_type.DOUBLE,
    }[dtype]


def layout_strides(shape: Sequence[int], layout: str) -> tuple[int, ...]:
    """Element strides of a logical (N, C, spatial...) shape stored channels first (NCHW, NCDHW)
    or channels last (NHWC, NDHWC)."""
    _n, c, *spatial = shape
    if layout == "NCHW":
        return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    return (math.prod(spatial) * c, 1, *(math.prod(spatial[i + 1 :]) * c for i in range(len(spatial))))


@dataclass(frozen=True, slots=True)
class DeclaredGraph:
    """A graph for one kernel, before validation, and its three operand tensors.

    `inputs` are the two operands in the kind's order (fwd: x, w; bwd_data: dy, w; bwd_filter:
    x, dy); `output` is what the kind writes (y, dx or dw).
    """

    graph: Any
    inputs: tuple[tuple[str, Any], tuple[str, Any]]
    output: Any


def declare_graph(cudnn: Any, problem: ConvProblem, *, promoted: bool = False, handle: Any = None) -> DeclaredGraph:
    """The `cudnn.pygraph` of one kernel of an ordinary (not transposed) convolution, 2-D or 3-D."""
    if problem.transposed:
        raise ValueError("declare_graph takes a convolution; pass problem.lowered() for a transposed one")
    io = _data_type(cudnn, problem.dtype)
    compute = _data_type(cudnn, "float32" if promoted else problem.effective_compute_type)
    wide = cudnn.data_type.DOUBLE if problem.dtype == "float64" else cudnn.data_type.FLOAT
    graph = cudnn.pygraph(
        name=f"ucudnn_{problem.kind}",
        io_data_type=io,
        intermediate_data_type=wide,
        compute_data_type=compute,
        handle=handle,
    )
    axes = problem.axes
    conv = {
        "padding": [a.pad for a in axes],
        "stride": [a.stride for a in axes],
        "dilation": [a.dilation for a in axes],
        "compute_data_type": compute,
    }
    x_stride = layout_strides(problem.x_shape, problem.layout)
    w_stride = layout_strides(problem.w_shape, problem.layout)
    y_stride = layout_strides(problem.y_shape, problem.layout)
    if problem.kind == "fwd":
        x_t = graph.tensor(name="x", dim=list(problem.x_shape), stride=list(x_stride), data_type=io)
        w_t = graph.tensor(name="w", dim=list(problem.w_shape), stride=list(w_stride), data_type=io)
        out_t = graph.conv_fprop(image=x_t, weight=w_t, name="fprop", **conv)
        inputs, out_shape, out_stride = (("x", x_t), ("w", w_t)), problem.y_shape, y_stride
    elif problem.kind == "bwd_data":
        dy_t = graph.tensor(name="dy", dim=list(problem.y_shape), stride=list(y_stride), data_type=io)
        w_t = graph.tensor(name="w", dim=list(problem.w_shape), stride=list(w_stride), data_type=io)
        out_t = graph.conv_dgrad(loss=dy_t, filter=w_t, name="dgrad", **conv)
        inputs, out_shape, out_stride = (("dy", dy_t), ("w", w_t)), problem.x_shape, x_stride
    else:
        x_t = graph.tensor(name="x", dim=list(problem.x_shape), stride=list(x_stride), data_type=io)
        dy_t = graph.tensor(name="dy", dim=list(problem.y_shape), stride=list(y_stride), data_type=io)
        out_t = graph.conv_wgrad(image=x_t, loss=dy_t, name="wgrad", **conv)
        inputs, out_shape, out_stride = (("x", x_t), ("dy", dy_t)), problem.w_shape, w_stride
    # dgrad and wgrad outputs cannot be inferred (strided dgrad is ambiguous; wgrad has none), and
    # pinning all three keeps the layout the caller's buffer has.
    out_t.set_output(True).set_dim(list(out_shape)).set_stride(list(out_stride)).set_data_type(io)
    return DeclaredGraph(graph, inputs, out_t)
