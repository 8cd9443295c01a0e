"""The agent adapters under real crashes, each test once per adapter: Pydantic AI's
``agent_flow(Agent(FunctionModel))`` and the OpenAI Agents SDK's
``agent_flow(Agent(model=PlanModel()))``, in real worker processes that SIGKILL themselves
at the named crash points, or are SIGSTOPped.

- every crash window x safety class of ``tests/crash_windows.py`` through the adapter,
  with the bare test's expectations, and the model asked once per turn;
- ``after_decide`` (the model answered, nothing journaled): the model is asked again for
  that turn and each tool effect happens once; ``after_record_turn``: never asked again;
- two runs whose model emits the same tool-call id get distinct keys, two effects;
- a worker SIGSTOPped inside the model request, taken over, then SIGCONTed: its
  ``record_turn`` is refused by the database and the journal keeps one row per turn.

The flows are ``tests/process/adapter_flows.py`` and ``tests/process/oa_flows.py``, the
same plan-replaying model and tools; the model records every request at the fake provider
(``model_key(run_id, turn)``), which is how requests are counted here. The expectations
are the same for both adapters; what differs (names, where a turn's record keeps the
model's tool-call ids, how a result is sent to the model) is in the flows modules.
Worker startup is what costs (the frameworks are preloaded in the fork server): each
test starts its crashing workers at once, one run each, steered by flow name
(``lane_<i>``), and recovers every run with one more worker. Leases are expired with the
fake database clock.
"""

from __future__ import annotations

import importlib
import json
from types import ModuleType
from typing import Any

import pytest

from runledger.testing import wait_for
from runledger.worker.recovery import MarkUnknown, Reuse
from tests.crash_windows import ROWS, Row
from tests.process.adapter_flows import GATE_ENV, model_key
from tests.process.conftest import call_rows, events, run_row, submit, wait_status

pytestmark = pytest.mark.process

FINAL = ("succeeded", "paused", "failed")


def asked(provider: Any, run_id: str, turns: int) -> list[int]:
    """How often the model was asked, turn by turn."""
    return [len(provider.client.effects(model_key(run_id, t))) for t in range(turns)]


def turn_rows(conn: Any, run_id: str) -> list[dict[str, Any]]:
    cur = conn.execute(
        "SELECT turn, calls, record, output, fencing_token FROM runledger.run_turns"
        " WHERE run_id = %s ORDER BY turn",
        (run_id,),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, r, strict=True)) for r in cur.fetchall()]


def provider_ids(conn: Any, run_id: str) -> list[str | None]:
    rows = conn.execute(
        "SELECT provider_id FROM runledger.run_calls WHERE run_id = %s ORDER BY turn, position",
        (run_id,),
    ).fetchall()
    return [r[0] for r in rows]


def seen_by_model(conn: Any, run_id: str) -> list[dict[str, Any]]:
    """The tool returns the model was sent on its final request (its answer lists them)."""
    row = conn.execute("SELECT result FROM runledger.runs WHERE run_id = %s", (run_id,)).fetchone()
    assert row is not None and isinstance(row[0], str), row
    seen: list[dict[str, Any]] = json.loads(row[0])["seen"]
    return seen


# -- the adapters ---------------------------------------------------------------------------


@pytest.fixture(
    params=["tests.process.adapter_flows", "tests.process.oa_flows"],
    ids=["pydantic_ai", "openai_agents"],
)
def adapter(request: pytest.FixtureRequest) -> ModuleType:
    """The flows module of one adapter: ``PREFIX`` (of its flow names and of the run ids
    here), ``lane(i)``/``spec(i)`` (a flow and its ``--flows`` spec), ``record_ids(record)``
    (the model's tool-call ids in a turn's record) and ``sent(result)`` (what the model is
    sent for a call's journaled result): what differs between the adapters."""
    return importlib.import_module(request.param)


def crash_lanes(workers: Any, adapter: ModuleType, crashes: list[str], args: list[str]) -> None:
    """Start one worker per lane ``i`` with lane ``i``'s flow only, dying at
    ``crashes[i]``, all at once; wait until every one has SIGKILLed itself."""
    started = []
    for i, spec in enumerate(crashes):
        workers.flows = [adapter.spec(i)]
        started += workers.start(1, env={"RUNLEDGER_CRASH_AT": spec}, args=args)
    for i in started:
        assert workers.wait(i, timeout=60) == -9, workers.log(i)
    workers.flows = [adapter.spec(i) for i in range(len(crashes))]


# The crash lanes' lease: long, so that a lane worker starved of CPU on a loaded machine
# (16 lanes start at once) still holds its run when its crash point kills it. A shorter
# one could expire first and be taken over by the same (live) worker: token 2, not the
# window under test. The recovery takes the runs over through the dead workers' ended
# sessions, or, past the advanced clock, through their expired leases.
CRASH_LEASE = 60.0
CRASH_LEASE_ARGS = ["--lease-seconds", str(CRASH_LEASE)]


# -- 1. every crash window x safety class ----------------------------------------------


def test_crash_windows_through_the_adapter(
    adapter: ModuleType,
    forked_workers: Any,
    provider: Any,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
) -> None:
    workers = forked_workers

    def run_of(row: Row) -> str:
        return f"{adapter.PREFIX}-{row.point}-{row.tool}"

    for i, row in enumerate(ROWS):
        plan = [[{"tool": row.tool}], [{"tool": "ticket", "args": {"title": "after"}}]]
        submit(admin_conn, run_of(row), plan, flow=adapter.lane(i).name)
    crash_lanes(workers, adapter, [f"{r.point}:{r.tool}" for r in ROWS], CRASH_LEASE_ARGS)
    for row in ROWS:
        crashed = run_row(admin_conn, run_of(row))
        assert crashed["status"] == "running" and crashed["fencing_token"] == 1, (row.id, crashed)

    db_clock.advance(CRASH_LEASE + 1)  # the dead workers' leases are over by the database clock
    (recovery,) = workers.start(1, args=lease_args)
    for row in ROWS:
        check_row(adapter, row, run_of(row), workers, recovery, provider, admin_conn)


def check_row(
    adapter: ModuleType,
    row: Row,
    run_id: str,
    workers: Any,
    recovery: int,
    provider: Any,
    admin_conn: Any,
) -> None:
    """The bare test's expectations for one row, plus the adapter's: one model request
    per turn (turn 0 was journaled before its call was sent), and the model is sent the
    journaled result."""
    key = f"{run_id}:0:c0"
    final = wait_status(admin_conn, run_id, FINAL)
    calls = call_rows(admin_conn, run_id)
    assert final["status"] == row.run_status, (row.id, final, calls, workers.log(recovery))
    first_call = calls[0]
    assert first_call["idempotency_key"] == key
    assert (first_call["status"], first_call["attempts"]) == (row.call_status, row.attempts), row
    effects = len(provider.client.effects(key))
    assert effects == row.effects, row.id
    resent = [
        e
        for e in events(admin_conn, run_id, "call_dispatched")
        if e["detail"]["idempotency_key"] == key and e["fencing_token"] == 2
    ]
    assert len(resent) == row.resends, row.id
    takeover = events(admin_conn, run_id, "takeover")
    assert takeover and takeover[0]["actor"] == workers.worker_id(recovery), row.id
    assert takeover[0]["fencing_token"] == 2

    if row.run_status == "paused":
        (unknown,) = row.steps
        assert isinstance(unknown, MarkUnknown)
        error = dict(first_call["error"])
        [waited] = error.pop("evidence")  # the dead worker, waited for
        assert error == unknown.error
        assert (waited["step"], waited["ended"]) == ("earlier sender", "process_gone")
        assert key in final["pause_reason"]
        # a person reconciles: the provider shows whether the e-mail went out
        resolution = "applied" if effects else "not_applied"
        admin_conn.execute(
            "SELECT runledger.resolve_call(%s, %s, %s::jsonb, 'ops', 'checked')",
            (key, resolution, '{"checked": true}' if effects else None),
        )
        wait_status(admin_conn, run_id, ("succeeded",))
        assert len(provider.client.effects(key)) == 1, row.id  # one e-mail, never two
    else:
        found_by = (first_call["receipt"] or {}).get("found_by")
        assert (found_by == "lookup") == row.found_by_lookup, row.id
        # a reused receipt keeps the dead worker's token; anything else is the new one's
        assert first_call["completed_token"] == (1 if row.steps == (Reuse(),) else 2), row.id
    # the second turn ran once, under the new token
    assert len(provider.client.effects(f"{run_id}:1:c0")) == 1, row.id
    # a crash in a call's window never asks the model again: each turn was asked once
    assert asked(provider, run_id, 4) == [1, 1, 1, 0], row.id
    # and the model was sent what the journal holds, under its own tool-call ids
    calls = call_rows(admin_conn, run_id)
    seen = seen_by_model(admin_conn, run_id)
    assert [(s["tool"], s["content"]) for s in seen] == [
        (c["tool"], adapter.sent(c["result"])) for c in calls
    ], row.id
    assert [s["id"] for s in seen] == provider_ids(admin_conn, run_id), row.id


# -- 2. crashes around the model's decision ---------------------------------------------

DECISION_CRASHES = (
    ("after_decide", 0),
    ("after_record_turn", 0),
    ("after_decide", 1),  # the final answer
    ("after_record_turn", 1),
)
DECIDE_PLAN = [
    [
        {"tool": "ticket", "args": {"title": "printer"}},
        {"tool": "email", "args": {"to": "ana@example.com"}},
    ]
]


def test_crash_around_the_model_request(
    adapter: ModuleType,
    forked_workers: Any,
    provider: Any,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
) -> None:
    workers = forked_workers

    def run_of(point: str, turn: int) -> str:
        return f"{adapter.PREFIX}-{point}-{turn}"

    for i, (point, turn) in enumerate(DECISION_CRASHES):
        submit(admin_conn, run_of(point, turn), DECIDE_PLAN, flow=adapter.lane(i).name)
    crash_lanes(workers, adapter, [f"{p}:{t}" for p, t in DECISION_CRASHES], CRASH_LEASE_ARGS)
    before: dict[str, list[dict[str, Any]]] = {}
    for point, turn in DECISION_CRASHES:
        run_id = run_of(point, turn)
        crashed = run_row(admin_conn, run_id)
        assert crashed["status"] == "running" and crashed["fencing_token"] == 1, run_id
        before[run_id] = turn_rows(admin_conn, run_id)
        # after_decide: the turn the model answered is not journaled; after_record_turn: it is
        recorded = turn + (1 if point == "after_record_turn" else 0)
        assert [t["turn"] for t in before[run_id]] == list(range(recorded)), run_id
        assert asked(provider, run_id, 3) == [1] * (turn + 1) + [0] * (2 - turn), run_id

    db_clock.advance(CRASH_LEASE + 1)
    (recovery,) = workers.start(1, args=lease_args)
    for point, turn in DECISION_CRASHES:
        run_id = run_of(point, turn)
        final = wait_status(admin_conn, run_id, FINAL)
        calls = call_rows(admin_conn, run_id)
        assert final["status"] == "succeeded", (run_id, final, calls, workers.log(recovery))
        # asked again for the turn whose answer was lost, never for a journaled one
        again = 2 if point == "after_decide" else 1
        assert asked(provider, run_id, 3) == [again if t == turn else 1 for t in (0, 1)] + [0], (
            run_id
        )
        journal = turn_rows(admin_conn, run_id)
        assert [t["turn"] for t in journal] == [0, 1], run_id
        # the turns the dead worker journaled are kept as they were; the rest are the new one's
        assert journal[: len(before[run_id])] == before[run_id], run_id
        assert [t["fencing_token"] for t in journal] == [
            1 if t < len(before[run_id]) else 2 for t in (0, 1)
        ], run_id
        assert len(events(admin_conn, run_id, "turn_recorded")) == 2, run_id
        # each tool effect exactly once, by runledger's keys
        assert [(c["idempotency_key"], c["status"], c["attempts"]) for c in calls] == [
            (f"{run_id}:0:c0", "succeeded", 1),
            (f"{run_id}:0:c1", "succeeded", 1),
        ], run_id
        for c in calls:
            assert len(provider.client.effects(c["idempotency_key"])) == 1, c
        # the journaled answer's tool-call ids map the results back to the model
        ids = adapter.record_ids(journal[0]["record"])
        assert provider_ids(admin_conn, run_id) == ids, run_id
        seen = seen_by_model(admin_conn, run_id)
        assert [(s["tool"], s["id"], s["content"]) for s in seen] == [
            (c["tool"], i, adapter.sent(c["result"])) for c, i in zip(calls, ids, strict=True)
        ], run_id
        # the final decision's journaled output is the run's result
        assert json.loads(journal[1]["output"]) == {"done": 1, "seen": seen}, run_id


# -- 3. the model's tool-call ids are not keys --------------------------------------------


def test_same_model_call_id_in_two_runs_gets_two_keys(
    adapter: ModuleType, forked_workers: Any, provider: Any, admin_conn: Any, lease_args: list[str]
) -> None:
    workers = forked_workers
    plan = [[{"tool": "ticket", "args": {"title": "same id"}, "id": "call_same"}]]
    runs = (f"{adapter.PREFIX}-same-id-a", f"{adapter.PREFIX}-same-id-b")
    for run_id in runs:
        submit(admin_conn, run_id, plan, flow=adapter.lane(0).name)
    workers.flows = [adapter.spec(0)]
    (w0,) = workers.start(1, args=lease_args)
    for run_id in runs:
        final = wait_status(admin_conn, run_id, FINAL)
        assert final["status"] == "succeeded", (final, workers.log(w0))
        assert provider_ids(admin_conn, run_id) == ["call_same"]
        assert [c["idempotency_key"] for c in call_rows(admin_conn, run_id)] == [f"{run_id}:0:c0"]
        assert [s["id"] for s in seen_by_model(admin_conn, run_id)] == ["call_same"]
    # the provider deduplicates by key: one key for both would have been one ticket
    tickets = [e for e in provider.client.effects() if e["kind"] == "ticket"]
    assert sorted(e["key"] for e in tickets) == [f"{r}:0:c0" for r in runs]


# -- 4. SIGSTOP inside the model request ----------------------------------------------------


def test_stopped_inside_the_model_request_is_fenced_at_record_turn(
    adapter: ModuleType,
    forked_workers: Any,
    provider: Any,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
) -> None:
    workers = forked_workers
    run_id = f"{adapter.PREFIX}-stopped-in-model"
    gate = "model"
    # w0's lease is long, so that when it wakes neither its lease keeper nor its local
    # deadline has noticed anything (as after a pause its monotonic clock did not see):
    # only the database can refuse its write
    long_lease = 120.0
    submit(admin_conn, run_id, [[{"tool": "ticket"}]], flow=adapter.lane(0).name)
    workers.flows = [adapter.spec(0)]
    (w0,) = workers.start(1, env={GATE_ENV: gate}, args=["--lease-seconds", str(long_lease)])
    provider.client.wait_for_held(gate)  # w0 is inside the model request of turn 0
    workers.stop(w0)

    db_clock.advance(long_lease + 1)
    (w1,) = workers.start(1, args=lease_args)
    done = wait_status(admin_conn, run_id, FINAL)
    assert done["status"] == "succeeded" and done["fencing_token"] == 2, (done, workers.log(w1))
    takeover = events(admin_conn, run_id, "takeover")
    assert [(e["actor"], e["fencing_token"]) for e in takeover] == [("w1", 2)]
    journal = turn_rows(admin_conn, run_id)
    calls = call_rows(admin_conn, run_id)

    provider.client.open_gate(gate)  # the model answers w0 while it is stopped
    workers.cont(w0)  # it wakes up with a decision for a lease it lost
    rejected = wait_for(
        lambda: events(admin_conn, run_id, "stale_write_rejected"),
        what="w0's refused record_turn recorded",
    )
    assert [(e["actor"], e["fencing_token"]) for e in rejected] == [("w0", None)]
    detail = rejected[0]["detail"]
    assert (detail["operation"], detail["stale_token"], detail["current_token"]) == (
        "record_turn",
        1,
        2,
    )
    assert detail["message"].startswith(f"lease lost on run {run_id}: token 1"), detail  # RL001
    log = workers.log(w0)
    assert "write refused: lease lost" in log and "run failed in the worker" not in log, log
    # the refused write changed nothing: one decision row per turn, both w1's
    assert turn_rows(admin_conn, run_id) == journal
    assert [(t["turn"], t["fencing_token"]) for t in journal] == [(0, 2), (1, 2)]
    assert len(events(admin_conn, run_id, "turn_recorded")) == 2
    assert call_rows(admin_conn, run_id) == calls
    # turn 0 was asked by both workers, its effect happened once
    assert asked(provider, run_id, 3) == [2, 1, 0]
    assert len(provider.client.effects(f"{run_id}:0:c0")) == 1
    assert workers.alive(w0)
