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
    checkpoints_pruned,
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
            pruned = checkpoints_pruned(conn)
            broken = []
            for anchor in expect:
                found = checkpoint_digest(conn, anchor.checkpoint_id)
                if found != anchor.digest:
                    broken.append(
                        {
                            "checkpoint_id": anchor.checkpoint_id,
                            "expected": anchor.digest,
                            "found": found,
                            "problem": _anchor_problem(anchor, found, pruned),
                        }
                    )
            findings.append(Finding(ANCHOR_CHECK, broken))
    return Audit(findings, latest, lossless)


def _anchor_problem(anchor: Anchor, found: str | None, pruned: dict[str, Any] | None) -> str:
    """Why an anchor does not hold. One that retention pruned cannot be checked any more:
    still a failure (the database no longer holds what it pinned), said as such."""
    if found is not None:
        return "the checkpoint's digest differs: the history was rewritten"
    if pruned is not None and 0 < anchor.checkpoint_id <= pruned["through_checkpoint_id"]:
        return (
            f"the checkpoint was pruned by retention (checkpoints 1-"
            f"{pruned['through_checkpoint_id']}, pruned at {pruned['pruned_at']} by "
            f"{pruned['pruned_by']}): it can no longer be checked; keep the anchor of a "
            "newer audit"
        )
    return "the checkpoint is gone"
