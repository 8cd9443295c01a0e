"""The runledger exception tree and the SQLSTATE -> exception registry.

Every refusal the database makes carries a SQLSTATE of class ``RL``;
:func:`runledger.db.sqlstate.map_error` maps it onto one of these classes with
:func:`from_sqlstate`. Nothing here imports
other runledger modules.
"""

from __future__ import annotations

from typing import Any, ClassVar


class RunLedgerError(Exception):
    """Base of every runledger error."""

    sqlstate: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        run_id: str | None = None,
        fencing_token: int | None = None,
        detail: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.run_id = run_id
        self.fencing_token = fencing_token
        self.detail = detail
        self.hint = hint

    def __str__(self) -> str:
        parts = [self.message]
        if self.detail:
            parts.append(f"DETAIL: {self.detail}")
        if self.hint:
            parts.append(f"HINT: {self.hint}")
        return "\n".join(parts)


class LeaseLost(RunLedgerError):
    """The lease id/token is not the run's current lease, or it expired by the DB clock."""

    sqlstate = "RL001"


class VersionConflict(RunLedgerError):
    """Compare-and-set saw another ``state_version``."""

    sqlstate = "RL002"


class RunNotFound(RunLedgerError):
    """No such run (or call)."""

    sqlstate = "RL003"


class InvalidTransition(RunLedgerError):
    """The run or call is not in a state that allows this operation."""

    sqlstate = "RL004"


class RunConflict(RunLedgerError):
    """The same run id was submitted with a different flow, version or input."""

    sqlstate = "RL005"


class InvalidInput(RunLedgerError):
    """Bad run id, non-object or oversized JSON, NUL characters, unknown words; or a write
    that extends a run's event chain from a REPEATABLE READ or SERIALIZABLE transaction
    (revision 0023: the chain is extended in READ COMMITTED only)."""

    sqlstate = "RL006"


class InvariantViolation(RunLedgerError):
    """A table trigger refused a write that breaks an invariant (the second wall)."""

    sqlstate = "RL007"


class WorkerConflict(RunLedgerError):
    """The worker id is registered by another database session that is still alive."""

    sqlstate = "RL008"


class SenderActive(RunLedgerError):
    """A call an earlier holder sent may still be on its way from that sender: it is not
    sent again until the sender released it, its process is known gone, or its lease
    expired by the database clock (revision 0031)."""

    sqlstate = "RL009"


class ReadOnly(RunLedgerError):
    """A write refused by a database that only reads: a hot standby (in recovery), or a
    read-only session (``default_transaction_read_only``). Reads work there; writes need
    the primary. Mapped in ``db/execution.py`` from SQLSTATE 25006, which is PostgreSQL's
    (so not in :data:`REGISTRY`); ``standby`` is what the server said of itself (None
    when it did not say: PostgreSQL 13)."""

    def __init__(self, message: str, *, standby: bool | None = None, **fields: Any) -> None:
        super().__init__(message, **fields)
        self.standby = standby


class ServerError(RunLedgerError):
    """The database failed a statement with a SQLSTATE that is none of runledger's
    refusals: a full disk (53100), out of memory (53200), a statement timeout (57014), an
    I/O error (58030), a missing privilege (42501), ... The statement's transaction was
    rolled back: nothing of it was written. ``code`` is the SQLSTATE, ``condition``
    PostgreSQL's name for it, in words (``disk full``; None when the driver has no class
    for it); the message starts with the condition and ends with the SQLSTATE. Mapped in
    ``db/sqlstate.py`` (:func:`runledger.db.sqlstate.server_error`)."""

    def __init__(
        self, message: str, *, code: str, condition: str | None = None, **fields: Any
    ) -> None:
        super().__init__(message, **fields)
        self.code = code
        self.condition = condition

    @property
    def transient(self) -> bool:
        """Whether the same statement may well succeed later, unchanged: the server ran
        short of something (class 53: disk, memory, connections), a statement timed out
        or was cancelled (57014), or the system failed it (class 58: I/O)."""
        return self.code.startswith(("53", "58")) or self.code == "57014"


class DatabaseUnavailable(RunLedgerError):
    """The database could not be reached (down, wrong host, role or database name)."""


class SchemaMissing(RunLedgerError):
    """The database has no runledger schema, or an older one: run ``runledger migrate``."""


class SchemaTooOld(SchemaMissing):
    """The database's runledger schema is at a revision this release cannot upgrade
    from (one before the 0.1 baseline's 0032): recreate it, or upgrade it with an earlier
    runledger first. ``runledger migrate`` says so in one line and exits 3."""


class ConfigurationError(RunLedgerError):
    """Settings are missing or inconsistent (for example no database URL)."""


class ProjectNotWritten(RunLedgerError):
    """``runledger init DIR``: the starter project cannot be written there (a parent that
    is not a directory, no permission)."""


class DirectoryNotEmpty(ProjectNotWritten):
    """``runledger init DIR``: DIR exists and holds something, or is not a directory (the
    starter project is written only into a new or empty directory)."""


REGISTRY: dict[str, type[RunLedgerError]] = {
    cls.sqlstate: cls
    for cls in (
        LeaseLost,
        VersionConflict,
        RunNotFound,
        InvalidTransition,
        RunConflict,
        InvalidInput,
        InvariantViolation,
        WorkerConflict,
        SenderActive,
    )
    if cls.sqlstate is not None
}


def from_sqlstate(sqlstate: str | None, message: str, **fields: Any) -> RunLedgerError | None:
    """Build the exception registered for ``sqlstate``, or ``None`` when it is not ours."""
    if sqlstate is None:
        return None
    cls = REGISTRY.get(sqlstate)
    if cls is None:
        return None
    return cls(message, **fields)
