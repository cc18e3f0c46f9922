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
`layer direct` and `layer routed`: forward and backward of a converted tiny layer planned `native`
(plain F.conv2d behind the layer's checks) and `im2col_gemm` (through the handle), per call;
`layer operators`: the latter's kernels called through ucudnn's torch.library operators instead.
`torch route` (when ucudnn.torch exists) is what ucudnn.torch charges per kernel call routed through
ucudnn instead of torch's own convolution (`ucudnn.torch.conv.route_overhead_ms`, forward and
backward of a tiny layer: the autograd Function plus one kernel's share of the handle route).

    OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_call_overhead.py [--calls 5000]
    python benchmarks/bench_call_overhead.py --backend cudnn      # on a GPU
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


def per_call_us(fn, calls: int, rounds: int, sync=lambda: None) -> float:
    best = float("inf")
    for _ in range(rounds):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


def layer_calls_us(calls: int, rounds: int) -> dict[str, float]:
    """Forward and backward of a converted tiny layer (`ucudnn.torch.convert`), per call: `layer
    direct` plans `native` (the layer is plain F.conv2d behind ucudnn's checks), `layer routed`
    plans im2col_gemm (the autograd Function and the handle's kernels); `layer operators` runs the
    routed layer's kernels through `torch.ops.ucudnn` (what eager calls would cost through them)."""
    from ucudnn.torch import convert

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, 8, 8, generator=g, requires_grad=True)
    dy = torch.randn(1, 8, 8, 8, generator=g)
    out = {}
    for name, algo in (("layer direct", "native"), ("layer routed", "im2col_gemm")):
        layer = convert(torch.nn.Conv2d(8, 8, 3, padding=1), backend="cpu", policy="undivided", algos=[algo], reps=1,
                        db=False, call_overhead=0)
        layer(x).backward(dy)  # plan and prepare
        out[name] = per_call_us(lambda: layer(x).backward(dy), calls, rounds)
    try:
        from ucudnn.torch.ops import layer_key
    except ImportError:  # an older checkout: no operators
        return out
    # the routed layer's kernels through ucudnn's torch.library operators, as a compiled graph calls them
    conv = (layer_key(layer), [1, 1], [1, 1], [1, 1], False, [0, 0], 1, "NCHW", True, True)
    out["layer operators"] = per_call_us(lambda: torch.ops.ucudnn.convolution(x, layer.weight, *conv).backward(dy),
                                         calls, rounds)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--backend", choices=("cpu", "cudnn"), default="cpu")
    args = parser.parse_args()
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
        results[name] = per_call_us(lambda: handle.conv_forward(x, w, padding=1, out=out, layer="l"),
                                    args.calls, args.rounds, sync)
        if n == 1:
            tx, tw = torch.as_tensor(x), torch.as_tensor(w)
            results["torch"] = per_call_us(lambda: F.conv2d(tx, tw, padding=1), args.calls, args.rounds, sync)
        if n == 1 and not gpu:
            problem = ConvProblem(n=1, c=8, h=8, w=8, k=8, r=3, s=3, pad_h=1, pad_w=1)
            backend, workspace = handle.backend, handle.backend.empty_workspace(0)
            results["backend"] = per_call_us(
                lambda: backend.run(problem, "native", x=x, w=w, out=out, workspace=workspace),
                args.calls, args.rounds)
    results["per micro-batch"] = (results["handle-4"] - results["handle"]) / 3
    if not gpu:
        results.update(layer_calls_us(args.calls // 5, args.rounds))
    if not gpu:
        results["handle - backend"] = results["handle"] - results["backend"]
        try:
            from ucudnn.torch.conv import route_overhead_ms
        except ImportError:  # an older checkout: no charge to report
            pass
        else:
            results["torch route"] = route_overhead_ms() * 1e3
    print(f"# host time per call, tiny convolution, 1 thread; ucudnn from {ucudnn.__file__}")
    for name, us in results.items():
        print(f"{name:>17}  {us:8.1f} us")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
