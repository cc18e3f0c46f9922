"""Host time the cuDNN frontend spends turning one convolution's operands into a variant pack, by the
form they are given in: what every `execute_plan_at_index` pays before cuDNN's own execute.

    OMP_NUM_THREADS=1 python benchmarks/gpu/frontend_pack.py [--calls N] [--rounds R]

Runs without a GPU: the pack is built on the host (nvidia-cudnn-frontend 1.32's `pygraph._normalize` /
`_normalize_ordered`, private names, called here only to measure them; with a GPU `execute_plan_at_index`
calls them and then cuDNN). Forms, interleaved round by round:

- `map-ptr`: {graph tensor: raw pointer} (what `CudnnBackend.run` passes);
- `uids-ptr`: a tuple of raw pointers with fixed `tensor_uids` (what `CudnnBackend.prepare_run` passes);
- `uids-torch`: a tuple of torch tensors with fixed `tensor_uids` (what the frontend's own torch operators
  pass): torch publishes DLPack's C exchange API, which the frontend reads natively; raw pointers and
  CuPy arrays (CuPy 14 does not publish it) go through its Python description of each operand.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import cudnn

    from ucudnn.backends.cudnn_graph import declare_graph
    from ucudnn.problem import ConvProblem

    problem = ConvProblem.parse("n=2,c=8,h=8,w=8,k=8,r=3,s=3,pad=1")
    declared = declare_graph(cudnn, problem)
    graph = declared.graph
    (_, x_t), (_, w_t) = declared.inputs
    y_t = declared.output
    uids = (x_t.uid, w_t.uid, y_t.uid)
    tensors = (torch.randn(problem.x_shape), torch.randn(problem.w_shape), torch.empty(problem.y_shape))
    pointers = tuple(t.data_ptr() for t in tensors)
    forms = {
        "map-ptr": lambda: graph._normalize(graph._uid_to_data(dict(zip((x_t, w_t, y_t), pointers))), 0),
        "uids-ptr": lambda: graph._normalize_ordered(pointers, uids, 0),
        "uids-torch": lambda: graph._normalize_ordered(tensors, uids, 0),
    }
    samples: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(args.rounds):
        for name, build in forms.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                build()
            samples[name].append((time.perf_counter() - start) / args.calls * 1e6)
    base = statistics.median(samples["map-ptr"])
    print(
        f"cudnn-frontend {cudnn.__version__}, torch {torch.__version__}, {args.rounds} rounds of {args.calls} "
        "packs (3 operands)"
    )
    for name, values in samples.items():
        median = statistics.median(values)
        print(f"{name:<11} {median:6.2f} us per pack (min {min(values):.2f})  x map-ptr {median / base:.2f}")


if __name__ == "__main__":
    main()
