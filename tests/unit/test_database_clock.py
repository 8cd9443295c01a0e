"""The database's clock as a worker estimates it (runledger.clock), and what compares
database times with it: the tool context, the landing wait, retention, evidence."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from runledger.clock import DRIFT, DatabaseClock
from runledger.flows import ToolContext
from runledger.providers.base import Retention, landing_wait
from runledger.worker.evidence import Trail

SKEW = dt.timedelta(minutes=5)


def _ctx(clock: DatabaseClock, **times: dt.datetime | None) -> ToolContext:
    return ToolContext(
        run_id="r",
        flow="f@1",
        turn=0,
        call_id="c0",
        tool="charge",
        idempotency_key="r:0:c0",
        fencing_token=1,
        attempt=1,
        lease_deadline=lambda: time.monotonic() + 30,
        clock=clock.now,
        **times,  # type: ignore[arg-type]
    )


def _measured(db_now: dt.datetime, round_trip: float = 0.002) -> DatabaseClock:
    clock = DatabaseClock()
    sent = time.monotonic()
    clock.measure(db_now, sent, sent + round_trip)
    return clock


def test_before_a_measurement_it_is_this_hosts_clock() -> None:
    clock = DatabaseClock()
    assert not clock.measured and clock.error() is None and clock.host_offset() is None
    assert abs((clock.now() - dt.datetime.now(dt.UTC)).total_seconds()) < 1


def test_a_measurement_puts_the_database_reading_at_the_middle_of_the_round_trip() -> None:
    db_now = dt.datetime.now(dt.UTC) - SKEW  # this host is five minutes fast
    clock = DatabaseClock()
    sent = time.monotonic()
    clock.measure(db_now, sent, sent + 0.2)
    # the estimate now is db_now + (now - the middle of the round trip)
    expected = db_now + dt.timedelta(seconds=time.monotonic() - (sent + 0.1))
    assert abs((clock.now() - expected).total_seconds()) < 0.01
    assert clock.error() == pytest.approx(0.1, abs=0.01)
    assert clock.host_offset() == pytest.approx(SKEW.total_seconds(), abs=0.2)


def test_the_tightest_reading_is_kept_and_a_looser_one_ignored() -> None:
    base = dt.datetime.now(dt.UTC)
    clock = DatabaseClock()
    sent = time.monotonic()
    clock.measure(base, sent, sent + 0.002)  # tight
    clock.measure(base + dt.timedelta(seconds=60), sent, sent + 2.0)  # loose and wrong
    assert abs((clock.now() - base).total_seconds()) < 1
    later = time.monotonic()
    clock.measure(base + dt.timedelta(seconds=later - sent), later, later + 0.0001)  # tighter
    assert clock.error() is not None and clock.error() < 0.001 + DRIFT


def test_an_answer_before_its_request_is_no_reading() -> None:
    clock = DatabaseClock()
    clock.measure(dt.datetime.now(dt.UTC), 10.0, 9.0)
    assert not clock.measured


@pytest.mark.parametrize("host", [SKEW, -SKEW])
def test_a_lookup_on_a_skewed_host_waits_out_the_bound_by_the_database_clock(
    host: dt.timedelta,
) -> None:
    db_now = dt.datetime.now(dt.UTC) - host  # what the database says now
    clock = _measured(db_now)
    sent = db_now - dt.timedelta(seconds=0.6)  # the database recorded the send 0.6 s ago
    ctx = _ctx(clock, sent_at=sent, first_sent_at=sent)
    assert landing_wait(ctx, 4.0) == pytest.approx(3.4, abs=0.1)
    assert ctx.since_sent() == pytest.approx(dt.timedelta(seconds=0.6), abs=dt.timedelta(0.1))
    assert not Retention(dt.timedelta(hours=24)).expired(ctx)


def test_a_context_without_sends_has_no_ages() -> None:
    ctx = _ctx(_measured(dt.datetime.now(dt.UTC)))
    assert ctx.since_sent() is None and ctx.since_first_sent() is None
    assert landing_wait(ctx, 4.0) == 0.0


def test_evidence_is_stamped_by_the_database_clock() -> None:
    db_now = dt.datetime.now(dt.UTC) - SKEW
    trail = Trail(clock=_measured(db_now))
    trail.dispatched()
    assert trail.sent is not None and abs((trail.sent - db_now).total_seconds()) < 1
    trail.add("send", time.monotonic(), ended="raised")
    at = dt.datetime.fromisoformat(trail.steps[0]["at"])
    assert abs((at - db_now).total_seconds()) < 1


def test_a_tighter_reading_never_ends_a_wait_early() -> None:
    """A reading may move the estimate by up to the error of the one it replaces: a send
    stamped with the latest bound, and waited for by the earliest (what a worker gives
    its tools), still waits the whole bound whatever reading comes between."""
    true_now = dt.datetime.now(dt.UTC)
    clock = DatabaseClock()
    sent = time.monotonic()
    # a loose first reading (100 ms round trip, so within 50 ms) that puts the database
    # 40 ms behind where it is at the middle of that round trip
    clock.measure(true_now + dt.timedelta(seconds=0.05 - 0.04), sent, sent + 0.1)
    trail = Trail(clock=clock)
    trail.dispatched()
    stamped = time.monotonic()
    # a tight reading with the truth: the estimate jumps ahead by about 40 ms
    now = time.monotonic()
    clock.measure(true_now + dt.timedelta(seconds=now - sent), now, now + 0.0002)
    ctx = ToolContext(
        run_id="r",
        flow="f@1",
        turn=0,
        call_id="c0",
        tool="charge",
        idempotency_key="r:0:c0",
        fencing_token=1,
        attempt=1,
        lease_deadline=lambda: time.monotonic() + 30,
        sent_at=trail.sent,
        clock=clock.earliest,
    )
    left = landing_wait(ctx, 1.0)
    assert left + (time.monotonic() - stamped) >= 1.0  # the whole bound is still waited
    # by the estimate alone, the jump would have cut the wait short
    assert (trail.sent + dt.timedelta(seconds=1.0) - clock.now()).total_seconds() < left
