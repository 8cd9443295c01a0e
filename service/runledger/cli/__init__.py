"""The ``runledger`` command: the group and its entry point (moved from cli.py)."""

from __future__ import annotations

from runledger.cli.runs import (
    EXIT_CODES,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    RESOLVABLE,
    main,
    resolve_command,
    run,
    worker,
)

__all__ = [
    "EXIT_CODES",
    "EXIT_FAILED",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "RESOLVABLE",
    "main",
    "resolve_command",
    "run",
    "worker",
]
