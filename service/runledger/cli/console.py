"""``runledger console``: the operator web console (the ``[console]`` extra;
:mod:`runledger.console`, docs/console.md). Registered on the ``runledger`` group by
:mod:`runledger.cli`; errors are one line and the exit codes of ``runledger --help``."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

import click

from runledger.cli.options import (
    CONTEXT,
    connect_option,
    database_option,
    opt,
    require_url,
    silent_option,
)

INSTALL_HINT = "runledger console needs its extra: pip install 'runledger-pg[console]'"
TOKEN_ENV = "RUNLEDGER_CONSOLE_TOKEN"

log = logging.getLogger("runledger.console")


def _can_act(url: str, connect_timeout: float) -> bool:
    from runledger.db.diagnosis import can_act
    from runledger.db.inspect import read_connection

    with read_connection(url, connect_timeout) as conn:
        return can_act(conn)


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise click.BadParameter("must not be empty (leave it out for console:<name>).")
    return value


@click.command(
    "console",
    context_settings=CONTEXT,
    epilog="\b\nThe login token is read from RUNLEDGER_CONSOLE_TOKEN only (never an option: "
    "\nit would show in the process list); at least 16 characters. docs/console.md.",
)
@database_option
@connect_option
@opt("--host", default="127.0.0.1", help="Address to listen on.")
@opt("--port", type=click.IntRange(0, 65535), default=8080, help="Port (0: any free one).")
@opt(
    "--allow-actions",
    is_flag=True,
    help="Let a signed-in operator resolve, approve, deny, cancel and retry (needs "
    "--operator-url and RUNLEDGER_CONSOLE_TOKEN). Off: read-only.",
)
@opt(
    "--operator-url",
    default=None,
    help="PostgreSQL URL of a runledger_operator login, for the actions only "
    "(--database-url, read-only, should be a runledger_auditor login).",
)
@opt(
    "--actor",
    default=None,
    callback=_not_empty,
    help="Record every action as this actor (default: console:<the name signed in with>).",
)
@opt(
    "--redact",
    is_flag=True,
    help="Show tool arguments, results, receipts, decision records and run input, state "
    "and result as [redacted], in the pages and in /api.",
)
@silent_option
def console(
    database_url: str | None,
    connect_timeout: float,
    host: str,
    port: int,
    allow_actions: bool,
    operator_url: str | None,
    actor: str | None,
    redact: bool,
    lease_seconds: float,
) -> None:
    """Serve the operator console: runs, a run's timeline, the inbox of calls waiting for a
    person, workers, live updates, and the JSON of each under /api.

    Read-only by default, through --database-url (a runledger_auditor login). With
    --allow-actions, an operator signs in with RUNLEDGER_CONSOLE_TOKEN and a name, and
    acts through --operator-url (a runledger_operator login); every action records
    console:<name> (or --actor) as its actor.
    """
    try:
        import jinja2  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise click.UsageError(INSTALL_HINT) from None
    from runledger.console import ConsoleConfig, create_app
    from runledger.db.connecting import probe_blocking

    token = os.environ.get(TOKEN_ENV) or None
    read_url = require_url(database_url)
    if allow_actions and not operator_url:
        raise click.UsageError(
            "--allow-actions needs --operator-url (RUNLEDGER_OPERATOR_URL): a "
            "runledger_operator login to act through"
        )
    if allow_actions and token is None:
        raise click.UsageError(
            f"--allow-actions needs a login token in {TOKEN_ENV} (at least 16 characters)"
        )
    try:
        config = ConsoleConfig(
            database_url=read_url,
            operator_url=operator_url if allow_actions else None,
            allow_actions=allow_actions,
            token=token,
            actor=actor,
            redact=redact,
            connect_timeout=connect_timeout,
            silent_after=lease_seconds,
        )
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)

    # the one-line errors of every command: unreachable, no schema, an older one
    probe_blocking(read_url, timeout=connect_timeout, application_name="runledger-console")
    if _can_act(read_url, connect_timeout):
        log.warning(
            "console: the read URL's role may act (EXECUTE on resolve_call); the console "
            "only reads through it, but give it a runledger_auditor login"
        )
    if allow_actions:
        assert operator_url is not None
        probe_blocking(operator_url, timeout=connect_timeout, application_name="runledger-console")
        if not _can_act(operator_url, connect_timeout):
            from runledger import errors

            raise errors.RunLedgerError(
                "the --operator-url role may not execute runledger.resolve_call: give it a "
                "runledger_operator login (deploy/roles.sql)"
            )
    elif operator_url:
        log.info("console: --operator-url is not used without --allow-actions")

    sock = listening_socket(host, port)
    shown_host = f"[{host}]" if ":" in host else host
    mode = "actions on" if allow_actions else "read-only"
    extras = (", redacted" if redact else "") + (", login required" if token else "")
    click.echo(
        f"runledger console: http://{shown_host}:{sock.getsockname()[1]}/ ({mode}{extras})",
        err=True,
    )
    app: Any = create_app(config)
    hub = app.state.console.hub

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # end the live streams first: the server waits for open responses to finish
            if hub.loop is not None and not hub.loop.is_closed():
                hub.loop.call_soon_threadsafe(hub.close_streams)
            super().handle_exit(sig, frame)

    server = Server(
        uvicorn.Config(
            app,
            log_level="warning",
            timeout_graceful_shutdown=5,
            lifespan="on",
            access_log=False,
        )
    )
    server.run(sockets=[sock])
    if not server.started:
        raise click.ClickException("the console did not start (see the lines above)")


def listening_socket(host: str, port: int) -> Any:
    """A TCP socket listening on ``host:port``, for uvicorn; one that cannot is a usage error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY on accepted sockets of such a listener
    # only (without it each response waits ~40 ms on a delayed ACK, keep-alive)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise click.UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock
