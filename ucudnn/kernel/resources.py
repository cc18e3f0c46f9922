"""Can this machine run a problem at all? Memory and support, known before anything is allocated.

Benchmarking a kernel allocates its operands at the largest micro-batch size, then one
algorithm's workspace at a time. A problem whose operands alone exceed the machine (233 TiB for
a 10^6 x 10^6 image) would otherwise end in a MemoryError or a NumPy dimension error after
minutes of smaller sizes; `check_fits` refuses it first, saying how many bytes it needs and how
many the machine has.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from ucudnn.backends.base import Backend
from ucudnn.errors import InvalidInput, UnsupportedProblem
from ucudnn.problem import ConvProblem
from ucudnn.sizes import format_size

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}
_OPERANDS = {
    "fwd": ("x_shape", "w_shape", "y_shape"),
    "bwd_data": ("y_shape", "w_shape", "x_shape"),
    "bwd_filter": ("x_shape", "y_shape", "w_shape"),
}


class NotEnoughMemory(InvalidInput):
    """A problem cannot be benchmarked or run here: it needs more memory than the machine has."""


def operand_bytes(problem: ConvProblem) -> int:
    """Bytes of one kernel's two inputs and its output (exact: Python integers never overflow)."""
    itemsize = _ITEMSIZE[problem.dtype]
    return sum(math.prod(getattr(problem, shape)) * itemsize for shape in _OPERANDS[problem.kind])


def available_bytes(backend: Backend) -> int:
    """Memory the backend can allocate from: the CPU's MemAvailable (Linux), else the device's total."""
    if backend.name == "cpu":
        try:
            with open("/proc/meminfo", encoding="ascii") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):  # not Linux: fall back to the total below
            pass
    return backend.device.memory_bytes


def _smallest_workspace(backend: Backend, problem: ConvProblem, algos: Iterable[str], limit: int | None) -> int | None:
    """The least workspace any runnable candidate needs (None: none can be sized or runs)."""
    sizes = []
    for algo in algos:
        if backend.unsupported_reason(problem, algo) is not None:
            continue
        try:
            need = backend.workspace_size(problem, algo)
        except Exception:  # noqa: BLE001, S112 -- a candidate that cannot be sized is measured (and fails) later
            continue
        if limit is None or need <= limit:
            sizes.append(need)
    return min(sizes) if sizes else None


def check_fits(
    backend: Backend,
    problem: ConvProblem,
    *,
    sizes: Sequence[int] = (),
    algos: Sequence[str] | None = None,
    workspace_limit: int | None = None,
) -> None:
    """NotEnoughMemory unless `problem`'s operands at its largest micro-batch size, plus the
    smallest workspace of a runnable candidate there, fit in `available_bytes(backend)`.

    Cheap: arithmetic on shapes, and workspace sizes only for a problem near the limit."""
    largest = problem.with_batch(max([problem.n, *sizes]))
    have = available_bytes(backend)
    need = operand_bytes(largest)
    # Sizing workspaces can build a plan per candidate (cuDNN), so it is done only when the
    # operands take more than half the memory; below that, a candidate whose workspace does not
    # fit is recorded by the benchmark as out of memory, and the others still run.
    if have // 2 < need <= have:
        workspace = _smallest_workspace(backend, largest, algos or backend.algorithms(largest), workspace_limit)
        need += workspace or 0
    if have and need > have:
        raise NotEnoughMemory(
            f"{largest.spec} ({largest.kind}) needs {format_size(need)} ({need} bytes: operands and "
            f"the smallest workspace at batch {largest.n}), but {backend.name} on {backend.device.model} "
            f"has {format_size(have)} ({have} bytes) available; use a smaller batch or layer"
        )


def check_runnable(
    backend: Backend, problem: ConvProblem, sizes: Sequence[int], algos: Sequence[str] | None = None
) -> None:
    """UnsupportedProblem when no candidate algorithm can run `problem` at any of `sizes`.

    That is a request the backend cannot serve (a dtype, layout or algorithm it lacks), not a
    limit that nothing fits; the message gives each algorithm's own reason.
    """
    reasons: dict[str, str] = {}
    for algo in algos or backend.algorithms(problem):  # stops at the first that can run
        for size in sizes or (problem.n,):
            reason = backend.unsupported_reason(problem.with_batch(size), algo)
            if reason is None:
                return
            reasons.setdefault(algo, reason)
    distinct = set(reasons.values())
    why = distinct.pop() if len(distinct) == 1 else "; ".join(f"{a}: {r}" for a, r in reasons.items())
    raise UnsupportedProblem(
        f"backend {backend.name} cannot run {problem.spec} ({problem.kind}) with {', '.join(reasons)}: {why}"
    )


def check_can_run(
    backend: Backend,
    problem: ConvProblem,
    *,
    sizes: Sequence[int] = (),
    algos: Sequence[str] | None = None,
    workspace_limit: int | None = None,
) -> None:
    """Both checks, before a problem is measured: some candidate supports it (`check_runnable`),
    and its benchmark fits in memory (`check_fits`). Bench and Handle call this one function."""
    check_runnable(backend, problem, sizes, algos)
    check_fits(backend, problem, sizes=sizes, algos=algos, workspace_limit=workspace_limit)
