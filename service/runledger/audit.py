"""Invariant checks over the run tables, the questions an auditor asks in SQL.

Each check is one query that returns the rows that break an invariant; an empty
answer is a pass (the checks and their queries: :mod:`runledger.db.audit`).
``runledger audit`` runs them all and exits 1 on any violation. The chain checks verify
the hash chains of run_events and their checkpoints; docs/audit.md explains them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runledger.db.audit import (
    CHAIN_CHECKS,
    CHECKS,
    Check,
    audit_connection,
    checkpoint_digest,
    latest_checkpoint,
    lossless_failovers,
    violations,
)

__all__ = ["ANCHOR_CHECK", "CHAIN_CHECKS", "CHECKS", "Anchor", "Audit", "Check", "Finding", "audit"]


@dataclass(frozen=True, slots=True)
class Anchor:
    """A checkpoint digest kept outside the database (``--expect ID:DIGEST``)."""

    checkpoint_id: int
    digest: str


@dataclass(frozen=True, slots=True)
class Finding:
    check: Check
    rows: list[dict[str, Any]]

    @property
    def ok(self) -> bool:
        return not self.rows


ANCHOR_CHECK = Check(
    "checkpoint_anchor",
    "each checkpoint digest kept outside the database (--expect ID:DIGEST) is still the "
    "digest of that checkpoint",
    "",
)


@dataclass(frozen=True, slots=True)
class Audit:
    findings: list[Finding]
    latest: dict[str, Any] | None  # the newest checkpoint: the digest to keep outside
    # failovers recorded lossless (timelines.lossless), with their evidence: not violations
    lossless: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)


def run_checks(database_url: str, limit: int = 50) -> list[Finding]:
    """Run every check; each finding lists up to ``limit`` violating rows."""
    return audit(database_url, limit=limit).findings


def audit(database_url: str, *, limit: int = 50, expect: tuple[Anchor, ...] = ()) -> Audit:
    """Every check, the anchors kept outside checked against the checkpoints, and the
    newest checkpoint (the anchor to keep for the next audit)."""
    findings = []
    with audit_connection(database_url) as conn:
        for check in CHECKS:
            findings.append(Finding(check, violations(conn, check, limit)))
        latest = latest_checkpoint(conn)
        lossless = lossless_failovers(conn)
        if expect:
            broken = []
            for anchor in expect:
                found = checkpoint_digest(conn, anchor.checkpoint_id)
                if found != anchor.digest:
                    broken.append(
                        {
                            "checkpoint_id": anchor.checkpoint_id,
                            "expected": anchor.digest,
                            "found": found,
                            "problem": "the checkpoint is gone"
                            if found is None
                            else "the checkpoint's digest differs: the history was rewritten",
                        }
                    )
            findings.append(Finding(ANCHOR_CHECK, broken))
    return Audit(findings, latest, lossless)
