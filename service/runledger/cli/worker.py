"""``runledger worker``: a worker process that claims runs of the given flows and drives
them (:mod:`runledger.worker`).

Its options are generated from :class:`runledger.config.Settings` (name, type, default,
range, help), so each setting has exactly one range; the command builds a ``Settings``
from them and makes the worker with ``worker_from_settings``. Registered on the
``runledger`` group by :mod:`runledger.cli`.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from runledger import errors
from runledger.cli.exits import EXIT_UNAVAILABLE, fail, one_line
from runledger.cli.options import CONTEXT, build_settings, opt, require_url, settings_options
from runledger.config import with_connect_timeout


@click.command(context_settings=CONTEXT)
@opt(
    "--flows",
    "flow_specs",
    multiple=True,
    required=True,
    help="package.module:attribute holding a Flow or a list of Flows "
    "(repeatable; space-separated in the env var).",
)
@settings_options
@click.pass_context
def worker(ctx: click.Context, /, flow_specs: tuple[str, ...], **values: Any) -> None:
    """Run a worker process: claim runs of the given flows and drive them."""
    from runledger.worker import (
        configure_logging,
        event_loop_runner,
        load_flows,
        run_worker,
        worker_from_settings,
    )

    settings = build_settings(ctx, values)
    configure_logging(settings.log_level, settings.log_json)
    url = require_url(settings.database_url)  # no URL: a usage error before importing flows
    # Every connection the worker makes (the pool's, the listener's) gets the timeout.
    try:
        url = with_connect_timeout(url, settings.connect_timeout)
    except Exception as exc:  # not a URL: the one-line ConfigurationError of Store.connect
        from runledger.db.connecting import connect_error

        raise connect_error(exc, url, None) from None
    settings = settings.model_copy(update={"database_url": url})
    if settings.otel or settings.otel_file:
        _configure_otel(settings.otel_file)
    if settings.http_port is not None:
        import importlib.util

        from runledger.worker.metrics import INSTALL_HINT

        if importlib.util.find_spec("prometheus_client") is None:
            raise click.UsageError(INSTALL_HINT)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        w = worker_from_settings(settings, load_flows(flow_specs))
        event_loop_runner(settings.event_loop)  # uvloop asked for but missing: one line
    except (ValueError, ImportError) as exc:
        raise click.UsageError(str(exc)) from exc
    try:
        run_worker(w, settings.event_loop)
    except errors.ReadOnly as exc:
        # a worker only writes: on a standby it can do nothing at all, as on a database it
        # cannot reach (exit 3, which a supervisor restarts on), not a refused request
        fail(
            f"error: ReadOnly: {one_line(exc)}; a worker needs the primary: list every "
            "host with target_session_attrs=read-write (docs/failover.md)",
            EXIT_UNAVAILABLE,
        )


def _configure_otel(file: str | None) -> None:
    """``--otel``: the SDK's TracerProvider for this process (runledger.worker.otel)."""
    from runledger.worker.tracing import INSTALL_HINT

    try:
        from runledger.worker import otel
    except ImportError:
        raise click.UsageError(INSTALL_HINT) from None
    try:
        otel.configure(file)
    except (otel.ExporterNotFound, OSError) as exc:
        raise click.UsageError(str(exc)) from None
