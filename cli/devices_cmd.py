"""`ucudnn devices`: the built-in device profiles the memory planner and the cluster optimizer use."""

from __future__ import annotations

import json

import click

from ucudnn.devices import PROFILES
from ucudnn.sizes import format_size


def _timings(name: str, measured: set[str]) -> str:
    """Where conv times come from (ucudnn.memory.timing): measured, else scaled from measured fronts or a roofline."""
    return "measured" if name in measured else "scaled/roofline"


@click.command("devices")
@click.option("--json", "as_json", is_flag=True, help='Print {"devices": [profile, ...]}.')
def devices(as_json: bool) -> None:
    """List the device profiles (a user profile is a JSON file with the same fields, given by path)."""
    from ucudnn.memory.timing import measured_devices

    measured = set(measured_devices())
    if as_json:
        click.echo(
            json.dumps(
                {"devices": [{**p.to_json(), "conv_timings": _timings(p.name, measured)} for p in PROFILES.values()]}
            )
        )
        return
    header = (
        "name",
        "model",
        "memory",
        "h2d GB/s",
        "d2h GB/s",
        "duplex GB/s",
        "per link",
        "TFLOP/s",
        "GB/s",
        "conv times",
    )
    rows = [header] + [
        (
            p.name,
            p.model,
            format_size(p.memory_bytes),
            f"{p.h2d_gbps:g}",
            f"{p.d2h_gbps:g}",
            f"{p.duplex_gbps:g}",
            str(p.devices_per_link),
            f"{p.fp32_tflops:g}",
            f"{p.memory_gbps:g}",
            _timings(p.name, measured),
        )
        for p in PROFILES.values()
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
