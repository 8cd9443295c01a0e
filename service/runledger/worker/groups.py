"""Calls that run at the same time: a turn's groups, and how one group settles."""

from __future__ import annotations

import asyncio

from runledger import errors
from runledger.flows import Flow
from runledger.model import Call
from runledger.worker.calls import Calls, Settled
from runledger.worker.runs import ActiveRun, Draining, LocalLeaseExpired


def group_sizes(flow: Flow, tools: list[str]) -> list[int]:
    """The sizes of the groups that calls of these tools (in order) run in, one group
    after another: consecutive calls whose tools may run in parallel
    (:meth:`Flow.runs_in_parallel`) form one group; every other call is a group of its
    own."""
    sizes: list[int] = []
    for i, tool in enumerate(tools):
        if i and flow.runs_in_parallel(tool) and flow.runs_in_parallel(tools[i - 1]):
            sizes[-1] += 1
        else:
            sizes.append(1)
    return sizes


def call_groups(flow: Flow, calls: list[Call]) -> list[list[Call]]:
    """The calls of a turn, in order, as the groups of :func:`group_sizes`."""
    groups: list[list[Call]] = []
    start = 0
    for size in group_sizes(flow, [x.tool for x in calls]):
        groups.append(calls[start : start + size])
        start += size
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
