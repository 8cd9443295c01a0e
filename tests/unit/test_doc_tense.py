"""The pages of docs/ describe runledger as it is (no database).

How it got there (the revisions before release 0.1, what each one changed, what came
before) is docs/history.md's and CHANGELOG.md's to tell. Every other page of docs/, and
the README, is checked for:

- a revision number: ``revision 0016``, ``Revision 0.2``, ``before 0025``, a bare
  ``0031``;
- narration of change: ``until revision``, ``before release``, ``used to``,
  ``formerly``, ``previously``, ``now ... instead``.

A match is allowed only where ALLOWED names it: text that is legitimately about versions
(the migration from the revisions before 0.1, an upgrade under running workers).
Function names such as ``claim_runs_v4`` and version strings such as ``0.1`` or
``githubkit>=0.16`` never match.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
EXEMPT = {"history.md"}  # the history itself (CHANGELOG.md is outside docs/)

PATTERNS = {
    "a revision number": re.compile(r"\brevisions?\s+0\.?\d+\b|(?<![\w.:/-])0\d{3}(?![\w.])", re.I),
    "narration of change": re.compile(
        r"\b(?:until|before|since|after)\s+(?:revision|release)\b"
        r"|\bused\s+to\b|\bformerly\b|\bpreviously\b|\bnow\b[^.\n]{0,80}\binstead\b",
        re.I,
    ),
}

# (page, a phrase of the sentence that matches): text about versions on purpose.
ALLOWED = {
    # the 0.1 baseline replaces the revisions written before it: how to migrate from them
    ("design.md", "the last of those revisions (0032)"),
    ("design.md", "to upgrade it to 0032 with a runledger from before 0.1"),
    # the output of /readyz on a worker whose code is behind the schema
    ("operating.md", "`not ready: schema revision 0.2, this code's head is 0.1`"),
    ("operating.md", "`not ready: schema revision 0.1, this code's head is 0.2`"),
}


def pages() -> list[Path]:
    found = sorted(p for p in DOCS.glob("*.md") if p.name not in EXEMPT)
    assert len(found) >= 10, found
    return [ROOT / "README.md", *found]


def offences(name: str, text: str) -> list[str]:
    """``line N: <what>: <the line>`` for each match not in ALLOWED."""
    allowed = [phrase for page, phrase in ALLOWED if page == name]
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for what, pattern in PATTERNS.items():
            for m in pattern.finditer(line):
                if any(m.group(0) in phrase and phrase in line for phrase in allowed):
                    continue
                found.append(f"line {n}: {what} {m.group(0)!r}: {line.strip()[:100]}")
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_the_page_is_in_the_present_tense(page: Path) -> None:
    found = offences(page.name, page.read_text(encoding="utf-8"))
    assert not found, (
        f"{page.name} narrates history (move it to docs/history.md, or add the sentence "
        "to ALLOWED if it is about versions on purpose):\n" + "\n".join(found)
    )


def test_every_allowed_phrase_is_still_on_its_page() -> None:
    stale = [
        (page, phrase)
        for page, phrase in ALLOWED
        if phrase not in (DOCS / page).read_text(encoding="utf-8")
    ]
    assert not stale, f"ALLOWED names text no page has any more: {stale}"


@pytest.mark.parametrize(
    "line",
    [
        "Revision 0010 (issue #10, deliverable 3).",
        "Until revision 0011 the worker waited.",
        "Before 0025 each writer locked the table.",
        "(0005 would send it unapproved).",
        "Roles: `runledger_worker`. Revision 0.2.",
        "The worker used to poll; it now listens instead.",
    ],
)
def test_the_patterns_catch_narration(line: str) -> None:
    assert offences("x.md", line)


@pytest.mark.parametrize(
    "line",
    [
        "`claim_runs_v4` takes the run; `record_turn_v4` refuses the next turn.",
        "Release 0.1 has one baseline; `githubkit>=0.16,<0.17`; 0.2-0.5 ms; port 5432.",
        "It listens on `127.0.0.1:8080`; commit 061b0a3; `00_clock.sql` opens the map.",
        "a call that can no longer land is sent again",
    ],
)
def test_the_patterns_spare_the_present(line: str) -> None:
    assert offences("x.md", line) == []
