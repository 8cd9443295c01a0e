"""No page of the documentation names a file, a heading or a module that does not exist
(no database).

Every page of docs/, the README and bench/README.md is read, fenced blocks included for
paths and modules, excluded for links:

- a relative Markdown link names a file that exists, and its ``#anchor`` a heading of
  that file (GitHub's slug, ``-1``, ``-2`` for repeated headings);
- a repository path (``service/...``, ``tests/...``, ``bench/...``, ``scripts/...``,
  ``migrations/...``, ``deploy/...``, ``docs/...``, ``examples/...``) names a file or
  directory that exists; a glob (``tests/*/conftest.py``), a placeholder (``<name>``)
  or a test id's ``::test`` part is not checked;
- a dotted name ``runledger.a.b`` is a module or package under service/runledger/, down
  to its first component that is not one, which must be a name its module's source
  defines or imports. ``runledger.x`` where ``x`` is neither a module nor a name of the
  package is a database object (``runledger.claim_runs_v4``, ``runledger.runs``) and is
  not checked here (tests/unit/test_docs.py checks those).
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "service" / "runledger"
TOPS = ("service", "tests", "bench", "scripts", "migrations", "deploy", "docs", "examples")
PATH = re.compile(r"(?<![\w./-])(?:" + "|".join(TOPS) + r")/[\w./*<>{}\[\]-]*[\w/*>}\]]")
MODULE = re.compile(r"(?<![\w.])runledger(?:\.[A-Za-z_]\w*)+")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def pages() -> list[Path]:
    found = sorted((ROOT / "docs").glob("*.md"))
    assert len(found) >= 10, found
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *found]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    seen: Counter[str] = Counter()
    found = set()
    for m in re.finditer(r"^#{1,6} (.+?)#*$", text, re.M):
        s = slug(m.group(1))
        found.add(s if not seen[s] else f"{s}-{seen[s]}")
        seen[s] += 1
    found |= set(re.findall(r'<a (?:name|id)="([^"]+)"', text))
    return found


def broken_links(page: Path, text: str) -> list[str]:
    bad = []
    for link in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", text)):
        if re.match(r"[a-z]+:", link):
            continue  # an absolute URL or mailto:
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            bad.append(f"link {link}: no file {path.relative_to(ROOT)}")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            bad.append(f"link {link}: no heading #{anchor} in {path.name}")
    return bad


def broken_paths(text: str) -> list[str]:
    bad = []
    for m in PATH.finditer(text):
        path = m.group(0).split("::")[0].rstrip(".")
        if re.search(r"[*<>{}\[\]]", path):
            continue  # a glob or a placeholder
        if not (ROOT / path).exists():
            bad.append(f"path {path}: no such file")
    return bad


def _module(parts: list[str]) -> Path | None:
    base = PACKAGE.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def broken_modules(text: str) -> list[str]:
    bad = []
    for name in sorted(set(MODULE.findall(text))):
        parts = name.split(".")[1:]
        source = PACKAGE / "__init__.py"
        for i, part in enumerate(parts):
            found = _module(parts[: i + 1])
            if found:
                source = found
                continue
            if re.search(rf"\b{re.escape(part)}\b", source.read_text(encoding="utf-8")):
                break  # a name the module defines or imports
            if i > 0:
                bad.append(f"module {name}: {'.'.join(parts[: i + 1])} is not in runledger")
            break  # i == 0: a database object
    return bad


def problems(page: Path, text: str) -> list[str]:
    return broken_links(page, text) + broken_paths(text) + broken_modules(text)


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_file_heading_and_module_named_exists(page: Path) -> None:
    found = problems(page, page.read_text(encoding="utf-8"))
    assert not found, f"{page.relative_to(ROOT)}:\n" + "\n".join(found)


def test_the_checks_find_what_is_missing() -> None:
    page = ROOT / "docs" / "design.md"
    text = (
        "[a](nowhere.md) [b](leases.md#no-such-heading) `service/runledger/db/gone.py` "
        "`tests/unit/test_gone.py::test_x` `runledger.db.gone` `runledger.worker.nothing_here`"
    )
    assert len(problems(page, text)) == 6, problems(page, text)


def test_the_checks_spare_what_exists() -> None:
    page = ROOT / "docs" / "design.md"
    text = (
        "[a](leases.md#the-mechanism) [b](../README.md) [c](https://example.com/x.md) "
        "`tests/*/conftest.py` `service/runledger/db/sql/` `tests/unit/test_docs.py::test_x` "
        "`runledger.claim_runs_v4` `runledger.errors` `runledger.Flow`"
    )
    assert problems(page, text) == []
