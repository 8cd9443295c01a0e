"""A call that becomes ``unknown`` keeps what its holder learned (issue #37, "evidence for
the person"): each send and lookup with its time, duration, outcome and what it observed;
and a lookup that says the provider cannot tell (``Unknowable``) makes the call unknown
at once, without sending it again.

Also the key's send times a lookup judges the provider's retention by:
``ctx.first_sent_at`` (the first dispatch: this holder's own, or, for a call another
holder sent, the journal's first ``call_dispatched`` event of the key) and
``ctx.sent_at``.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from typing import Any

from click.testing import CliRunner
from psycopg.types.json import Jsonb
from starlette.testclient import TestClient

from runledger.cli import main
from runledger.console import ConsoleConfig, create_app
from runledger.flows import Flow, ToolCall, ToolContext, Unknowable
from tests.integration.conftest import Db, Recorder, StartWorker, eventually


def _flow(rec: Recorder) -> Flow:
    flow = Flow("evidence", "1")

    @flow.policy
    def decide(ctx: Any, history: list[Any]) -> list[ToolCall]:
        rec.policy(ctx, history)
        return [] if history else [ToolCall("charge", {"amount": 7})]

    return flow


async def test_an_unknowable_lookup_pauses_at_once_with_the_steps_it_took(
    db: Db, start_worker: StartWorker
) -> None:
    rec = Recorder()
    flow = _flow(rec)
    seen: list[tuple[dt.datetime | None, dt.datetime | None]] = []

    @flow.tool(safety="lookup", max_attempts=3)
    def charge(ctx: ToolContext, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        seen.append((ctx.first_sent_at, ctx.sent_at))
        ctx.observe(asked="POST /v1/charges", request_id=f"req_{ctx.attempt}")
        raise TimeoutError("no answer in 10 s")

    lookups: list[ToolContext] = []

    @charge.lookup
    def find(ctx: ToolContext) -> dict[str, Any] | None:
        lookups.append(ctx)
        ctx.observe(asked=f"GET /v1/charges?key={ctx.idempotency_key}", saw="0 results")
        raise Unknowable("the key is past the provider's 24-hour window", age_hours=25)

    await db.submit("ev-1", flow)
    await start_worker(flow)
    run = await db.wait_status("ev-1", "paused", "succeeded", "failed")

    assert run["status"] == "paused"
    [call] = await db.calls("ev-1")
    assert call["status"] == "unknown"
    # one send, one lookup: Unknowable is final, neither asked again nor sent again
    assert len(rec.tool_calls) == 1 and len(lookups) == 1
    error = call["error"]
    assert error["reason"] == (
        "the provider cannot tell: the key is past the provider's 24-hour window"
    )
    send, lookup = error["evidence"]
    assert (send["step"], send["ended"], send["attempt"]) == ("send", "raised", 1)
    assert send["error"] == {"type": "TimeoutError", "message": "no answer in 10 s"}
    assert send["observed"] == [{"asked": "POST /v1/charges", "request_id": "req_1"}]
    assert (lookup["step"], lookup["saw"]) == ("lookup", "unknowable")
    assert lookup["observed"] == [
        {"asked": "GET /v1/charges?key=ev-1:0:c0", "saw": "0 results"},
        {"age_hours": 25},
    ]
    for step in (send, lookup):
        assert isinstance(step["ms"], int) and step["ms"] >= 0
        dt.datetime.fromisoformat(step["at"])
    # the send saw the key's first send as its own; so did the lookup, and the database
    # keeps the first dispatch
    [(first, sent)] = seen
    assert first is not None and first == sent
    assert (lookups[0].first_sent_at, lookups[0].sent_at) == (first, sent)
    # this holder's own clock, next to the database's record of the dispatch
    assert abs((call["dispatched_at"] - first).total_seconds()) < 5


async def test_a_resend_keeps_the_first_dispatch_and_a_recovered_lookup_sees_it(
    db: Db, start_worker: StartWorker
) -> None:
    """Sent twice (the lookup found nothing in between), then ambiguous again and looked
    up by the next attempt: ``first_sent_at`` stays the first dispatch, ``sent_at`` moves."""
    rec = Recorder()
    flow = _flow(rec)
    seen: list[tuple[dt.datetime | None, dt.datetime | None]] = []

    @flow.tool(safety="lookup", max_attempts=2)
    def charge(ctx: ToolContext, amount: int) -> dict[str, Any]:
        rec.tool(ctx)
        seen.append((ctx.first_sent_at, ctx.sent_at))
        raise ConnectionError("reset by peer")

    @charge.lookup
    def find(ctx: ToolContext) -> dict[str, Any] | None:
        seen.append((ctx.first_sent_at, ctx.sent_at))
        return None

    await db.submit("ev-2", flow)
    await start_worker(flow)
    run = await db.wait_status("ev-2", "paused", "succeeded", "failed")

    # lookup: not found after each ambiguous send; after max_attempts sends the call fails
    assert run["status"] == "succeeded"
    [call] = await db.calls("ev-2")
    assert (call["status"], call["attempts"]) == ("failed", 2)
    (f1, s1), (f2, s2), (f3, s3), (f4, s4) = seen
    assert f1 == s1 == f2 == s2  # the first send, then its lookup
    assert f3 == f4 == f1 and s3 == s4 and s3 > s1  # the second send moved sent_at only
    sends = await db.events("ev-2", "call_dispatched")
    assert [e["detail"]["attempt"] for e in sends] == [1, 2]


async def test_the_person_sees_the_evidence_in_the_cli_and_the_console(
    db: Db, start_worker: StartWorker, database_url: str
) -> None:
    rec = Recorder()
    flow = _flow(rec)

    @flow.tool(safety="lookup")
    def charge(ctx: ToolContext, amount: int) -> dict[str, Any]:
        ctx.observe(asked="POST /v1/charges", request_id="req_77")
        raise ConnectionError("connection reset after the request was sent")

    @charge.lookup
    def find(ctx: ToolContext) -> dict[str, Any] | None:
        raise Unknowable("past the window", asked="GET /v1/charges/search")

    await db.submit("ev-3", flow)
    await start_worker(flow)
    await db.wait_status("ev-3", "paused")

    def cli(*args: str) -> str:
        result = CliRunner().invoke(
            main, list(args), env={"RUNLEDGER_DATABASE_URL": database_url, "COLUMNS": "200"}
        )
        assert result.exit_code == 0, result.output
        return result.output

    waiting = await asyncio.to_thread(cli, "unknown")
    shown = await asyncio.to_thread(cli, "show", "ev-3")
    as_json = json.loads(await asyncio.to_thread(cli, "unknown", "--json"))
    send = "send #1 at "
    for text in (waiting, shown):
        assert send in text and "ended raised" in text and "request_id: req_77" in text
        assert "lookup #1 at " in text and "saw unknowable" in text
        assert "asked: GET /v1/charges/search" in text
    [call] = as_json["calls"]
    assert [s["step"] for s in call["error"]["evidence"]] == ["send", "lookup"]

    config = ConsoleConfig(database_url=database_url)

    def page() -> str:
        with TestClient(create_app(config)) as client:
            response = client.get("/runs/ev-3")
            assert response.status_code == 200
            return response.text

    html = await asyncio.to_thread(page)
    assert "what its worker saw (2 steps)" in html
    assert "saw unknowable" in html and "request_id: req_77" in html


async def test_a_call_another_holder_sent_is_looked_up_with_its_first_send_from_the_journal(
    db: Db, start_worker: StartWorker, database_url: str
) -> None:
    """A worker that died after it dispatched the call twice (the database's journal is
    all that is left of it): the next holder's lookup sees the first dispatch's time as
    ``first_sent_at`` and the second's as ``sent_at``, by the database's clock."""
    rec = Recorder()
    flow = _flow(rec)
    seen: list[tuple[dt.datetime | None, dt.datetime | None]] = []

    @flow.tool(safety="lookup")
    def charge(ctx: ToolContext, amount: int) -> dict[str, Any]:
        raise AssertionError("found by the lookup: never sent again")

    @charge.lookup
    def find(ctx: ToolContext) -> dict[str, Any] | None:
        seen.append((ctx.first_sent_at, ctx.sent_at))
        return {"charge_id": "ch_1"}

    await db.submit("ev-4", flow)
    ghost = await db.rows(
        "SELECT * FROM runledger.claim_runs_v4('ghost', ARRAY['evidence@1'], '3 hours', 1)"
    )
    lease = (ghost[0]["run_id"], ghost[0]["lease_id"], ghost[0]["fencing_token"])
    await db.rows(
        "SELECT * FROM runledger.record_turn_v4(%s, %s, %s, 0, %s, NULL, NULL, NULL, NULL,"
        " false, NULL)",
        *lease,
        Jsonb([{"call_id": "c0", "tool": "charge", "args": {"amount": 7}}]),
    )
    for _ in range(2):  # sent, then sent again with the same key
        await db.rows("SELECT runledger.dispatch_call(%s, %s, %s, 'ev-4:0:c0')", *lease)
        await db.rows(
            "UPDATE runledger.settings SET clock_offset = clock_offset + interval '1 hour'"
        )
    await db.rows(  # the ghost's lease is over by the database clock
        "UPDATE runledger.settings SET clock_offset = clock_offset + interval '2 hours'"
    )
    await start_worker(flow)
    await db.wait_status("ev-4", "succeeded", "paused", "failed")

    first, second = (e["at"] for e in await db.events("ev-4", "call_dispatched"))
    assert second - first >= dt.timedelta(hours=1)
    assert seen == [(first, second)]
    [call] = await db.calls("ev-4")
    assert (call["status"], call["receipt"]) == ("succeeded", {"charge_id": "ch_1"})


async def test_a_call_a_failover_marked_dispatched_counts_from_the_failover(
    db: Db, start_worker: StartWorker
) -> None:
    """A lossy failover marks the held run's planned call dispatched (it may have been
    sent on the lost timeline): the lookup's ``first_sent_at`` is the time of the
    ``failover_detected`` event that marked it."""
    rec = Recorder()
    flow = _flow(rec)
    seen: list[dt.datetime | None] = []

    @flow.tool(safety="lookup")
    def charge(ctx: ToolContext, amount: int) -> dict[str, Any]:
        raise AssertionError("found by the lookup: never sent again")

    @charge.lookup
    def find(ctx: ToolContext) -> dict[str, Any] | None:
        seen.append(ctx.first_sent_at)
        return {"charge_id": "ch_2"}

    await db.submit("ev-5", flow)
    ghost = await db.rows(
        "SELECT * FROM runledger.claim_runs_v4('ghost', ARRAY['evidence@1'], '3 hours', 1)"
    )
    await db.rows(
        "SELECT * FROM runledger.record_turn_v4(%s, %s, %s, 0, %s, NULL, NULL, NULL, NULL,"
        " false, NULL)",
        ghost[0]["run_id"],
        ghost[0]["lease_id"],
        ghost[0]["fencing_token"],
        Jsonb([{"call_id": "c0", "tool": "charge", "args": {"amount": 7}}]),
    )
    # the schema last saw another timeline, with nothing to say the failover lost nothing:
    # what a lossy promotion looks like to the next claim
    await db.rows(
        "INSERT INTO runledger.timelines (position, timeline, seen_at) "
        "SELECT max(position) + 1, runledger._timeline() + 6, now() FROM runledger.timelines"
    )
    await start_worker(flow)
    detected = await eventually(
        lambda: db.events("ev-5", "failover_detected"), what="the failover's detection"
    )
    assert detected[0]["detail"]["marked_dispatched"] == ["ev-5:0:c0"]
    await db.rows(  # the ghost's lease, ended by the detection within 10 s, is over
        "UPDATE runledger.settings SET clock_offset = clock_offset + interval '1 minute'"
    )
    await db.wait_status("ev-5", "succeeded", "paused", "failed")

    assert seen == [detected[0]["at"]]
    assert await db.events("ev-5", "call_dispatched") == []  # never sent on this timeline
