"""The crash-window table after a failover (docs/failover.md), without a database: a
planned call that may have been sent on the lost timeline is not sent as new."""

from __future__ import annotations

import pytest

from runledger.model import Outcome, Safety
from runledger.worker.recovery import (
    Complete,
    Dispatch,
    Known,
    LookedUp,
    Lookup,
    MarkUnknown,
    Probe,
    ToolMissing,
    Window,
    next_step,
)


@pytest.mark.parametrize("safety", [Safety.LOOKUP, Safety.UNSAFE])
def test_a_suspect_call_that_cannot_be_repeated_is_dispatched_without_a_send(
    safety: Safety,
) -> None:
    assert next_step(Known(window=Window.PLANNED, safety=safety, suspect=True)) == Probe()


@pytest.mark.parametrize("safety", [Safety.IDEMPOTENT, Safety.READ_ONLY])
def test_a_suspect_call_that_may_be_repeated_is_sent_with_its_key(safety: Safety) -> None:
    assert next_step(Known(window=Window.PLANNED, safety=safety, suspect=True)) == Dispatch()


def test_a_suspect_call_of_a_missing_tool_fails_the_run_unsent() -> None:
    assert next_step(Known(window=Window.PLANNED, safety=None, suspect=True)) == ToolMissing()


def test_a_call_no_failover_doubts_is_sent() -> None:
    for safety in Safety:
        assert next_step(Known(window=Window.PLANNED, safety=safety)) == Dispatch()


def test_after_the_probe_a_lookup_asks_first_and_a_found_effect_is_reused() -> None:
    probed = Known(window=Window.IN_FLIGHT, safety=Safety.LOOKUP, failover=True, attempts=1)
    assert next_step(probed) == Lookup()
    found = Known(
        window=Window.IN_FLIGHT, safety=Safety.LOOKUP, failover=True, looked_up=LookedUp.FOUND
    )
    assert next_step(found) == Complete(Outcome.SUCCEEDED)
    missing = Known(
        window=Window.IN_FLIGHT, safety=Safety.LOOKUP, failover=True, looked_up=LookedUp.NOT_FOUND
    )
    assert next_step(missing) == Dispatch()


def test_after_the_probe_an_unsafe_call_is_unknown_and_says_why() -> None:
    step = next_step(Known(window=Window.IN_FLIGHT, safety=Safety.UNSAFE, failover=True))
    assert isinstance(step, MarkUnknown)
    assert "failover" in step.error["reason"]
    plain = next_step(Known(window=Window.IN_FLIGHT, safety=Safety.UNSAFE))
    assert isinstance(plain, MarkUnknown)
    assert "failover" not in plain.error["reason"]
