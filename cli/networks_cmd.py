"""`ucudnn networks`: the network zoo, as a summary table or one network's layers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import click

from ucudnn.network.zoo import DEFAULT_BATCH, NETWORKS, Layer, canonical_name, layers, unique_problems

_GIGA = 1e9


def _gflops(net: list[Layer]) -> float:
    return sum(layer.problem.flops for layer in net) / _GIGA


def _batch_of(name: str, batch: int | None) -> int | None:
    """The batch the layers were built with; None where every problem carries its own."""
    return batch if batch is not None else DEFAULT_BATCH[name]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], right: set[int]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(row: Sequence[str]) -> str:
        cells = [
            cell.rjust(width) if i in right else cell.ljust(width) for i, (cell, width) in enumerate(zip(row, widths))
        ]
        return "  ".join(cells).rstrip()

    return "\n".join([line(header), *(line(row) for row in rows)])


def _summary(batch: int | None, as_json: bool) -> None:
    entries: list[dict[str, Any]] = []  # JSON objects, one per network
    for name, description in NETWORKS.items():
        net = layers(name, batch)
        entries.append(
            {
                "name": name,
                "description": description,
                "batch": _batch_of(name, batch),
                "conv_layers": len(net),
                "unique_shapes": len(unique_problems(net)),
                "gflops_fwd": _gflops(net),
            }
        )
    if as_json:
        click.echo(json.dumps({"networks": entries}))
        return
    rows = [
        (
            e["name"],
            str(e["conv_layers"]),
            str(e["unique_shapes"]),
            "own" if e["batch"] is None else str(e["batch"]),
            f"{e['gflops_fwd']:.1f}",
            e["description"],
        )
        for e in entries
    ]
    click.echo(_table(("network", "convs", "unique", "batch", "GFLOP/fwd", "description"), rows, right={1, 2, 3, 4}))


def _one(name: str, batch: int | None, as_json: bool) -> None:
    canonical = canonical_name(name)
    net = layers(canonical, batch)
    if as_json:
        click.echo(
            json.dumps(
                {
                    "network": canonical,
                    "description": NETWORKS[canonical],
                    "batch": _batch_of(canonical, batch),
                    "gflops_fwd": _gflops(net),
                    "unique_shapes": len(unique_problems(net)),
                    "layers": [
                        {
                            "name": layer.name,
                            "spec": layer.problem.spec,
                            "key": layer.problem.key,
                            "output": list(layer.problem.y_shape),
                            "gflops_fwd": layer.problem.flops / _GIGA,
                        }
                        for layer in net
                    ],
                }
            )
        )
        return
    rows = [
        (
            layer.name,
            layer.problem.spec,
            "x".join(map(str, layer.problem.y_shape)),
            f"{layer.problem.flops / _GIGA:.2f}",
        )
        for layer in net
    ]
    click.echo(f"{canonical}: {NETWORKS[canonical]}")
    layout = "NCDHW" if any(layer.problem.spatial_dims == 3 for layer in net) else "NCHW"
    click.echo(_table(("layer", "spec", f"output ({layout})", "GFLOP/fwd"), rows, right={3}))
    click.echo(
        f"{len(net)} conv layers, {len(unique_problems(net))} unique shapes, {_gflops(net):.1f} GFLOP per forward pass"
    )


@click.command("networks")
@click.argument("name", required=False)
@click.option(
    "--batch",
    type=int,
    default=None,
    help="Mini-batch size for every layer (default: each network's training batch; DeepBench problems keep their own).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def networks(name: str | None, batch: int | None, as_json: bool) -> None:
    """List the network zoo, or with NAME the conv layers of one network."""
    if name is None:
        _summary(batch, as_json)
    else:
        _one(name, batch, as_json)
