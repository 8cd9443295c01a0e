"""Read facts out of the contract SQL text (no database): regexes and CHECK word lists.

The text is the living contract, ``service/runledger/db/sql/*.sql`` concatenated in install
order (what ``runledger.db.schema.install`` runs), not any one frozen revision.
"""

from __future__ import annotations

import re
from functools import cache

from runledger.db import schema

SQL_SOURCE = "the living SQL files (runledger/db/sql)"

# What the SQL patterns may contain for the translation below to be exact: anchors,
# bracket expressions of ASCII letters/digits/punctuation, and {m,n} bounds.
_SIMPLE_POSIX = re.compile(r"\^(?:\[[A-Za-z0-9._:@+\-]+\](?:\{\d+,\d+\})?|@)+\$")


@cache
def sql_text() -> str:
    return schema.living_sql()


def sql_patterns(subject: str) -> list[str]:
    """Every POSIX regex the SQL matches ``subject`` against with ``~`` or ``!~``."""
    found = re.findall(
        r"(?<![\w>])" + re.escape(subject) + r"\s*(?:!?~|OPERATOR\(pg_catalog\.!?~\))\s*'([^']*)'",
        sql_text(),
    )
    assert found, f"no regex applied to {subject!r} in {SQL_SOURCE}"
    return found


def sql_pattern(subject: str) -> str:
    patterns = set(sql_patterns(subject))
    assert len(patterns) == 1, f"{subject!r} is checked against different regexes: {patterns}"
    return patterns.pop()


def as_python(posix: str) -> re.Pattern[str]:
    """The same language for ``re.fullmatch``.

    PostgreSQL's ``$`` matches only at the very end, Python's also before a final newline,
    so the anchors are dropped and the caller uses ``fullmatch``. Everything else in these
    patterns (bracket expressions of ASCII ranges, ``{m,n}``) means the same in both.
    """
    assert _SIMPLE_POSIX.fullmatch(posix), f"pattern outside the translatable subset: {posix}"
    return re.compile(posix[1:-1])


def check_words(constraint: str) -> list[str]:
    """The quoted words of ``CONSTRAINT <constraint> CHECK (... IN (...))``; since revision
    0027 the constraint calls ``runledger._<constraint>(...)``, whose body is that
    expression, schema-qualified (``RETURN <column> OPERATOR(pg_catalog.=) ANY (ARRAY[...])``)."""
    sql = sql_text()
    assert re.search(
        re.escape(constraint) + r"\s+CHECK\s*\(\s*runledger\._" + re.escape(constraint) + r"\(",
        sql,
    ), f"no CHECK named {constraint} calling its function"
    match = re.search(
        r"FUNCTION runledger\._"
        + re.escape(constraint)
        + r"\([^)]*\)[^$]*\$\$ BEGIN\s+RETURN \w+ OPERATOR\(pg_catalog\.=\) ANY"
        + r" \(ARRAY\[([^\]]*)\]",
        sql,
        re.S,
    )
    assert match, f"no function of {constraint} returning ... = ANY (ARRAY[...])"
    return re.findall(r"'([^']*)'", match.group(1))


def word_arrays(what: str) -> list[str]:
    """The ARRAY[...] passed to ``runledger._check_word('<what>', ...)``."""
    match = re.search(
        r"_check_word\('" + re.escape(what) + r"',\s*\w+,\s*ARRAY\[([^\]]*)\]", sql_text()
    )
    assert match, f"no _check_word('{what}', ...) in the SQL"
    return re.findall(r"'([^']*)'", match.group(1))


def raised_sqlstates() -> set[str]:
    """Every SQLSTATE of class RL that the SQL raises."""
    return set(re.findall(r"_raise\('(RL\d{3})'", sql_text()))


def call_args(text: str, open_paren: int) -> list[str]:
    """The top-level arguments of the call whose ``(`` is at ``open_paren``: commas inside
    parentheses, brackets and string literals do not split."""
    args: list[str] = []
    depth, start, i = 0, open_paren + 1, open_paren
    while True:
        ch = text[i]
        if ch == "'":
            i = text.index("'", i + 1)  # SQL's '' escape is two literals side by side
        elif ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
            if depth == 0:
                args.append(text[start:i].strip())
                return args
        elif ch == "," and depth == 1:
            args.append(text[start:i].strip())
            start = i + 1
        i += 1


def batched_event_kinds(text: str) -> list[tuple[str, list[str]]]:
    """Each ``runledger._events(...)`` call (revision 0028: the events of one write in one
    INSERT) with the quoted kinds of its kinds argument (the fifth; for a variable, the
    expression last assigned to it before the call), in call order."""
    found = []
    for m in re.finditer(r"(?<!FUNCTION )runledger\._events\(", text):
        kinds_arg = call_args(text, m.end() - 1)[4]
        if re.fullmatch(r"v_\w+", kinds_arg):  # a variable: its last assignment before
            sets = list(
                re.finditer(re.escape(kinds_arg) + r"\s*:=\s*(.*?);", text[: m.start()], re.S)
            )
            assert sets, f"{kinds_arg} is never assigned before _events"
            kinds_arg = sets[-1].group(1)
        # the literals of its ARRAY[...] and array_fill('...', ...) parts (not a condition's)
        parts = re.findall(r"ARRAY\[([^\]]*)\]|array_fill\(('[a-z_]+')", kinds_arg)
        found.append((kinds_arg, re.findall(r"'([a-z_]+)'", " ".join(a + b for a, b in parts))))
    return found
