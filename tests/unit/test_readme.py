"""The README's first screen and the pages it sends readers to (no database):

- it stays short, and opens with its example (tests/process/test_readme.py runs it);
- its table of contents lists its sections, each with a working anchor;
- its two commands are there as .ci/run reads them, and "run it" installs the [demo]
  extra, not the test stack;
- every relative link of the README and of the pages moved out of it names a file that
  exists, and every ``#anchor`` a heading of that file.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README] + [ROOT / "docs" / f"{n}.md" for n in ("guide", "database", "on-call", "testing")]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def headings(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return [m.group(2) for m in re.finditer(r"^(#{1,6}) (.+)$", text, re.M)]


def command(tag: str) -> str:
    """The README line that ends ``# <tag>``, without the tag, as .ci/run extracts it."""
    lines = [line for line in README.read_text().splitlines() if line.endswith(f"# {tag}")]
    assert len(lines) == 1, lines
    return re.sub(r"\s+# " + tag + "$", "", lines[0])


def test_the_readme_is_short_and_opens_with_its_example() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 250
    first_block = next(i for i, line in enumerate(lines, 1) if line.startswith("```"))
    assert first_block <= 12, first_block
    assert lines[first_block - 1] == "```python"


def test_the_contents_list_every_section_with_a_working_anchor() -> None:
    text = README.read_text(encoding="utf-8")
    contents = text[text.index("## Contents\n") :]
    contents = contents[: contents.index("\n## ")]
    anchors = re.findall(r"^- \[.+\]\(#([\w-]+)\)$", contents, re.M)
    sections = re.findall(r"^## (.+)$", text, re.M)
    assert sections[0] == "Contents"
    assert anchors == [slug(h) for h in sections[1:]]


def test_run_it_installs_the_demo_extra_and_test_it_is_the_script() -> None:
    run_it = command("run it")
    assert 'pip install -e ".[demo]"' in run_it and run_it.endswith("&& runledger demo")
    assert command("test it") == "scripts/test"
    assert os.access(ROOT / "scripts" / "test", os.X_OK)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["demo"] == ["runledger-pg[pydantic-ai,embedded]"]  # no test stack


def links(path: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.S | re.M)
    return re.findall(r"\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_names_a_file_and_a_heading_that_exist(page: Path) -> None:
    found = links(page)
    assert found
    for link in found:
        if re.match(r"\w+:", link):
            continue  # an absolute URL
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link} names no file"
        if anchor:
            assert anchor in {slug(h) for h in headings(path)}, f"{page.name}: {link}"
