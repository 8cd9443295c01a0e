"""``runledger demo``: the whole story in one command, against a real PostgreSQL.

Runs of ``support@1``, a Pydantic AI agent (:mod:`runledger.demo.agent`, a scripted
``FunctionModel``) that opens a ticket (idempotent), charges a card (lookup) and emails
the customer (unsafe). Three worker processes drive them; the demo SIGKILLs a worker
while one of those calls is in flight (the provider holds it at a gate: the effect done,
the reply not yet sent), then restarts it. The first kill lands on an email, so at least
one run ends paused on an ``unknown`` call for a person. Then the audit: the provider's
record against the journal (:mod:`runledger.demo.report`).
"""

from __future__ import annotations

import contextlib
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import psycopg

from runledger.db import batch
from runledger.db.migrate import upgrade
from runledger.demo import HOLD_ENV, TURN, prompt_for
from runledger.demo.cluster import (
    PROVIDER_LOG,
    DemoDatabase,
    DemoError,
    demo_database,
    keep_provider,
)
from runledger.demo.report import audit, print_audit, print_paused
from runledger.testing.processes import ProviderProcess, WorkerPool, wait_for

FLOW, FLOW_SPEC = "support", "runledger.demo.agent:flow"
HOLDS = ("send_email", "create_ticket", "charge")  # what the 1st, 2nd, 3rd... SIGKILL interrupts
WHILE = {
    "send_email": "was sending its email (sent",
    "create_ticket": "was opening its ticket (opened",
    "charge": "was charging the card (charged",
}
NAMES = ("ana", "bo", "chen", "dara", "eli", "fay", "gus", "hana", "ivo", "jun", "kai", "lea")
WORKER_ARGS = ["--lease-seconds", "2", "--poll-seconds", "0.2", "--log-level", "WARNING"]

Say = Callable[[str], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoOptions:
    database_url: str | None = None
    runs: int = 40
    workers: int = 3
    kills: int = 3
    seed: int = 7
    keep: bool = False
    timeout: float = 120.0  # for every run to succeed or pause, after the last kill


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    prefix: str
    inputs: dict[str, dict[str, Any]]  # run id -> input, in submission order
    holds: dict[str, str]  # run id -> the tool whose call a SIGKILL interrupts

    @classmethod
    def make(cls, options: DemoOptions) -> Plan:
        rng = random.Random(options.seed)
        prefix = f"demo-{secrets.token_hex(2)}"  # fresh ids in a database used before
        inputs = {}
        for n in range(options.runs):
            customer = f"{rng.choice(NAMES)}@example.com"
            order, amount = f"o-{rng.randrange(1000, 10000)}", rng.choice((9, 12, 15, 19, 25))
            inputs[f"{prefix}-{n:03d}"] = {"prompt": prompt_for(customer, order, amount)}
        held = list(inputs)[: min(options.kills, options.runs)]
        return cls(
            prefix=prefix,
            inputs=inputs,
            holds={run: HOLDS[i % len(HOLDS)] for i, run in enumerate(held)},
        )


def run_demo(options: DemoOptions, say: Say = click.echo) -> int:
    """Play the demo; 0 when the audit holds, 1 otherwise (:class:`DemoError` when it
    cannot start). Everything it started is stopped on the way out, Ctrl-C and SIGTERM
    included; with ``keep`` a throwaway cluster is left running once the demo finished,
    and with a local cluster the fake provider too, so that a run resolved as
    ``not_applied`` can send its call again (``--stop`` ends both)."""
    _require_pydantic_ai()
    plan = Plan.make(options)
    with _sigterm_interrupts(), demo_database(options.database_url, say) as db:
        upgrade(db.url)
        # --keep of a local cluster keeps the provider beside it (its log in its directory)
        keeping = options.keep and db.throwaway and db.directory is not None
        provider = ProviderProcess(
            log=Path(db.directory) / PROVIDER_LOG if keeping and db.directory else None,
            new_session=keeping,
        )
        try:
            pool = WorkerPool(
                db.url,
                [FLOW_SPEC],
                env={
                    "RUNLEDGER_PROVIDER_URL": provider.url,
                    HOLD_ENV: ",".join(f"{r}={t}" for r, t in plan.holds.items()),
                },
                args=WORKER_ARGS,
            )
            try:
                elapsed, kills = _play(db.url, provider, pool, plan, options, say)
                result = audit(db.url, plan.prefix, options.runs, provider.client.effects())
                if not result.ok:
                    _show_logs(pool)
            except DemoError:
                _show_logs(pool)
                raise
            finally:
                pool.close()
            # a call resolved not_applied is sent again: advise it only where the provider
            # runs on, or where the database ends with the demo (the advice is for --keep)
            resend = keeping or (db.throwaway and not options.keep)
            print_audit(result, elapsed, kills, say)
            print_paused(result.unknown, say, resend=resend)
            if options.keep and db.throwaway:
                if db.backend == "docker":  # testcontainers removes it when this process ends
                    say(
                        "\n--keep: a Docker container cannot outlive the demo; "
                        "use local PostgreSQL."
                    )
                else:
                    db.keep()
            kept = provider.url if keeping and db.kept else None
            _footer(db, kept, [u.command(resend) for u in result.unknown], result.unknown, say)
            if kept is not None and db.directory is not None:
                keep_provider(db.directory, provider.proc.pid, provider.url)
                provider.detach()
        finally:
            provider.stop()  # nothing once detached
        return 0 if result.ok else 1


def _play(
    url: str, provider: ProviderProcess, pool: WorkerPool, plan: Plan, o: DemoOptions, say: Say
) -> tuple[float, int]:
    """Submit, kill, restart, wait: the seconds from the first submission until every run
    settled (succeeded, paused, failed or cancelled), and the SIGKILLs that landed."""
    provider.client.configure(latency=0.02)  # a provider that takes a moment to answer
    started = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        for run_id, payload in plan.inputs.items():
            if run_id not in plan.holds:
                _submit(conn, run_id, payload, priority=0)
        pool.start(o.workers)
        say(
            f"{o.runs} runs of {FLOW}@1, a Pydantic AI agent (scripted FunctionModel, no network)"
            f" that calls\n  create_ticket (idempotent), charge (lookup), send_email (unsafe), "
            f"then answers; {o.workers} workers"
        )
        kills = 0
        for run_id, tool in plan.holds.items():
            # submitted now, first in line: no earlier kill can have touched it
            _submit(conn, run_id, plan.inputs[run_id], priority=1)
            kills += _kill_mid_call(conn, provider, pool, run_id, tool, say)

        def settled() -> bool:
            return batch.settled(conn, plan.prefix) == o.runs

        try:
            wait_for(settled, timeout=o.timeout, interval=0.1, what="every run settled")
        except AssertionError:
            say(f"timed out after {o.timeout:.0f} s: some runs neither succeeded nor paused")
    return time.monotonic() - started, kills


def _kill_mid_call(
    conn: psycopg.Connection[Any],
    provider: ProviderProcess,
    pool: WorkerPool,
    run_id: str,
    tool: str,
    say: Say,
    timeout: float = 60.0,
) -> int:
    """SIGKILL the worker whose ``tool`` call of ``run_id`` the provider holds (the effect
    done, the reply not sent), release the call, restart the worker; 1 if it was killed."""
    gate = f"hold:{run_id}:{TURN[tool]}:c0"
    try:
        provider.client.wait_for_held(gate, timeout=timeout)
    except AssertionError:
        raise DemoError(f"{run_id} did not reach its {tool} call within {timeout:.0f} s") from None
    workers = {pool.worker_id(i): i for i in range(len(pool.procs))}
    deadline = time.monotonic() + timeout
    while True:
        status, owner = batch.status_and_owner(conn, run_id) or ("missing", None)
        victim = workers.get(str(owner)) if status == "running" else None
        if victim is not None and pool.alive(victim):
            break
        if status not in ("running", "queued"):  # its lease ran out first: a busy machine
            say(f"{run_id} was {status} before its SIGKILL (its lease ran out); no kill")
            provider.client.open_gate(gate)
            return 0
        if time.monotonic() > deadline:
            raise DemoError(f"no live worker held {run_id} within {timeout:.0f} s")
        time.sleep(0.02)
    pool.kill(victim)
    say(f"SIGKILL {owner} mid-call: {run_id} {WHILE[tool]}, reply not back yet); restarted")
    provider.client.open_gate(gate)
    pool.restart(victim)
    return 1


def _submit(
    conn: psycopg.Connection[Any], run_id: str, payload: dict[str, Any], priority: int
) -> None:
    batch.submit(conn, run_id, FLOW, "1", payload, priority)


def _footer(
    db: DemoDatabase, provider_url: str | None, commands: list[str], unknown: list[Any], say: Say
) -> None:
    """How to go on: the commands to paste while the database (and, with ``provider_url``,
    the provider the demo's tools call) runs on."""
    runs = [u.run_id for u in unknown]
    if not db.throwaway:
        if commands:
            say("\nThe runs are in your database (--database-url): resolve them there.")
        return
    if not db.kept:
        if commands:
            say(
                "\n(The throwaway database is gone now: `runledger demo --keep` leaves it running.)"
            )
        return
    running = "The database and the demo's provider are" if provider_url else "The database is"
    say(f"\n{running} still running (--keep). In a shell:")
    say(f"  export RUNLEDGER_DATABASE_URL={_shell_word(db.url)}")
    if provider_url:
        say(f"  export RUNLEDGER_PROVIDER_URL={_shell_word(provider_url)}")
    if commands:
        say(f"  runledger status {runs[0]}")
        say(f"  {commands[0]}")
        say(f"  runledger worker --flows {FLOW_SPEC}    # finishes the run (Ctrl-C to stop)")
    else:
        say("  runledger audit")
    if db.directory:
        both = "both" if provider_url else "it"
        say(f"Stop {both} when done: runledger demo --stop {db.directory}")
    else:
        say(f"Drop it when done: DROP DATABASE {db.url.rsplit('/', 1)[1].split('?')[0]}")


def _shell_word(text: str) -> str:
    quoted = text.replace("'", "'\\''")  # a shell word, whatever the text holds
    return f"'{quoted}'"


def _require_pydantic_ai() -> None:
    import importlib.util

    if importlib.util.find_spec("pydantic_ai") is None:
        raise DemoError("the demo's agent needs Pydantic AI: pip install 'runledger-pg[demo]'")


@contextlib.contextmanager
def _sigterm_interrupts() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the ``finally`` blocks stop what the demo started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _show_logs(pool: WorkerPool, lines: int = 20) -> None:
    for i in range(len(pool.procs)):
        tail = pool.log(i).splitlines()[-lines:]
        if tail:
            click.echo(f"--- worker {pool.worker_id(i)} (last {len(tail)} log lines)", err=True)
            click.echo("\n".join(tail), err=True)
