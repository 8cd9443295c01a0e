"""What a worker counts, for ``/metrics`` (``runledger worker --http-port``).

:class:`Metrics` is what the worker calls at each event: a claim, a finished run, a
completed call, a renewal, a lost lease, a refused write. Its methods do nothing; a
worker started with ``--http-port`` gets a :class:`PrometheusMetrics` instead, whose
methods increment prometheus-client counters (a lock and an add, no I/O). The names are
a contract (docs/operating.md, "Metrics and health"); each worker has its own registry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any

from runledger.errors import ConfigurationError
from runledger.model import ClaimedRun

log = logging.getLogger(__name__)

HOLDERS = ("expired", "session_ended")

INSTALL_HINT = "--http-port needs prometheus-client: pip install 'runledger-pg[metrics]'"

# claim_runs and tool calls: from a millisecond to minutes
CLAIM_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
CALL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


def flow_label(run: ClaimedRun) -> str:
    return f"{run.flow}@{run.flow_version}"


class Metrics:
    """No metrics: every event is a no-op (the worker without ``--http-port``)."""

    def claim_took(self, seconds: float) -> None:
        pass

    def claimed(self, run: ClaimedRun) -> None:
        pass

    def finished(self, run: ClaimedRun, status: str) -> None:
        pass

    def call_completed(
        self, run: ClaimedRun, tool: str, outcome: str, seconds: float | None
    ) -> None:
        pass

    def renewed(self, leases: int) -> None:
        pass

    def lease_lost(self) -> None:
        pass

    def stale_write(self) -> None:
        pass


class PrometheusMetrics(Metrics):
    """The worker's counters in a registry of its own."""

    def __init__(self, active: Callable[[], int]) -> None:
        try:
            import prometheus_client as p
        except ImportError:
            raise ConfigurationError(INSTALL_HINT) from None
        # why a taken-over run could be taken: the claim does not say, its takeover
        # event does (set by the health server: one read per takeover, off the run's path)
        self.read_holder: Callable[[ClaimedRun], Awaitable[str | None]] | None = None
        self._reading: set[asyncio.Task[None]] = set()
        self._children: dict[tuple[str, str, str, str], tuple[Any, Any]] = {}
        self.registry = r = p.CollectorRegistry(auto_describe=True)
        self._claimed = p.Counter(
            "runledger_runs_claimed", "Runs claimed (takeovers too).", ["flow"], registry=r
        )
        self._takeovers = p.Counter(
            "runledger_takeovers",
            "Runs taken over from another holder (holder: why the run could be taken).",
            ["flow", "holder"],
            registry=r,
        )
        self._finished = p.Counter(
            "runledger_runs_finished",
            "Runs this worker stopped holding: succeeded, failed, paused, released.",
            ["flow", "status"],
            registry=r,
        )
        self._calls = p.Counter(
            "runledger_calls",
            "Tool calls completed, by outcome.",
            ["flow", "tool", "outcome"],
            registry=r,
        )
        self._renewals = p.Counter(
            "runledger_lease_renewals", "Leases renewed (one per run per renewal).", registry=r
        )
        self._lost = p.Counter(
            "runledger_leases_lost",
            "Runs dropped because their lease was or may have been lost.",
            registry=r,
        )
        self._stale = p.Counter(
            "runledger_stale_writes_refused",
            "Writes the database refused because the lease had moved on.",
            registry=r,
        )
        self._claim_seconds = p.Histogram(
            "runledger_claim_seconds", "One claim_runs call.", buckets=CLAIM_BUCKETS, registry=r
        )
        self._call_seconds = p.Histogram(
            "runledger_call_seconds",
            "A tool call, from its dispatch to its completion.",
            ["tool"],
            buckets=CALL_BUCKETS,
            registry=r,
        )
        p.Gauge("runledger_runs_active", "Runs this worker holds.", registry=r).set_function(
            lambda: float(active())
        )
        self._depth = p.Gauge(
            "runledger_queue_depth",
            "Queued and running runs per flow this worker serves (read at scrape time).",
            ["flow", "status"],
            registry=r,
        )
        # the store's write coalescers (set by the health server), read at scrape time
        self.coalescers: Callable[[], Sequence[Any]] = tuple
        r.register(_CoalescedWrites(self))

    def claim_took(self, seconds: float) -> None:
        self._claim_seconds.observe(seconds)

    def claimed(self, run: ClaimedRun) -> None:
        flow = flow_label(run)
        self._claimed.labels(flow).inc()
        if run.takeover:
            task = asyncio.get_running_loop().create_task(self._takeover(run, flow))
            self._reading.add(task)
            task.add_done_callback(self._reading.discard)

    async def _takeover(self, run: ClaimedRun, flow: str) -> None:
        holder: str | None = None
        try:
            if self.read_holder is not None:
                holder = await asyncio.wait_for(self.read_holder(run), timeout=5.0)
        except Exception as exc:
            log.info("takeover holder not read: %r", exc, extra={"run_id": run.run_id})
        self._takeovers.labels(flow, holder if holder in HOLDERS else "unknown").inc()

    def finished(self, run: ClaimedRun, status: str) -> None:
        self._finished.labels(flow_label(run), status).inc()

    def call_completed(
        self, run: ClaimedRun, tool: str, outcome: str, seconds: float | None
    ) -> None:
        key = (run.flow, run.flow_version, tool, outcome)
        children = self._children.get(key)
        if children is None:  # labels() looks its child up under a lock: once per key
            children = self._children[key] = (
                self._calls.labels(flow_label(run), tool, outcome),
                self._call_seconds.labels(tool),
            )
        children[0].inc()
        if seconds is not None:
            children[1].observe(seconds)

    def renewed(self, leases: int) -> None:
        self._renewals.inc(leases)

    def lease_lost(self) -> None:
        self._lost.inc()

    def stale_write(self) -> None:
        self._stale.inc()

    def set_queue_depth(self, depth: Mapping[tuple[str, str], int]) -> None:
        for (flow, status), n in depth.items():
            self._depth.labels(flow, status).set(n)

    def exposition(self) -> tuple[bytes, str]:
        """The registry in the text format, and its content type."""
        import prometheus_client as p

        return p.generate_latest(self.registry), p.CONTENT_TYPE_LATEST


class _CoalescedWrites:
    """The counters of the store's write coalescers (runledger.db.coalesce), by kind."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily

        families = (
            (
                "runledger_write_batches",
                "Statements that carried the writes of several runs.",
                "batches",
            ),
            ("runledger_batched_writes", "Writes sent in those statements.", "batched"),
            (
                "runledger_write_batches_failed",
                "Batches that failed, each of their writes then sent alone.",
                "failed",
            ),
        )
        coalescers = list(self.metrics.coalescers())
        for name, text, attribute in families:
            family = CounterMetricFamily(name, text, labels=["kind"])
            for c in coalescers:
                family.add_metric([c.kind], float(getattr(c, attribute)))
            yield family
