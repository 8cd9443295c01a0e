"""Each read-back answers from what its write leaves in the tables: ``None`` before the
write (send it), the write's typed result after it (do not send it again).

Asked directly, on a real database, before and after the real write; the
ambiguous-commit test drives the same read-backs through a lost acknowledgement.
"""

from __future__ import annotations

import datetime as dt

import pytest

from runledger.db.results import (
    Checkpointed,
    Completed,
    Dispatched,
    Finished,
    Pruned,
    Released,
    Requeued,
    Resolved,
)
from runledger.db.store import Store
from runledger.model import CallStatus, FinishStatus, Outcome, Resolution, RunStatus
from tests.integration.test_store_ambiguous_commit import (
    KEY,
    RUN,
    dispatched,
    lease_of,
    leased,
    paused,
    paused_unknown,
    planned,
    succeeded,
)


async def test_checkpointed(store: Store) -> None:
    c = await leased(store)
    assert await store.landed.checkpointed(RUN, c.fencing_token, 0) is None
    await store.worker.checkpoint(*lease_of(c), 0, {"a": 1})
    assert await store.landed.checkpointed(RUN, c.fencing_token, 0) == Checkpointed(
        run_id=RUN, state_version=1
    )
    assert await store.landed.checkpointed(RUN, c.fencing_token, 1) is None  # the next one
    assert await store.landed.checkpointed(RUN, c.fencing_token + 1, 0) is None  # another lease


async def test_dispatched(store: Store) -> None:
    c = await planned(store)
    assert await store.landed.dispatched(RUN, KEY, c.fencing_token) is None
    await store.worker.dispatch_call(*lease_of(c), KEY)
    first = Dispatched(idempotency_key=KEY, attempt=1)
    assert await store.landed.dispatched(RUN, KEY, c.fencing_token) == first
    assert await store.landed.dispatched(RUN, KEY, c.fencing_token, attempts_seen=0) == first
    # sent again under the same lease: only the attempts seen before tell it landed
    assert await store.landed.dispatched(RUN, KEY, c.fencing_token, attempts_seen=1) is None
    await store.worker.dispatch_call(*lease_of(c), KEY)
    assert await store.landed.dispatched(RUN, KEY, c.fencing_token, attempts_seen=1) == Dispatched(
        idempotency_key=KEY, attempt=2
    )


@pytest.mark.parametrize("outcome", list(Outcome))
async def test_completed(store: Store, outcome: Outcome) -> None:
    c = await dispatched(store)
    assert await store.landed.completed(RUN, KEY, c.fencing_token, outcome) is None
    await store.worker.complete_call(*lease_of(c), KEY, outcome, {"r": 1}, None)
    status = CallStatus.PLANNED if outcome is Outcome.NOT_APPLIED else CallStatus(outcome.value)
    assert await store.landed.completed(RUN, KEY, c.fencing_token, outcome) == Completed(
        idempotency_key=KEY, outcome=outcome, status=status
    )
    for other in Outcome:
        if other is not outcome:
            assert await store.landed.completed(RUN, KEY, c.fencing_token, other) is None


async def test_a_planned_call_never_completed_is_not_a_landed_not_applied(store: Store) -> None:
    c = await planned(store)  # planned, no completion fields: but no call_not_applied event
    assert await store.landed.completed(RUN, KEY, c.fencing_token, Outcome.NOT_APPLIED) is None
    await store.worker.dispatch_call(*lease_of(c), KEY)
    await store.worker.complete_call(*lease_of(c), KEY, "not_applied", None, None)
    await store.worker.dispatch_call(*lease_of(c), KEY)
    # attempt 2 is in flight: the not_applied of attempt 1 does not answer for it
    assert await store.landed.completed(RUN, KEY, c.fencing_token, Outcome.NOT_APPLIED) is None


@pytest.mark.parametrize("status", list(FinishStatus))
async def test_finished(store: Store, status: FinishStatus) -> None:
    c = await leased(store)
    assert await store.landed.finished(RUN, c.fencing_token, status) is None
    await store.worker.finish_run(*lease_of(c), status, None, "r")
    assert await store.landed.finished(RUN, c.fencing_token, status) == Finished(
        run_id=RUN, status=RunStatus(status.value)
    )


async def test_released(store: Store) -> None:
    c = await leased(store)
    assert await store.landed.released(RUN, c.fencing_token) is None
    await store.worker.release_lease(*lease_of(c))
    assert await store.landed.released(RUN, c.fencing_token) == Released(run_id=RUN, reason=None)
    ((again, _),) = await store.worker.claim_runs("w1", ["demo@1"], dt.timedelta(seconds=60), 1)
    assert await store.landed.released(RUN, again.fencing_token) is None


@pytest.mark.parametrize("resolution", list(Resolution))
async def test_resolved(store: Store, resolution: Resolution) -> None:
    await paused_unknown(store)
    mark = await store.landed.event_mark(RUN)
    assert await store.landed.resolved(KEY, resolution, "alice", mark) is None
    await store.operator.resolve_call(KEY, resolution, None, "alice", None)
    status = {"applied": "succeeded", "not_applied": "planned", "abandoned": "failed"}
    assert await store.landed.resolved(KEY, resolution, "alice", mark) == Resolved(
        idempotency_key=KEY, resolution=resolution, status=CallStatus(status[resolution])
    )
    assert await store.landed.resolved(KEY, resolution, "bob", mark) is None
    assert (
        await store.landed.resolved(KEY, resolution, "alice", await store.landed.event_mark(RUN))
        is None
    )


async def test_requeued(store: Store) -> None:
    await paused(store)
    mark = await store.landed.event_mark(RUN)
    assert await store.landed.requeued(RUN, "alice", mark) is None
    await store.operator.retry_run(RUN, "alice")
    assert await store.landed.requeued(RUN, "alice", mark) == Requeued(run_id=RUN)
    assert await store.landed.requeued(RUN, "alice", await store.landed.event_mark(RUN)) is None


async def test_pruned(store: Store) -> None:
    await succeeded(store)
    before = dt.datetime.now(dt.UTC) + dt.timedelta(days=1)
    counted = await store.operator.prunable(before)
    assert counted == 1
    assert await store.landed.pruned(before, counted) is None
    assert await store.operator.prune_runs(before, False) == 1
    assert await store.landed.pruned(before, counted) == Pruned(runs=1)
    assert await store.landed.pruned(before, 0) is None  # nothing was there: sending is harmless
