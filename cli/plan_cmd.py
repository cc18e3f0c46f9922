"""`ucudnn plan`: a memory plan for a zoo network on a device profile; `--compare` for every policy."""

from __future__ import annotations

import dataclasses
import json
import sys

import click
from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from ucudnn.cli.options import size_option

from ucudnn.devices import load_profile
from ucudnn.errors import InvalidInput
from ucudnn.sizes import format_size, format_sizes

_EXIT_NOTHING_FITS = 1


def _table(plans) -> str:
    header = ("policy", "fits", "peak", "average", "step ms", "overhead", "stall ms", "offloaded", "recompute")
    rows = [header]
    for p in plans:
        recompute = sum(1 for t in p.tensors if t.action == "recompute")
        rows.append(
            (
                p.policy,
                "yes" if p.fits else "NO",
                format_size(p.peak_bytes),
                format_size(p.average_bytes),
                f"{p.step_ms:.1f}",
                f"{100 * p.overhead:+.1f}%",
                f"{p.stall_ms:.1f}",
                format_size(p.bytes_offloaded),
                str(recompute),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows
    )


def _per_device(plan) -> str:
    """One line per device, for plans whose devices act differently (swap-multi's staggered layers)."""
    lines = [f"{plan.policy}: what each device does (the figures above are the slowest or largest device's)"]
    for d, tensors in enumerate(plan.device_actions()):
        offloaded = [t for t in tensors if t.action == "offload"]
        names = ", ".join(t.name for t in offloaded) or "nothing"
        lines.append(
            f"  device {d}: offloads {len(offloaded)} ({format_size(sum(t.bytes for t in offloaded))}): {names}"
        )
    return "\n".join(lines)


def _describe(plan) -> str:
    return (
        f"{plan.network} batch {plan.batch} on {plan.devices}x {plan.device}, limit "
        f"{format_size(plan.memory_limit)}; everything resident: {format_size(plan.baseline_peak_bytes)}, "
        f"{plan.baseline_step_ms:.1f} ms"
    )


def plot_paths(path: str, policies: list[str], compare: bool) -> dict[str, str]:
    """Where each policy's figure goes: `path` itself for one plan; with --compare, `path` with the
    policy before the suffix, so that every policy is drawn and none overwrites another."""
    from pathlib import Path

    if not compare:
        return {policies[0]: path}
    target = Path(path)
    suffix = target.suffix or ".png"
    return {p: str(target.with_name(f"{target.stem}-{p}{suffix}")) for p in policies}


@click.command("plan")
@click.option("--network", required=True, help="Zoo network (ucudnn networks lists them).")
@click.option("--batch", type=int, default=None, help="Mini-batch size (default: the network's training batch).")
@click.option(
    "--device",
    "device_name",
    default="h100",
    show_default=True,
    help="Device profile name (ucudnn devices) or a profile's JSON file.",
)
@click.option(
    "--memory",
    "memory",
    default=None,
    callback=size_option,
    help="Device memory limit, e.g. 12GiB (default: the device's); a fraction of a byte is rounded down.",
)
@click.option(
    "--policy",
    default="optimal",
    show_default=True,
    help="vdnn-all, vdnn-conv, vdnn-dyn, swap-multi, dymem, checkpoint or optimal.",
)
@click.option("--devices", type=int, default=1, show_default=True, help="Devices training data-parallel.")
@click.option(
    "--devices-per-link",
    type=int,
    default=None,
    help="Devices sharing one host link (a PCIe switch), whose copies share its bandwidth "
    "(default: the device profile's).",
)
@click.option(
    "--db",
    "db_url",
    default=None,
    help="A measurement cache (URL or SQLite file) whose measurements of this device come first.",
)
@click.option("--compare", is_flag=True, help="Plan with every available policy, side by side.")
@click.option("--json", "as_json", is_flag=True, help='Print JSON (one plan, or {"policies": [...]}).')
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(dir_okay=False),
    help="Draw memory over the step and the streams' activity to this PNG; with --compare, one PNG "
    "per policy, named FILE with the policy added (timeline-vdnn-dyn.png).",
)
@click.option(
    "--check",
    "check_step",
    is_flag=True,
    help="Build the network in PyTorch, plan it for this machine and run one training step under the "
    "plan: predicted against achieved peak (counted from live tensors), step time, bytes moved.",
)
@click.pass_context
def plan(
    ctx,
    network,
    batch,
    device_name,
    memory,
    policy,
    devices,
    devices_per_link,
    db_url,
    compare,
    as_json,
    plot_path,
    check_step,
):
    """Plan where each feature map lives (kept, offloaded, recomputed) so NETWORK trains within --memory.

    Exit 0 when the plan fits (with --compare: some plan fits), 1 when nothing fits (the message names
    the smallest limit that would), 2 on bad input.
    """
    from ucudnn.memory import available_policies, make_plan
    from ucudnn.memory.graph import from_network
    from ucudnn.memory.planner import smallest_fitting_limit
    from ucudnn.memory.reuse import PlanCache
    from ucudnn.network.zoo import DEFAULT_BATCH, canonical_name

    canonical = canonical_name(network)
    if batch is None:
        batch = DEFAULT_BATCH.get(canonical) or 0
    if not isinstance(batch, int) or batch < 1:
        raise InvalidInput(f"--batch must be a positive integer, got {batch}")
    if devices < 1:
        raise InvalidInput(f"--devices must be a positive integer, got {devices}")
    if check_step:
        flags = {
            "device_name": "--device",
            "devices": "--devices",
            "devices_per_link": "--devices-per-link",
            "db_url": "--db",
            "compare": "--compare",
            "plot_path": "--plot",
        }
        given = [
            flag
            for name, flag in flags.items()
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise InvalidInput(f"--check plans for this machine and runs one step here; leave out {', '.join(given)}")
        return _check(canonical, batch, memory, policy, as_json)
    profile = load_profile(device_name)
    if devices_per_link is not None:
        if devices_per_link < 1:
            raise InvalidInput(f"--devices-per-link must be a positive integer, got {devices_per_link}")
        profile = dataclasses.replace(profile, devices_per_link=devices_per_link)
    limit = memory if memory is not None else profile.memory_bytes
    if limit <= 0:
        raise InvalidInput(f"--memory must be positive, got {memory!r} bytes")
    policies = available_policies() if compare else [policy]
    if not compare and policy not in available_policies():
        raise InvalidInput(f"unknown or unavailable policy {policy!r}; available: {', '.join(available_policies())}")
    plots = plot_paths(plot_path, policies, compare) if plot_path else {}
    if plots:  # before planning, not after
        from ucudnn.cli.bench import check_plot_path

        for path in plots.values():
            check_plot_path(path)
    graph = from_network(canonical, batch)
    # one cache for every plan here: optimal's comparison reuses the other policies' plans, and the search for the
    # smallest limit that fits reuses their simulations
    cache = PlanCache()
    # progress on stderr, on a terminal only and never with --json (its stdout is the JSON alone)
    quiet = as_json or not sys.stderr.isatty()
    with logging_redirect_tqdm():
        plans = [
            make_plan(graph, profile, limit, p, devices=devices, db=db_url, cache=cache)
            for p in tqdm(policies, desc="planning", unit="policy", disable=quiet, leave=False, file=sys.stderr)
        ]

    if plots:
        from ucudnn.memory.plot import plot_plan

        for p in plans:
            plot_plan(p, plots[p.policy])
    if as_json:
        body = {"policies": [p.to_json() for p in plans]} if compare else plans[0].to_json()
        click.echo(json.dumps(body))
    else:
        click.echo(_describe(plans[0]))
        click.echo(_table(plans))
        for p in plans:
            if p.device_tensors:
                click.echo(_per_device(p))
        if compare and plots:
            click.echo(f"plots: {', '.join(plots.values())}")
    if any(p.fits for p in plans):
        return 0
    needed = min(
        (smallest_fitting_limit(graph, profile, p.policy, devices=devices, above=limit, cache=cache), p.policy)
        for p in plans
    )
    shown_limit, shown_needed = format_sizes(limit, needed[0])  # two sizes never read as one
    click.echo(
        f"ucudnn: failed: nothing fits {shown_limit}; the smallest limit that fits is "
        f"{shown_needed} ({needed[0]} bytes, {needed[1]})",
        err=True,
    )
    return _EXIT_NOTHING_FITS


def _check(network: str, batch: int, memory: int | None, policy: str, as_json: bool) -> int:
    """--check: one step of the network under its plan on this machine (ucudnn.torch.checking.check)."""
    try:
        from ucudnn.torch.checking.check import check_network
    except ImportError as exc:
        raise InvalidInput(f"--check needs PyTorch: {exc}") from None
    checked = check_network(network, batch, memory_limit=memory, policy=policy)
    if as_json:
        click.echo(json.dumps({"network": network, "batch": batch, **checked.to_json()}))
    else:
        plan = checked.plan
        click.echo(
            f"{network} batch {batch}, {checked.policy} plan for {plan.device} within "
            f"{format_size(plan.memory_limit)}, one step run on {checked.device}"
        )
        rows = (
            ("peak", format_size(checked.predicted_peak_bytes), format_size(checked.peak_bytes), checked.peak_ratio),
            ("step ms", f"{checked.predicted_step_ms:.1f}", f"{checked.step_ms:.1f}", checked.step_ratio),
            (
                "bytes moved",
                format_size(checked.predicted_bytes_moved),
                format_size(checked.bytes_moved),
                checked.bytes_moved / checked.predicted_bytes_moved if checked.predicted_bytes_moved else None,
            ),
        )
        click.echo(f"{'':12}{'predicted':>12}{'achieved':>12}{'ratio':>8}")
        for name, pred, got, ratio in rows:
            click.echo(f"{name:12}{pred:>12}{got:>12}{'' if ratio is None else f'{ratio:.2f}':>8}")
    return 0 if checked.plan.fits else _EXIT_NOTHING_FITS
