"""The operator web console: ``runledger console`` (the ``[console]`` extra).

A small server-rendered Starlette app over the same reads as the CLI
(:mod:`runledger.db.inspect`, :mod:`runledger.db.event_log`): runs with filters and
paging, a run page (lease, turns with their decision records, calls with keys, attempts
and receipts, the timeline), the inbox of calls waiting for a person, and workers; the
JSON the pages show is under ``/api``. Live updates are server-sent events driven by
``LISTEN runledger_events`` (one listening connection per process, fanned out).

Read-only by default, through an auditor-role URL. With ``allow_actions`` an operator
who signed in with the console's token resolves, approves, denies, cancels and retries
through an operator-role URL (:class:`runledger.db.store.Store`, as the CLI's
:class:`runledger.client.Client` does), each action recorded under the operator's name.
docs/console.md is the manual.
"""

from __future__ import annotations

from runledger.console.config import ConsoleConfig

__all__ = ["ConsoleConfig", "create_app"]


def create_app(config: ConsoleConfig) -> object:
    """The ASGI app (a Starlette instance) for ``config``."""
    from runledger.console.app import build_app

    return build_app(config)
