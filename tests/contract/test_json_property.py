"""Random JSON through submit_run, record_turn and complete_call: a typed refusal with
nothing written, or an exact round trip. Nothing else.

Two ways in: the Python ``Store`` (a refusal is ``InvalidInput``) and direct SQL with
``psycopg.types.json.Jsonb`` (a refusal is SQLSTATE RL006, or 22P05/22P02 when PostgreSQL
cannot parse the JSON text the driver sent). What comes back is read from the tables as
``jsonb::text`` and compared with what went in, under these JSON semantics:

- what went in is the JSON text the client sent (``json.dumps``): a Python string holding
  a high and a low surrogate as two code points is sent as the escapes ``\\ud83d\\ude00``,
  which JSON reads as one character;
- numbers are exact decimals (``Decimal`` of the text, both ways): JSON has one number
  type, so ``1e16`` may come back as ``10000000000000000``, but never as another value;
  a float round-trips exactly when the decimal that comes back is the one it was sent as;
- objects compare as mappings: jsonb keeps neither key order nor the first of duplicate
  keys (the last one wins, as in ``json.loads``); arrays keep their order;
- the one exception, asserted on its own below: jsonb stores numbers as ``numeric``,
  which has no negative zero, so ``-0.0`` comes back as ``0.0``.

Per example the runs get fresh ids; one database serves each test function.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import uuid
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from psycopg.types.json import Jsonb

from runledger.errors import InvalidInput

from .helpers import claim, rows, scalar, submit

Conn = psycopg.Connection[Any]
LEASE = dt.timedelta(seconds=300)
SETTINGS = settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# -- the values -------------------------------------------------------------------------------

SPECIAL_STRINGS = [
    "",
    "\x00",
    "a\x00b",
    "\ud800",  # a lone high surrogate
    "\udfff",  # a lone low surrogate
    "\ud83d\ude00",  # a pair as two code points: JSON reads one character
    "\U0001f600",
    "\u2028\u2029",
    "\ufeff",
    "\\u0000",  # the six characters, not NUL
    '"',
    "é",
    "e\u0301",  # the same letter, decomposed: a different string (no normalisation)
]
# Keys that look alike (Python cannot hold a real duplicate key; see the raw-text test).
LOOKALIKE_KEYS = ["a", "a ", " a", "A", "é", "e\u0301", "1", "01", "1.0", "", "\x00", "null"]
SPECIAL_FLOATS = [
    -0.0,
    0.0,
    1e308,
    -1e308,
    1.7976931348623157e308,
    5e-324,
    2.2250738585072014e-308,
    0.1,
    1e16,
    1e22,
    123456789.123456789,
    -1.5,
]

# Mostly text PostgreSQL can hold (any code point but NUL and surrogates), sometimes any
# code point at all, sometimes one of the special strings: so both outcomes are common.
clean_text = st.text(
    st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=30
)
any_text = st.text(st.characters(exclude_categories=()), max_size=30)
strings = st.one_of(clean_text, clean_text, clean_text, any_text, st.sampled_from(SPECIAL_STRINGS))
keys = st.one_of(
    clean_text,
    clean_text,
    st.sampled_from(LOOKALIKE_KEYS),
    any_text,
    st.text(
        st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
        min_size=200,
        max_size=600,
    ),
)
numbers = st.one_of(
    st.integers(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.sampled_from([2**63, -(2**63) - 1, 10**4299, -(10**4299)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(SPECIAL_FLOATS),
)
leaves = st.one_of(st.none(), st.booleans(), numbers, strings)
json_values = st.recursive(
    leaves,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=12,
)
json_objects = st.dictionaries(keys, json_values, max_size=5)

# The Store refuses what is not JSON before sending it: these go through it only.
NOT_JSON = [float("nan"), float("inf"), float("-inf"), 10**5000]
not_json = st.sampled_from(NOT_JSON)
store_values = st.tuples(st.integers(0, 4), json_values, not_json).map(
    lambda t: t[2] if t[0] == 0 else t[1]  # one in five is not JSON
)
store_objects = st.tuples(st.integers(0, 4), json_objects, keys, not_json).map(
    lambda t: {**t[1], t[2]: t[3]} if t[0] == 0 else t[1]
)


# -- JSON semantics -----------------------------------------------------------------------


def exact(text: str) -> Any:
    """A JSON text as Python values with every number an exact Decimal."""
    return json.loads(text, parse_float=Decimal, parse_int=Decimal)


def sent(value: Any) -> Any:
    """What the JSON text a client sends for ``value`` means."""
    return exact(json.dumps(value))


def strings_of(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings_of(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings_of(v)]
    return []


def has_surrogate(s: str) -> bool:
    return any(0xD800 <= ord(c) <= 0xDFFF for c in s)


def sql_refusal(*values: Any) -> set[str]:
    """The SQLSTATEs PostgreSQL may answer for these values; empty: it must accept them."""
    codes: set[str] = set()
    for value in values:
        if any("\x00" in s for s in strings_of(value)):
            codes.add("22P05")  # jsonb cannot hold \u0000
        if value is not None and any(has_surrogate(s) for s in strings_of(sent(value))):
            codes.add("22P02")  # a lone surrogate escape is not valid JSON for PostgreSQL
    return codes


def store_refuses(*values: Any) -> bool:
    """What the Store must refuse: text PostgreSQL cannot hold, or a value that is not JSON."""
    for value in values:
        if any("\x00" in s or has_surrogate(s) for s in strings_of(value)):
            return True
        try:
            json.dumps(value, allow_nan=False)
        except ValueError:
            return True
    return False


def same(a: Any, b: Any) -> bool:
    """Equal as JSON values (see the module docstring); a Decimal zero of either sign is 0."""
    if isinstance(a, Decimal) and isinstance(b, Decimal):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def read_json(admin: Conn, sql: str, params: tuple[Any, ...]) -> Any:
    text = scalar(admin, sql, params)
    return None if text is None else exact(text)


def fingerprint(admin: Conn) -> str:
    """A hash of every row of the journal tables: equal before and after means unchanged."""
    parts = [
        f"(SELECT md5(coalesce(string_agg(x::text, '|' ORDER BY x::text), '')) "
        f"FROM runledger.{t} x)"
        for t in ("runs", "run_turns", "run_calls", "run_events", "workers")
    ]
    return str(scalar(admin, "SELECT " + " || ".join(parts)))


def new_id() -> str:
    return "j" + uuid.uuid4().hex


# -- direct SQL -------------------------------------------------------------------------------


def _sql_expect(admin: Conn, codes: set[str], run: Any) -> bool:
    """Run ``run()``; True if it was accepted. A refusal must be one of ``codes``."""
    before = fingerprint(admin)
    try:
        run()
    except psycopg.Error as exc:
        assert codes, (
            f"refused {exc.sqlstate} ({exc.diag.message_primary}) but expected a round trip"
        )
        assert exc.sqlstate in codes, f"got {exc.sqlstate} {exc}, expected one of {codes}"
        assert fingerprint(admin) == before, "a refused call wrote something"
        event(f"refused {exc.sqlstate}")
        return False
    assert not codes, f"accepted, but expected a refusal {codes}"
    event("round trip")
    return True


@SETTINGS
@given(value=json_objects)
def test_submit_run_input_by_sql(value: dict[str, Any], worker: Conn, admin_conn: Conn) -> None:
    run_id = new_id()
    if _sql_expect(admin_conn, sql_refusal(value), lambda: submit(worker, run_id, value, flow="j")):
        got = read_json(
            admin_conn, "SELECT input::text FROM runledger.runs WHERE run_id = %s", (run_id,)
        )
        assert same(got, sent(value)), (got, value)


# a bare decision: no record, output, checkpoint, finish or dispatch
RECORD_TURN = (
    "SELECT runledger.record_turn_v4(%s, %s, %s, 0, %s, NULL, NULL, NULL, NULL, false, NULL)"
)


@SETTINGS
@given(args=json_objects, result=json_values, receipt=st.none() | json_objects)
def test_record_turn_and_complete_call_by_sql(
    args: dict[str, Any], result: Any, receipt: Any, worker: Conn, admin_conn: Conn
) -> None:
    run_id = new_id()
    submit(worker, run_id)
    [lease] = claim(worker, "w1", max_runs=1)
    assert lease.run_id == run_id
    key = f"{run_id}:0:c1"
    calls = [{"call_id": "c1", "tool": "t", "args": args}]
    record = lambda: worker.execute(  # noqa: E731
        RECORD_TURN,
        (run_id, lease.lease_id, lease.token, Jsonb(calls)),
    )
    if not _sql_expect(admin_conn, sql_refusal(args), record):
        calls = [{"call_id": "c1", "tool": "t", "args": {}}]
        worker.execute(
            RECORD_TURN,
            (run_id, lease.lease_id, lease.token, Jsonb(calls)),
        )
    else:
        got = read_json(
            admin_conn,
            "SELECT args::text FROM runledger.run_calls WHERE idempotency_key = %s",
            (key,),
        )
        assert same(got, sent(args)), (got, args)
        turn = read_json(
            admin_conn,
            "SELECT calls::text FROM runledger.run_turns WHERE run_id = %s AND turn = 0",
            (run_id,),
        )
        assert same(turn, sent(calls)), (turn, calls)

    worker.execute(
        "SELECT runledger.dispatch_call(%s, %s, %s, %s)", (run_id, lease.lease_id, lease.token, key)
    )
    complete = lambda: worker.execute(  # noqa: E731
        "SELECT runledger.complete_call(%s, %s, %s, %s, 'succeeded', %s, %s)",
        (
            run_id,
            lease.lease_id,
            lease.token,
            key,
            Jsonb(result),
            None if receipt is None else Jsonb(receipt),
        ),
    )
    if _sql_expect(admin_conn, sql_refusal(result, receipt), complete):
        got = read_json(
            admin_conn,
            "SELECT result::text FROM runledger.run_calls WHERE idempotency_key = %s",
            (key,),
        )
        assert same(got, sent(result)), (got, result)
        got = read_json(
            admin_conn,
            "SELECT receipt::text FROM runledger.run_calls WHERE idempotency_key = %s",
            (key,),
        )
        assert same(got, None if receipt is None else sent(receipt)), (got, receipt)


def test_duplicate_keys_in_the_json_text_keep_the_last(worker: Conn, admin_conn: Conn) -> None:
    """A real duplicate key can only be sent as text: jsonb keeps the last, like json.loads."""
    text = '{"a": 1, "b": {"x": 1, "x": [2]}, "a": -0.5e1}'
    worker.execute("SELECT * FROM runledger.submit_run('dup', 'j', '1', %s::jsonb)", (text,))
    got = read_json(admin_conn, "SELECT input::text FROM runledger.runs WHERE run_id = 'dup'", ())
    assert same(got, exact(text))
    assert got == {"a": Decimal("-5"), "b": {"x": [Decimal(2)]}}


# -- through the Store ------------------------------------------------------------------------


async def _store_expect(admin: Conn, refuse: bool, run: Any) -> bool:
    before = fingerprint(admin)
    try:
        await run()
    except InvalidInput as exc:
        assert refuse, f"InvalidInput ({exc}) but expected a round trip"
        assert fingerprint(admin) == before, "a refused call wrote something"
        event("refused InvalidInput")
        return False
    assert not refuse, "accepted, but expected InvalidInput"
    event("round trip")
    return True


@SETTINGS
@given(value=store_objects)
async def test_submit_run_input_through_the_store(
    value: dict[str, Any], store: Any, admin_conn: Conn
) -> None:
    run_id = new_id()

    async def run() -> None:
        await store.worker.submit_run(run_id, "j", "1", value)

    if await _store_expect(admin_conn, store_refuses(value), run):
        got = read_json(
            admin_conn, "SELECT input::text FROM runledger.runs WHERE run_id = %s", (run_id,)
        )
        assert same(got, sent(value)), (got, value)


@SETTINGS
@given(args=store_objects, result=store_values, receipt=st.none() | store_objects)
async def test_record_turn_and_complete_call_through_the_store(
    args: dict[str, Any], result: Any, receipt: Any, store: Any, admin_conn: Conn
) -> None:
    run_id = new_id()
    await store.worker.submit_run(run_id, "demo", "1", {"n": 1})
    [(c, _)] = await store.worker.claim_runs("w1", ["demo@1"], LEASE, 1)
    assert c.run_id == run_id
    key = f"{run_id}:0:c1"

    async def record() -> None:
        calls = [{"call_id": "c1", "tool": "t", "args": args}]
        await store.worker.record_turn(run_id, c.lease_id, c.fencing_token, 0, calls)

    if await _store_expect(admin_conn, store_refuses(args), record):
        got = read_json(
            admin_conn,
            "SELECT args::text FROM runledger.run_calls WHERE idempotency_key = %s",
            (key,),
        )
        assert same(got, sent(args)), (got, args)
    else:
        plain = [{"call_id": "c1", "tool": "t", "args": {}}]
        await store.worker.record_turn(run_id, c.lease_id, c.fencing_token, 0, plain)
    await store.worker.dispatch_call(run_id, c.lease_id, c.fencing_token, key)

    async def complete() -> None:
        await store.worker.complete_call(
            run_id, c.lease_id, c.fencing_token, key, "succeeded", result, receipt
        )

    if await _store_expect(admin_conn, store_refuses(result, receipt), complete):
        got = read_json(
            admin_conn,
            "SELECT result::text FROM runledger.run_calls WHERE idempotency_key = %s",
            (key,),
        )
        assert same(got, None if result is None else sent(result)), (got, result)
        got = read_json(
            admin_conn,
            "SELECT receipt::text FROM runledger.run_calls WHERE idempotency_key = %s",
            (key,),
        )
        assert same(got, None if receipt is None else sent(receipt)), (got, receipt)


# -- the one exception ------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["sql", "store"])
async def test_negative_zero_comes_back_as_zero(
    how: str, store: Any, worker: Conn, admin_conn: Conn
) -> None:
    """jsonb numbers are numeric, which has no -0: the sign of a float zero is lost. Not a
    refusal and not bit-exact; the database cannot tell (``'-0.0'::jsonb`` is already
    ``0.0``), so only the client could refuse it (reported: runledger.db.validate)."""
    if how == "sql":
        submit(worker, "z", {"z": -0.0}, flow="j")
    else:
        await store.worker.submit_run("z", "j", "1", {"z": -0.0})
    assert scalar(admin_conn, "SELECT input::text FROM runledger.runs WHERE run_id = 'z'") == (
        '{"z": 0.0}'
    )
    [row] = rows(admin_conn, "SELECT input FROM runledger.runs WHERE run_id = 'z'")
    assert math.copysign(1.0, row["input"]["z"]) == 1.0  # +0.0: what went in was -0.0
