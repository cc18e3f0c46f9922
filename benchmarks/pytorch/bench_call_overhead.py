"""Host time per call of `Handle.conv_forward` on a tiny convolution, against the work it wraps.

The convolution is 1x8x8x8 with a 8x8x3x3 filter (pad 1), so that nearly all the time is call
overhead. Contenders, each timed as the best of `--rounds` loops of `--calls` calls:

  torch     F.conv2d on torch tensors (what nn.Conv2d runs)
  backend   CpuBackend.run(problem, "native") on NumPy views (the backend's checked entry)
  handle    Handle.conv_forward(x, w, out=..., layer=...) planned "native", undivided
  handle-4  the same with the batch of 4 split into 4 micro-batches of 1 (policy (1,))

`handle - backend` is what the handle adds per call (lookup, checks, micro-batch sequencing);
`per micro-batch` is (handle-4 - handle) / 3, the host time of one more micro-batch launch (issue
10's goal on a GPU: at most 15 us). `--backend cudnn` runs the same on a GPU (CuPy arrays, torch's
CUDA tensors for `torch`, any cuDNN engine; no `backend` row there, host time only: each round
starts after a device synchronisation and the tiny kernels keep up with the launches).
It only uses APIs that predate the prepared path, so that the same script measures an older
checkout (PYTHONPATH=that checkout) for a before/after comparison.
`layer direct` and `layer routed`: forward and backward of a converted tiny layer (--layer-batch x 8 x 8 x 8)
planned `native` (plain F.conv2d behind the layer's checks) and `im2col_gemm` (through the handle), per
call, interleaved with `torch layer` (nn.Conv2d) and `torch forward` (its forward alone); `layer operators`:
the routed layer's kernels called through ucudnn's torch.library operators instead (`direct operators`:
the direct layer's), beside `operator floor`, custom operators of the same schemas around torch's own
convolution. Derived: `routed - torch layer` (issue 36's target: at most two torch forwards), `operators -
routed` and `direct ops - direct` against `floor - torch layer` (what the operators add over eager,
against what any custom operator adds; `one dispatch`: calling an operator of the same schema whose Python
autograd kernel does nothing, the least an operator call costs). `layer graph ops` and `direct graph ops`:
the same layers' operators as a compiled graph calls them (the forward without autograd, then the backward
operator and the bias's sum), against `graph aten`, aten.convolution and aten.convolution_backward called so
(`graph ops - aten`: what a compiled graph pays per layer torch runs for going through ucudnn's operators).
`torch route` (when ucudnn.torch exists) is what ucudnn.torch charges per kernel call routed through
ucudnn instead of torch's own convolution (`ucudnn.torch.converting.conv.route_overhead_ms`, forward and
backward of a tiny layer: the autograd Function plus one kernel's share of the handle route).

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/pytorch/bench_call_overhead.py [--calls 5000]
    python benchmarks/pytorch/bench_call_overhead.py --backend cudnn      # on a GPU
    OMP_NUM_THREADS=1 python benchmarks/pytorch/bench_call_overhead.py --clock cpu   # on a loaded machine
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import ucudnn
from ucudnn import Handle
from ucudnn.problem import ConvProblem

# --clock: wall time, or this thread's CPU time (on a loaded machine a one-thread loop is then charged what it
# ran, not what it waited for a core)
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def per_call_us(fn, calls: int, rounds: int, sync=lambda: None, clock=time.perf_counter) -> float:
    best = float("inf")
    for _ in range(rounds):
        sync()
        start = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - start) / calls * 1e6)
    return best


def _floor_operator():
    """The least torch.library custom operators with an autograd formula cost, in ucudnn's arrangement: a
    forward operator of ucudnn.convolution's schema (a layer key, the geometry, flags, an optional bias)
    around F.conv2d, whose backward calls one more operator (dx and dw at once, as ucudnn's does where both
    are asked for) around aten.convolution_backward: what PyTorch's own machinery requires of two operators."""
    ops = getattr(torch.ops, "ucudnn_bench", None)
    if ops is not None and hasattr(ops, "conv"):
        return ops.conv
    geometry = "int[] stride, int[] padding, int[] dilation, bool transposed, int[] output_padding, int groups"

    @torch.library.custom_op(
        "ucudnn_bench::conv",
        mutates_args=(),
        schema=f"(Tensor x, Tensor weight, int layer, {geometry}, str layout, bool need_dx, "
        "bool need_dw, Tensor? bias=None) -> Tensor",
    )
    def conv(
        x,
        weight,
        layer,
        stride,
        padding,
        dilation,
        transposed,
        output_padding,
        groups,
        layout,
        need_dx,
        need_dw,
        bias=None,
    ):
        return F.conv2d(x, weight, bias, stride, padding, dilation, groups)

    @torch.library.custom_op(
        "ucudnn_bench::conv_backward",
        mutates_args=(),
        schema=f"(Tensor dy, Tensor x, Tensor weight, int layer, {geometry}) -> (Tensor, Tensor)",
    )
    def conv_backward(dy, x, weight, layer, stride, padding, dilation, transposed, output_padding, groups):
        dx, dw, _ = torch.ops.aten.convolution_backward(
            dy, x, weight, None, stride, padding, dilation, transposed, output_padding, groups, [True, True, False]
        )
        return dx, dw

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], inputs[1])
        ctx.conv = inputs[2:9]

    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        dx, dw = torch.ops.ucudnn_bench.conv_backward(dy, x, w, *ctx.conv)
        return dx, dw, *[None] * 11

    conv.register_autograd(backward, setup_context=setup)
    return torch.ops.ucudnn_bench.conv


def _one_dispatch():
    """An operator of ucudnn.convolution's schema whose autograd kernel (Python, as ucudnn's) returns its input: a
    call costs one dispatch into Python, what calling any such operator costs beyond its kernel's work."""
    ops = getattr(torch.ops, "ucudnn_bench", None)
    if ops is not None and hasattr(ops, "identity"):
        return ops.identity.default
    library = torch.library.Library("ucudnn_bench", "FRAGMENT")
    library.define(
        "identity(Tensor x, Tensor weight, SymInt layer, int[] stride, int[] padding, int[] dilation, "
        "bool transposed, int[] output_padding, int groups, str layout, bool need_dx, bool need_dw, "
        "Tensor? bias=None) -> Tensor"
    )
    library.impl("identity", lambda x, *args: x, "Autograd")
    _LIBRARIES.append(library)  # (a Library's registrations last as long as the object)
    return torch.ops.ucudnn_bench.identity.default


_LIBRARIES: list = []


def _graph_step(forward, backward) -> None:
    """A layer's forward and backward as a compiled graph runs them: autograd off, each kernel's operator called."""
    with torch.no_grad():
        forward()
        backward()


def layer_calls_us(calls: int, rounds: int, batch: int = 2, clock=time.perf_counter) -> dict[str, float]:
    """Forward and backward of a tiny layer (batch x 8 x 8 x 8, 3x3), per call, the contenders interleaved
    (`interleaved_samples_ms`, each sample a loop of `calls` calls; medians): `torch layer` is plain
    nn.Conv2d, `layer direct` the converted layer planned `native` (F.conv2d behind ucudnn's checks),
    `layer routed` the converted layer planned im2col_gemm (the autograd Function and the handle's
    kernels); `layer operators` runs the routed layer's kernels through `torch.ops.ucudnn` (what a
    compiled graph calls), `direct operators` the direct layer through them, `operator floor` a custom operator of the same schema around torch's own
    convolution (what PyTorch's custom operators cost), `torch forward` nn.Conv2d's forward alone."""
    import statistics

    from ucudnn.kernel.measure import interleaved_samples_ms
    from ucudnn.torch import convert

    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 8, 8, 8, generator=g, requires_grad=True)
    dy = torch.randn(batch, 8, 8, 8, generator=g)
    plain = torch.nn.Conv2d(8, 8, 3, padding=1)
    layers = {
        name: convert(
            torch.nn.Conv2d(8, 8, 3, padding=1),
            backend="cpu",
            policy="undivided",
            algos=[algo],
            reps=1,
            db=False,
            call_overhead=0,
        )
        for name, algo in (("layer direct", "native"), ("layer routed", "im2col_gemm"))
    }
    xd = x.detach()
    fns = {"torch layer": lambda: plain(x).backward(dy), "torch forward": lambda: plain(x)}
    fns.update({name: (lambda layer=layer: layer(x).backward(dy)) for name, layer in layers.items()})
    try:
        from ucudnn.torch.converting.ops import layer_key
    except ImportError:  # an older checkout: no operators
        pass
    else:
        for name, layer in (("layer operators", layers["layer routed"]), ("direct operators", layers["layer direct"])):
            conv = (layer_key(layer), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, "NCHW", True, True)
            fns[name] = lambda layer=layer, conv=conv: torch.ops.ucudnn.convolution(
                x, layer.weight, *conv, layer.bias
            ).backward(dy)
            # as a compiled graph calls them: the forward without autograd, the backward operator, the bias's sum
            fns[name.replace("operators", "graph ops")] = lambda layer=layer, conv=conv: _graph_step(
                lambda: torch.ops.ucudnn.convolution.default(xd, layer.weight, *conv, layer.bias),
                lambda: (
                    torch.ops.ucudnn.convolution_backward.default(dy, xd, layer.weight, *conv[:8]),
                    dy.sum((0, 2, 3)),
                ),
            )
        geometry = ([1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        fns["graph aten"] = lambda: _graph_step(
            lambda: torch.ops.aten.convolution.default(xd, plain.weight, plain.bias, *geometry),
            lambda: torch.ops.aten.convolution_backward.default(
                dy, xd, plain.weight, [8], *geometry, [True, True, True]
            ),
        )
        identity = _one_dispatch()
        fns["one dispatch"] = lambda: identity(
            x, plain.weight, 0, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, "NCHW", True, True, plain.bias
        )
        floor = _floor_operator()
        fns["operator floor"] = lambda: floor(
            x, plain.weight, 0, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, "NCHW", True, True, plain.bias
        ).backward(dy)
    for fn in fns.values():  # plan, prepare, warm up
        for _ in range(20):
            fn()

    def loop(fn):
        return lambda: [fn() for _ in range(calls)]

    samples = interleaved_samples_ms({name: loop(fn) for name, fn in fns.items()}, rounds, clock=clock)
    return {name: statistics.median(s) / calls * 1e3 for name, s in samples.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--layer-batch", type=int, default=2, help="the batch of the layer contenders (issue 36: 2)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--backend", choices=("cpu", "cudnn"), default="cpu")
    parser.add_argument(
        "--clock", choices=tuple(CLOCKS), default="wall", help="wall time, or this thread's CPU time (a loaded machine)"
    )
    args = parser.parse_args()
    clock = CLOCKS[args.clock]
    torch.set_num_threads(1)
    gpu = args.backend == "cudnn"
    if gpu:
        try:
            import cupy
        except ImportError:
            parser.error("--backend cudnn needs CuPy and a CUDA GPU")
        to_device, sync, options = cupy.asarray, torch.cuda.synchronize, {}
    else:
        to_device, sync, options = (lambda a: a), (lambda: None), {"algos": ["native"]}
    rng = np.random.default_rng(0)
    results = {}
    for n, policy in ((1, "undivided"), (4, (1,))):
        x = to_device(rng.standard_normal((n, 8, 8, 8), dtype=np.float32))
        w = to_device(rng.standard_normal((8, 8, 3, 3), dtype=np.float32))
        out = to_device(np.zeros((n, 8, 8, 8), np.float32))
        handle = Handle(backend=args.backend, policy=policy, reps=1, db=False, **options)
        handle.conv_forward(x, w, padding=1, out=out, layer="l")  # plan, check and prepare
        name = "handle" if n == 1 else f"handle-{n}"
        results[name] = per_call_us(
            lambda h=handle, x=x, w=w, out=out: h.conv_forward(x, w, padding=1, out=out, layer="l"),
            args.calls,
            args.rounds,
            sync,
            clock,
        )
        if n == 1:
            tx, tw = torch.as_tensor(x), torch.as_tensor(w)
            results["torch"] = per_call_us(
                lambda tx=tx, tw=tw: F.conv2d(tx, tw, padding=1), args.calls, args.rounds, sync, clock
            )
        if n == 1 and not gpu:
            problem = ConvProblem(n=1, c=8, h=8, w=8, k=8, r=3, s=3, pad_h=1, pad_w=1)
            backend, workspace = handle.backend, handle.backend.empty_workspace(0)
            results["backend"] = per_call_us(
                lambda b=backend, p=problem, x=x, w=w, out=out, ws=workspace: b.run(
                    p, "native", x=x, w=w, out=out, workspace=ws
                ),
                args.calls,
                args.rounds,
                clock=clock,
            )
    results["per micro-batch"] = (results["handle-4"] - results["handle"]) / 3
    if not gpu:
        results.update(layer_calls_us(args.calls // 10, args.rounds, args.layer_batch, clock))
        torch_fwd = results["torch forward"]
        results["routed - torch layer"] = results["layer routed"] - results["torch layer"]
        results["  in torch forwards"] = results["routed - torch layer"] / torch_fwd
        if "layer operators" in results:
            results["operators - routed"] = results["layer operators"] - results["layer routed"]
            results["direct ops - direct"] = results["direct operators"] - results["layer direct"]
            results["floor - torch layer"] = results["operator floor"] - results["torch layer"]
            results["graph ops - aten"] = results["direct graph ops"] - results["graph aten"]
    if not gpu:
        results["handle - backend"] = results["handle"] - results["backend"]
        try:
            from ucudnn.torch.converting.conv import route_overhead_ms
        except ImportError:  # an older checkout: no charge to report
            pass
        else:
            results["torch route"] = route_overhead_ms() * 1e3
    print(f"# host time per call ({args.clock} clock), tiny convolution, 1 thread; ucudnn from {ucudnn.__file__}")
    for name, us in results.items():
        print(f"{name:>21}  {us:8.1f}" + ("" if name.startswith("  in") else " us"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
