"""All SQL lives under ``runledger/db/`` (issue #35), checked over the source's AST.

Outside ``db/`` no string literal may start with an SQL statement keyword: one passed to
``execute`` (or to ``sql.SQL``, or to anything), and also one bound to a name to be
passed later, since that is a statement too. A literal is the whole string constant, the
first piece of an f-string, or each operand of a ``+`` (``"LISTEN " + CHANNEL`` counts).
Keywords count in capitals only (as the code writes SQL; "Select a flow" is prose), and a
docstring or other bare string statement is never SQL. A file that administers the
server rather than the runledger schema is exempt by name, with its reason.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

SOURCE_ROOT = Path(__file__).resolve().parents[2] / "service"
TOP = "runledger"
DATA_LAYER = f"{TOP}/db"

KEYWORDS = (
    "SELECT",
    "INSERT",
    "UPDATE",
    "DELETE",
    "LISTEN",
    "NOTIFY",
    "SET",
    "SHOW",
    "CREATE",
    "DROP",
    "ALTER",
    "LOCK",
    "WITH",
)
STATEMENT = re.compile(r"\s*(?:" + "|".join(KEYWORDS) + r")\b")

# file (relative to service/) -> why its SQL stays outside db/
EXEMPT = {
    f"{TOP}/testing/postgres.py": (
        "administers the test server, not the runledger schema: its version, an advisory "
        "lock between test processes, CREATE/ALTER/DROP DATABASE of templates and clones"
    ),
}


@dataclass(frozen=True, slots=True)
class Found:
    file: str  # relative to the source root
    line: int
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.text[:70]!r}"


def _never_sql(tree: ast.AST) -> set[int]:
    """The ids of string constants that are no statement: bare string statements
    (docstrings), the pieces of an f-string after its first, and format specs."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        elif isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values[1:])
        elif isinstance(node, ast.FormattedValue) and node.format_spec is not None:
            skip.update(id(n) for n in ast.walk(node.format_spec))
    return skip


def statements_in(path: Path, name: str) -> list[Found]:
    """Every string literal of ``path`` (shown as ``name``) that starts with a keyword."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _never_sql(tree)
    return [
        Found(name, node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in skip
        and STATEMENT.match(node.value)
    ]


def stray_sql(root: Path, exempt: dict[str, str] = EXEMPT) -> list[Found]:
    """The statements of every module under ``root/runledger`` outside ``db/`` and
    ``exempt``, by file and line."""
    found: list[Found] = []
    for path in sorted((root / TOP).rglob("*.py")):
        name = path.relative_to(root).as_posix()
        if name.startswith(DATA_LAYER + "/") or name in exempt:
            continue
        found.extend(statements_in(path, name))
    return sorted(found, key=lambda f: (f.file, f.line))


# -- the package itself ----------------------------------------------------------------


def test_all_sql_is_under_db() -> None:
    stray = stray_sql(SOURCE_ROOT)
    assert not stray, "SQL outside runledger/db/ (move it into a db/ function):\n" + "\n".join(
        map(str, stray)
    )


def test_each_exemption_still_holds_sql_and_says_why() -> None:
    for name, reason in EXEMPT.items():
        path = SOURCE_ROOT / name
        assert path.is_file(), f"EXEMPT names {name}, which is gone"
        assert reason.strip(), f"EXEMPT {name} gives no reason"
        assert statements_in(path, name), f"EXEMPT {name} holds no SQL any more: drop it"


def test_the_scan_sees_the_data_layer_sql() -> None:
    # the same scan over db/ finds statements there: it reads the real files
    found = [
        f
        for path in sorted((SOURCE_ROOT / DATA_LAYER).rglob("*.py"))
        for f in statements_in(path, path.relative_to(SOURCE_ROOT).as_posix())
    ]
    files = {f.file for f in found}
    assert f"{DATA_LAYER}/batch.py" in files
    assert any(f.text.startswith("LISTEN ") for f in found)


# -- the scan against a fake module tree ------------------------------------------------

FAKE = {
    "__init__.py": '"""SELECT is how a docstring may start: prose."""\n',
    "db/__init__.py": "",
    "db/reads.py": 'def f(conn):\n    return conn.execute("SELECT 1")\n',
    "testing/postgres.py": 'def f(conn):\n    conn.execute("CREATE DATABASE x")\n',
    "cli/help.py": (
        "import click\n"
        '@click.command(help="Select a run; SET nothing.")\n'
        "def show(n):\n"
        '    print(f"{n:>5} rows")\n'
        '    print(f"shown: {n} SELECTED")\n'
    ),
    "demo/report.py": (
        "def read(conn, like):\n"
        '    """SELECT in a docstring is prose."""\n'
        "    return conn.execute(\n"
        '        "SELECT count(*) FROM runledger.runs "\n'
        '        "WHERE run_id LIKE %s", (like,)\n'
        "    ).fetchone()\n"
    ),
    "console/live.py": (
        'CHANNEL = "events"\nasync def listen(conn):\n    await conn.execute("LISTEN " + CHANNEL)\n'
    ),
    "worker/lock.py": (
        "from psycopg import sql\n"
        'LOCK = """\n  LOCK TABLE runledger.runs"""\n'
        "def f(conn, name):\n"
        '    conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(name)))\n'
        '    conn.execute(f"WITH x AS (SELECT {name}) SELECT * FROM x")\n'
        '    conn.execute(query="UPDATE runledger.runs SET status = %s", params=(name,))\n'
    ),
}


def fake_tree(tmp_path: Path) -> Path:
    for rel, source in FAKE.items():
        path = tmp_path / TOP / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return tmp_path


def test_the_scan_catches_sql_outside_db(tmp_path: Path) -> None:
    root = fake_tree(tmp_path)
    exempt = {f"{TOP}/testing/postgres.py": "the test server"}
    assert [str(f) for f in stray_sql(root, exempt)] == [
        f"{TOP}/console/live.py:3: 'LISTEN '",
        f"{TOP}/demo/report.py:4: 'SELECT count(*) FROM runledger.runs WHERE run_id LIKE %s'",
        f"{TOP}/worker/lock.py:2: '\\n  LOCK TABLE runledger.runs'",
        f"{TOP}/worker/lock.py:5: 'DROP TABLE {{}}'",
        f"{TOP}/worker/lock.py:6: 'WITH x AS (SELECT '",
        f"{TOP}/worker/lock.py:7: 'UPDATE runledger.runs SET status = %s'",
    ]


def test_an_exempt_file_is_caught_without_its_exemption(tmp_path: Path) -> None:
    root = fake_tree(tmp_path)
    found = {f.file for f in stray_sql(root, {})}
    assert f"{TOP}/testing/postgres.py" in found
    assert f"{TOP}/db/reads.py" not in found  # db/ is SQL's home, never scanned
    assert f"{TOP}/cli/help.py" not in found  # prose, an f-string's later pieces, a spec
    assert f"{TOP}/__init__.py" not in found  # a docstring
