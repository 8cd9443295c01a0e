"""Calls that run at the same time: a turn's groups, and how one group settles."""

from __future__ import annotations

import asyncio

from runledger import errors
from runledger.flows import Flow
from runledger.model import Call
from runledger.worker.calls import Calls, Settled
from runledger.worker.runs import ActiveRun, Draining, LocalLeaseExpired


def call_groups(flow: Flow, calls: list[Call]) -> list[list[Call]]:
    """The calls of a turn, in order, as groups that run one after another: consecutive
    calls whose tools may run in parallel (:meth:`Flow.runs_in_parallel`) form one
    group; every other call is a group of its own."""
    groups: list[list[Call]] = []
    for x in calls:
        together = flow.runs_in_parallel(x.tool)
        if together and groups and flow.runs_in_parallel(groups[-1][-1].tool):
            groups[-1].append(x)
        else:
            groups.append([x])
    return groups


async def settle_group(
    calls: Calls,
    active: ActiveRun,
    flow: Flow,
    group: list[Call],
    *,
    dispatched: dict[str, int] | None = None,
) -> list[tuple[Call, Settled]]:
    """Settle the calls of ``group`` at the same time (one call: just that one).
    ``dispatched``: attempt numbers of calls of the group whose dispatch committed
    already (with their decision); those are sent at once.

    Every call runs to its own end -- a sibling that hits the lease's boundary or a
    refusal does not cut the others off midway: each checks the lease itself before
    it sends and on every write. If the run is fenced (its task cancelled) the calls
    are abandoned as a single call is. Then the first failure, if any, is raised
    (a lost lease before a local deadline before a drain)."""
    sent = dispatched or {}
    if len(group) == 1:
        x = group[0]
        return [
            (x, (await calls.settle(active, flow, x, dispatched=sent.get(x.idempotency_key)))[0])
        ]
    tasks = [
        asyncio.ensure_future(calls.settle(active, flow, x, dispatched=sent.get(x.idempotency_key)))
        for x in group
    ]
    try:
        await asyncio.wait(tasks)
    except asyncio.CancelledError:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    failures = [exc for t in tasks if (exc := t.exception()) is not None]
    if failures:
        for kind in (errors.LeaseLost, LocalLeaseExpired, Draining):
            for exc in failures:
                if isinstance(exc, kind):
                    raise exc
        raise failures[0]
    return [(x, t.result()[0]) for x, t in zip(group, tasks, strict=True)]
