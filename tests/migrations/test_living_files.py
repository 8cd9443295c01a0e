"""The living SQL files keep their house rules (no database): a header map, one writer of
events with literal kinds, and nothing left of the helpers 0002 replaced."""

from __future__ import annotations

import re

from runledger.db import schema
from tests.unit.sql_source import batched_event_kinds

CALL = re.compile(r"(?<!FUNCTION )runledger\._event\((?!\.\.\.)")
LITERAL_KIND = re.compile(r"runledger\._event\(\s*[\w.]+,\s*'([a-z_]+)',")


def _text() -> str:
    return schema.living_sql()


def test_files_are_numbered_in_install_order_and_mapped_in_the_first() -> None:
    files = schema.living_files()
    prefixes = [f.name[:2] for f in files]
    assert prefixes == sorted(set(prefixes)), "two files share a number"
    assert [f.name for f in files][:2] == ["00_clock.sql", "01_tables.sql"]
    header = files[0].read_text(encoding="utf-8").split("CREATE SCHEMA", 1)[0]
    missing = [f.name for f in files if f.name not in header]
    assert missing == [], f"the header map of {files[0].name} does not list {missing}"


def test_every_event_is_written_by_event_with_a_literal_kind() -> None:
    text = _text()
    calls = [m.start() for m in CALL.finditer(text)]
    literal = {m.start(): m.group(1) for m in LITERAL_KIND.finditer(text)}
    computed = [text[i : i + 80].splitlines()[0] for i in calls if i not in literal]
    assert computed == [], f"event kinds not written as a literal: {computed}"
    assert len(literal) >= 20
    kinds = set(literal.values())
    assert {"claimed", "takeover", "renewal_failed", "run_paused", "call_unknown"} <= kinds
    # _event and _events (revision 0028: the events of one write in one INSERT) are the
    # only INSERTs INTO run_events, and every kind _events writes is a literal too
    inserts = re.findall(r"INSERT INTO runledger\.run_events", text)
    assert len(inserts) == 2
    for name in ("_event(", "_events("):
        definition = text[text.index(f"CREATE FUNCTION runledger.{name}") :]
        assert definition.index("INSERT INTO runledger.run_events") < definition.index("$$;")
    batched = batched_event_kinds(text)
    assert len(batched) >= 2
    for kinds_arg, batch_kinds in batched:
        assert batch_kinds, f"_events kinds not written as literals: {kinds_arg}"
        assert not re.search(r"\|\|\s*p_\w+|p_\w+\s*\|\|", kinds_arg), kinds_arg


def test_lease_history_lists_only_kinds_that_are_written() -> None:
    text = _text()
    view = text[text.index("CREATE VIEW runledger.lease_history") :]
    listed = re.findall(r"'([a-z_]+)'", view[view.index("e.kind IN") : view.index(");")])
    written = set(LITERAL_KIND.findall(text))
    written |= {k for _, kinds in batched_event_kinds(text) for k in kinds}
    assert listed and set(listed) <= written, set(listed) - written


def test_no_bare_boolean_json_check_is_left() -> None:
    text = _text()
    assert "_check_json(" not in text
    assert "pg_notify('runledger_runs'" in text
    # the senders: runledger._notify_queued (runs), runledger._event (events, 0015) and
    # runledger._events (the events of one write, 0028)
    assert text.count("pg_notify('runledger_events'") == 2
    assert text.count("pg_notify(") == 3, "notify through _notify_queued, _event, _events only"
    for check in ("_check_worker_id", "_check_lease", "_check_flow"):
        assert text.count(f"runledger.{check}(") >= 2, f"{check} defined but never used"


def test_the_two_event_writers_share_their_rules() -> None:
    """_event and _events (revision 0028) notify the same kinds, their lists word for
    word, and refuse an isolation level through the one helper."""
    text = _text()

    def body(name: str) -> str:
        start = text.index(f"CREATE FUNCTION runledger.{name}(")
        return text[start : text.index("$$;", text.index("AS $$", start))]

    def quiet(b: str) -> list[str]:
        found = re.search(r"NOT IN \(('call_dispatched'.*?)\)", b, re.S)
        assert found, "no list of kinds left unnotified"
        return re.findall(r"'([a-z_]+)'", found.group(1))

    one, many = body("_event"), body("_events")
    assert quiet(one) == quiet(many) and len(quiet(one)) == 7
    for b in (one, many):
        assert "PERFORM runledger._refuse_event_isolation(p_run_id);" in b
        assert "_raise(" not in b
    assert "read committed" in body("_refuse_event_isolation")
