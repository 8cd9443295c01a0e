"""The database's clock, as a worker process knows it.

Every time runledger writes is the database's (``runledger.now()``): a lease's expiry, a
call's dispatch, an event. A worker that compares one of them with "now" takes "now" from
the same clock. A host whose clock is five minutes fast, compared with its own, would find
a request sent a second ago long gone and send it again; a slow one would wait five
minutes for nothing.

The worker measures the database's clock on round trips it makes anyway (each heartbeat
and lease renewal): the server read its clock after the request left and before the
answer came back, so that reading, placed at the midpoint of the round trip on this
host's *monotonic* clock, is off by at most half the round trip. The estimate is kept on
the monotonic clock, which a step of the host's wall clock (NTP, ``date -s``) does not
move, and the tightest measurement is kept, its error grown by a bound on how far two
clocks drift apart (:data:`DRIFT`). Before the first measurement the estimate is the
host's own clock (:attr:`DatabaseClock.measured` says which).

A tighter reading may move the estimate by up to the error of the one it replaces (a
few milliseconds). Waits are therefore judged by bounds, not by the estimate: a worker
stamps its own send with :meth:`DatabaseClock.latest` and a lookup compares with
:meth:`DatabaseClock.earliest`, so a wait for a database time never ends early.
"""

from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass

__all__ = ["DRIFT", "DatabaseClock", "wall_now"]

# how fast two clocks may run apart, as a fraction (100 ppm: an undisciplined quartz
# oscillator's usual bound; NTP keeps a host's clock far closer)
DRIFT = 1e-4

_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def wall_now() -> dt.datetime:
    """This host's own clock (UTC): what a context knows without a database."""
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True, slots=True)
class _Reading:
    base: float  # the database's epoch seconds minus this host's monotonic seconds
    error: float  # seconds, half the round trip it was measured on
    at: float  # monotonic seconds when it was measured

    def error_at(self, mono: float) -> float:
        return self.error + DRIFT * max(0.0, mono - self.at)


class DatabaseClock:
    """The database's "now", estimated from this host's monotonic clock."""

    __slots__ = ("_reading",)

    def __init__(self) -> None:
        self._reading: _Reading | None = None

    @property
    def measured(self) -> bool:
        return self._reading is not None

    def measure(self, db_now: dt.datetime, sent: float, received: float) -> None:
        """Take a reading of the database's clock: ``db_now`` was read by the server
        between ``sent`` and ``received`` (``time.monotonic()`` of this process). Kept
        when it is tighter than the one held, aged."""
        if received < sent:
            return
        reading = _Reading(
            base=(db_now - _EPOCH).total_seconds() - (sent + received) / 2,
            error=(received - sent) / 2,
            at=received,
        )
        held = self._reading
        if held is None or reading.error <= held.error_at(received):
            self._reading = reading

    def now(self) -> dt.datetime:
        """The database's clock now (this host's own before any measurement)."""
        reading = self._reading
        if reading is None:
            return wall_now()
        return _EPOCH + dt.timedelta(seconds=reading.base + time.monotonic())

    def earliest(self) -> dt.datetime:
        """The earliest the database's clock can be now (:meth:`now` less its error):
        what a wait until a database time has passed compares with, so that it never
        ends early. Tools get this one (``ToolContext.now``)."""
        return self.now() - dt.timedelta(seconds=self.error() or 0.0)

    def latest(self) -> dt.datetime:
        """The latest the database's clock can be now (:meth:`now` plus its error): how a
        worker stamps its own send, so that a wait counted from the stamp by
        :meth:`earliest` lasts at least as long as asked, whatever readings come between."""
        return self.now() + dt.timedelta(seconds=self.error() or 0.0)

    def error(self) -> float | None:
        """How far :meth:`now` may be off, in seconds (None: not measured)."""
        reading = self._reading
        return None if reading is None else reading.error_at(time.monotonic())

    def host_offset(self) -> float | None:
        """Seconds this host's wall clock is ahead of the database's (negative: behind);
        None before any measurement."""
        if self._reading is None:
            return None
        return time.time() - (self.now() - _EPOCH).total_seconds()
