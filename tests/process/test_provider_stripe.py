"""The Stripe tools under real crashes: a worker process SIGKILLs itself at each crash
window of a ``create_payment_intent`` call against the local Stripe, which runs in this
test's process and so survives the kill; a second worker recovers every run.

- every window: the call in flight settles without a person (the run succeeds, never
  pauses), Stripe holds exactly one PaymentIntent for the key and one Customer for the
  next turn's key (no effect twice), and how it settled is the window's: sent once
  (before the dispatch), looked up and sent again with the key (after the dispatch,
  nothing sent), found by the lookup (after the effect), reused (after the complete);
- past Stripe's 24-hour window (the database clock set 25 hours back, so the dead
  worker's dispatch is that old): the lookup finds nothing and the call waits for a
  person, unknown, with what was asked; never sent again.

The crashing workers start at once, one run each, steered by flow name
(``stripe_flows.lane_<i>``); their leases are expired with the fake database clock.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runledger.testing import WorkerPool
from tests.process.conftest import call_rows, events, run_row, submit, wait_status
from tests.process.stripe_flows import URL_ENV, spec
from tests.providers.fake_stripe import FakeStripe

pytestmark = pytest.mark.process

CRASH_LEASE = 60.0  # long: a starved lane worker still holds its run when it dies
LEASE_ARGS = ["--lease-seconds", str(CRASH_LEASE)]
FINAL = ("succeeded", "paused", "failed")
TOOL = "create_payment_intent"
PLAN = [
    [{"tool": TOOL, "args": {"amount": 2500, "currency": "eur"}}],
    [{"tool": "create_customer", "args": {"email": "after@example.com"}}],
]

# window -> (dispatches of the call in the journal, how its receipt was found, completed by
# the recovering worker's token)
WINDOWS = {
    "before_dispatch": (1, None, 2),
    "after_dispatch": (2, None, 2),  # looked up (nothing), sent again with the key
    "after_effect": (1, "search", 2),  # the lookup found it: not sent again
    "after_complete": (1, None, 1),  # the receipt is journaled: reused
}


@pytest.fixture
def fake() -> Iterator[FakeStripe]:
    f = FakeStripe()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def pool(runledger_workers: WorkerPool, fake: FakeStripe) -> WorkerPool:
    runledger_workers.env[URL_ENV] = fake.url
    return runledger_workers


def crash(pool: WorkerPool, lanes: dict[int, str]) -> None:
    """One worker per lane, with that lane's flow only, dying at its crash point."""
    started = []
    for i, point in lanes.items():
        pool.flows = [spec(i)]
        started += pool.start(1, env={"RUNLEDGER_CRASH_AT": f"{point}:{TOOL}"}, args=LEASE_ARGS)
    for w in started:
        assert pool.wait(w, timeout=90) == -9, pool.log(w)


def test_every_crash_window_settles_without_a_person(
    pool: WorkerPool, fake: FakeStripe, admin_conn: Any, db_clock: Any
) -> None:
    runs = {point: f"stripe-{point}" for point in WINDOWS}
    for i, point in enumerate(WINDOWS):
        submit(admin_conn, runs[point], PLAN, flow=f"stripe-lane-{i}")
    crash(pool, dict(enumerate(WINDOWS)))
    for run_id in runs.values():
        crashed = run_row(admin_conn, run_id)
        assert crashed["status"] == "running" and crashed["fencing_token"] == 1, crashed

    db_clock.advance(CRASH_LEASE + 1)  # the dead workers' leases are over
    pool.flows = [spec(i) for i in range(len(WINDOWS))]
    (recovery,) = pool.start(1, args=LEASE_ARGS)

    for point, (attempts, found_by, token) in WINDOWS.items():
        run_id = runs[point]
        key = f"{run_id}:0:c0"
        final = wait_status(admin_conn, run_id, FINAL, timeout=90)
        calls = call_rows(admin_conn, run_id)
        assert final["status"] == "succeeded", (point, final, calls, pool.log(recovery))
        assert final["pause_reason"] is None and not events(admin_conn, run_id, "paused")
        first = calls[0]
        assert (first["status"], first["attempts"]) == ("succeeded", attempts), (point, first)
        assert first["receipt"].get("found_by") == found_by, (point, first["receipt"])
        assert first["completed_token"] == token, point
        # exactly one PaymentIntent for the key, the one journaled; one Customer after it
        [pi] = fake.effects(key)
        assert first["receipt"]["id"] == pi["id"] and pi["metadata"]["runledger_key"] == key
        assert [c["status"] for c in calls] == ["succeeded", "succeeded"], point
        assert len(fake.effects(f"{run_id}:1:c0")) == 1, point
        resent = [
            e
            for e in events(admin_conn, run_id, "call_dispatched")
            if e["detail"]["idempotency_key"] == key and e["fencing_token"] == 2
        ]
        assert len(resent) == (1 if point in ("before_dispatch", "after_dispatch") else 0)
    # no key of any run made two objects
    effects = fake.all_effects()
    assert len(effects) == 2 * len(WINDOWS) and all(len(v) == 1 for v in effects.values()), effects


def test_past_the_window_the_call_waits_for_a_person_with_the_evidence(
    pool: WorkerPool, fake: FakeStripe, admin_conn: Any, db_clock: Any
) -> None:
    # the dead worker journals its dispatch on a database clock 25 hours back; then the
    # database's clock comes back to now, by which the recovery judges the key 25 hours old
    db_clock.advance(-25 * 3600)
    submit(admin_conn, "stripe-old", PLAN, flow="stripe-lane-0")
    crash(pool, {0: "after_dispatch"})
    db_clock.advance(25 * 3600 + CRASH_LEASE + 1)
    pool.flows = [spec(0)]
    (recovery,) = pool.start(1, args=LEASE_ARGS)

    key = "stripe-old:0:c0"
    final = wait_status(admin_conn, "stripe-old", FINAL, timeout=90)
    [call] = call_rows(admin_conn, "stripe-old")
    assert final["status"] == "paused", (final, call, pool.log(recovery))
    assert key in final["pause_reason"]
    assert (call["status"], call["attempts"]) == ("unknown", 1)
    assert call["error"]["reason"].startswith("the provider cannot tell: nothing found")
    earlier, lookup = call["error"]["evidence"]
    assert (earlier["step"], earlier["ended"]) == ("earlier sender", "process_gone")
    assert lookup["step"] == "lookup" and lookup["saw"] == "unknowable"
    asked = [o["asked"] for o in lookup["observed"] if "request_id" in o]
    assert asked[0].startswith("GET /v1/payment_intents/search")
    assert asked[1].startswith("GET /v1/payment_intents?created[gte]=")
    assert lookup["observed"][-1]["window_hours"] == 24
    assert lookup["observed"][-1]["key_age_hours"] >= 25
    # asked, never sent: Stripe has no request with the key at all
    assert fake.requests(key) == [] and fake.effects(key) == []
    assert [r["path"] for r in fake.log] == ["/v1/payment_intents/search", "/v1/payment_intents"]
