"""docs/design.md and docs/concepts.md state only what the SQL contract does (no database).

The SQL is read from the living files (service/runledger/db/sql/*.sql) when they exist,
else from the revisions (migrations/versions/*.sql). Checked:

- every ``runledger.<name>(...)`` signature in design.md is a function of the SQL with
  the same argument names, types, defaults and result, and every public function (no
  leading underscore) of the SQL is documented, each overload by its arity;
- every SQLSTATE a function can raise (itself or through its helpers) and every event
  kind it writes are named in its section; every event kind of the SQL is in design.md,
  and every kind design.md lists is written by the SQL;
- the SQLSTATE table names each ``RL`` code with its exception of ``runledger.errors``;
- the roles named in each section are the roles granted EXECUTE on it;
- constraint, index, trigger and helper names in design.md exist in the SQL;
- every mermaid block is a ``stateDiagram-v2`` whose states are statuses of the schema
  and whose arrows are each labelled with the SQL function that makes the move.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from runledger import errors
from tests.unit.sql_source import batched_event_kinds, check_words

ROOT = Path(__file__).resolve().parents[2]
LIVING = ROOT / "service" / "runledger" / "db" / "sql"
REVISIONS = ROOT / "migrations" / "versions"
DESIGN = ROOT / "docs" / "design.md"
CONCEPTS = ROOT / "docs" / "concepts.md"

# Documented ahead of the SQL that brings it (the split of issue 6 adds it). Once the
# SQL has a function of this name and arity, the signature must match it exactly.
PENDING = {("release_lease", 5)}

# Retired at 0.1 (issue 35): no caller of the release uses them, and the 0.1 baseline
# drops them from the living SQL. design.md documents only live functions; these are in
# docs/history.md.
RETIRED = {
    "claim_runs",
    "claim_runs_v2",
    "claim_runs_v3",
    "record_turn",
    "record_turn_v2",
    "record_turn_v3",
    "register_worker",
}
HISTORY = ROOT / "docs" / "history.md"


# -- reading the SQL ---------------------------------------------------------------------


def _sql_files() -> list[Path]:
    if LIVING.is_dir():
        files = sorted(LIVING.glob("*.sql"))
        assert files, f"{LIVING} exists but holds no .sql file"
        return files
    return sorted(p for p in REVISIONS.glob("*.sql") if not p.name.endswith(".down.sql"))


@cache
def sql_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in _sql_files())


@cache
def all_sql_text() -> str:
    """The current SQL plus the revisions: where a documented name may be found."""
    revisions = [p for p in REVISIONS.glob("*.sql") if not p.name.endswith(".down.sql")]
    return sql_text() + "\n".join(p.read_text(encoding="utf-8") for p in revisions)


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at ``text[start]``."""
    assert text[start] == "("
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise AssertionError(f"unbalanced parenthesis at {text[start : start + 60]!r}")


_TYPES = {"int": "integer", "int4": "integer", "int8": "bigint", "bool": "boolean"}


def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip()).lower()


def _norm_type(t: str) -> str:
    t = _norm(t)
    base, brackets = re.match(r"(.*?)((?:\[\])*)$", t).groups()  # type: ignore[union-attr]
    return _TYPES.get(base.strip(), base.strip()) + brackets


def _split_top(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += ch == "("
        depth -= ch == ")"
        cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts]


Arg = tuple[str, str, str | None]  # name, type, default


def _parse_args(inside: str) -> tuple[Arg, ...]:
    args: list[Arg] = []
    for part in _split_top(inside):
        m = re.fullmatch(
            r"(?:(?:IN|OUT|INOUT|VARIADIC)\s+)?(\w+)\s+(.+?)(?:\s+DEFAULT\s+(.+))?",
            part,
            re.S | re.I,
        )
        assert m, f"cannot read the argument {part!r}"
        default = _norm(m.group(3)) if m.group(3) else None
        args.append((m.group(1), _norm_type(m.group(2)), default))
    return tuple(args)


def _parse_returns(text: str, at: int) -> str:
    """The ``RETURNS ...`` clause starting at ``text[at:]``, normalized ('' if none)."""
    m = re.compile(r"\s*RETURNS\s+", re.I).match(text, at)
    if not m:
        return ""
    rest = m.end()
    t = re.compile(r"TABLE\s*", re.I).match(text, rest)
    if t:
        end = _balanced(text, t.end())
        cols = _parse_args(text[t.end() + 1 : end - 1])
        return "table (" + ", ".join(f"{n} {ty}" for n, ty, _ in cols) + ")"
    word = re.compile(r"[\w\[\]]+").match(text, rest)
    assert word, f"cannot read RETURNS at {text[at : at + 60]!r}"
    return _norm_type(word.group(0))


@dataclass(frozen=True)
class SqlFunction:
    name: str
    args: tuple[Arg, ...]
    returns: str
    body: str

    @property
    def arity(self) -> int:
        return len(self.args)


def _functions_in(text: str) -> list[SqlFunction]:
    found = []
    for m in re.finditer(r"CREATE\s+(?:OR\s+REPLACE\s+)?FUNCTION\s+runledger\.(\w+)\s*(\()", text):
        close = _balanced(text, m.start(2))
        returns = _parse_returns(text, close)
        tag = re.compile(r"\bAS\s+(\$\w*\$)", re.I).search(text, close)
        assert tag, f"no body for runledger.{m.group(1)}"
        end = text.index(tag.group(1), tag.end())
        args = _parse_args(text[m.start(2) + 1 : close - 1])
        found.append(SqlFunction(m.group(1), args, returns, text[tag.end() : end]))
    return found


@cache
def functions() -> list[SqlFunction]:
    fns = _functions_in(sql_text())
    assert fns, "no CREATE FUNCTION runledger.* in the SQL"
    return fns


@cache
def all_function_names() -> set[str]:
    return {f.name for f in _functions_in(all_sql_text())}


def public_functions() -> list[SqlFunction]:
    return [f for f in functions() if not f.name.startswith("_")]


def live_functions() -> list[SqlFunction]:
    """The public functions of the contract: those the SQL defines."""
    return public_functions()


def bodies(name: str) -> str:
    return "\n".join(f.body for f in functions() if f.name == name)


def raised_codes(name: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """SQLSTATEs a function raises itself or through the helpers it calls."""
    body = bodies(name)
    codes = set(re.findall(r"_raise\(\s*'(RL\d{3})'", body))
    for helper in set(re.findall(r"runledger\.(_\w+)\s*\(", body)) - seen - {name}:
        codes |= raised_codes(helper, seen | {name})
    return codes


def _expand(body: str, prefix: str, var: str) -> set[str]:
    words = re.search(
        r"_check_word\(\s*'[^']*'\s*,\s*" + re.escape(var) + r"\s*,\s*ARRAY\[([^\]]*)\]", body
    )
    if not words:
        return {prefix + "*"}  # cannot expand: any documented kind with this prefix
    return {prefix + w for w in re.findall(r"'([^']*)'", words.group(1))}


def event_kinds(body: str) -> set[str]:
    """Kinds written through ``_event(run, '<kind>', ...)`` or a direct INSERT."""
    kinds: set[str] = set()
    call = r"_event\(\s*[\w.]+\s*,\s*'([a-z_]+)'(?:\s*\|\|\s*(\w+))?"
    for m in re.finditer(call, body):
        kinds |= _expand(body, m.group(1), m.group(2)) if m.group(2) else {m.group(1)}
    insert = (
        r"INSERT\s+INTO\s+runledger\.run_events\s*\([^)]*\)\s*SELECT\s+[^,]+,\s*[^,]+,\s*"
        r"(CASE\b.*?\bEND|'[a-z_]+')"
    )
    for m in re.finditer(insert, body, re.S | re.I):
        kinds |= set(re.findall(r"'([a-z_]+)'", m.group(1)))
    for _, batch in batched_event_kinds(body):  # revision 0028: _events(..., ARRAY[kinds])
        kinds |= set(batch)
    return kinds


def all_event_kinds() -> set[str]:
    return set().union(*(event_kinds(f.body) for f in functions()))


def _kind_matches(kind: str, patterns: set[str]) -> bool:
    return kind in patterns or any(p.endswith("*") and kind.startswith(p[:-1]) for p in patterns)


# -- reading the docs ---------------------------------------------------------------------


@cache
def design() -> str:
    return DESIGN.read_text(encoding="utf-8")


def _code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(r"^```" + lang + r"[ \t]*\n(.*?)^```", text, re.S | re.M)


@dataclass(frozen=True)
class DocSignature:
    name: str
    args: tuple[Arg, ...]
    returns: str
    text: str


@cache
def doc_signatures() -> list[DocSignature]:
    sigs = []
    for block in _code_blocks(design(), "sql"):
        block = re.sub(r"--[^\n]*", "", block)
        for m in re.finditer(r"^[ \t]*runledger\.(\w+)(\()", block, re.M):
            close = _balanced(block, m.start(2))
            args = _parse_args(block[m.start(2) + 1 : close - 1])
            returns = _parse_returns(block, close)
            sigs.append(DocSignature(m.group(1), args, returns, block[m.start() : close]))
    assert sigs, "no runledger.<name>(...) signature in docs/design.md"
    return sigs


def section(name: str) -> str:
    """The part of design.md under the heading that names ``name``."""
    m = re.search(r"^(#{2,4}) `(?:runledger\.)?" + re.escape(name) + r"`[^\n]*\n", design(), re.M)
    assert m, f"docs/design.md has no heading for {name}"
    nxt = re.compile(rf"^#{{1,{len(m.group(1))}}} ", re.M).search(design(), m.end())
    return design()[m.end() : nxt.start() if nxt else len(design())]


def mermaid_blocks() -> list[tuple[str, str]]:
    return [
        (p.name, block)
        for p in (DESIGN, CONCEPTS)
        for block in _code_blocks(p.read_text(encoding="utf-8"), "mermaid")
    ]


# -- signatures ---------------------------------------------------------------------------


def test_every_documented_function_exists_in_the_sql() -> None:
    missing = {s.name for s in doc_signatures()} - all_function_names()
    assert not missing, f"docs/design.md documents functions the SQL lacks: {sorted(missing)}"


@pytest.mark.parametrize("sig", doc_signatures(), ids=lambda s: f"{s.name}/{len(s.args)}")
def test_documented_signature_is_exact(sig: DocSignature) -> None:
    same_arity = [f for f in functions() if f.name == sig.name and f.arity == len(sig.args)]
    if not same_arity:
        assert (sig.name, len(sig.args)) in PENDING, (
            f"runledger.{sig.name} has no overload of {len(sig.args)} arguments in the SQL"
        )
        return
    (fn,) = same_arity
    assert sig.args == fn.args, f"arguments of runledger.{sig.name} differ from the SQL"
    assert sig.returns == fn.returns, f"result of runledger.{sig.name} differs from the SQL"


def test_every_public_function_is_documented() -> None:
    documented = {(s.name, len(s.args)) for s in doc_signatures()}
    missing = sorted(
        f"{f.name}/{f.arity}" for f in live_functions() if (f.name, f.arity) not in documented
    )
    assert not missing, f"public SQL functions missing from docs/design.md: {missing}"


def test_retired_functions_are_history_not_contract() -> None:
    """The SQL defines no retired function, design.md names none, history.md each one."""
    defined = sorted(RETIRED & {f.name for f in public_functions()})
    assert not defined, f"the living SQL still defines retired functions: {defined}"
    text = design()
    named = sorted(n for n in RETIRED if re.search(rf"`(?:runledger\.)?{n}`|\b{n}\(", text))
    assert not named, f"docs/design.md still documents retired functions: {named}"
    history = HISTORY.read_text(encoding="utf-8")
    untold = sorted(n for n in RETIRED if f"`{n}`" not in history)
    assert not untold, f"docs/history.md does not tell of the retired functions: {untold}"


def versions_by_name(names: Iterable[str]) -> dict[str, list[str]]:
    """``{base name: [its live versions]}``: ``claim_runs_v4`` is a version of ``claim_runs``."""
    found: dict[str, set[str]] = {}
    for name in names:
        found.setdefault(re.sub(r"_v[0-9]+$", "", name), set()).add(name)
    return {base: sorted(versions) for base, versions in sorted(found.items())}


def test_at_most_two_versions_of_a_function_are_live() -> None:
    """CONTRIBUTING.md, "Function versions": ``name_v2`` in release N, the old name dropped
    in release N+1, so no name has more than two live versions."""
    many = {
        base: versions
        for base, versions in versions_by_name(f.name for f in public_functions()).items()
        if len(versions) > 2
    }
    assert many == {}, f"more than two live versions of a function: {many}"


def test_the_version_count_sees_suffixes() -> None:
    assert versions_by_name(["claim_runs", "claim_runs_v2", "claim_runs_v3", "now"]) == {
        "claim_runs": ["claim_runs", "claim_runs_v2", "claim_runs_v3"],
        "now": ["now"],
    }


def test_no_signature_documented_twice() -> None:
    keys = [(s.name, len(s.args)) for s in doc_signatures()]
    assert len(keys) == len(set(keys))


# -- refusals, events, roles ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted({f.name for f in live_functions()}))
def test_section_names_every_sqlstate_the_function_raises(name: str) -> None:
    text = section(name)
    missing = sorted(c for c in raised_codes(name) if c not in text)
    assert not missing, f"the section of {name} omits the SQLSTATEs it raises: {missing}"


@pytest.mark.parametrize("name", sorted({f.name for f in live_functions()}))
def test_section_names_every_event_the_function_writes(name: str) -> None:
    text = section(name)
    documented = set(re.findall(r"`([a-z_]+)`", text))
    for kind in event_kinds(bodies(name)):
        if kind.endswith("*"):
            assert any(d.startswith(kind[:-1]) for d in documented), (name, kind)
        else:
            assert kind in documented, f"the section of {name} omits the event {kind}"


def test_every_event_kind_is_in_design() -> None:
    kinds = all_event_kinds()
    assert {"submitted", "claimed", "takeover", "renewal_failed"} <= kinds  # the parser works
    documented = set(re.findall(r"`([a-z_]+)`", design()))
    missing = sorted(k for k in kinds if not k.endswith("*") and k not in documented)
    assert not missing, f"event kinds missing from docs/design.md: {missing}"


def test_every_listed_event_kind_is_written_by_the_sql() -> None:
    events = design().split("\n## Events\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([a-z_]+)` \|", events, re.M)
    assert len(listed) >= 15
    kinds = all_event_kinds()
    unknown = [k for k in listed if not _kind_matches(k, kinds)]
    assert not unknown, f"docs/design.md lists event kinds the SQL never writes: {unknown}"


def test_sqlstate_table_matches_the_error_registry() -> None:
    for code, cls in errors.REGISTRY.items():
        assert re.search(rf"^\| {code} \| `{cls.__name__}` \|", design(), re.M), code
    raised = set(re.findall(r"_raise\(\s*'(RL\d{3})'", sql_text()))
    assert raised <= set(errors.REGISTRY), raised - set(errors.REGISTRY)


def _grants() -> dict[str, set[str]]:
    roles: dict[str, set[str]] = {}
    for m in re.finditer(r"GRANT\s+EXECUTE\s+ON\s+FUNCTION(.*?)\bTO\s+(\w+)", sql_text(), re.S):
        for fn in re.findall(r"runledger\.(\w+)\s*\(", m.group(1)):
            roles.setdefault(fn, set()).add(m.group(2))
    return roles


@pytest.mark.parametrize("name", sorted({f.name for f in live_functions()}))
def test_section_names_the_roles_granted(name: str) -> None:
    m = re.search(r"^Roles: (.*)$", section(name), re.M)
    assert m, f"the section of {name} has no 'Roles:' line"
    assert set(re.findall(r"`(runledger_\w+)`", m.group(1))) == _grants().get(name, set())


def test_named_schema_objects_exist() -> None:
    text = sql_text()
    names = set(re.findall(r"`((?:pk|fk|uq|ck|ix|tg)_\w+)`", design()))
    assert len(names) > 20
    missing = sorted(n for n in names if not re.search(rf"\b{n}\b", text))
    assert not missing, f"docs/design.md names objects the SQL lacks: {missing}"
    helpers = set(re.findall(r"`(?:runledger\.)?(_[a-z]\w*)`", design()))
    existing = {f.name for f in functions()}
    assert helpers <= existing, f"helpers named in docs/design.md: {sorted(helpers - existing)}"


# -- diagrams -----------------------------------------------------------------------------


def _statuses(constraint: str) -> set[str]:
    return set(check_words(constraint))  # the CHECK's words (its function's, since 0027)


def test_concepts_has_the_two_state_diagrams() -> None:
    blocks = [b for name, b in mermaid_blocks() if name == CONCEPTS.name]
    assert len(blocks) >= 2
    states = [{s for pair in re.findall(r"(\S+)\s*-->\s*(\S+)", b) for s in pair} for b in blocks]
    assert any(_statuses("ck_runs_status") <= s for s in states), "no complete run diagram"
    assert any(_statuses("ck_run_calls_status") <= s for s in states), "no complete call diagram"


@pytest.mark.parametrize(
    "where,block", mermaid_blocks(), ids=lambda v: v if isinstance(v, str) and len(v) < 20 else ""
)
def test_mermaid_block_is_a_state_diagram_of_real_moves(where: str, block: str) -> None:
    lines = [ln.strip() for ln in block.splitlines() if ln.strip()]
    assert lines and lines[0] == "stateDiagram-v2", f"{where}: a block must be a stateDiagram-v2"
    states = _statuses("ck_runs_status") | _statuses("ck_run_calls_status") | {"[*]"}
    names = {f.name for f in live_functions()}
    for line in lines[1:]:
        if line.startswith("%%"):
            continue
        m = re.fullmatch(r"(\S+)\s*-->\s*(\S+)\s*:\s*(\w+)\b.*", line)
        assert m, f"{where}: not a labelled transition: {line!r}"
        src, dst, fn = m.groups()
        assert {src, dst} <= states, f"{where}: unknown state in {line!r}"
        assert fn in names, f"{where}: {fn} in {line!r} is not a function of the SQL"
