"""``runledger audit`` (the invariants and the event chains, :mod:`runledger.audit`) and
``runledger checkpoint`` (a checkpoint of the event chains now). Registered on the
``runledger`` group by :mod:`runledger.cli`; docs/audit.md explains both.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import click

from runledger.cli.options import (
    CONTEXT,
    actor_option,
    connect_option,
    database_option,
    default_actor,
    emit,
    json_option,
    opt,
    require_url,
)

_ANCHOR = re.compile(r"^(\d{1,18}):([0-9a-f]{64})$")


class AnchorType(click.ParamType):  # type: ignore[type-arg]
    """``ID:DIGEST``: a checkpoint id and its 64-hex-digit digest, as audit printed them."""

    name = "ID:DIGEST"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        from runledger.audit import Anchor

        if isinstance(value, Anchor):
            return value
        m = _ANCHOR.match(str(value).strip().lower())
        if m is None:
            self.fail(
                f"{value!r} is not a checkpoint anchor ID:DIGEST (a number, a colon, 64 hex "
                "digits), as `runledger audit` prints it",
                param,
                ctx,
            )
        return Anchor(int(m.group(1)), m.group(2))


def _lossless_line(row: dict[str, Any]) -> str:
    seen = (row.get("evidence") or {}).get("commit_guarantee") or {}
    return (
        f"note failover to timeline {row['timeline']} (from {row['previous_timeline']}, seen "
        f"{row['seen_at']} by {row['seen_by']}) was lossless: every acknowledged commit was on "
        f"every synchronous standby (synchronous_commit {seen.get('synchronous_commit')}, "
        f"synchronous_standby_names '{seen.get('synchronous_standby_names')}'); "
        f"{row['affected_runs']} lease(s) ended, no run doubted"
    )


def _anchor_line(latest: dict[str, Any] | None) -> str:
    if latest is None:
        return "no checkpoint: the event chains have no anchor (runledger migrate writes one)"
    return (
        f"anchor {latest['checkpoint_id']}:{latest['digest']}  (checkpoint of {latest['at']}, "
        f"events through {latest['through_event_id']}; keep it outside the database and pass "
        "it to the next audit with --expect)"
    )


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@opt(
    "--expect",
    "expect",
    type=AnchorType(),
    multiple=True,
    help="A checkpoint anchor ID:DIGEST an earlier audit printed; fail when the history no "
    "longer has it. Repeatable.",
)
@json_option
def audit(
    database_url: str | None, connect_timeout: float, expect: tuple[Any, ...], as_json: bool
) -> None:
    """Check the run tables' invariants and the event chains; exit 1 when any is broken."""
    from runledger.audit import audit as run_audit
    from runledger.db.connecting import probe_blocking

    url = require_url(database_url)
    probe_blocking(url, timeout=connect_timeout, application_name="runledger-audit")
    result = run_audit(url, expect=expect)
    if as_json:
        checks: list[dict[str, Any]] = [
            {"check": f.check.name, "ok": f.ok, "violations": f.rows} for f in result.findings
        ]
        # the lossless failovers and the anchor to keep: one more entry each, so that the
        # document stays a list of checks
        checks.append(
            {
                "check": "lossless_failovers",
                "ok": True,
                "violations": [],
                "failovers": result.lossless,
            }
        )
        checks.append({"check": "anchor", "ok": True, "violations": [], "anchor": result.latest})
        emit(checks, as_json=True)
    else:
        for f in result.findings:
            mark = "ok  " if f.ok else "FAIL"
            click.echo(f"{mark} {f.check.name}: {f.check.description}")
            for row in f.rows:
                click.echo(f"     {json.dumps(row, default=str)}")
        for row in result.lossless:
            click.echo(_lossless_line(row))
        click.echo(_anchor_line(result.latest))
    sys.exit(0 if result.ok else 1)


@click.command(context_settings=CONTEXT)
@database_option
@connect_option
@actor_option
@json_option
def checkpoint(
    database_url: str | None, connect_timeout: float, actor: str | None, as_json: bool
) -> None:
    """Checkpoint the event chains now: record every run's newest event and its hash,
    chained to the previous checkpoint (workers do it every 10 s)."""
    from runledger.db.chain import checkpoint_now
    from runledger.db.connecting import probe_blocking

    url = require_url(database_url)
    probe_blocking(url, timeout=connect_timeout, application_name="runledger-checkpoint")
    made = checkpoint_now(url, actor or default_actor(), connect_timeout=connect_timeout)
    if as_json:
        emit(made, as_json=True)
        return
    what = "made" if made["created"] else "no new events since"
    click.echo(
        f"checkpoint {made['checkpoint_id']} {what}: {made['runs']} "
        f"run{'' if made['runs'] == 1 else 's'}, events through "
        f"{made['through_event_id']}\n{_anchor_line(made)}"
    )
