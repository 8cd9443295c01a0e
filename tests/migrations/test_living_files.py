"""The living SQL files keep their house rules (no database): a header map, one writer of
events with literal kinds, and nothing left of the helpers 0002 replaced."""

from __future__ import annotations

import re

from runledger.db import schema

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
    # _event itself is the only INSERT INTO run_events.
    inserts = re.findall(r"INSERT INTO runledger\.run_events", text)
    assert len(inserts) == 1
    definition = text[text.index("CREATE FUNCTION runledger._event(") :]
    assert definition.index("INSERT INTO runledger.run_events") < definition.index("$$;")


def test_lease_history_lists_only_kinds_that_are_written() -> None:
    text = _text()
    view = text[text.index("CREATE VIEW runledger.lease_history") :]
    listed = re.findall(r"'([a-z_]+)'", view[view.index("e.kind IN") : view.index(");")])
    written = set(LITERAL_KIND.findall(text))
    assert listed and set(listed) <= written, set(listed) - written


def test_no_bare_boolean_json_check_is_left() -> None:
    text = _text()
    assert "_check_json(" not in text
    assert "pg_notify('runledger_runs'" in text
    # two senders: runledger._notify_queued (runs) and runledger._event (events, 0015)
    assert text.count("pg_notify('runledger_events'") == 1
    assert text.count("pg_notify(") == 2, "notify through _notify_queued and _event only"
    for check in ("_check_worker_id", "_check_lease", "_check_flow"):
        assert text.count(f"runledger.{check}(") >= 2, f"{check} defined but never used"
