"""`ucudnn bench`: benchmark and optimise layers or a whole network."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

import click
from ucudnn.cli.options import positive_int
from ucudnn.cli.options import size_option as _size_option

from ucudnn.backends.base import NOISY_SPREAD_FRACTION
from ucudnn.errors import InvalidInput
from ucudnn.kernel.measure import DEFAULT_BENCHMARK_LIMIT
from ucudnn.kernel.resources import check_can_run
from ucudnn.problem import KINDS, ConvProblem
from ucudnn.sizes import format_size

# Timed runs per measurement; more only adds time (the median of 1000 runs is already stable).
MAX_REPS = 1000
# What `--layer` ignores, and why: refused in one line rather than silently dropped.
_UNUSED_LAYER_KEYS = {"kind": "bench runs every kind of --kinds"}


@click.command()
@click.option(
    "--layer",
    "layer_specs",
    multiple=True,
    metavar="SPEC",
    help="A conv layer, e.g. n=32,c=64,h=56,w=56,k=128,r=3,s=3,pad=1 (repeatable; no kind=, see --kinds).",
)
@click.option("--network", metavar="NAME", help="A network of the zoo (see `ucudnn networks`).")
@click.option("--batch", type=int, callback=positive_int, help="Mini-batch size (overrides n of --layer).")
@click.option(
    "--workspace", callback=_size_option, metavar="SIZE", help="Per-kernel workspace limit, WR mode (e.g. 64MiB)."
)
@click.option(
    "--total-workspace",
    callback=_size_option,
    metavar="SIZE",
    help="Total workspace of all kernels, WD mode (e.g. 256MiB).",
)
@click.option(
    "--policy",
    default="powerOfTwo",
    show_default=True,
    help="Micro-batch sizes to benchmark: all, powerOfTwo, undivided, or a list like 1,4,16.",
)
@click.option(
    "--backend",
    "backend_name",
    default="auto",
    show_default=True,
    type=click.Choice(["auto", "cpu", "cudnn"]),
    help="Where the kernels run: cpu (NumPy/SciPy algorithms, and PyTorch's own as native when torch is "
    "installed), cudnn (cuDNN's engines on an NVIDIA GPU), auto (cudnn when a GPU is usable, else cpu).",
)
@click.option("--kinds", default=",".join(KINDS), show_default=True, help="Kernels to optimise, comma-separated.")
@click.option("--algos", help="Restrict the candidate algorithms (comma-separated).")
@click.option(
    "--db",
    "db_url",
    metavar="URL",
    help="Measurement cache (SQLAlchemy URL or SQLite file); default $UCUDNN_DB or the user cache.",
)
@click.option(
    "--reps",
    default=3,
    show_default=True,
    type=click.IntRange(1, MAX_REPS),
    help="Timed runs per measurement (median).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option(
    "--verbose", is_flag=True, help="After the table, list every noisy timing and every excluded (wrong) algorithm."
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Measure in N processes (one GPU each on cudnn, N CPU workers on cpu) into the one cache; "
    "they time every candidate (no --benchmark-limit).",
)
@click.option(
    "--benchmark-limit",
    default=DEFAULT_BENCHMARK_LIMIT,
    show_default=True,
    type=click.IntRange(min=0),
    help="Time at most N candidates per kernel and micro-batch size, the backend's best-ranked first, "
    "and skip those that lost clearly at the next larger size (0: time every candidate).",
)
@click.option("--exhaustive", is_flag=True, help="Time every candidate at every size (--benchmark-limit 0).")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="WD mode: draw the Pareto front and the workspace division to this PNG.",
)
def bench(
    layer_specs,
    network,
    batch,
    workspace,
    total_workspace,
    policy,
    backend_name,
    kinds,
    algos,
    db_url,
    reps,
    as_json,
    verbose,
    quiet,
    workers,
    benchmark_limit,
    exhaustive,
    plot_path,
):
    """Benchmark every algorithm at several micro-batch sizes and pick the fastest division.

    WR (--workspace, or no limit) optimises each kernel within its own limit, so --layer specs
    may have different n; WD (--total-workspace) divides one budget among all kernels of the
    network, at one batch size.
    """
    from ucudnn.db import Cache

    from ucudnn.backends import get_backend
    from ucudnn.kernel.measure import batch_sizes, parse_policy
    from ucudnn.network.optimize import expand_kernels, optimize

    if workers > 1:  # the same optimize, after N worker processes have filled the cache
        from ucudnn.network.parallel import parallel_optimize

        optimize = parallel_optimize(workers, db_url)

    if bool(layer_specs) == bool(network):
        raise InvalidInput("give --layer SPEC (repeatable) or --network NAME, one of the two")
    if workspace is not None and total_workspace is not None:
        raise InvalidInput("give --workspace (WR) or --total-workspace (WD), not both")
    if plot_path and total_workspace is None:
        raise InvalidInput("--plot draws the WD solution: give --total-workspace too")
    if plot_path:
        check_plot_path(plot_path)  # before the benchmark, not after minutes of it
    policy_value = parse_policy(policy)
    # Each kind and algorithm once, in the order given: `fwd,fwd` must not count fwd twice.
    kind_list = list(dict.fromkeys(k.strip() for k in kinds.split(",") if k.strip()))
    algo_list = list(dict.fromkeys(a.strip() for a in algos.split(",") if a.strip())) if algos else None

    if network:
        from ucudnn.network.zoo import layers as network_layers

        layers = [(layer.name, layer.problem) for layer in network_layers(network, batch)]
    else:
        problems = [ConvProblem.parse(spec, unused=_UNUSED_LAYER_KEYS) for spec in layer_specs]
        if batch is None and total_workspace is not None and len({p.n for p in problems}) > 1:
            raise InvalidInput(
                "the --layer specs have different n and WD divides one workspace among kernels of "
                "one batch size; give --batch to choose one"
            )
        layers = [(f"layer{i + 1}", p) for i, p in enumerate(problems)]  # the table names each --layer above it
    # Each layer at --batch, or at its own n (WR: every kernel stands alone).
    kernels = [kernel for layer in layers for kernel in expand_kernels([layer], batch or layer[1].n, kind_list)]

    backend = get_backend(backend_name)
    if algo_list:
        known = set().union(*(backend.algorithms(p) for _, p in kernels))
        unknown = [a for a in algo_list if a not in known]
        if unknown:
            raise InvalidInput(
                f"unknown algorithm(s) {', '.join(unknown)} for backend {backend.name}; "
                f"known: {', '.join(sorted(known))}"
            )
    unique = {(p.key, p.n): p for _, p in kernels}
    sizes = {p.n: batch_sizes(policy_value, p.n) for p in unique.values()}
    for n, sizes_n in sizes.items():
        if not sizes_n:
            raise InvalidInput(f"--policy {policy}: every size is larger than the batch {n}")
    for problem in unique.values():  # refuse before measuring anything
        check_can_run(
            backend,
            problem,
            sizes=sizes[problem.n],
            algos=algo_list,
            workspace_limit=workspace if workspace is not None else total_workspace,
        )
    cache = Cache(db_url)
    show_progress = not quiet and not (as_json and not sys.stderr.isatty())
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    total = sum(len(sizes[p.n]) * len(algo_list or backend.algorithms(p)) for p in unique.values())
    try:
        # One step per candidate (an algorithm at a micro-batch size): measured, from the cache, over the limit or pruned.
        with (
            tqdm(
                total=total, desc="benchmark", unit="candidate", file=sys.stderr, disable=not show_progress, leave=False
            ) as progress,
            logging_redirect_tqdm(),
        ):
            report = optimize(
                backend,
                kernels,
                policy=policy_value,
                workspace_limit=workspace,
                total_workspace=total_workspace,
                cache=cache,
                algos=algo_list,
                reps=reps,
                progress=progress,
                benchmark_limit=0 if exhaustive else benchmark_limit,
            )
    finally:
        cache.close()

    if plot_path:
        from ucudnn.network.plot import plot_wd

        plot_wd(report, plot_path)
    conditions = run_conditions(report, backend)
    if as_json:
        click.echo(json.dumps({**report.to_json(), "conditions": conditions}, indent=2))
    else:
        specs = None if network else [(name, p.spec) for name, p in layers]
        click.echo(format_report(report, verbose=verbose, layer_specs=specs, conditions=conditions))


# The library each CPU algorithm's speed rests on, so that a ratio says whose speed it compares.
_LIBRARY = {"native": "PyTorch", "fft": "scipy.fft"}


def run_conditions(report, backend) -> dict:
    """What the speedup rests on here: the algorithms on each side, the BLAS pools threadpoolctl finds (the package
    that ships each, its library, version and threads while measuring) and PyTorch's version and threads (null
    when no side ran `native`)."""
    from threadpoolctl import threadpool_info

    baseline_algos = sorted({k.baseline.algo for k in report.kernels if k.baseline})
    algos = sorted({m.algo for k in report.kernels for m in k.config.micros})
    torch = None
    if "native" in baseline_algos + algos:  # a warm run read its times from the cache without loading torch
        torch = importlib.import_module("torch")
    threads = getattr(backend, "numpy_threads", None)
    return {
        "baseline_algos": baseline_algos,
        "algos": algos,
        "blas": [
            {
                "package": _shipped_by(pool["filepath"]),
                "library": pool["internal_api"],
                "version": pool["version"],
                "threads": threads or pool["num_threads"],
            }
            for pool in threadpool_info()
            if pool["user_api"] == "blas"
        ],
        "torch": {"version": torch.__version__, "threads": torch.get_num_threads()} if torch else None,
    }


def _threads(n: int) -> str:
    return f"{n} thread" + ("" if n == 1 else "s")


def _shipped_by(filepath: str) -> str:
    """The package whose wheel holds a library: `numpy` for site-packages/numpy.libs/libscipy_openblas64_.so."""
    parts = Path(filepath).parts
    if "site-packages" in parts[:-2]:
        return parts[parts.index("site-packages") + 1].removesuffix(".libs")
    return Path(filepath).name


def format_conditions(conditions: dict, backend_name: str) -> list[str]:
    """The `why:` lines under the CPU backend's speedup: whose speed each side is, with its threads."""
    if backend_name != "cpu":
        return []
    blas = (
        ", ".join(
            f"{b['package']}'s {b['library']} {b['version']} ({_threads(b['threads'])})" for b in conditions["blas"]
        )
        or "none found"
    )
    torch = conditions["torch"]

    def side(algos: list[str]) -> str:
        named = []
        for algo in algos:
            library = _LIBRARY.get(algo, "NumPy on BLAS")
            if library == "PyTorch" and torch:
                library = f"PyTorch {torch['version']}, {_threads(torch['threads'])}"
            named.append(f"{algo} ({library})")
        return ", ".join(named) or "none"

    sides = f"why: baseline {side(conditions['baseline_algos'])} against {side(conditions['algos'])}"
    return [
        f"{sides}; BLAS (threadpoolctl): {blas}.",
        "why: each side runs at its library's speed on this CPU and threads: the ratio moves with them and the load.",
    ]


def format_report(report, verbose: bool = False, layer_specs=None, conditions: dict | None = None) -> str:
    """A table a person can read: one row per kernel, then totals, what the columns mean, the headline."""
    from ucudnn.network.optimize import BASELINE_LEAST_WORKSPACE, configuration_notation

    limit = (
        f"workspace limit {format_size(report.workspace_limit)} per kernel"
        if report.mode == "WR"
        else f"total workspace {format_size(report.total_workspace)}"
    )
    lines = [
        (
            f"device {report.device} | backend {report.backend} | mode {report.mode}, {limit} | "
            f"policy {report.policy} | batch {report.batch if report.batch is not None else 'per layer'}"
        )
    ]
    lines += [f"{name}: --layer {spec}" for name, spec in layer_specs or ()]
    header = ("layer", "kind", "baseline", "base ms", "configuration", "ms", "workspace", "speedup")
    rows = []
    for k in report.kernels:
        base = k.baseline
        fallback = "*" if base and k.baseline_rule == BASELINE_LEAST_WORKSPACE else ""
        rows.append(
            (
                k.layer,
                k.problem.kind,
                base.algo + fallback if base else "(none runs)",
                f"{base.time:.3f}" if base else "-",
                k.config.describe(),
                f"{k.config.time:.3f}",
                format_size(k.config.workspace),
                _ratio(k.speedup) + ("?" if k.doubtful else ""),
            )
        )
    total_ws = "sum " if report.mode == "WD" else "max "
    rows.append(
        (
            "total",
            "",
            "",
            _ms(report.baseline_ms),
            "",
            f"{report.time_ms:.3f}",
            total_ws + format_size(report.workspace),
            _ratio(report.baseline_ms / report.time_ms),
        )
    )
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    numeric = {3, 5, 6, 7}

    def line(row):
        return "  ".join(
            str(c).rjust(w) if i in numeric else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    lines += [line(header), rule, *map(line, rows[:-1]), rule, line(rows[-1])]
    fallbacks = sum(1 for k in report.kernels if k.baseline and k.baseline_rule == BASELINE_LEAST_WORKSPACE)
    lines += [
        f"configuration: {configuration_notation(report.example_configuration)}.",
        f"baseline: {report.baseline_text}"
        + (f" (marked *: {fallbacks} of {len(report.kernels)} kernels)." if fallbacks else "."),
    ]
    speedup = report.baseline_ms / report.time_ms
    doubtful = sum(k.doubtful for k in report.kernels)
    if math.isfinite(speedup):
        lines.append(
            f"speedup: {speedup:.2f}x in total, {report.time_ms:.1f} ms against the baselines' "
            f"{report.baseline_ms:.1f} ms (sums over the {len(report.kernels)} kernels)"
            + (
                f"; `?` marks {doubtful} ratio{'' if doubtful == 1 else 's'} resting on a time that still looks like an outlier "
                f"(noisy, or over 2x slower per sample than at a smaller size) after re-measuring"
                if doubtful
                else ""
            )
        )
    else:
        lines.append("speedup: - in total: some kernel has no baseline (no algorithm ran its undivided batch)")
    lines += format_conditions(conditions, report.backend) if conditions else []
    s = report.stats
    lines.append(
        f"benchmark: {s.candidates} candidates (an algorithm at a micro-batch size), {s.measured} measured now, "
        f"{s.cached} from the cache, {s.over_limit} not run (workspace over the limit), {s.pruned} pruned "
        f"(--benchmark-limit; --exhaustive times them); {s.seconds:.1f} s wall time ("
        + (
            f"measuring, re-measuring {report.remeasured} outlier{'' if report.remeasured == 1 else 's'}: "
            f"{report.remeasure_seconds:.1f} s, solving)"
            if report.remeasured
            else "measuring and solving)"
        )
    )
    if report.noise_text:
        lines.append(f"note: {report.noise_text}")
    skipped: dict[tuple[str, str], int] = {}
    for k in report.kernels:
        for pair in k.unsupported:
            skipped[pair] = skipped.get(pair, 0) + 1
    lines += [
        f"skipped: {algo} on {count} of {len(report.kernels)} kernels, which it cannot run: {reason}"
        for (algo, reason), count in skipped.items()
    ]
    excluded = [(k, m) for k in report.kernels for m in k.excluded]
    if excluded:
        lines.append(
            f"warning: {len(excluded)} wrong results excluded" + ("" if verbose else " (details: --verbose or --json)")
        )
    if verbose:
        lines += [
            f"noisy: {k.layer} {k.problem.kind} {m.algo} at batch {m.batch}: median {m.time:.3f} ms, "
            f"IQR {m.spread:.3f} ms (over {NOISY_SPREAD_FRACTION:.0%} of the median)"
            for k, m in report.noisy
        ]
        lines += [f"excluded: {k.layer} {k.problem.kind} {m.algo} at batch {m.batch}: {m.reason}" for k, m in excluded]
    return "\n".join(lines)


def _ms(x: float) -> str:
    """A total in ms, or `-` when some kernel has none (no undivided baseline fits its share)."""
    return f"{x:.3f}" if math.isfinite(x) else "-"


def check_plot_path(path: str) -> None:
    """InvalidInput unless a figure can be saved at `path`: a known format, a writable place."""
    from matplotlib.backend_bases import FigureCanvasBase

    target = Path(path).expanduser()
    formats = FigureCanvasBase.get_supported_filetypes()
    if target.suffix and target.suffix[1:].lower() not in formats:
        raise InvalidInput(
            f"--plot {path!r}: matplotlib cannot write {target.suffix!r} files; "
            f"use one of {', '.join('.' + f for f in sorted(formats))}"
        )
    folder = target.parent
    if target.is_dir():
        raise InvalidInput(f"--plot {path!r} is a directory; name a file")
    if not folder.is_dir():
        raise InvalidInput(f"--plot {path!r}: the directory {str(folder)!r} does not exist")
    existed = target.exists()
    try:  # the one sure test (root, read-only mounts, /proc): open it for appending, as savefig will
        with open(target, "ab"):
            pass
    except OSError as exc:
        raise InvalidInput(f"--plot {path!r} cannot be written: {exc.strerror or exc}") from None
    if not existed:
        target.unlink()


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "-"
