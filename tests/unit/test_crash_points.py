"""Crash points kill the worker only in tests: RUNLEDGER_CRASH_AT needs RUNLEDGER_TESTING=1."""

from __future__ import annotations

import logging
import signal

import pytest

from runledger.worker import crash
from runledger.worker.crash import CrashPoints


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record the worker's SIGKILL of itself instead of dying."""
    sent: list[tuple[int, int]] = []
    monkeypatch.setattr(crash.os, "kill", lambda pid, sig: sent.append((pid, sig)))
    return sent


def test_honoured_when_tests_enable_it(
    kills: list[tuple[int, int]], caplog: pytest.LogCaptureFixture
) -> None:
    env = {"RUNLEDGER_CRASH_AT": "after_dispatch:ticket:2", "RUNLEDGER_TESTING": "1"}
    with caplog.at_level(logging.WARNING, logger="runledger.worker.crash"):
        points = CrashPoints.from_env(env)
    assert points.armed
    assert not caplog.records
    points.hit("after_dispatch", "charge")  # another tool
    points.hit("before_dispatch", "ticket")  # another point
    points.hit("after_dispatch", "ticket")  # the first occurrence, not the second
    assert kills == []
    points.hit("after_dispatch", "ticket")
    assert kills == [(crash.os.getpid(), signal.SIGKILL)]


@pytest.mark.parametrize("testing", [None, "0", "true", ""])
def test_ignored_with_one_warning_outside_tests(
    testing: str | None, kills: list[tuple[int, int]], caplog: pytest.LogCaptureFixture
) -> None:
    env = {"RUNLEDGER_CRASH_AT": "after_dispatch"}
    if testing is not None:
        env["RUNLEDGER_TESTING"] = testing
    with caplog.at_level(logging.WARNING, logger="runledger.worker.crash"):
        points = CrashPoints.from_env(env)
    assert not points.armed
    points.hit("after_dispatch", "ticket")
    assert kills == []
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "RUNLEDGER_CRASH_AT" in record.getMessage()
    assert "RUNLEDGER_TESTING=1" in record.getMessage()


def test_a_bad_spec_outside_tests_is_ignored_not_fatal(kills: list[tuple[int, int]]) -> None:
    assert not CrashPoints.from_env({"RUNLEDGER_CRASH_AT": "nowhere"}).armed
    with pytest.raises(ValueError, match="unknown crash point"):
        CrashPoints.from_env({"RUNLEDGER_CRASH_AT": "nowhere", "RUNLEDGER_TESTING": "1"})


def test_nothing_set_nothing_said(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="runledger.worker.crash"):
        assert not CrashPoints.from_env({}).armed
        assert not CrashPoints.from_env({"RUNLEDGER_TESTING": "1"}).armed
    assert not caplog.records


def test_from_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNLEDGER_CRASH_AT", "after_effect")
    monkeypatch.delenv("RUNLEDGER_TESTING", raising=False)
    assert not CrashPoints.from_env().armed
    monkeypatch.setenv("RUNLEDGER_TESTING", "1")
    assert CrashPoints.from_env().armed


def test_decision_points_are_qualified_by_the_turn(kills: list[tuple[int, int]]) -> None:
    points = CrashPoints("after_decide:1,after_record_turn:0:2")
    points.hit("after_decide", "0")  # another turn
    points.hit("after_record_turn", "0")  # the first recording of turn 0, not the second
    assert kills == []
    points.hit("after_decide", "1")
    points.hit("after_record_turn", "0")
    assert kills == [(crash.os.getpid(), signal.SIGKILL)] * 2
