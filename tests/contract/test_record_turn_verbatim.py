"""record_turn_v4 keeps the decision verbatim (the provider-native record, the final
output, each call's provider id), called as a live or a stale worker would.

Until the baseline "0.1" these were record_turn_v2's tests; record_turn_v4 takes the same
arguments and more (here: no checkpoint, no finish, no dispatch, through helpers.record_v2).
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from runledger.testing import DbClock

from .helpers import (
    LEASE_SECONDS,
    call,
    call_row,
    claim,
    complete,
    dispatch,
    events,
    finish,
    key,
    one,
    record_turn,
    record_v2,
    refused,
    rows,
    run_row,
    set_payload_cap,
    submit_and_claim,
    unchanged,
)

Conn = psycopg.Connection[Any]

# An Anthropic-style assistant message: unicode, nesting, a signed reasoning block.
RECORD: dict[str, Any] = {
    "role": "assistant",
    "content": [
        {"type": "thinking", "thinking": "Le client veut un ticket… 🎫", "signature": "c2ln=="},
        {"type": "text", "text": "Voy a crear el ticket — «urgente»"},
        {
            "type": "tool_use",
            "id": "toolu_01",
            "name": "create_ticket",
            "input": {"title": "ñandú", "tags": [["a", {"b": [1, 2.5, None, True]}]]},
        },
    ],
    "usage": {"input_tokens": 12, "output_tokens": 34},
    "empty": {},
    "zero": 0,
}


def turn_row(conn: Conn, run_id: str, turn: int) -> dict[str, Any]:
    row = one(
        conn, "SELECT * FROM runledger.run_turns WHERE run_id = %s AND turn = %s", (run_id, turn)
    )
    assert row is not None
    return row


def with_provider(call_id: str, provider_id: Any, tool: str = "create_ticket") -> dict[str, Any]:
    return {**call(call_id, tool), "provider_id": provider_id}


def test_the_record_is_stored_verbatim(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    calls = [with_provider("c0", "toolu_01")]
    record_v2(worker, lease, 0, calls, RECORD)

    row = turn_row(admin_conn, "r1", 0)
    assert row["record"] == RECORD
    assert row["calls"] == calls and row["output"] is None
    # jsonb keeps the text of strings as sent, unicode included
    text = one(
        admin_conn,
        "SELECT record #>> '{content,0,thinking}' AS t FROM runledger.run_turns WHERE turn = 0",
    )
    assert text == {"t": "Le client veut un ticket… 🎫"}
    c = call_row(admin_conn, key("r1", 0, "c0"))
    assert (c["provider_id"], c["status"], c["position"]) == ("toolu_01", "planned", 0)
    [ev] = events(admin_conn, "r1", "turn_recorded")
    assert ev["detail"] == {"turn": 0, "calls": 1}


def test_an_identical_retry_is_a_no_op(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    calls = [with_provider("c0", "toolu_01"), call("c1", "send_email")]
    record_v2(worker, lease, 0, calls, RECORD)

    for _ in range(2):  # a retried ambiguous commit: nothing at all changes
        with unchanged(admin_conn):
            record_v2(worker, lease, 0, calls, RECORD)
    assert len(rows(admin_conn, "SELECT * FROM runledger.run_calls")) == 2


def test_a_final_decision_keeps_its_output_and_an_identical_retry_is_a_no_op(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    output = {"answer": "ticket T-1 créé", "n": [1, {"x": None}]}
    record_v2(worker, lease, 0, [], RECORD, output)
    record_v2(worker, lease, 0, [], RECORD, output)
    row = turn_row(admin_conn, "r1", 0)
    assert (row["calls"], row["record"], row["output"]) == ([], RECORD, output)
    assert len(events(admin_conn, "r1", "turn_recorded")) == 1
    # an output that is not an object is a result like any other
    lease2 = submit_and_claim(worker, "r2")
    record_v2(worker, lease2, 0, [], None, "just text")
    assert turn_row(admin_conn, "r2", 0)["output"] == "just text"


@pytest.mark.parametrize(
    ("record", "output"),
    [
        ({**RECORD, "usage": {"input_tokens": 13}}, None),  # another record
        (None, None),  # the record dropped
        (RECORD, {"other": "output"}),  # another output (for an empty turn, below)
    ],
)
def test_another_record_for_a_recorded_turn_is_refused(
    worker: Conn, admin_conn: Conn, record: Any, output: Any
) -> None:
    lease = submit_and_claim(worker)
    calls: list[dict[str, Any]] = [] if output is not None else [with_provider("c0", "toolu_01")]
    record_v2(worker, lease, 0, calls, RECORD, {"first": True} if output is not None else None)

    with refused(admin_conn, "RL004") as info:
        record_v2(worker, lease, 0, calls, record, output)
    assert "already recorded" in info.value.diag.message_primary
    assert "the calls are the same" in (info.value.diag.message_detail or "")


def test_other_calls_with_the_same_record_are_refused(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    record_v2(worker, lease, 0, [with_provider("c0", "toolu_01")], RECORD)
    with refused(admin_conn, "RL004") as info:
        record_v2(worker, lease, 0, [with_provider("c0", "toolu_02")], RECORD)
    assert "the calls differ" in (info.value.diag.message_detail or "")


@pytest.mark.parametrize(
    ("calls", "record", "output", "message"),
    [
        ([], [1, 2], None, "record must be a JSON object"),
        ([], "text", None, "record must be a JSON object"),
        ([], 7, None, "record must be a JSON object"),
        ([call("c0")], None, {"done": True}, "output is the final decision's"),
        ([with_provider("c0", 17)], None, None, "provider id of call c0 must be a string"),
        ([with_provider("c0", ["x"])], None, None, "provider id of call c0 must be a string"),
        ([with_provider("c0", "")], None, None, "provider id must be 1-200 characters"),
        ([with_provider("c0", "p" * 201)], None, None, "provider id must be 1-200 characters"),
        ([{"tool": "x"}], None, None, "invalid call id"),
    ],
)
def test_a_bad_decision_is_refused_and_writes_nothing(
    worker: Conn, admin_conn: Conn, calls: Any, record: Any, output: Any, message: str
) -> None:
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL006", message) as info:
        record_v2(worker, lease, 0, calls, record, output)
    assert message in info.value.diag.message_primary


def test_a_record_too_deep_or_too_large_is_refused(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    deep: Any = {}
    for _ in range(64):
        deep = {"a": deep}  # depth 65
    with refused(admin_conn, "RL006") as info:
        record_v2(worker, lease, 0, [], deep)
    assert "record nests deeper than 64 levels" in info.value.diag.message_primary
    record_v2(worker, lease, 0, [], deep["a"])  # depth 64 is the limit: accepted

    lease2 = submit_and_claim(worker, "r2")
    set_payload_cap(admin_conn, 2048)
    with refused(admin_conn, "RL006") as info:
        record_v2(worker, lease2, 0, [], {"text": "x" * 3000})
    assert "record is" in info.value.diag.message_primary
    with refused(admin_conn, "RL006") as info:
        record_v2(worker, lease2, 0, [], None, "y" * 3000)
    assert "output is" in info.value.diag.message_primary


def test_a_provider_id_of_200_characters_and_a_null_one_are_stored(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    calls = [with_provider("c0", "p" * 200), with_provider("c1", None), call("c2")]
    record_v2(worker, lease, 0, calls, None)
    got = [call_row(admin_conn, key("r1", 0, c))["provider_id"] for c in ("c0", "c1", "c2")]
    assert got == ["p" * 200, None, None]


def test_keys_come_from_call_ids_never_from_provider_ids(worker: Conn, admin_conn: Conn) -> None:
    """Two runs whose model emits the same provider id get distinct keys."""
    for run_id in ("r1", "r2"):
        lease = submit_and_claim(worker, run_id)
        record_v2(worker, lease, 0, [with_provider("c0", "call_same")], RECORD)
    found = rows(
        admin_conn,
        "SELECT run_id, idempotency_key, provider_id FROM runledger.run_calls ORDER BY run_id",
    )
    assert found == [
        {"run_id": "r1", "idempotency_key": "r1:0:c0", "provider_id": "call_same"},
        {"run_id": "r2", "idempotency_key": "r2:0:c0", "provider_id": "call_same"},
    ]


def test_a_stale_lease_is_refused_before_anything_else(
    worker: Conn, worker2: Conn, admin_conn: Conn, db_clock: DbClock
) -> None:
    lease = submit_and_claim(worker)
    db_clock.advance(LEASE_SECONDS + 1)
    [fresh] = claim(worker2, "w2")
    assert fresh.token == lease.token + 1
    with refused(admin_conn, "RL001"):
        record_v2(worker, lease, 0, [call("c0")], RECORD)
    with refused(admin_conn, "RL001"):  # even with a bad record: the lease check is first
        record_v2(worker, lease, 0, [call("c0")], [1])
    record_v2(worker2, fresh, 0, [call("c0")], RECORD)  # the holder records
    assert turn_row(admin_conn, "r1", 0)["fencing_token"] == fresh.token


def test_turn_order_and_open_calls_are_checked_as_record_turn(
    worker: Conn, admin_conn: Conn
) -> None:
    lease = submit_and_claim(worker)
    with refused(admin_conn, "RL004"):
        record_v2(worker, lease, 1, [], RECORD)  # turn 0 first
    record_v2(worker, lease, 0, [call("c0")], RECORD)
    with refused(admin_conn, "RL004"):
        record_v2(worker, lease, 1, [], RECORD)  # c0 is not final
    k = key("r1", 0, "c0")
    dispatch(worker, lease, k)
    complete(worker, lease, k, "succeeded", {"ok": True})
    record_v2(worker, lease, 1, [], RECORD, {"done": 1})
    finish(worker, lease, "succeeded", {"done": 1})
    assert run_row(admin_conn, "r1")["status"] == "succeeded"


def test_a_decision_alone_stores_null_and_is_a_no_op_on_repeat(
    worker: Conn, admin_conn: Conn
) -> None:
    """record_turn_v4 with the calls alone (what record_turn, v1, took) stores no record,
    no output and no provider id."""
    lease = submit_and_claim(worker)
    calls = [call("c0")]
    record_turn(worker, lease, 0, calls)
    record_turn(worker, lease, 0, calls)  # still a no-op on repeat
    row = turn_row(admin_conn, "r1", 0)
    assert (row["calls"], row["record"], row["output"]) == (calls, None, None)
    assert call_row(admin_conn, key("r1", 0, "c0"))["provider_id"] is None
    # the same decision with an explicit null record is the same decision
    record_v2(worker, lease, 0, calls, None)
    # with a record it is another one
    with refused(admin_conn, "RL004"):
        record_v2(worker, lease, 0, calls, RECORD)
    assert len(events(admin_conn, "r1", "turn_recorded")) == 1


def test_the_wall_keeps_record_and_provider_id(worker: Conn, admin_conn: Conn) -> None:
    lease = submit_and_claim(worker)
    record_v2(worker, lease, 0, [with_provider("c0", "toolu_01")], RECORD)
    with refused(admin_conn, "RL007"):
        admin_conn.execute("UPDATE runledger.run_turns SET record = '{}'::jsonb")
    with refused(admin_conn, "RL007") as info:
        admin_conn.execute("UPDATE runledger.run_calls SET provider_id = 'forged'")
    assert "provider id are immutable" in info.value.diag.message_primary
    with refused(admin_conn, "42501"):  # and a worker writes no table at all
        worker.execute("UPDATE runledger.run_calls SET provider_id = 'forged'")
