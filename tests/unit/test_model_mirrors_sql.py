"""runledger.model refuses and accepts exactly what the SQL contract does (no database).

The regexes and word lists are read from the living SQL (service/runledger/db/sql), so a
change on one side without the other fails here.
"""

from __future__ import annotations

import re
from enum import StrEnum

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from runledger import model
from runledger.db import tables
from tests.unit.sql_source import as_python, check_words, sql_pattern, word_arrays

RUN_ID_SQL = sql_pattern("run_id")
RUN_ID_SQL_RE = as_python(RUN_ID_SQL)
FLOW_NAME_SQL_RE = as_python(sql_pattern("p_flow"))
FLOW_VERSION_SQL_RE = as_python(sql_pattern("p_flow_version"))
FLOW_REF_SQL_RE = as_python(sql_pattern("f"))  # claim_runs_v4/register_worker_v2, via _parse_flows
CALL_ID_SQL_RE = as_python(sql_pattern("(e.c ->> 'call_id')"))  # record_turn_v4

# Characters the ids allow, and a selection of look-alikes they must not.
ALLOWED = "abcxyzABCXYZ0189._:@-"
TRICKY = " \t\n\r/\\'\"%*+,;=?[]{}()~`!#$&|<>^\x00\x7fé\u00df\u212a\u0661\uff10\u200b😀_"
id_chars = st.sampled_from(ALLOWED + TRICKY)
id_strings = st.one_of(
    st.text(alphabet=id_chars, min_size=0, max_size=140),
    st.text(alphabet=st.sampled_from(ALLOWED), min_size=120, max_size=135),
    st.text(max_size=20),
)


def _accepted(pattern: re.Pattern[str], value: str) -> bool:
    return pattern.fullmatch(value) is not None


# -- run ids ------------------------------------------------------------------------------------


def test_run_id_check_and_function_use_one_regex() -> None:
    """The table CHECK, the function check and tables.py agree on the run id pattern."""
    assert sql_pattern("p_run_id") == RUN_ID_SQL
    assert tables.RUN_ID_PATTERN == RUN_ID_SQL


@pytest.mark.parametrize(
    "run_id",
    ["a", "0", "Z", "run-1", "a_b", "a.b:c@d-e", "2026-11-30T10:00:00", "x" * 128],
)
def test_run_ids_accepted(run_id: str) -> None:
    assert _accepted(model.RUN_ID_RE, run_id)
    assert _accepted(RUN_ID_SQL_RE, run_id)


@pytest.mark.parametrize(
    "run_id",
    [
        "",
        "-a",
        ".a",
        ":a",
        "@a",
        "_a",
        "x" * 129,
        "a b",
        "a/b",
        "é",
        "run\n",  # Python's $ would match before this newline; PostgreSQL's does not
        "\nrun",
        "a\x00",
        "\u0661",  # an Arabic-Indic digit: \d would take it, [0-9] does not
        "\u212a",  # the Kelvin sign, which case-folds to K
    ],
)
def test_run_ids_refused(run_id: str) -> None:
    assert not _accepted(model.RUN_ID_RE, run_id)
    assert not _accepted(RUN_ID_SQL_RE, run_id)


@given(id_strings)
@example("a" * 128)
@example("a" * 129)
@example("ok\n")
def test_run_id_regex_agrees_with_sql(value: str) -> None:
    assert _accepted(model.RUN_ID_RE, value) == _accepted(RUN_ID_SQL_RE, value)


# -- flow names, versions, references, call ids ---------------------------------------------


@given(id_strings)
def test_flow_name_and_version_regexes_agree_with_sql(value: str) -> None:
    assert _accepted(model.FLOW_NAME_RE, value) == _accepted(FLOW_NAME_SQL_RE, value)
    assert _accepted(model.FLOW_VERSION_RE, value) == _accepted(FLOW_VERSION_SQL_RE, value)


@given(id_strings)
def test_call_id_regex_agrees_with_sql(value: str) -> None:
    assert _accepted(model.CALL_ID_RE, value) == _accepted(CALL_ID_SQL_RE, value)


@pytest.mark.parametrize(
    ("ref", "parsed"),
    [
        ("demo@1", ("demo", "1")),
        ("ticket-triage@2.0.1+build.7", ("ticket-triage", "2.0.1+build.7")),
        ("a_b.c@v1", ("a_b.c", "v1")),
    ],
)
def test_parse_flow_ref_accepts(ref: str, parsed: tuple[str, str]) -> None:
    assert model.parse_flow_ref(ref) == parsed
    assert model.flow_ref(*parsed) == ref


@pytest.mark.parametrize(
    "ref", ["demo", "demo@", "@1", "demo@1@2", "de mo@1", "demo@ 1", "-demo@1", "demo@+1", ""]
)
def test_parse_flow_ref_refuses(ref: str) -> None:
    with pytest.raises(ValueError, match="name@version"):
        model.parse_flow_ref(ref)


@given(
    st.one_of(
        id_strings,
        st.builds(lambda a, b: f"{a}@{b}", id_strings, id_strings),
    )
)
@example("demo@1@2")
def test_parse_flow_ref_agrees_with_claim_runs(value: str) -> None:
    """parse_flow_ref accepts exactly the strings claim_runs/register_worker accept."""
    try:
        name, version = model.parse_flow_ref(value)
    except ValueError:
        assert not _accepted(FLOW_REF_SQL_RE, value)
    else:
        assert _accepted(FLOW_REF_SQL_RE, value)
        assert model.flow_ref(name, version) == value


def test_idempotency_key_matches_the_sql_formula() -> None:
    # CHECK (idempotency_key = run_id || ':' || turn || ':' || call_id)
    assert model.idempotency_key("r1", 0, "c1") == "r1:0:c1"
    assert model.idempotency_key("a:b", 12, "x") == "a:b:12:x"


# -- state lists ------------------------------------------------------------------------------


def test_run_status_mirrors_check() -> None:
    words = check_words("ck_runs_status")
    assert [s.value for s in model.RunStatus] == words
    assert list(tables.RUN_STATUSES) == words
    assert {s for s in model.RunStatus if s.finished} == {"succeeded", "failed", "cancelled"}


def test_call_status_mirrors_check() -> None:
    words = check_words("ck_run_calls_status")
    assert [s.value for s in model.CallStatus] == words
    assert list(tables.CALL_STATUSES) == words
    assert {s for s in model.CallStatus if s.terminal} == {"succeeded", "failed"}


@pytest.mark.parametrize(
    ("enum", "what"),
    [
        (model.Outcome, "outcome"),
        (model.FinishStatus, "status"),
        (model.Resolution, "resolution"),
    ],
)
def test_function_word_lists_mirror_sql(enum: type[StrEnum], what: str) -> None:
    assert [e.value for e in enum] == word_arrays(what)
