"""The e-mail tools under SIGKILL: a worker process kills itself at each crash window
(``before_dispatch``, ``after_dispatch``, ``after_effect``, ``after_complete``) inside a
call of ``smtp_email`` or ``resend_email`` (tests/process/email_flows.py); a second
worker recovers. The fake servers run in this process, so they outlive the kill.

Every window settles without a person: the run succeeds, the call is ``succeeded``,
and the provider holds exactly one e-mail for its key (SMTP: through the sent-folder
lookup; Resend: sent again with the same key, answered from its idempotency record).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runledger.testing import WorkerPool
from tests.process.conftest import LEASE, call_rows, events, run_row, submit, wait_status
from tests.providers.fake_email import FakeImap, FakeResend, FakeSmtp

pytestmark = pytest.mark.process

POINTS = ("before_dispatch", "after_dispatch", "after_effect", "after_complete")
TOOLS = ("smtp_email", "resend_email")
ARGS = {"to": "bob@example.org", "subject": "Your ticket", "text": "It is fixed."}


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[FakeSmtp, FakeImap, FakeResend]]:
    with FakeImap() as imap, FakeSmtp() as smtp, FakeResend() as api:
        yield smtp, imap, api


def effects(servers: tuple[FakeSmtp, FakeImap, FakeResend], tool: str, key: str) -> int:
    smtp, _, api = servers
    return len(smtp.effects(key) if tool == "smtp_email" else api.effects(key))


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("point", POINTS)
def test_a_kill_in_every_window_settles_with_one_email(
    point: str,
    tool: str,
    servers: tuple[FakeSmtp, FakeImap, FakeResend],
    runledger_workers: WorkerPool,
    admin_conn: Any,
    db_clock: Any,
    lease_args: list[str],
) -> None:
    smtp, imap, api = servers
    workers = runledger_workers
    workers.flows = ["tests.process.email_flows:flow"]
    env = {
        "EMAIL_SMTP_PORT": str(smtp.port),
        "EMAIL_IMAP_PORT": str(imap.port),
        "EMAIL_RESEND_URL": api.url,
    }
    run_id = f"mail-{point}-{tool}"
    key = f"{run_id}:0:c0"
    plan = [[{"tool": tool, "args": ARGS}], [{"tool": tool, "args": {**ARGS, "subject": "2"}}]]
    submit(admin_conn, run_id, plan, flow="email-providers")

    crash = {**env, "RUNLEDGER_CRASH_AT": f"{point}:{tool}"}
    (first,) = workers.start(1, env=crash, args=lease_args)
    assert workers.wait(first, timeout=30) == -9, workers.log(first)
    assert run_row(admin_conn, run_id)["status"] == "running"
    sent_before = effects(servers, tool, key)
    assert sent_before == (1 if point in ("after_effect", "after_complete") else 0)

    db_clock.advance(LEASE + 1)  # the dead worker's lease is over by the database clock
    (second,) = workers.start(1, env=env, args=lease_args)
    final = wait_status(admin_conn, run_id, ("succeeded", "paused", "failed"), timeout=40)

    calls = call_rows(admin_conn, run_id)
    assert final["status"] == "succeeded", (final, calls, workers.log(second))
    assert [c["status"] for c in calls] == ["succeeded", "succeeded"]
    assert effects(servers, tool, key) == 1  # never twice, never lost
    assert effects(servers, tool, f"{run_id}:1:c0") == 1
    assert not events(admin_conn, run_id, "run_paused")
    if tool == "smtp_email" and point == "after_effect":
        # sent, its result never journaled: the sent-folder lookup found it
        assert calls[0]["receipt"]["found_by"] == "lookup"
