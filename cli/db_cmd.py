"""`ucudnn db`: inspect, export, import and prune the measurement cache."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click
from ucudnn.db import MERGE_RULE, Cache
from ucudnn.db.transfer import export_to, import_into

_DB_HELP = (
    "Cache URL (sqlite:///PATH, postgresql+psycopg://USER@HOST/DB) or a SQLite file path. "
    "Default: $UCUDNN_DB, else $XDG_CACHE_HOME/ucudnn/cache.db."
)


def _db_option(command: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--db", "db_url", metavar="URL", default=None, help=_DB_HELP)(command)


@click.group("db")
def db() -> None:
    """Inspect and maintain the measurement cache."""


@db.command("info")
@_db_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def info(db_url: str | None, as_json: bool) -> None:
    """Show what the cache holds: devices, problems, measurements, plans, schema version.

    A "device" is a device model with one backend and one set of library versions (NumPy/BLAS,
    torch, cuDNN, thread settings): measurements taken under other versions are kept apart, so one
    machine can count several times. `device_models` counts the models.
    """
    with Cache(db_url, readonly=True) as cache:
        facts = cache.info()
    # `devices` counts identities (model, backend, library versions), each measured apart; say so,
    # and how many device models they are, since one machine with two torch versions shows two.
    facts["device_models"] = len({d["device"] for d in facts["by_device"]})
    if as_json:
        click.echo(json.dumps(facts, sort_keys=True))
        return
    for name in ("url", "schema_version", "devices", "problems", "measurements", "plans"):
        note = ""
        if name == "devices":
            models = facts["device_models"]
            note = (
                f"  (sets of device model, backend and library versions, each measured apart; "
                f"{models} device model{'' if models == 1 else 's'})"
            )
        click.echo(f"{name:<15} {facts[name]}{note}")
    for d in facts["by_device"]:
        click.echo(f"  {d['measurements']:>8}  {d['device']} [{d['backend']}] {d['versions']}")


@db.command("check")
@_db_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_context
def check(ctx: click.Context, db_url: str | None, as_json: bool) -> None:
    """List the damaged rows: measurements and plans that break the rules a fresh row keeps.

    A damaged row (a time stored as text or negative, a negative workspace, a failed candidate with no
    reason, a plan whose micro-batches do not sum to its batch, ...) is ignored wherever it is read and
    replaced when it is measured or planned again; `ucudnn db prune --invalid` removes all of them at once.
    Exit status 0 when the cache is clean, 1 when it holds damaged rows.
    """
    with Cache(db_url, readonly=True) as cache:
        found = cache.check()
        url = cache.url
    if as_json:
        click.echo(json.dumps({"url": url, "damaged": [r.to_json() for r in found]}, sort_keys=True))
    elif not found:
        click.echo(f"{url}: no damaged rows")
    else:
        width = max(len(r.kind) for r in found)
        click.echo(f"{'kind':<{width}}  key  rule")
        for r in found:
            click.echo(f"{r.kind:<{width}}  {r.key}  {r.rule}")
        click.echo(f"{len(found)} damaged rows; `ucudnn db prune --invalid` removes them")
    ctx.exit(1 if found else 0)


@db.command("export")
@_db_option
@click.argument("file", metavar="FILE")
def export(db_url: str | None, file: str) -> None:
    """Write the cache to FILE as JSON lines ('-' for stdout).

    A header line, then one object per measurement (device, backend, versions, problem_key,
    kind, algo, batch, time_ms (null: could not run), spread_ms, workspace_bytes, reason,
    created_at), then one per plan (key, plan, created_at).
    """
    with Cache(db_url, readonly=True) as cache:
        counts = export_to(cache, file)
    if file != "-":
        click.echo(f"exported {counts['measurements']} measurements and {counts['plans']} plans to {file}")


@db.command("import", epilog=MERGE_RULE)
@_db_option
@click.argument("source", metavar="SOURCE")
@click.option("--json", "as_json", is_flag=True, help="Print the counts as one JSON object.")
def import_(db_url: str | None, source: str, as_json: bool) -> None:
    """Merge SOURCE into the cache: an export file, another SQLite cache file, or a cache URL.

    The whole import is checked first and written in one transaction: a bad SOURCE changes
    nothing. Conflicts are settled by the merge rule below.
    """
    with Cache(db_url) as cache:
        report = import_into(cache, source)
    counts = {"measurements": _counts(report.measurements), "plans": _counts(report.plans)}
    if as_json:
        click.echo(json.dumps(counts, sort_keys=True))
        return
    for name, c in counts.items():
        click.echo(f"{name}: {c['inserted']} inserted, {c['replaced']} replaced, {c['kept']} kept")


def _counts(c: Any) -> dict[str, int]:
    return {"inserted": c.inserted, "replaced": c.replaced, "kept": c.kept}


@db.command("prune")
@_db_option
@click.option("--device", default=None, help="Only this device model (exact match).")
@click.option("--backend", default=None, help="Only this backend (exact match).")
@click.option("--versions", default=None, help="Only this library-versions text (exact match).")
@click.option(
    "--older-than",
    "older_than",
    type=click.FloatRange(min=0),
    default=None,
    metavar="DAYS",
    help="Only rows written more than DAYS days ago.",
)
@click.option("--invalid", is_flag=True, help="Remove the damaged rows that `ucudnn db check` lists (and no filter).")
@click.option("--all", "everything", is_flag=True, help="Remove everything (and no filter).")
@click.option("--dry-run", is_flag=True, help="Count what would be removed; remove nothing.")
def prune(
    db_url: str | None,
    device: str | None,
    backend: str | None,
    versions: str | None,
    older_than: float | None,
    invalid: bool,
    everything: bool,
    dry_run: bool,
) -> None:
    """Remove measurements matching every filter given (AND), and print how many rows went.

    Plans carry no device, so they go only with --older-than alone, with --invalid (the damaged
    ones), or with --all. Devices and problems left without measurements are removed too.
    """
    with Cache(db_url, create=False) as cache:
        removed = cache.prune(
            device=device,
            backend=backend,
            versions=versions,
            older_than_days=older_than,
            everything=everything,
            invalid=invalid,
            dry_run=dry_run,
        )
    verb = "would remove" if dry_run else "removed"
    parts = ", ".join(f"{n} {name}" for name, n in removed.items())
    click.echo(f"{verb} {sum(removed.values())} rows ({parts})")
