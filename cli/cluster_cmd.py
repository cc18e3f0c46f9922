"""`ucudnn cluster`: split a global batch over unequal devices so that they finish a step together."""

from __future__ import annotations

import json
import math

import click
from ucudnn.cli.options import size_option

from ucudnn.errors import InvalidInput


@click.command()
@click.option("--network", required=True, metavar="NAME", help="A network of the zoo (see `ucudnn networks`).")
@click.option("--batch", required=True, type=click.IntRange(min=1), help="The global mini-batch B.")
@click.option(
    "--devices",
    "devices_text",
    required=True,
    metavar="A,B,C",
    help="Device models as stored in the cache (`ucudnn db info`), or profiles (`ucudnn devices` "
    "lists them; or a JSON file); names may repeat.",
)
@click.option("--db", "db_url", metavar="URL", help="Measurement cache; default $UCUDNN_DB or the user cache.")
@click.option(
    "--policy",
    default="powerOfTwo",
    show_default=True,
    help="Micro-batch sizes WR may use from cached measurements (as in `ucudnn bench`).",
)
@click.option(
    "--workspace",
    default="64MiB",
    show_default=True,
    metavar="SIZE",
    callback=size_option,
    help="Per-kernel workspace limit for the WR times of measured devices.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="Draw the per-device times (PNG).")
def cluster(network, batch, devices_text, db_url, policy, workspace, as_json, plot_path):
    """The batch of each device that minimises the slowest device's step (μ-cuDNN §III-E).

    Devices with measurements in the cache use their WR times; the others a roofline estimate from
    their profile (convolutions only).
    """
    from ucudnn.network.cluster import plan_cluster

    devices = [d.strip() for d in devices_text.split(",")]
    if not all(devices):
        raise InvalidInput(
            f"--devices must be comma-separated device names without empty entries, got {devices_text!r}"
        )
    plan = plan_cluster(batch, devices, network=network, db=db_url, policy=policy, workspace_limit=workspace)
    if plot_path:
        from ucudnn.network.plot import plot_cluster

        plot_cluster(plan, plot_path)
    click.echo(json.dumps(plan.to_json(), indent=2) if as_json else format_plan(plan))


def format_plan(plan) -> str:
    header = ("device", "batch", "time ms", "times from")
    rows = [(d.device, str(d.batch), f"{d.time_ms:.2f}" if d.batch else "-", d.source) for d in plan.devices]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row):
        cells = [c.rjust(w) if i in (1, 2) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(cells).rstrip()

    single = (
        f"{plan.best_single.device} alone at batch {plan.batch}: {plan.best_single.time_ms:.2f} ms, "
        f"speedup {_ratio(plan.speedup_vs_best_single)}"
        if plan.best_single
        else f"no single device can take batch {plan.batch}"
    )
    even = ", ".join(str(d.batch) for d in plan.even)
    return "\n".join(
        [
            f"network {plan.network} | batch {plan.batch} | {len(plan.devices)} devices",
            line(header),
            "  ".join("-" * w for w in widths),
            *map(line, rows),
            f"makespan {plan.makespan_ms:.2f} ms",
            f"vs best single device: {single}",
            f"vs even split ({even}): {_ms(plan.even_makespan_ms)}, speedup {_ratio(plan.speedup_vs_even)}",
        ]
    )


def _ms(x: float) -> str:
    return f"{x:.2f} ms" if math.isfinite(x) else "cannot run"


def _ratio(x: float) -> str:
    return f"{x:.2f}x" if math.isfinite(x) else "-"
