"""What verifying every candidate costs a benchmark run, CPU backend, side by side in one run.

Each round measures one layer's kernels at every micro-batch size of the policy from an empty
cache twice: with verification (the shipped `Backend.measure`: a float64 reference per problem and
micro-batch size, one comparison per candidate) and without it (a backend whose reference and
comparison are no-ops). Rounds alternate the order, so both see the same machine load; the
reported ratio is the median over rounds.

    python benchmarks/bench_verification.py [--layer SPEC] [--rounds 3] [--reps 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import table  # noqa: E402

from ucudnn.backends.cpu import CpuBackend  # noqa: E402
from ucudnn.kernel.measure import batch_sizes, measure_table  # noqa: E402
from ucudnn.problem import KINDS, ConvProblem  # noqa: E402


class Unverified(CpuBackend):
    """The CPU backend with verification switched off: no reference, every result accepted."""

    def trusted_result(self, problem, inputs):
        return None

    def result_error(self, problem, out, trusted):
        return 0.0


def bench_seconds(backend, problem: ConvProblem, policy: str, reps: int) -> float:
    start = time.perf_counter()
    for kind in KINDS:
        measure_table(backend, problem.with_kind(kind), batch_sizes(policy, problem.n), reps=reps)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", default="n=16,c=96,h=27,w=27,k=256,r=5,s=5,pad=2,groups=2")
    parser.add_argument("--policy", default="powerOfTwo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=1)
    args = parser.parse_args()
    problem = ConvProblem.parse(args.layer)
    contenders = {"verified": CpuBackend(), "unverified": Unverified()}
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for round_ in range(args.rounds):
        order = list(contenders) if round_ % 2 == 0 else list(reversed(contenders))
        for name in order:
            seconds[name].append(bench_seconds(contenders[name], problem, args.policy, args.reps))
    medians = {name: statistics.median(s) for name, s in seconds.items()}
    print(f"layer {problem.spec}, policy {args.policy}, reps {args.reps}, {args.rounds} rounds, all kinds")
    print(table(["measure_table", "median s", "rounds (s)"],
                [[name, f"{medians[name]:.1f}", " ".join(f"{s:.1f}" for s in seconds[name])] for name in contenders]))
    print(f"verification overhead: {medians['verified'] / medians['unverified'] - 1:+.1%}")


if __name__ == "__main__":
    main()
