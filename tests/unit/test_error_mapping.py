"""SQLSTATE -> exception: runledger.errors.REGISTRY/from_sqlstate and store.map_error.

The psycopg errors are built the way psycopg builds them from a server reply (an error
class chosen by SQLSTATE, the diagnostic fields as ``info``), without a server.
"""

from __future__ import annotations

import pickle

import psycopg
import pytest
from psycopg.errors import lookup
from psycopg.pq import DiagnosticField

from runledger import errors
from runledger.db.sqlstate import describe, map_error, server_error
from tests.unit.sql_source import raised_sqlstates

DESIGN_TABLE = {
    "RL001": errors.LeaseLost,
    "RL002": errors.VersionConflict,
    "RL003": errors.RunNotFound,
    "RL004": errors.InvalidTransition,
    "RL005": errors.RunConflict,
    "RL006": errors.InvalidInput,
    "RL007": errors.InvariantViolation,
    "RL008": errors.WorkerConflict,
    "RL009": errors.SenderActive,
}


def pg_error(
    sqlstate: str,
    message: str = "refused",
    detail: str | None = None,
    hint: str | None = None,
) -> psycopg.Error:
    """What psycopg raises for a server error with these diagnostic fields."""
    info: dict[DiagnosticField, bytes | None] = {
        DiagnosticField.SQLSTATE: sqlstate.encode(),
        DiagnosticField.MESSAGE_PRIMARY: message.encode(),
        DiagnosticField.MESSAGE_DETAIL: None if detail is None else detail.encode(),
        DiagnosticField.MESSAGE_HINT: None if hint is None else hint.encode(),
        DiagnosticField.SEVERITY: b"ERROR",
    }
    try:
        cls: type[psycopg.Error] = lookup(sqlstate)
    except KeyError:  # our own RLxxx codes: psycopg has no class for them
        cls = psycopg.errors.get_base_exception(sqlstate)
    return cls(f"ERROR: {message}", info=info)  # type: ignore[arg-type]


# -- the registry --------------------------------------------------------------------------


def test_registry_is_the_design_table() -> None:
    assert errors.REGISTRY == DESIGN_TABLE


def test_registry_is_one_to_one_and_self_consistent() -> None:
    classes = list(errors.REGISTRY.values())
    assert len(set(classes)) == len(classes)
    for code, cls in errors.REGISTRY.items():
        assert issubclass(cls, errors.RunLedgerError)
        assert cls.sqlstate == code


def test_every_class_with_a_sqlstate_is_registered() -> None:
    def walk(cls: type[errors.RunLedgerError]) -> list[type[errors.RunLedgerError]]:
        return [cls, *(c for sub in cls.__subclasses__() for c in walk(sub))]

    with_state = {c for c in walk(errors.RunLedgerError) if c.sqlstate is not None}
    assert with_state == set(errors.REGISTRY.values())


def test_registry_covers_every_sqlstate_the_sql_raises() -> None:
    assert raised_sqlstates() == set(errors.REGISTRY)


@pytest.mark.parametrize(("code", "cls"), sorted(DESIGN_TABLE.items()))
def test_from_sqlstate_builds_the_exception_with_fields(
    code: str, cls: type[errors.RunLedgerError]
) -> None:
    exc = errors.from_sqlstate(
        code, "lease lost on run r1", run_id="r1", fencing_token=7, detail="d", hint="h"
    )
    assert type(exc) is cls
    assert exc.message == "lease lost on run r1"
    assert (exc.run_id, exc.fencing_token, exc.detail, exc.hint) == ("r1", 7, "d", "h")
    assert str(exc) == "lease lost on run r1\nDETAIL: d\nHINT: h"


@pytest.mark.parametrize("code", [None, "23505", "40001", "08006", "P0001", "RL000", "RL999"])
def test_from_sqlstate_ignores_other_codes(code: str | None) -> None:
    assert errors.from_sqlstate(code, "x") is None


def test_str_without_detail_or_hint_is_the_message() -> None:
    assert str(errors.RunNotFound("run r1 not found")) == "run r1 not found"


# -- store.map_error -------------------------------------------------------------------------


def test_fake_driver_error_looks_like_a_real_one() -> None:
    """Guard for the helper: psycopg reads sqlstate and diag from the info we give it."""
    exc = pg_error("RL001", "m", "d", "h")
    assert isinstance(exc, psycopg.DatabaseError)
    assert exc.sqlstate == "RL001"
    assert (exc.diag.message_primary, exc.diag.message_detail, exc.diag.message_hint) == (
        "m",
        "d",
        "h",
    )


@pytest.mark.parametrize(("code", "cls"), sorted(DESIGN_TABLE.items()))
def test_map_error_maps_every_rl_code(code: str, cls: type[errors.RunLedgerError]) -> None:
    driver = pg_error(code, "lease lost on run r1", "seen token 3", "drop it")
    mapped = map_error(driver, run_id="r1", fencing_token=3)
    assert type(mapped) is cls
    assert mapped is not None
    assert mapped.message == "lease lost on run r1"
    assert (mapped.detail, mapped.hint) == ("seen token 3", "drop it")
    assert (mapped.run_id, mapped.fencing_token) == ("r1", 3)


def test_map_error_turns_empty_detail_and_hint_into_none() -> None:
    # runledger._raise sends coalesce(detail, '') and coalesce(hint, '').
    mapped = map_error(pg_error("RL003", "run r9 not found", "", ""))
    assert isinstance(mapped, errors.RunNotFound)
    assert (mapped.detail, mapped.hint) == (None, None)
    assert str(mapped) == "run r9 not found"


@pytest.mark.parametrize(
    "code",
    [
        "22P05",  # untranslatable_character: \u0000 in jsonb
        "22021",  # character_not_in_repertoire
        "22P02",  # invalid_text_representation (bad JSON, bad uuid)
        "22003",  # numeric_value_out_of_range
        "54000",  # program_limit_exceeded
    ],
)
def test_map_error_treats_bad_values_as_invalid_input(code: str) -> None:
    mapped = map_error(pg_error(code, "bad value", "where"), run_id="r1")
    assert isinstance(mapped, errors.InvalidInput)
    assert (mapped.message, mapped.detail, mapped.run_id) == ("bad value", "where", "r1")


@pytest.mark.parametrize(
    "code",
    [
        "23505",  # unique_violation: a bug of ours, not a refusal to map
        "40001",  # serialization_failure: retried, not mapped
        "40P01",  # deadlock_detected
        "57P01",  # admin_shutdown
        "08006",  # connection_failure
        "42883",  # undefined_function: schema behind the code
        "P0001",  # raise_exception without our code
    ],
)
def test_map_error_leaves_other_errors_alone(code: str) -> None:
    assert map_error(pg_error(code)) is None


def test_map_error_without_sqlstate() -> None:
    assert map_error(psycopg.OperationalError("connection refused")) is None
    assert map_error(psycopg.InterfaceError("connection already closed")) is None


def test_mapped_driver_error_survives_pickling() -> None:
    """Errors cross process boundaries (worker pool); the SQLSTATE must come along."""
    driver = pickle.loads(pickle.dumps(pg_error("RL002", "conflict", "expected 1")))
    mapped = map_error(driver)
    assert isinstance(mapped, errors.VersionConflict)
    assert mapped.detail == "expected 1"


# -- any other error of the server: ServerError, naming its SQLSTATE ----------------------


@pytest.mark.parametrize(
    ("code", "condition", "transient"),
    [
        ("53100", "disk full", True),
        ("53200", "out of memory", True),
        ("57014", "query canceled", True),
        ("58030", "io error", True),
        ("42501", "insufficient privilege", False),
        ("23514", "check violation", False),
        ("XX000", "internal error", False),
    ],
)
def test_any_other_server_error_is_a_server_error_naming_its_sqlstate(
    code: str, condition: str, transient: bool
) -> None:
    driver = pg_error(code, "could not extend file", "on disk", "Check free disk space.")
    failed = server_error(driver, run_id="r1", fencing_token=2)
    assert isinstance(failed, errors.ServerError)
    assert (failed.code, failed.condition, failed.transient) == (code, condition, transient)
    assert (failed.run_id, failed.fencing_token) == ("r1", 2)
    assert str(failed) == (
        f"{condition}: could not extend file; DETAIL: on disk; HINT: Check free disk space. "
        f"(SQLSTATE {code})"
    )
    assert describe(failed) == str(failed) == describe(driver)


@pytest.mark.parametrize("code", ["RL001", "RL006", "22P02", "25006", "08006", "57P01"])
def test_refusals_and_lost_connections_are_no_server_errors(code: str) -> None:
    assert server_error(pg_error(code)) is None


def test_describe_puts_the_cause_first_on_one_line() -> None:
    assert describe(pg_error("RL001", "lease lost", "token 3")) == (
        "LeaseLost: lease lost; DETAIL: token 3"
    )
    assert describe(psycopg.OperationalError("connection\nrefused")) == (
        "OperationalError: connection refused"
    )
    assert describe(RuntimeError("two\n  lines")) == "RuntimeError: two lines"


# -- a write refused because the server only reads (SQLSTATE 25006) ------------------------


def _read_only_error(message: str, context: str | None) -> psycopg.Error:
    info: dict[DiagnosticField, bytes | None] = {
        DiagnosticField.SQLSTATE: b"25006",
        DiagnosticField.MESSAGE_PRIMARY: message.encode(),
        DiagnosticField.CONTEXT: None if context is None else context.encode(),
        DiagnosticField.SEVERITY: b"ERROR",
    }
    return psycopg.errors.ReadOnlySqlTransaction(f"ERROR: {message}", info=info)  # type: ignore[arg-type]


def test_a_read_only_refusal_names_the_outermost_contract_function() -> None:
    context = (
        'SQL statement "INSERT INTO runledger.run_events (run_id) VALUES (p_run_id)"\n'
        "PL/pgSQL function runledger._event(text,text) line 5 at SQL statement\n"
        "PL/pgSQL function cancel_run(text,text,text) line 10 at PERFORM"
    )
    mapped = map_error(
        _read_only_error("cannot execute INSERT in a read-only transaction", context),
        run_id="r1",
    )
    assert isinstance(mapped, errors.ReadOnly)
    # no connection to ask: it does not claim a standby it cannot tell from a read-only session
    assert mapped.standby is None
    assert mapped.run_id == "r1"
    assert str(mapped) == (
        "runledger.cancel_run refused: cannot execute INSERT in a read-only transaction; "
        "the database only reads (a standby, or a read-only session): point writes at the "
        "primary"
    )


def test_a_read_only_refusal_outside_a_function_is_the_write() -> None:
    mapped = map_error(
        _read_only_error("cannot execute CREATE SCHEMA in a read-only transaction", None)
    )
    assert isinstance(mapped, errors.ReadOnly)
    assert mapped.message.startswith(
        "the write refused: cannot execute CREATE SCHEMA in a read-only transaction; "
    )


def test_read_only_is_not_in_the_registry_of_our_own_codes() -> None:
    assert errors.ReadOnly.sqlstate is None
    assert errors.from_sqlstate("25006", "x") is None
