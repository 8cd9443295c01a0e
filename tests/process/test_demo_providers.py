"""The demo's three-tool scenario (open a ticket, charge the card, email the customer)
with SIGKILLs, its tools on provider adapters: how many of the calls in flight at a kill
settle without a person, against the same scenario with the demo's own tools.

The demo's own tools (the ``scripted`` flow, ``tests/crash_windows.py``): ``create_ticket``
is ``idempotent``, ``charge`` a ``lookup`` tool, ``send_email`` ``unsafe``; a kill while
an email is in flight pauses the run for a person. Here the three are a GitHub issue, a
Stripe PaymentIntent and an SMTP email (tests/process/demo_provider_flows.py), each a
``lookup`` tool with its provider's lookup, against the fakes this test runs (they
outlive the kills). Every tool is killed at every crash window, one run and one worker
per lane, all at once; one more worker recovers every run.

A call is *in flight* at a kill when it was dispatched and its outcome not journaled
(``after_dispatch``, ``after_effect``). The demo's own tools settle 4 of those 6 without a
person; the adapters settle all 6, with one effect per key at every provider.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runledger.testing import WorkerPool
from runledger.worker.recovery import MarkUnknown
from tests.crash_windows import ROWS
from tests.process import conftest as process
from tests.process.conftest import (
    ForkedWorkerPool,
    call_rows,
    events,
    forked_like,
    run_row,
    wait_status,
)
from tests.process.demo_provider_flows import LANES, OWNER, REPO, spec
from tests.providers.fake_email import FakeImap, FakeSmtp
from tests.providers.fake_github import FakeGitHub
from tests.providers.fake_stripe import FakeStripe

pytestmark = pytest.mark.process

TOOLS = ("create_ticket", "charge", "send_email")
POINTS = ("before_dispatch", "after_dispatch", "after_effect", "after_complete")
IN_FLIGHT = ("after_dispatch", "after_effect")
# the demo's own tools, as the scripted flow names them in tests/crash_windows.py
DEMO_TOOLS = {"create_ticket": "ticket", "charge": "charge", "send_email": "email"}
CRASH_LEASE = 60.0  # long: a starved lane worker still holds its run when it dies
RECOVERY_LEASE = ["--lease-seconds", "20"]
PLAN = [
    {"tool": "create_ticket", "args": {"title": "Expedite order 42", "body": "For ana"}},
    {"tool": "charge", "args": {"amount": 4000, "currency": "eur"}},
    {"tool": "send_email", "args": {"to": "ana@example.org", "subject": "Order 42", "text": "."}},
]


class Fakes:
    def __init__(self, gh: FakeGitHub, stripe: FakeStripe, smtp: FakeSmtp) -> None:
        self.gh, self.stripe, self.smtp = gh, stripe, smtp

    def effects(self, tool: str, key: str) -> int:
        if tool == "create_ticket":
            return len(self.gh.effects(key))
        if tool == "charge":
            return len(self.stripe.effects(key))
        return len(self.smtp.effects(key))


@pytest.fixture
def fakes() -> Iterator[tuple[Fakes, dict[str, str]]]:
    gh, stripe = FakeGitHub(OWNER, REPO), FakeStripe()
    try:
        with FakeImap() as imap, FakeSmtp() as smtp:
            env = {
                "DEMO_GITHUB_URL": gh.url,
                "DEMO_STRIPE_URL": stripe.url,
                "DEMO_SMTP_PORT": str(smtp.port),
                "DEMO_IMAP_PORT": str(imap.port),
            }
            yield Fakes(gh, stripe, smtp), env
    finally:
        gh.close()
        stripe.close()


PRELOAD = [
    "runledger.cli",
    "runledger.worker.process",
    "runledger.providers.github",
    "runledger.providers.stripe",
    "runledger.providers.email",
    "githubkit_schemas.v2026_03_10.rest.issues",
]


@pytest.fixture
def pool(
    runledger_workers: WorkerPool, fakes: tuple[Fakes, dict[str, str]]
) -> Iterator[ForkedWorkerPool]:
    p = forked_like(runledger_workers, fakes[1], PRELOAD)
    try:
        yield p
    finally:
        p.close()


def test_the_demo_tools_settle_every_call_in_flight_without_a_person(
    pool: ForkedWorkerPool,
    fakes: tuple[Fakes, dict[str, str]],
    admin_conn: Any,
    db_clock: Any,
) -> None:
    got = fakes[0]
    lanes = [(point, tool) for tool in TOOLS for point in POINTS]
    assert len(lanes) == LANES
    runs = []
    for i, (point, tool) in enumerate(lanes):
        run_id = f"demo-{point}-{tool}"
        plan = [[call] for call in PLAN]
        process.submit(admin_conn, run_id, plan, flow=f"demo_providers_{i}")
        runs.append(run_id)

    started = []  # every lane's worker at once, each dying at its crash point
    for i, (point, tool) in enumerate(lanes):
        pool.flows = [spec(i)]
        crash = {"RUNLEDGER_CRASH_AT": f"{point}:{tool}"}
        started += pool.start(1, env=crash, args=["--lease-seconds", str(CRASH_LEASE)])
    for i in started:
        try:
            code = pool.wait(i, timeout=90)
        except Exception:
            raise AssertionError(pool.log(i)) from None
        assert code == -9, pool.log(i)
    for run_id in runs:
        crashed = run_row(admin_conn, run_id)
        assert crashed["status"] == "running" and crashed["fencing_token"] == 1, crashed

    db_clock.advance(CRASH_LEASE + 1)  # the dead workers' leases are over by the db clock
    pool.flows = [spec(i) for i in range(LANES)]
    (recovery,) = pool.start(1, args=RECOVERY_LEASE)

    in_flight = settled = 0
    for (point, tool), run_id in zip(lanes, runs, strict=True):
        final = wait_status(admin_conn, run_id, ("succeeded", "paused", "failed"), timeout=90)
        calls = call_rows(admin_conn, run_id)
        assert [c["tool"] for c in calls] == list(TOOLS)
        for c in calls:  # every call of every run: one effect at its provider, never two
            assert got.effects(c["tool"], c["idempotency_key"]) == 1, (point, tool, c)
        if point in IN_FLIGHT:
            in_flight += 1
            killed = next(c for c in calls if c["tool"] == tool)
            settled += killed["status"] == "succeeded" and final["status"] == "succeeded"
        assert final["status"] == "succeeded", (point, tool, final, calls, pool.log(recovery))
        assert [c["status"] for c in calls] == ["succeeded"] * 3, (point, tool, calls)
        assert not events(admin_conn, run_id, "run_paused"), (point, tool)

    # the same scenario with the demo's own tools (tests/crash_windows.py, which
    # tests/process/test_crash_windows.py runs with real SIGKILLs): the unsafe email pauses
    demo_rows = [r for r in ROWS if r.tool in DEMO_TOOLS.values() and r.point in IN_FLIGHT]
    demo_settled = sum(not any(isinstance(s, MarkUnknown) for s in r.steps) for r in demo_rows)
    assert (len(demo_rows), demo_settled) == (6, 4)
    assert (in_flight, settled) == (6, 6)
    print(
        f"calls in flight at a kill settled without a person: demo tools {demo_settled} of "
        f"{len(demo_rows)}, provider adapters {settled} of {in_flight}"
    )
