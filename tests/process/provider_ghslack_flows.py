"""Flows for tests/process/test_provider_ghslack.py: the GitHub and Slack tools against
the fakes the test runs in its own process (``GHSLACK_GITHUB_URL``,
``GHSLACK_SLACK_URL``), one flow per lane (``ghslack_<i>``) so that each crashing worker
takes exactly its own run. The policy replays ``input["plan"]`` as the scripted flow does.
"""

from __future__ import annotations

import os
from typing import Any

from githubkit import GitHub
from slack_sdk import WebClient

from runledger.demo.flows import scripted_policy
from runledger.flows import Flow
from runledger.providers import github as github_tools
from runledger.providers import slack as slack_tools

LANES = 16
OWNER, REPO, CHANNEL = "acme", "support", "C0GENERAL1"
# small bounds for the fakes: the client gives up after 2 s, and the fakes act at once
REQUEST_TIMEOUT = 2.0
LANDING_BOUND = 3.0
# the test imports this module for its constants, without the fakes' URLs
UNSET = "http://127.0.0.1:9/"


def _lane(i: int) -> Flow:
    flow = Flow(f"ghslack_{i}", "1")
    gh = GitHub("ghp_test", base_url=os.environ.get("GHSLACK_GITHUB_URL", UNSET), auto_retry=False)
    kw: dict[str, Any] = {"owner": OWNER, "repo": REPO, "request_timeout": REQUEST_TIMEOUT}
    github_tools.create_issue(flow, gh, landing_bound=LANDING_BOUND, **kw)
    github_tools.add_comment(flow, gh, landing_bound=LANDING_BOUND, **kw)
    github_tools.add_labels(flow, gh, **kw)
    slack = WebClient(
        "xoxb-test",
        base_url=os.environ.get("GHSLACK_SLACK_URL", UNSET),
        timeout=int(REQUEST_TIMEOUT),
        retry_handlers=[],
    )
    slack_tools.post_message(flow, slack, channel=CHANNEL, processing_bound=1.0)

    flow.policy(scripted_policy)  # the scripted demo flow's: turn n makes plan[n]'s calls

    return flow


_lanes = {f"lane_{i}": _lane(i) for i in range(LANES)}
globals().update(_lanes)
flows = list(_lanes.values())


def spec(i: int) -> str:
    return f"tests.process.provider_ghslack_flows:lane_{i}"
