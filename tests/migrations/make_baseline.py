"""Write the 0.1 baseline revision's SQL from the living files (a maintainer's tool).

    python -m tests.migrations.make_baseline

writes, in ``migrations/versions``:

- ``0_1_baseline.sql``: the living files as ``runledger.db.schema.install`` runs them;
- ``0_1_baseline.from_0032.sql``: what brings a database of the last revision before the
  baseline (0032, runledger at 4b19f01) to the same catalog: DROP FUNCTION of each
  function the baseline retired, CREATE OR REPLACE of each function whose text changed
  (comments inside a body are part of it). migrations/env.py runs it, then stamps the
  version table.

Run it while revision 0.1 is open (until the 0.1.0 release) after a change of the living
files; ``tests/migrations/test_baseline.py`` fails when the files and the revision differ.
Once 0.1.0 is released both files are frozen and this tool has no more use.
"""

from __future__ import annotations

import io
import re
import subprocess
import tarfile
from pathlib import Path

from runledger.db import schema

ROOT = Path(__file__).resolve().parents[2]
VERSIONS = ROOT / "migrations" / "versions"
LAST_BEFORE_BASELINE_COMMIT = "4b19f01"  # runledger at revision 0032

HEADER = """\
-- Revision 0.1, the baseline of runledger 0.1: the whole schema, as the living files in
-- service/runledger/db/sql/ had it at the release (tests/migrations/make_baseline.py
-- wrote it from them). An empty database gets it from `runledger migrate`; a database
-- at revision 0032 is brought to it by 0_1_baseline.from_0032.sql (migrations/env.py).
"""

FROM_0032_HEADER = """\
-- From revision 0032 (runledger at 4b19f01) to the baseline 0.1: the same schema but for
-- the function versions that no caller of 0.1 uses, and the text of the functions whose
-- comments changed. migrations/env.py runs it in one transaction with the stamp of the
-- version table, under the migration lock. tests/migrations/make_baseline.py wrote it.
"""

_FUNCTION = re.compile(r"^CREATE FUNCTION (runledger\.\w+\([^)]*\))", re.M)


def functions(sql: str) -> dict[str, str]:
    """Each ``CREATE FUNCTION`` statement of ``sql`` by its header (name and arguments),
    from ``CREATE`` to the ``$$;`` that ends its body."""
    found: dict[str, str] = {}
    for match in _FUNCTION.finditer(sql):
        body = sql.index("AS $$", match.start()) + len("AS $$")
        end = sql.index("$$;", body) + len("$$;")
        key = " ".join(match.group(1).split())
        assert key not in found, f"{key} is defined twice"
        found[key] = sql[match.start() : end]
    return found


def _without_functions_and_comments(sql: str, dropped: frozenset[str] = frozenset()) -> list[str]:
    """What is left of ``sql`` without its functions and comments; without the lines of
    a grant list that name a function of ``dropped`` either (its grant goes with it)."""
    for text in functions(sql).values():
        sql = sql.replace(text, "")
    lines = [line.split("--", 1)[0].rstrip() for line in sql.splitlines()]
    kept: list[str] = []
    depth = 0  # open parentheses of a dropped function's signature
    for line in lines:
        if depth or any(f"{name}(" in line for name in dropped):
            depth += line.count("(") - line.count(")")
            continue
        if line.strip():
            kept.append(line)
    return kept


def living_sql_at(commit: str) -> str:
    """The living files of ``commit``, concatenated as :func:`schema.living_sql` does."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "service/runledger/db/sql"],
        capture_output=True,
        check=True,
    ).stdout
    parts = []
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = Path(member.name).name
            if member.isfile() and re.fullmatch(r"\d\d_.*\.sql", name):
                file = tar.extractfile(member)
                assert file is not None
                parts.append(f"-- file: {name}\n{file.read().decode('utf-8')}")
    return "\n".join(parts)


def _arguments(header: str) -> str:
    """``runledger.f(p_a text, p_b int DEFAULT 0)`` -> ``runledger.f(text, int)``."""
    name, args = header.split("(", 1)
    types = []
    for arg in args.rstrip(")").split(","):
        words = arg.split(" DEFAULT ")[0].split()
        if words:
            types.append(" ".join(words[1:]))
    return f"{name}({', '.join(types)})"


def from_0032(before: str, after: str) -> str:
    old, new = functions(before), functions(after)
    dropped = frozenset(key.split("(")[0] for key in set(old) - set(new))
    if _without_functions_and_comments(before, dropped) != _without_functions_and_comments(after):
        raise SystemExit(
            "the living files changed more than functions since 0032: write that change"
            " into 0_1_baseline.from_0032.sql by hand"
        )
    assert set(new) <= set(old), f"functions new since 0032: {sorted(set(new) - set(old))}"
    out = [FROM_0032_HEADER]
    for key in sorted(set(old) - set(new)):
        out.append(f"DROP FUNCTION {_arguments(key)};\n")
    for key, text in new.items():
        if text != old[key]:
            out.append("\n" + text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1))
            out.append("\n")
    return "".join(out)


def main() -> None:
    living = schema.living_sql()
    (VERSIONS / "0_1_baseline.sql").write_text(HEADER + "\n" + living, encoding="utf-8")
    upgrade = from_0032(living_sql_at(LAST_BEFORE_BASELINE_COMMIT), living)
    (VERSIONS / "0_1_baseline.from_0032.sql").write_text(upgrade, encoding="utf-8")


if __name__ == "__main__":
    main()
