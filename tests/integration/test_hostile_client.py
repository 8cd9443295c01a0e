"""Hostile input through ``Client``: each is a typed ``runledger.errors`` exception and
writes nothing (every row of every runledger table is the same before and after).

Connections fail fast and say so: a port nothing listens on, a server that never answers,
a database or role that does not exist, a string that is not a URL, a database without
the schema or with an older revision of it -- each one typed error within the connect
timeout, against the real test server.
"""

from __future__ import annotations

import math
import socket
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from runledger import Client, cli, errors
from runledger.model import MAX_JSON_DEPTH
from runledger.testing.postgres import Databases, url_with_dbname

Snapshot = dict[str, list[str]]


def snapshot(conn: psycopg.Connection[Any]) -> Snapshot:
    """Every row of every table in schema runledger, as sorted JSON text."""
    tables = [
        r[0]
        for r in conn.execute(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'runledger' ORDER BY 1"
        )
    ]
    assert {"runs", "run_calls", "run_events", "workers"} <= set(tables)
    out: Snapshot = {}
    for table in tables:
        rows = conn.execute(
            psycopg.sql.SQL("SELECT to_jsonb(t)::text FROM runledger.{} t ORDER BY 1").format(
                psycopg.sql.Identifier(table)
            )
        ).fetchall()
        out[table] = [r[0] for r in rows]
    return out


@pytest.fixture
def unchanged(admin_conn: psycopg.Connection[Any]) -> Iterator[Callable[[], None]]:
    """Call it after the hostile input: asserts that no row of any table changed."""
    before = snapshot(admin_conn)

    def check() -> None:
        assert snapshot(admin_conn) == before

    yield check


@pytest.fixture
def client(database_url: str) -> Iterator[Client]:
    with Client(database_url, actor="ops:mallory") as c:
        yield c


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def deep_list(depth: int) -> Any:
    value: Any = []
    for _ in range(depth - 1):
        value = [value]
    return value


def cyclic() -> dict[str, Any]:
    loop: dict[str, Any] = {}
    loop["again"] = loop
    return loop


DEPTH = f"nests deeper than the limit of {MAX_JSON_DEPTH} levels"
INT32 = r"priority must be an integer from -2147483648 to 2147483647 \(int32\)"

# (id, submit keyword arguments, message pattern)
SUBMITS: list[tuple[str, dict[str, Any], str]] = [
    ("input-65-deep", {"input": nested(MAX_JSON_DEPTH + 1)}, DEPTH),
    ("input-65-deep-list", {"input": {"x": deep_list(MAX_JSON_DEPTH)}}, DEPTH),
    ("input-2000-deep", {"input": nested(2_000)}, DEPTH),
    ("input-100k-deep", {"input": nested(100_000)}, DEPTH),
    ("input-cyclic", {"input": cyclic()}, DEPTH),
    ("input-list", {"input": [1]}, "input must be a JSON object"),
    ("input-nan", {"input": {"a": math.nan}}, "input is not JSON"),
    ("input-bytes", {"input": {"a": b"x"}}, "input is not JSON"),
    ("input-nul", {"input": {"a": "\x00"}}, "NUL"),
    ("priority-2**31", {"priority": 2**31}, INT32),
    ("priority--2**31-1", {"priority": -(2**31) - 1}, INT32),
    ("priority-3e9", {"priority": 3_000_000_000}, INT32),
    ("priority-2**63", {"priority": 2**63}, INT32),
    ("priority-nan", {"priority": math.nan}, INT32),
    ("priority-inf", {"priority": math.inf}, INT32),
    ("priority-float", {"priority": 3.0}, INT32),
    ("priority-true", {"priority": True}, INT32),
    ("priority-str", {"priority": "3"}, INT32),
    ("priority-none", {"priority": None}, INT32),
    ("run-id-empty", {"run_id": ""}, "run id must not be empty"),
    ("run-id-space", {"run_id": " "}, "run id"),
    ("run-id-nul", {"run_id": "a\x00"}, "NUL"),
    ("run-id-129", {"run_id": "r" * 129}, "run id"),
]


@pytest.mark.parametrize(
    ("kwargs", "message"), [s[1:] for s in SUBMITS], ids=[s[0] for s in SUBMITS]
)
def test_hostile_submit_is_invalid_input_and_writes_nothing(
    client: Client, unchanged: Callable[[], None], kwargs: dict[str, Any], message: str
) -> None:
    args: dict[str, Any] = {"input": {"ok": True}, "run_id": "hostile-1", **kwargs}
    with pytest.raises(errors.InvalidInput, match=message) as info:
        client.submit("nobody@1", **args)
    assert not isinstance(info.value.__cause__, RecursionError)
    unchanged()


def test_the_limit_itself_is_accepted_and_stored_whole(
    client: Client, admin_conn: psycopg.Connection[Any]
) -> None:
    value = {"x": nested(MAX_JSON_DEPTH - 1)}  # 64 levels
    assert client.submit("nobody@1", value, run_id="at-limit", priority=2**31 - 1).created
    row = admin_conn.execute(
        "SELECT input, priority FROM runledger.runs WHERE run_id = 'at-limit'"
    ).fetchone()
    assert row == (value, 2**31 - 1)


def test_none_generates_a_run_id_and_an_empty_one_never_does(
    client: Client, admin_conn: psycopg.Connection[Any]
) -> None:
    generated = client.submit("nobody@1", {}, run_id=None)
    assert generated.created and generated.run_id.startswith("run-")
    for _ in range(2):  # a caller retrying with an empty id gets the same refusal each time
        with pytest.raises(errors.InvalidInput, match="must not be empty"):
            client.submit("nobody@1", {}, run_id="")
    assert admin_conn.execute("SELECT run_id FROM runledger.runs").fetchall() == [
        (generated.run_id,)
    ]


RECEIPTS: list[tuple[str, Any, str]] = [
    ("receipt-65-deep", nested(MAX_JSON_DEPTH + 1), DEPTH),
    ("receipt-100k-deep", nested(100_000), DEPTH),
    ("receipt-cyclic", cyclic(), DEPTH),
    ("receipt-list", [1], "receipt must be a JSON object"),
]


@pytest.mark.parametrize(
    ("receipt", "message"), [r[1:] for r in RECEIPTS], ids=[r[0] for r in RECEIPTS]
)
def test_hostile_receipt_is_invalid_input_and_writes_nothing(
    client: Client,
    admin_conn: psycopg.Connection[Any],
    receipt: Any,
    message: str,
) -> None:
    admin_conn.execute("SELECT * FROM runledger.submit_run('rc-1', 'nobody', '1', '{}')")
    before = snapshot(admin_conn)
    with pytest.raises(errors.InvalidInput, match=message):
        client.resolve("rc-1:0:c0", "applied", receipt)
    assert snapshot(admin_conn) == before


# -- connections -----------------------------------------------------------------------------

MARGIN = 5.0  # seconds over the connect timeout a failure may take


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def empty_database(runledger_databases: Databases) -> Iterator[str]:
    url = runledger_databases.create("rl_empty", migrated=False)
    try:
        yield url
    finally:
        runledger_databases.drop(url)


def connect_cases(database_url: str, empty: str) -> list[tuple[str, str, type[Exception], str]]:
    port = closed_port()
    return [
        ("refused", f"postgresql://postgres@127.0.0.1:{port}/app", errors.DatabaseUnavailable,
         f"cannot reach PostgreSQL at 127.0.0.1:{port} (database 'app')"),
        ("no-database", url_with_dbname(database_url, "rl_no_such_db"), errors.DatabaseUnavailable,
         "database 'rl_no_such_db' does not exist on PostgreSQL at 127.0.0.1:"),
        ("no-role", make_conninfo(database_url, user="rl_no_such_role"), errors.DatabaseUnavailable,
         "refused role 'rl_no_such_role'"),
        ("dns", "postgresql://u@no-such-host.invalid/app", errors.DatabaseUnavailable,
         "cannot reach PostgreSQL at no-such-host.invalid:5432"),
        ("notaurl", "notaurl", errors.ConfigurationError, "is not a PostgreSQL URL"),
        ("bad-port", "postgresql://u@127.0.0.1:notaport/app", errors.DatabaseUnavailable,
         "127.0.0.1:notaport"),
        ("unmigrated", empty, errors.SchemaMissing,
         "has no runledger schema: run `runledger migrate`"),
    ]  # fmt: skip


HINTS = {
    "refused": "check that the server is running",
    "no-database": "createdb rl_no_such_db",
    "no-role": "check the role and password",
    "unmigrated": "runledger migrate",
}


@pytest.mark.parametrize(
    "case", ["refused", "no-database", "no-role", "dns", "notaurl", "bad-port", "unmigrated"]
)
def test_client_connection_failures_are_typed_one_line_and_fast(
    database_url: str, empty_database: str, case: str
) -> None:
    [(_, url, kind, message)] = [
        c for c in connect_cases(database_url, empty_database) if c[0] == case
    ]
    started = time.monotonic()
    with pytest.raises(kind) as info:
        Client(url, connect_timeout=3)
    elapsed = time.monotonic() - started
    assert elapsed < 3 + MARGIN, elapsed
    text = str(info.value)
    assert message in text and "\n" not in text, text
    assert HINTS.get(case, "") in text
    assert "Traceback" not in text


def test_a_server_that_never_answers_fails_within_the_connect_timeout() -> None:
    with socket.socket() as listener:  # accepts TCP connections, never says a word
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(errors.DatabaseUnavailable, match="no answer from PostgreSQL") as info:
            Client(f"postgresql://u@127.0.0.1:{port}/app", connect_timeout=1.5)
        elapsed = time.monotonic() - started
    assert 1.0 <= elapsed < 1.5 + MARGIN, elapsed
    assert "within 1.5 s" in str(info.value)


def test_the_connect_timeout_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_CONNECT_TIMEOUT", "1")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        started = time.monotonic()
        with pytest.raises(errors.DatabaseUnavailable, match="within 1 s"):
            Client(f"postgresql://u@127.0.0.1:{listener.getsockname()[1]}/app")
        assert time.monotonic() - started < 1 + MARGIN


def test_a_database_behind_the_code_is_schema_missing_naming_the_revision(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    from runledger.db import migrate
    from runledger.db.revisions import BEFORE_BASELINE

    chain = migrate.revision_chain()
    assert chain[-1] == migrate.head()  # read without Alembic, the same head
    # The baseline 0.1 is the whole chain, so the revision behind it is the last one it
    # replaced (0032: runledger at 4b19f01).
    old = max(BEFORE_BASELINE)
    assert old == "0032" and old not in chain
    admin_conn.execute("UPDATE runledger.alembic_version SET version_num = %s", (old,))
    with pytest.raises(errors.SchemaMissing) as info:
        Client(database_url)
    assert str(info.value) == (
        f"database '{admin_conn.info.dbname}' at 127.0.0.1:{admin_conn.info.port} is at schema "
        f"revision {old}, this code needs {chain[-1]}: run `runledger migrate`"
    )


def test_a_database_ahead_of_the_code_is_accepted(
    database_url: str, admin_conn: psycopg.Connection[Any]
) -> None:
    # a rolling deploy: the new release migrated, this one still runs against it
    admin_conn.execute("UPDATE runledger.alembic_version SET version_num = '9999_newer'")
    with Client(database_url) as c:
        assert c.submit("nobody@1", {}, run_id="ahead-1").created


# -- the CLI over the same cases: one line, the documented exit code --------------------------


@pytest.mark.parametrize(
    ("case", "code"),
    [("refused", 3), ("no-database", 3), ("no-role", 3), ("dns", 3), ("notaurl", 2),
     ("unmigrated", 3)],
)  # fmt: skip
@pytest.mark.parametrize(
    "argv", [["status", "r-1"], ["submit", "f@1"], ["audit"], ["migrate", "--check"]]
)
def test_cli_connection_failures_are_one_line_and_an_exit_code(
    database_url: str,
    empty_database: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    case: str,
    code: int,
    argv: list[str],
) -> None:
    [(_, url, kind, message)] = [
        c for c in connect_cases(database_url, empty_database) if c[0] == case
    ]
    if case == "unmigrated" and argv[0] == "migrate":
        code, kind, message = 1, type(None), "behind: database at nothing"  # --check: exit 1
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", url)
    monkeypatch.setattr(sys, "argv", ["runledger", *argv, "--connect-timeout", "3"])
    started = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert time.monotonic() - started < 3 + MARGIN
    out, err = capsys.readouterr()
    assert exit_.value.code == code, err
    assert out == "", out
    [line] = err.splitlines()
    assert message in line, line
    if kind is not type(None):
        assert line.startswith(f"error: {kind.__name__}: ")
    assert "Traceback" not in err


# -- JSON the store cannot decode is shown, not raised ----------------------------------------


def test_status_of_a_run_with_undecodable_json(
    database_url: str,
    admin_conn: psycopg.Connection[Any],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    deep = "[" * 5000 + "]" * 5000  # jsonb holds it; Python's json cannot decode it
    admin_conn.execute("SELECT * FROM runledger.submit_run('deep-1', 'nobody', '1', '{}')")
    admin_conn.execute(
        "UPDATE runledger.runs SET state = %s::jsonb, state_version = state_version + 1 "
        "WHERE run_id = 'deep-1'",
        ('{"s": ' + deep + "}",),
    )
    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", database_url)
    monkeypatch.setenv("COLUMNS", "80")
    for extra in ([], ["--json"]):
        monkeypatch.setattr(sys, "argv", ["runledger", "status", "deep-1", *extra])
        with pytest.raises(SystemExit) as exit_:
            cli.run()
            raise SystemExit(0)
        out, err = capsys.readouterr()
        assert (exit_.value.code, err) == (0, "")
        shown = "<undecodable JSON, 10007 bytes: nested too deeply for Python to decode>"
        if extra:
            assert json.loads(out)["run"]["state"] == shown
        else:
            assert f"state: {shown}" in out.splitlines()
