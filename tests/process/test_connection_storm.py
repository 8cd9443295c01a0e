"""A lost connection is not a dead worker.

The server ends the sessions of live workers (``pg_terminate_backend``, as an operator, a
proxy's failover or an idle timeout would) while their calls are on their way to a
provider that applies a request only some time after it came in. A session that ended
frees its lock and lets another worker take the run over at once; that worker must not
look the call up or send it again while its first sender may still be sending it.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from typing import Any, LiteralString

import pytest

from runledger.testing import wait_for
from tests.process.conftest import listening_backend, submit

pytestmark = [pytest.mark.process, pytest.mark.chaos, pytest.mark.slow]

# one tool of each class that has an effect, each in its own turn
PLAN: list[list[dict[str, Any]]] = [
    [{"tool": "ticket"}],
    [{"tool": "charge", "args": {"amount": 3}}],
    [{"tool": "email"}],
]
ARRIVAL = 0.3  # s a request spends on its way before the provider applies it


def _backends(conn: Any, kinds: tuple[str, ...]) -> list[tuple[int, str]]:
    rows = conn.execute(
        "SELECT pid, application_name FROM pg_stat_activity"
        " WHERE split_part(application_name, ':', 1) = ANY (%s)",
        (list(kinds),),
    ).fetchall()
    return [(int(pid), str(name)) for pid, name in rows]


def _settled(conn: Any, prefix: str) -> int:
    return _count(conn, "runs WHERE status IN ('succeeded', 'paused')", prefix)


def _takeovers(conn: Any, prefix: str) -> int:
    """Runs taken over because their holder's session had ended."""
    where = "run_events WHERE kind = 'takeover' AND detail->>'holder' = 'session_ended'"
    return _count(conn, where, prefix)


def _count(conn: Any, where: LiteralString, prefix: str) -> int:
    row = conn.execute(
        "SELECT count(*) FROM runledger." + where + " AND run_id LIKE %s", (prefix + "%",)
    ).fetchone()
    return int(row[0])


def _storm(
    workers: Any,
    provider: Any,
    admin_conn: Any,
    *,
    prefix: str,
    runs: int,
    kinds: tuple[str, ...],
    seconds: float,
    takeovers: int,
) -> dict[str, Any]:
    """Submit ``runs`` runs, then terminate one backend of ``kinds`` every 0.2-0.5 s for at
    least ``seconds`` and until ``takeovers`` runs were taken over from an ended session
    (more runs are submitted whenever all have settled, so the storm always meets calls in
    flight, however fast or slow the machine); then wait for every run to settle, and say
    what the provider and the journal saw."""
    seed = int(os.environ.get("RUNLEDGER_CHAOS_SEED", time.time_ns() % 1_000_000))
    rng = random.Random(seed)
    print(f"storm seed {seed} (RUNLEDGER_CHAOS_SEED to replay)")
    provider.client.configure(arrival=ARRIVAL)
    submitted = 0

    def submit_more(n: int) -> None:
        nonlocal submitted
        for i in range(submitted, submitted + n):
            submit(admin_conn, f"{prefix}{i:04d}", PLAN)
        submitted += n

    submit_more(runs)
    terminated = 0
    started = time.monotonic()
    deadline = started + seconds + 120  # the takeovers asked for, or a defect
    while time.monotonic() < started + seconds or _takeovers(admin_conn, prefix) < takeovers:
        assert time.monotonic() < deadline, (
            f"{_takeovers(admin_conn, prefix)} takeovers after {terminated} terminations "
            f"(seed {seed})"
        )
        if _settled(admin_conn, prefix) == submitted:
            submit_more(max(1, runs // 4))
        time.sleep(rng.uniform(0.2, 0.5))  # the storm's schedule, not a wait for a result
        found = _backends(admin_conn, kinds)
        if found:
            pid, _ = rng.choice(found)
            admin_conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
            terminated += 1
    wait_for(
        lambda: _settled(admin_conn, prefix) == submitted,
        timeout=180,
        interval=0.2,
        what="every run settled",
    )
    effects = Counter(e["key"] for e in provider.client.effects() if e["key"].startswith(prefix))
    calls = admin_conn.execute(
        "SELECT idempotency_key, tool, status FROM runledger.run_calls WHERE run_id LIKE %s",
        (prefix + "%",),
    ).fetchall()
    statuses = Counter(
        r[0]
        for r in admin_conn.execute(
            "SELECT status FROM runledger.runs WHERE run_id LIKE %s", (prefix + "%",)
        )
    )
    print(
        f"terminated {terminated} backends; {_takeovers(admin_conn, prefix)} takeovers;"
        f" {submitted} runs {dict(statuses)}"
    )
    return {"seed": seed, "effects": effects, "calls": calls, "statuses": statuses}


def _listening(workers: Any, admin_conn: Any, count: int) -> None:
    """Until every worker has started on its listener: the storm is about workers that
    run, and it begins once they do."""
    for i in range(count):
        wait_for(
            lambda i=i: listening_backend(admin_conn, workers.worker_id(i)),
            timeout=60,
            what=f"worker {i} listening",
        )


def _assert_once(seen: dict[str, Any], workers: Any, count: int) -> None:
    seed, effects = seen["seed"], seen["effects"]
    twice = {k: n for k, n in effects.items() if n > 1}
    assert twice == {}, f"effects sent twice (seed {seed}): {twice}"
    for key, _tool, status in seen["calls"]:
        if status == "succeeded":
            assert effects[key] == 1, f"succeeded call {key} without its effect (seed {seed})"
    unknown = [(k, t) for k, t, s in seen["calls"] if s == "unknown"]
    assert all(t == "email" for _, t in unknown), unknown  # only the unsafe tool is ambiguous
    assert set(seen["statuses"]) <= {"succeeded", "paused"}, seen["statuses"]
    # a lost connection is survived: no worker exited by itself
    for i in range(count):
        assert workers.alive(i), f"worker {i} exited ({workers.returncode(i)}): {workers.log(i)}"


@pytest.mark.timeout(300)
def test_a_backend_kill_storm_sends_no_effect_twice(
    workers: Any, provider: Any, admin_conn: Any
) -> None:
    """Listener and pool sessions of three live workers are ended at random mid-call."""
    workers.start(3, args=["--concurrency", "8", "--max-stalled-claims", "1000"])
    _listening(workers, admin_conn, 3)
    seen = _storm(
        workers,
        provider,
        admin_conn,
        prefix="storm-",
        runs=48,
        kinds=("runledger-listener", "runledger-worker"),
        seconds=15,
        takeovers=5,  # runs taken from live workers' ended sessions: what the storm is for
    )
    _assert_once(seen, workers, 3)


@pytest.mark.timeout(300)
def test_a_worker_that_registers_again_does_not_resend_its_own_calls(
    workers: Any, provider: Any, admin_conn: Any
) -> None:
    """One worker alone: its listener is ended again and again; each new listener session
    is a new holder of the runs the previous one held, in the same process, whose earlier
    calls may still be on their way."""
    workers.start(1, args=["--concurrency", "8", "--max-stalled-claims", "1000"])
    _listening(workers, admin_conn, 1)
    seen = _storm(
        workers,
        provider,
        admin_conn,
        prefix="self-",
        runs=16,
        kinds=("runledger-listener",),
        seconds=8,
        takeovers=3,  # the worker's new sessions took its own runs over
    )
    _assert_once(seen, workers, 1)
