"""The GitHub and Slack tools under real crashes: worker processes SIGKILLed at every
crash window (before_dispatch, after_dispatch, after_effect, after_complete) while
calling each tool against the fakes, which run in this test's process and survive the
kills; one more worker recovers every run.

For the three lookup tools (create an issue, comment, post a Slack message) the
expectations are the ``lookup`` rows of tests/crash_windows.py: every call in flight at
a kill settles without a person (succeeded, no pause), and each key has exactly one
effect at the provider. For the idempotent label tool: the labels are on the issue
once, whatever was sent twice.

Each crashing worker takes its own run (one flow per lane, tests/process/
provider_ghslack_flows.py); workers are forked from a server that imported runledger
and both SDKs once.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from runledger.testing import WorkerPool
from tests.crash_windows import ROWS
from tests.process import conftest as process
from tests.process.conftest import ForkedWorkerPool, call_rows, forked_like, run_row, wait_status
from tests.process.provider_ghslack_flows import CHANNEL, LANES, OWNER, REPO, spec
from tests.providers.fake_github import FakeGitHub
from tests.providers.fake_slack import FakeSlack

pytestmark = pytest.mark.process

LOOKUP_TOOLS = ("create_github_issue", "comment_on_github_issue", "post_slack_message")
TOOLS = (*LOOKUP_TOOLS, "label_github_issue")
POINTS = ("before_dispatch", "after_dispatch", "after_effect", "after_complete")
# the recovery's lease (the lookups' landing waits are 5 s at most here)
RECOVERY_LEASE = ["--lease-seconds", "20"]
CRASH_LEASE = 60.0  # long: a starved lane worker still holds its run when it dies
# the lookup rows of the seed's crash-window table (tool "charge"), by crash point
LOOKUP_ROWS = {r.point: r for r in ROWS if r.tool == "charge"}
IDEMPOTENT_ROWS = {r.point: r for r in ROWS if r.tool == "ticket"}


@pytest.fixture
def fakes() -> Iterator[tuple[FakeGitHub, FakeSlack]]:
    gh, sl = FakeGitHub(OWNER, REPO), FakeSlack((CHANNEL,))
    try:
        yield gh, sl
    finally:
        gh.close()
        sl.close()


PRELOAD = [
    "runledger.cli",
    "runledger.worker.process",
    "runledger.providers.github",
    "runledger.providers.slack",
    "githubkit_schemas.v2026_03_10.rest.issues",
]


@pytest.fixture
def pool(
    runledger_workers: WorkerPool, fakes: tuple[FakeGitHub, FakeSlack]
) -> Iterator[ForkedWorkerPool]:
    gh, sl = fakes
    p = forked_like(
        runledger_workers, {"GHSLACK_GITHUB_URL": gh.url, "GHSLACK_SLACK_URL": sl.api_url}, PRELOAD
    )
    try:
        yield p
    finally:
        p.close()


def test_every_crash_window_of_every_tool_settles_with_one_effect(
    pool: ForkedWorkerPool,
    fakes: tuple[FakeGitHub, FakeSlack],
    admin_conn: Any,
    db_clock: Any,
) -> None:
    gh, sl = fakes
    lanes = [(point, tool) for tool in TOOLS for point in POINTS]
    assert len(lanes) == LANES
    issue = gh.seed_issue("the issue the comments and labels go to")
    args = {
        "create_github_issue": {"title": "Printer on fire", "body": "Room 4"},
        "comment_on_github_issue": {"issue_number": issue, "body": "On it."},
        "label_github_issue": {"issue_number": issue, "labels": ["bug"]},
        "post_slack_message": {"text": "Deploy finished"},
    }
    runs = []
    for i, (point, tool) in enumerate(lanes):
        run_id = f"ghslack-{point}-{tool}"
        process.submit(
            admin_conn, run_id, [[{"tool": tool, "args": args[tool]}]], flow=f"ghslack_{i}"
        )
        runs.append(run_id)

    # every lane's worker at once, each dying at its crash point
    started = []
    for i, (point, tool) in enumerate(lanes):
        pool.flows = [spec(i)]
        started += pool.start(
            1,
            env={"RUNLEDGER_CRASH_AT": f"{point}:{tool}"},
            args=["--lease-seconds", str(CRASH_LEASE)],
        )
    for i in started:
        assert pool.wait(i, timeout=60) == -9, pool.log(i)
    for run_id in runs:
        crashed = run_row(admin_conn, run_id)
        assert crashed["status"] == "running" and crashed["fencing_token"] == 1, crashed

    db_clock.advance(CRASH_LEASE + 1)  # the dead workers' leases are over by the db clock
    pool.flows = [spec(i) for i in range(LANES)]
    (recovery,) = pool.start(1, args=RECOVERY_LEASE)

    for (point, tool), run_id in zip(lanes, runs, strict=True):
        key = f"{run_id}:0:c0"
        final = wait_status(admin_conn, run_id, ("succeeded", "paused", "failed"), timeout=60)
        [call] = call_rows(admin_conn, run_id)
        # settled without a person: no pause, no unknown
        assert final["status"] == "succeeded", (point, tool, final, call, pool.log(recovery))
        assert call["status"] == "succeeded", (point, tool, call)
        if tool in LOOKUP_TOOLS:
            row = LOOKUP_ROWS[point]
            effects = (gh if "github" in tool else sl).effects(key)
            assert len(effects) == 1, (point, tool, effects)  # 0 effects twice
            assert call["attempts"] == row.attempts, (point, tool, call)
            found_by = (call["receipt"] or {}).get("found_by")
            assert (found_by == "lookup") == row.found_by_lookup, (point, tool, call)
        else:
            row = IDEMPOTENT_ROWS[point]
            assert call["attempts"] == row.attempts, (point, tool, call)
    # labels: sent once per lane, twice where the crash came after the effect (the
    # provider applied it, the journal did not know): on the issue once all the same
    assert len(gh.label_adds) == 5
    assert [x["name"] for x in gh.issues[issue]["labels"]] == ["bug"]
