"""The worker runtime: load flows, run a :class:`~runledger.worker.process.Worker`."""

from __future__ import annotations

import asyncio
import importlib
import json
import logging
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Coroutine, Iterable, Sequence
from typing import Any

from runledger import errors
from runledger.config import Settings, normalize_url, with_connect_timeout
from runledger.flows import Flow
from runledger.worker.executor import Limits
from runledger.worker.process import Worker, WorkerFailed, conflict_message, is_worker_conflict
from runledger.worker.tracing import log_fields

log = logging.getLogger(__name__)

__all__ = [
    "FlowsImportError",
    "Limits",
    "Worker",
    "configure_logging",
    "limits_from_settings",
    "load_flows",
    "run_worker",
    "worker_from_settings",
]


def limits_from_settings(settings: Settings) -> Limits:
    """The per-run budgets and timeouts of ``settings``."""
    return Limits(
        max_turns=settings.max_turns,
        max_calls=settings.max_calls,
        max_stalled_claims=settings.max_stalled_claims,
        tool_timeout=settings.tool_timeout,
        policy_timeout=settings.policy_timeout,
    )


def worker_from_settings(settings: Settings, flows: Sequence[Flow]) -> Worker:
    """The worker that ``settings`` describe, for ``flows``.

    Raises :class:`~runledger.errors.ConfigurationError` when no database URL is set.
    """
    return Worker(
        database_url=settings.require_database_url(),
        flows=flows,
        worker_id=settings.worker_id,
        concurrency=settings.concurrency,
        lease_seconds=settings.lease_seconds,
        poll_seconds=settings.poll_seconds,
        grace_seconds=settings.grace_seconds,
        limits=limits_from_settings(settings),
        session_locks=settings.session_locks,
        http_port=settings.http_port,
        http_host=settings.http_host,
        pooler=settings.pooler,
        direct_url=_direct_url(settings),
    )


def _direct_url(settings: Settings) -> str | None:
    """The direct URL (past the pooler), with the connect timeout every connection of the
    worker gets; None when none is set."""
    if not settings.direct_url:
        return None
    url = normalize_url(settings.direct_url)
    try:
        return with_connect_timeout(url, settings.connect_timeout)
    except Exception as exc:  # not a URL: one line, as for the database URL
        from runledger.db.connecting import connect_error

        raise connect_error(exc, url, None) from None


class FlowsImportError(ImportError):
    """A flows module could not be imported: one line naming the module and its error."""


def _import_flows_module(module_name: str) -> Any:
    """Import ``module_name``; whatever its import raised (a syntax error, an exception
    at import, a dependency that is not installed) is :class:`FlowsImportError` naming the
    module, the error and where it was raised (the traceback at DEBUG)."""
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        log.debug("flows module %r failed to import", module_name, exc_info=True)
        missing = exc.name if isinstance(exc, ModuleNotFoundError) else None
        if missing is not None and (module_name + ".").startswith(missing + "."):
            raise FlowsImportError(
                f"flows module {module_name!r} not found ({exc}): is it installed, or "
                "importable from the current directory?"
            ) from None
        where = "" if isinstance(exc, SyntaxError) else _raised_at(exc)  # it names its line
        said = " ".join(str(exc).split())
        raise FlowsImportError(
            f"flows module {module_name!r} failed to import: "
            f"{type(exc).__name__}{': ' + said if said else ''}{where}"
        ) from None


def _raised_at(exc: BaseException) -> str:
    """`` (myapp/flows.py, line 12)``: the innermost line of the traceback in the user's
    code (not in the standard library, site-packages or importlib), else the innermost."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<")]
    libraries = tuple(
        {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    )
    own = [f for f in frames if not f.filename.startswith(libraries)]
    if not (own or frames):
        return ""
    frame = (own or frames)[-1]
    path = os.path.relpath(frame.filename)
    return f" ({frame.filename if path.startswith('..') else path}, line {frame.lineno})"


def load_flows(specs: Iterable[str]) -> list[Flow]:
    """Import ``package.module:attribute`` specs; the attribute is a Flow or a list of Flows.

    Raises :class:`ValueError` for a malformed spec or attribute, and
    :class:`FlowsImportError` (one line) when the module cannot be imported."""
    flows: list[Flow] = []
    for spec in specs:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr:
            raise ValueError(f"--flows {spec!r}: expected package.module:attribute")
        module = _import_flows_module(module_name)
        try:
            value: Any = getattr(module, attr)
        except AttributeError:
            raise ValueError(f"--flows {spec!r}: module {module_name} has no {attr}") from None
        items = value if isinstance(value, list | tuple) else [value]
        for item in items:
            if not isinstance(item, Flow):
                raise ValueError(f"--flows {spec!r}: {item!r} is not a Flow")
            flows.append(item)
    return flows


class _JsonFormatter(logging.Formatter):
    _skip = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "at": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update({k: v for k, v in record.__dict__.items() if k not in self._skip})
        out.update(log_fields())  # trace_id, span_id: where a span is recording
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


class _FieldsFormatter(logging.Formatter):
    _skip = _JsonFormatter._skip

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in record.__dict__.items() if k not in self._skip)
        return f"{line} {extra}" if extra else line


def configure_logging(level: str = "INFO", as_json: bool = False) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonFormatter()
        if as_json
        else _FieldsFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.getLogger("psycopg.pool").setLevel(logging.WARNING)


def event_loop_runner(choice: str = "auto") -> Callable[[Coroutine[Any, Any, None]], None]:
    """How the worker's loop runs: ``uvloop.run`` for ``uvloop``, and for ``auto`` when
    uvloop is installed; else ``asyncio.run``. uvloop's loop is written in C: the
    scheduling of the tasks and the socket waits of each tool call cost the worker
    7-19 % less CPU, measured A/B (bench/README.md, "The worker's event loop")."""
    if choice in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ValueError(
                    "--event-loop uvloop: uvloop is not installed (pip install uvloop)"
                ) from None
        else:
            return uvloop.run
    return asyncio.run


def run_worker(worker: Worker, event_loop: str = "auto") -> None:
    """Run ``worker`` until it stops; exit 1 with one line when it cannot go on.

    Exit codes: 0 after a clean stop (SIGTERM/SIGINT, runs drained); 1 when an internal
    task died, or when the database refused the worker id on reconnecting (another live
    worker took it meanwhile). Raises :class:`~runledger.errors.WorkerConflict` (one line)
    when the id is refused at startup, after retrying for a few seconds: another live
    worker holds it. ``event_loop``: see :func:`event_loop_runner`.
    """
    runner = event_loop_runner(event_loop)

    async def main() -> None:
        worker.install_signal_handlers()
        await worker.run()

    try:
        runner(main())
    except WorkerFailed:
        # already logged as one CRITICAL line naming the task and its error
        sys.exit(1)
    except Exception as exc:
        if not is_worker_conflict(exc):
            raise
        raise errors.WorkerConflict(conflict_message(worker.worker_id, exc)) from None
