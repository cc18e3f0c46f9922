"""The correctness suite behind `ucudnn selftest`.

For a handful of small problems (padding, stride, dilation, groups, non-square filters; 1-D, 3-D and
transposed convolutions) and for
every kind and every algorithm a backend offers, each check runs the algorithm

1. undivided, compared with the float64 reference (`ucudnn.reference`);
2. again into the same output with alpha = ALPHA and beta = BETA, compared with
   ALPHA * reference + BETA * (the first result), which checks the blend of the contract;
3. micro-batched through `run_configuration` (the batch split in two, so bwd_filter accumulates),
   compared with the reference and with the undivided result.

Errors are normwise: max |out - expected| / max |expected|, so one number per comparison that does
not blow up where a single expected value happens to be near zero. A check passes when every
comparison it could make is within `TOLERANCE[dtype]`; an algorithm the backend declares unsupported
for a problem is skipped with its reason (a dtype the backend lacks skips every check; `ucudnn selftest`
then exits 2, as for any unsupported request). A failed check whose algorithm the backend's measurement
also rejects (`wrong result`: verification against a trusted result, see `Backend.measure`) is
`excluded`: ucudnn never chooses it, so it does not fail the suite, and the report shows it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from ucudnn.backends.base import UNWRITTEN_WORKSPACE_BYTE, Backend
from ucudnn.errors import UcudnnError
from ucudnn.kernel.run import run_configuration
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.reference import reference, relative_error, to_host_float64
from ucudnn.solver.types import Configuration, MicroConfig

# Small on purpose (the CPU backend runs the suite in seconds) and odd-sized on purpose (micro-batch
# slices then start at addresses that are not 16-byte aligned, and spatial sizes are not multiples
# of any tile). Each exercises one feature besides 3x3 padding-1 convolution.
DEFAULT_PROBLEMS: tuple[str, ...] = (
    "n=3,c=4,h=7,w=7,k=6,r=3,s=3,pad=1",  # padding
    "n=3,c=4,h=9,w=8,k=4,r=3,s=3,pad=1,stride=2",  # stride, uneven output
    "n=2,c=3,h=9,w=9,k=4,r=3,s=3,pad=2,dilation=2",  # dilation
    "n=3,c=6,h=6,w=6,k=4,r=3,s=3,pad=1,groups=2",  # groups
    "n=2,c=4,h=8,w=7,k=5,r=5,s=3,pad_h=2,pad_w=0,stride_h=1,stride_w=2",  # non-square filter, per-axis pad/stride
    "n=3,c=4,h=1,w=13,k=6,r=1,s=5,pad_w=2,stride_w=2",  # 1-D: a 2-D layer of height 1
    "n=2,c=4,d=5,h=6,w=5,k=4,t=3,r=3,s=3,pad=1,stride_d=2",  # 3-D
    "n=3,c=4,h=5,w=4,k=6,r=3,s=3,pad=1,stride=2,transposed=1,output_padding=1,groups=2",  # transposed
    "n=2,c=4,d=3,h=4,w=3,k=4,t=2,r=2,s=2,stride=2,transposed=1",  # transposed 3-D (U-Net up-conv)
)

# Normwise relative error allowed per io dtype. float32 allows for TF32 tensor cores and
# down-converting engines on GPUs (10-bit mantissa, error ~2^-11 per product, a few times that
# after summation); float16 and bfloat16 for their own 10- and 7-bit mantissas and half-precision
# accumulation; float64 for summation order only.
TOLERANCE = {"float64": 1e-9, "float32": 2e-3, "float16": 1e-2, "bfloat16": 4e-2}

# The alpha/beta check: neither is 0 or 1, so a blend that ignores either one shows.
ALPHA, BETA = 0.75, 0.5


class SelftestFailed(UcudnnError):
    """At least one check of the correctness suite failed (the report says which)."""


def micro_batches(n: int) -> tuple[int, ...]:
    """The split of the micro-batched run: two parts, the larger first (just n when n = 1)."""
    return (n - n // 2, n // 2) if n > 1 else (1,)


# ---- results ----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Check:
    """One algorithm on one problem and kind. Errors are None where the comparison was not made."""

    problem: str
    kind: str
    algo: str
    status: str  # "pass", "fail", "skip" or "excluded" (wrong, and rejected by the measurement)
    tolerance: float
    micro_batches: tuple[int, ...] = ()
    error_reference: float | None = None  # undivided vs float64 reference
    error_alpha_beta: float | None = None  # alpha/beta blend vs its float64 expectation
    error_micro_reference: float | None = None  # micro-batched vs float64 reference
    error_micro_undivided: float | None = None  # micro-batched vs undivided
    reason: str = ""

    @property
    def errors(self) -> tuple[float, ...]:
        return tuple(
            e
            for e in (
                self.error_reference,
                self.error_alpha_beta,
                self.error_micro_reference,
                self.error_micro_undivided,
            )
            if e is not None
        )

    @property
    def worst_error(self) -> float | None:
        return max(self.errors, default=None)


def _json_number(value: float | None) -> float | str | None:
    # JSON has no infinity; a non-finite error is spelled out rather than emitted as invalid JSON.
    if value is None or math.isfinite(value):
        return value
    return str(value)


@dataclass(frozen=True, slots=True)
class SelftestReport:
    backend: str
    device: str
    dtype: str
    checks: tuple[Check, ...]
    seconds: float

    def count(self, status: str) -> int:
        return sum(1 for c in self.checks if c.status == status)

    @property
    def passed(self) -> bool:
        return self.count("fail") == 0

    def table(self) -> dict[str, dict[str, tuple[str, float | None]]]:
        """algo -> kind -> (status, worst error over problems); fail beats excluded beats pass beats skip."""
        rank = {"skip": 0, "pass": 1, "excluded": 2, "fail": 3}
        cells: dict[str, dict[str, tuple[str, float | None]]] = {}
        for c in self.checks:
            row = cells.setdefault(c.algo, {})
            status, worst = row.get(c.kind, ("skip", None))
            if rank[c.status] > rank[status]:
                status = c.status
            if c.worst_error is not None:
                worst = c.worst_error if worst is None else max(worst, c.worst_error)
            row[c.kind] = (status, worst)
        return cells

    def format(self) -> str:
        kinds = [k for k in KINDS if any(c.kind == k for c in self.checks)]
        problems = list(dict.fromkeys(c.problem for c in self.checks))
        tolerance = TOLERANCE[self.dtype]
        lines = [
            (
                f"ucudnn selftest: backend {self.backend} on {self.device}, dtype {self.dtype}, "
                f"{len(problems)} problems, tolerance {tolerance:.0e} (max |out - expected| / max |expected|)"
            )
        ]
        table = self.table()
        width = max([len("algorithm"), *(len(a) for a in table)])
        lines.append((f"{'algorithm':<{width}}  " + "  ".join(f"{k:<15}" for k in kinds)).rstrip())
        for algo, row in table.items():
            cells = []
            for kind in kinds:
                if kind not in row:
                    cells.append(f"{'-':<15}")
                    continue
                status, worst = row[kind]
                text = status if worst is None else f"{status} {worst:.1e}"
                cells.append(f"{text:<15}")
            lines.append(f"{algo:<{width}}  " + "  ".join(cells).rstrip())
        lines.append(
            f"checks: {self.count('pass')} passed, {self.count('fail')} failed, "
            f"{self.count('excluded')} excluded (wrong results ucudnn never chooses), "
            f"{self.count('skip')} skipped (unsupported) in {self.seconds:.1f} s"
        )
        for c in self.checks:
            if c.status == "fail":
                errors = ", ".join(f"{e:.2e}" for e in c.errors)
                detail = c.reason or f"errors {errors} over {c.tolerance:.0e}"
                lines.append(f"FAIL {c.kind} {c.algo} on {c.problem}: {detail}")
            elif c.status == "excluded":
                lines.append(f"excluded {c.kind} {c.algo} on {c.problem}: {c.reason}")
        skipped = collections.Counter((c.algo, c.reason) for c in self.checks if c.status == "skip")
        for (algo, reason), times in skipped.items():
            lines.append(f"skip {algo} ({times}x): {reason}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "device": self.device,
            "dtype": self.dtype,
            "tolerance": TOLERANCE[self.dtype],
            "passed": self.passed,
            "summary": {
                "passed": self.count("pass"),
                "failed": self.count("fail"),
                "skipped": self.count("skip"),
                "excluded": self.count("excluded"),
                "seconds": self.seconds,
            },
            "table": {
                algo: {
                    kind: {"status": status, "max_rel_error": _json_number(worst)}
                    for kind, (status, worst) in row.items()
                }
                for algo, row in self.table().items()
            },
            "checks": [
                {
                    "problem": c.problem,
                    "kind": c.kind,
                    "algo": c.algo,
                    "status": c.status,
                    "tolerance": c.tolerance,
                    "micro_batches": list(c.micro_batches),
                    "error_reference": _json_number(c.error_reference),
                    "error_alpha_beta": _json_number(c.error_alpha_beta),
                    "error_micro_reference": _json_number(c.error_micro_reference),
                    "error_micro_undivided": _json_number(c.error_micro_undivided),
                    "reason": c.reason,
                }
                for c in self.checks
            ],
        }


# ---- the runner -------------------------------------------------------------------------------
class _Named(TypedDict):
    """What names a check, as `Check` takes it."""

    problem: str
    kind: str
    algo: str
    tolerance: float


def _made(base: _Named, status: str, sizes: tuple[int, ...], reason: str, errors: dict[str, float]) -> Check:
    """The check with the errors measured before it ended (`Check`'s `error_*` fields; None: not compared)."""
    return Check(
        status=status,
        micro_batches=sizes,
        reason=reason,
        **base,
        error_reference=errors.get("error_reference"),
        error_alpha_beta=errors.get("error_alpha_beta"),
        error_micro_reference=errors.get("error_micro_reference"),
        error_micro_undivided=errors.get("error_micro_undivided"),
    )


def _check(backend: Backend, problem: ConvProblem, algo: str, seed: int) -> Check:
    tolerance = TOLERANCE[problem.dtype]
    base: _Named = {"problem": _problem_text(problem), "kind": problem.kind, "algo": algo, "tolerance": tolerance}
    reason = backend.unsupported_reason(problem, algo)
    if reason is not None:
        return Check(status="skip", reason=reason, **base)
    sizes = micro_batches(problem.n)
    errors: dict[str, float] = {}
    notes = []
    try:
        operands = backend.random_operands(problem, seed)
        inputs = {name: array for name, array in operands.items() if name != "out"}
        expected = reference(problem, **{name: to_host_float64(a, problem.dtype) for name, a in inputs.items()})
        out = operands["out"]
        workspace = backend.empty_workspace(backend.workspace_size(problem, algo))
        workspace.fill(UNWRITTEN_WORKSPACE_BYTE)  # an algorithm reading workspace it never wrote shows
        backend.run(problem, algo, out=out, workspace=workspace, **inputs)
        undivided = to_host_float64(out, problem.dtype)
        errors["error_reference"] = relative_error(undivided, expected)

        backend.run(problem, algo, out=out, workspace=workspace, alpha=ALPHA, beta=BETA, **inputs)
        blended = to_host_float64(out, problem.dtype)
        errors["error_alpha_beta"] = relative_error(blended, ALPHA * expected + BETA * undivided)

        micros = []
        for size in sizes:
            part = problem.with_batch(size)
            why = backend.unsupported_reason(part, algo)
            if why is not None:
                notes.append(f"micro-batched run not checked: unsupported at batch {size}: {why}")
                break
            micros.append(MicroConfig(algo, size, 0.0, backend.workspace_size(part, algo)))
        else:
            micro_out = backend.random_operands(problem, seed + 1)["out"]
            run_configuration(backend, problem, Configuration(tuple(micros)), out=micro_out, **inputs)
            micro = to_host_float64(micro_out, problem.dtype)
            errors["error_micro_reference"] = relative_error(micro, expected)
            errors["error_micro_undivided"] = relative_error(micro, undivided)
    except Exception as exc:  # noqa: BLE001 -- an offered algorithm that cannot run is a failed check, reported
        message = " ".join(str(exc).split())
        return _made(base, "fail", sizes, f"{type(exc).__name__}: {message}", errors)
    status = "pass" if all(e <= tolerance for e in errors.values()) else "fail"
    return _made(base, status, sizes, "; ".join(notes), errors)


def _exclude_rejected(backend: Backend, problem: ConvProblem, checks: list[Check]) -> list[Check]:
    """Failed checks whose algorithm the measurement's verification rejects become `excluded`.

    The measurement is asked at every size the check ran, as `measure_table` would ask it: the
    whole batch, and each micro-batch size (bwd_filter's accumulating with beta = 1), so an
    algorithm that is right undivided and wrong micro-batched is rejected where it would run.
    """
    failed = [c.algo for c in checks if c.status == "fail"]
    if not failed:
        return checks
    verdicts: dict[str, str] = {}
    for size in sorted({problem.n, *micro_batches(problem.n)}, reverse=True):
        part = problem.with_batch(size)
        accumulate = problem.kind == "bwd_filter" and size < problem.n
        for m in backend.measure(part, [a for a in failed if a not in verdicts], reps=1, accumulate=accumulate):
            if m.reason.startswith("wrong result"):
                verdicts[m.algo] = m.reason if size == problem.n else f"{m.reason} at micro-batch {size}"
    return [
        dataclasses.replace(c, status="excluded", reason=f"{verdicts[c.algo]}; measurement rejects it")
        if c.status == "fail" and c.algo in verdicts
        else c
        for c in checks
    ]


def _problem_text(problem: ConvProblem) -> str:
    """The problem's spec without its kind (a check names the kind apart)."""
    return dataclasses.replace(problem, kind="fwd").spec


def run_selftest(
    backend: Backend,
    *,
    problems: Sequence[str | ConvProblem] = DEFAULT_PROBLEMS,
    dtype: str = "float32",
    kinds: Sequence[str] = KINDS,
    seed: int = 0,
) -> SelftestReport:
    """Check every algorithm of every kind of every problem (at `dtype`) on `backend`."""
    if dtype not in TOLERANCE:
        raise ValueError(f"dtype must be one of {', '.join(TOLERANCE)}, got {dtype!r}")
    start = time.perf_counter()
    checks: list[Check] = []
    for item in problems:
        problem = ConvProblem.parse(item) if isinstance(item, str) else item
        for kind in kinds:
            part = dataclasses.replace(problem, kind=kind, dtype=dtype)
            # Every algorithm skipped (unsupported) is a skip, reported with each reason: what a
            # backend does not offer is not a failure. The command says when nothing ran at all.
            found = _exclude_rejected(
                backend, part, [_check(backend, part, algo, seed) for algo in backend.algorithms(part)]
            )
            checks.extend(found)
    return SelftestReport(backend.name, backend.device.model, dtype, tuple(checks), time.perf_counter() - start)
