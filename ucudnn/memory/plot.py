"""The picture of a memory plan: device memory over the step, and what each stream did when."""

from __future__ import annotations

from ucudnn.errors import InvalidInput

_GIB = 2**30
_STREAMS = ("compute", "recompute", "d2h", "h2d")
_COLOURS = {"compute": "tab:blue", "recompute": "tab:purple", "d2h": "tab:orange", "h2d": "tab:green"}


def plot_plan(plan, path: str) -> None:
    """Top: device 0's memory in use over the step, with the limit. Bottom: the streams' activity."""
    result = plan.simulation
    if result is None:
        raise InvalidInput("this plan carries no simulation to draw (plans read back from JSON do not)")
    import matplotlib

    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    times = [t for t, _ in result.memory] + [result.step_ms]
    used = [b / _GIB for _, b in result.memory]
    top.stairs(used, times, color="tab:blue", fill=True, alpha=0.4, label="in use")
    top.axhline(plan.memory_limit / _GIB, color="tab:red", linestyle="--", label="limit")
    top.axhline(plan.baseline_peak_bytes / _GIB, color="0.5", linestyle=":", label="everything resident")
    top.set(
        ylabel="device memory (GiB)",
        title=f"{plan.network} b{plan.batch} on {plan.device}, {plan.policy}: peak "
        f"{plan.peak_bytes / _GIB:.2f} GiB, step {plan.step_ms:.1f} ms (+{100 * plan.overhead:.1f}%)",
    )
    top.legend(loc="upper right")
    for row, stream in enumerate(_STREAMS):
        spans = [
            (i.start_ms, i.end_ms - i.start_ms)
            for i in result.timeline
            if i.device == 0 and i.stream == stream and i.end_ms > i.start_ms
        ]
        bottom.broken_barh(spans, (row - 0.4, 0.8), color=_COLOURS[stream])
    bottom.set(yticks=range(len(_STREAMS)), yticklabels=_STREAMS, xlabel="time in the step (ms)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
