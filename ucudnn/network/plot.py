"""The two pictures of a WD solution: a kernel's Pareto front, and the workspace division."""

from __future__ import annotations

from ucudnn.errors import InvalidInput

_MIB = 2**20
_KIND_COLOURS = {"fwd": "tab:blue", "bwd_data": "tab:orange", "bwd_filter": "tab:green"}


# More tick labels than this do not fit under a 14-inch plot in a readable font.
MAX_TICK_LABELS = 40


def layer_ticks(layers: list[str], max_labels: int = MAX_TICK_LABELS) -> tuple[list[float], list[str]]:
    """One tick per layer (its kernels are adjacent bars, told apart by colour) at the middle of
    its bars; with more layers than `max_labels`, every k-th layer, so the labels never overlap
    (ResNet-50's 159 kernels are 53 layers: every 2nd is named)."""
    spans: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        spans.setdefault(layer, []).append(i)
    step = -(-len(spans) // max_labels)  # ceiling division
    chosen = list(spans.items())[::step]
    return [(idx[0] + idx[-1]) / 2 for _, idx in chosen], [name for name, _ in chosen]


def plot_wd(report, path: str) -> None:
    """Left: the Pareto front (time x workspace) of the most expensive kernel, each point labelled
    with its division and the chosen one marked. Right: the workspace each kernel was given."""
    if report.mode != "WD" or not report.kernels:
        raise InvalidInput("plot_wd needs a WD report with at least one kernel")
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    costliest = max(report.kernels, key=lambda k: k.config.time)
    front = report.fronts[costliest.problem.key]
    fig, (left, right) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [1, 1.4]})

    ws = [c.workspace / _MIB for c in front]
    ms = [c.time for c in front]
    left.step(ws, ms, where="post", color="0.6", zorder=1)
    left.scatter(ws, ms, color="tab:blue", zorder=2, label="Pareto front")
    for c in front[:: max(1, len(front) // 12)]:  # label at most ~12 points so the text stays readable
        left.annotate(c.describe(), (c.workspace / _MIB, c.time), fontsize=7, xytext=(4, 4), textcoords="offset points")
    left.scatter(
        [costliest.config.workspace / _MIB],
        [costliest.config.time],
        s=160,
        facecolors="none",
        edgecolors="tab:red",
        linewidths=2,
        zorder=3,
        label="chosen by WD",
    )
    left.set(
        xlabel="workspace (MiB)",
        ylabel="time (ms)",
        title=f"{costliest.layer} {costliest.problem.kind}, batch {report.batch}",
    )
    left.legend()

    given = [k.config.workspace / _MIB for k in report.kernels]
    right.bar(range(len(given)), given, color=[_KIND_COLOURS.get(k.problem.kind, "0.5") for k in report.kernels])
    positions, labels = layer_ticks([k.layer for k in report.kernels])
    right.set_xticks(positions, labels, rotation=90, fontsize=7)
    right.set_xlim(-0.6, len(given) - 0.4)
    right.set_xlabel("kernels by layer (colour: kind)")
    right.set(
        ylabel="workspace given (MiB)",
        title=f"WD division: {report.workspace / _MIB:.1f} of {report.total_workspace / _MIB:.1f} MiB used",
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _KIND_COLOURS.values()]
    right.legend(handles, list(_KIND_COLOURS), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cluster(plan, path: str) -> None:
    """The paper's Fig. 13: a bar per device (its time, its batch on it), the makespan dashed; the
    even split beside the optimised one, and the best single device as a reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [("optimised", plan.devices, plan.makespan_ms), ("even split", plan.even, plan.even_makespan_ms)]
    if plan.best_single is not None:
        groups.append(("best single", (plan.best_single,), plan.best_single.time_ms))
    fig, ax = plt.subplots(figsize=(2 + 0.6 * sum(len(g[1]) + 1 for g in groups), 4.5))
    colours = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(d.device for d in plan.devices))}
    x, ticks = 0, []
    for title, steps, span in groups:
        start = x
        for d in steps:
            ax.bar(x, d.time_ms, color=colours[d.device], width=0.8)
            ax.text(x, d.time_ms, str(d.batch), ha="center", va="bottom", fontsize=9)
            x += 1
        ax.hlines(span, start - 0.45, x - 0.55, colors="k", linestyles="dashed")
        ticks.append(((start + x - 1) / 2, f"{title}\n{span:.1f} ms"))
        x += 1
    ax.set_xticks([t for t, _ in ticks], [label for _, label in ticks])
    ax.set(
        ylabel="estimated forward+backward time (ms)",
        title=f"{plan.network}, batch {plan.batch}: numbers are batch sizes, dashes the makespan",
    )
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()], list(colours), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
