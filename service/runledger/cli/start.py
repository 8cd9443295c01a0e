"""The commands that start someone off: ``runledger demo`` (a Pydantic AI agent's runs,
workers SIGKILLed mid-call, an audit) and, beside it, ``runledger init DIR`` (a starter
project). Registered on the ``runledger`` group by :mod:`runledger.cli`.
"""

from __future__ import annotations

import sys

import click

from runledger import errors
from runledger.cli.exits import EXIT_FAILED, fail
from runledger.cli.options import CONTEXT, opt


@click.command(context_settings=CONTEXT)
@opt(
    "--database-url",
    envvar=None,  # the demo migrates and writes into it: never one taken from the environment
    default=None,
    help="Run the demo in this database (it migrates it and leaves its runs there); "
    "default: a throwaway cluster. Never read from RUNLEDGER_DATABASE_URL or DATABASE_URL.",
)
@opt("--runs", type=click.IntRange(1, 10000), default=40, help="Runs to submit.")
@opt("--workers", "n_workers", type=click.IntRange(1, 32), default=3, help="Worker processes.")
@opt(
    "--kills",
    type=click.IntRange(0, 100),
    default=3,
    help="SIGKILLs, each while a call is in flight: an email, a ticket, a charge, an email...",
)
@opt("--seed", type=int, default=7, help="Picks the customers, orders and amounts.")
@opt(
    "--keep",
    is_flag=True,
    help="Leave the throwaway cluster and the demo's provider running and print how to "
    "connect, resolve and finish the paused runs.",
)
@opt(
    "--stop",
    "stop_dir",
    default=None,
    metavar="DIR",
    help="Stop and remove a cluster (and its provider) an earlier `demo --keep` left "
    "running; nothing else.",
)
def demo(
    database_url: str | None,
    runs: int,
    n_workers: int,
    kills: int,
    seed: int,
    keep: bool,
    stop_dir: str | None,
) -> None:
    """Run the demo: a Pydantic AI agent's runs, workers SIGKILLed mid-call, an audit.

    Exit 0 when the audit holds (no effect twice, no succeeded call without its effect,
    every run succeeded or paused on an unknown call), 1 otherwise.
    """
    from runledger.demo.cluster import BadClusterDir, DemoError, NoDemoDatabase, stop_cluster

    try:
        if stop_dir is not None:
            stop_cluster(stop_dir)
            click.echo(f"stopped and removed {stop_dir}")
            return
        from runledger.demo.run import DemoOptions, run_demo

        options = DemoOptions(
            database_url=database_url,
            runs=runs,
            workers=n_workers,
            kills=kills,
            seed=seed,
            keep=keep,
        )
        code = run_demo(options)
    except BadClusterDir as exc:
        raise click.BadParameter(str(exc), param_hint="'--stop'") from None
    except NoDemoDatabase as exc:  # each source tried on a line of its own, no traceback
        fail(f"error: {exc}", EXIT_FAILED)
    except DemoError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(code)


@click.command(context_settings=CONTEXT)
@click.argument("directory", metavar="DIR", type=click.Path())
def init(directory: str) -> None:
    """Write a starter project into DIR: a flow with an idempotent and an unsafe tool, its
    pytest test that SIGKILLs a worker mid-call, and a README.

    DIR must be new or empty: otherwise exit 2, and nothing is written.
    """
    from runledger.starter import write_project

    try:
        written = write_project(directory)
    except errors.ProjectNotWritten as exc:
        raise click.BadParameter(str(exc), param_hint="'DIR'") from None
    click.echo(f"wrote {', '.join(p.name for p in written)} in {directory}")
    click.echo(f"next: cd {directory} && pip install 'runledger-pg[testing]' && pytest")
