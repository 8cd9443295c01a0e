"""Time from SIGKILL of a worker holding a run mid-call to another worker's takeover.

    .venv/bin/python bench/takeover.py                        # leases 2, 5, 10 s; 5 reps each
    .venv/bin/python bench/takeover.py --leases 2,5 --reps 3
    .venv/bin/python bench/takeover.py --leases 30 --poll-seconds 2   # the default settings

Two worker processes, both with ``--lease-seconds L --poll-seconds 0.5`` (the poll interval
of the worker that takes over is what matters; both have it because either may be the one
that claims). Per repetition:

1. submit one ``scripted@1`` run whose only call is the idempotent ``ticket`` tool with a
   gate, so the fake provider holds the response: the run is mid-call, for certain;
2. wait until the call is ``dispatched`` in the database *and* the provider has received it;
3. after a random 0..poll s, send one ``NOTIFY runledger_runs`` (what any other submit
   does): the submit woke both workers at once, so the idle worker's polls are anchored at
   the claim, and with a lease that is a multiple of the poll interval the expiry would
   line up with one of its polls. The notification moves its poll phase to a random point,
   as in a real deployment, where a crash is unrelated to the other workers' polls;
4. (by default) wait a random 0..L/3 s more, so the kill lands at a random point of the
   lease keeper's renewal cycle (it renews every L/3), as a real crash would;
5. SIGKILL the holder, then at once ``SELECT runledger.now()`` (the kill time on the
   database clock) together with the run's ``lease_expires_at``;
6. wait for the ``takeover`` row in ``runledger.lease_history``; its ``at`` minus the kill
   time is the number reported. The takeover event says why the run could be taken
   (``holder``): ``session_ended`` when the killed worker's listener session ended and
   freed its session lock (revision 0011: the other worker's listener heartbeat, every
   0.5 s, sees it and claims), ``expired`` when the lease ran out first (a worker without
   a session lock). Beside it: the lease time left at the kill
   (``lease_expires_at - kill``) and the lag after expiry (``takeover -
   lease_expires_at``: negative for a takeover before the lease expired);
7. open the gate so the new holder's repeated call (same idempotency key) completes, check
   the run succeeded with exactly one effect at the provider, restart the killed worker.

The database clock is real here: nothing is faked, so this measures actual expiry plus
poll latency. Data on stdout (markdown tables), progress on stderr.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from runledger.testing.processes import wait_for

from _common import (
    BenchPool,
    background_load,
    database,
    load_note,
    provider,
    say,
    stop_on_sigterm,
    summary,
    table,
    tag,
    wait_ready,
)


@dataclass
class Sample:
    lease: float
    total: float  # takeover - kill
    left: float  # lease_expires_at - kill
    lag: float  # takeover - lease_expires_at
    holder: str  # why the run could be taken: session_ended | expired


def one(
    conn: psycopg.Connection[Any],
    pool: BenchPool,
    prov: Any,
    lease: float,
    rep: int,
    prefix: str,
    rng: random.Random,
    phase: str,
    poll: float,
) -> Sample:
    run_id = f"{prefix}-l{lease:g}-r{rep}"
    gate = f"{run_id}-gate"
    key = f"{run_id}:0:c0"
    conn.execute(
        "SELECT * FROM runledger.submit_run(%s, 'scripted', '1', %s::jsonb)",
        (run_id, Jsonb({"plan": [[{"tool": "ticket", "args": {"title": run_id, "gate": gate}}]]})),
    )

    def in_call() -> str | None:
        row = conn.execute(
            "SELECT c.dispatched_by FROM runledger.run_calls c JOIN runledger.runs r USING (run_id)"
            " WHERE c.idempotency_key = %s AND c.status = 'dispatched'"
            "   AND r.lease_owner = c.dispatched_by",
            (key,),
        ).fetchone()
        if row and prov.client.effects(key):
            return str(row[0])
        return None

    holder = wait_for(in_call, timeout=30, interval=0.01, what=f"{run_id} mid-call")
    victim = next(i for i in range(len(pool.procs)) if pool.worker_id(i) == holder)
    time.sleep(rng.uniform(0, poll))
    conn.execute("SELECT pg_notify('runledger_runs', 'scripted@1')")  # re-phase the taker
    if phase == "random":
        time.sleep(rng.uniform(0, lease / 3))

    pool.kill_now(victim)
    row = conn.execute(
        "SELECT runledger.now(), lease_expires_at, lease_owner FROM runledger.runs "
        "WHERE run_id = %s",
        (run_id,),
    ).fetchone()
    assert row is not None
    killed_at, expires_at, owner = row
    pool.procs[victim].wait(timeout=30)
    if owner != holder:
        raise RuntimeError(f"{run_id}: lease owner changed before the kill ({owner} != {holder})")

    def taken() -> Any:
        return conn.execute(
            "SELECT h.at, h.worker_id, h.previous_owner, e.detail ->> 'holder' "
            "FROM runledger.lease_history h JOIN runledger.run_events e USING (event_id) "
            "WHERE h.run_id = %s AND h.kind = 'takeover' ORDER BY h.event_id LIMIT 1",
            (run_id,),
        ).fetchone()

    took_at, taker, previous, holder_why = wait_for(
        taken, timeout=lease + 30, interval=0.01, what=f"takeover of {run_id}"
    )
    if previous != holder or taker == holder:
        raise RuntimeError(f"{run_id}: takeover by {taker} from {previous}, killed {holder}")

    prov.client.open_gate(gate)

    def succeeded() -> bool:
        row = conn.execute(
            "SELECT status = 'succeeded' FROM runledger.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
        return bool(row and row[0])

    wait_for(succeeded, timeout=30, interval=0.02, what=f"{run_id} succeeded")
    effects = prov.client.effects(key)
    if len(effects) != 1:
        raise RuntimeError(f"{run_id}: {len(effects)} effects at the provider for {key}")

    pool.restart(victim)
    wait_ready(conn, pool, [victim])
    return Sample(
        lease=lease,
        total=(took_at - killed_at).total_seconds(),
        left=(expires_at - killed_at).total_seconds(),
        lag=(took_at - expires_at).total_seconds(),
        holder=holder_why or "expired",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--leases", default="2,5,10", help="lease lengths in s (default 2,5,10)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per lease (default 5)")
    ap.add_argument("--poll-seconds", type=float, default=0.5)
    ap.add_argument(
        "--phase",
        choices=["random", "immediate"],
        default="random",
        help="kill at a random point of the renewal cycle, or as soon as the "
        "call is in flight and the taker re-phased (nearly a full lease left)",
    )
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    leases = [float(x) for x in args.leases.split(",") if x.strip()]
    rng = random.Random(args.seed)
    me = tag()
    samples: list[Sample] = []
    stop_on_sigterm()
    before = background_load()
    started = time.monotonic()

    with database() as db, provider() as prov, psycopg.connect(db.url, autocommit=True) as conn:
        say(f"PostgreSQL {db.version}, {db.source}; bench tag {me}")
        for lease in leases:
            pool = BenchPool(
                db.url,
                f"t{me}-l{lease:g}",
                env={"RUNLEDGER_PROVIDER_URL": prov.url},
                args=[
                    "--concurrency",
                    "4",
                    "--lease-seconds",
                    str(lease),
                    "--poll-seconds",
                    str(args.poll_seconds),
                    "--log-level",
                    "WARNING",
                ],
            )
            try:
                pool.start(2)
                wait_ready(conn, pool, [0, 1])
                for rep in range(args.reps):
                    s = one(
                        conn, pool, prov, lease, rep, f"t{me}", rng, args.phase, args.poll_seconds
                    )
                    say(
                        f"lease {lease:g} s rep {rep + 1}/{args.reps}: takeover after "
                        f"{s.total:.2f} s (lease left at kill {s.left:.2f} s, "
                        f"then {s.lag:.2f} s; holder {s.holder})"
                    )
                    samples.append(s)
            finally:
                pool.close()

    rows = []
    for lease in leases:
        mine = [s for s in samples if s.lease == lease]
        t, left, lag = ([getattr(s, f) for s in mine] for f in ("total", "left", "lag"))
        tmin, tmed, tmax = summary(t)
        rows.append(
            [
                f"{lease:g}",
                len(mine),
                f"{tmin:.2f}",
                f"{tmed:.2f}",
                f"{tmax:.2f}",
                "{:.2f} / {:.2f} / {:.2f}".format(*summary(left)),
                "{:.2f} / {:.2f} / {:.2f}".format(*summary(lag)),
                f"{statistics.median(t) / lease:.2f}",
                ", ".join(f"{k} {v}" for k, v in sorted(Counter(s.holder for s in mine).items())),
            ]
        )
    print()
    print(
        f"PostgreSQL {db.version}, {db.source}; poll {args.poll_seconds:g} s; "
        f"kill phase {args.phase}; {load_note(before)}"
    )
    print(
        table(
            [
                "lease s",
                "reps",
                "takeover min s",
                "median s",
                "max s",
                "lease left at kill (min/med/max)",
                "after expiry (min/med/max)",
                "median / lease",
                "taken because",
            ],
            rows,
        )
    )
    print()
    print(
        "takeover = lease_history 'takeover' at - runledger.now() read right after SIGKILL; "
        "lease left = the run's lease_expires_at - kill; after expiry = takeover - "
        "lease_expires_at (negative: taken before the lease expired); taken because = the "
        "takeover event's holder (session_ended: the holder's session lock was free)."
    )
    say(f"total {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
