"""A snapshot of everything in schema ``runledger`` as PostgreSQL renders it, and a diff.

Used to prove that two ways of building the schema (the living files, the revisions)
give the same database. Object ids never appear; role names are normalised (the owner
of the schema becomes ``<owner>``, grantee 0 ``PUBLIC``), so two databases of one
cluster, or of two clusters, compare equal when their definitions do.
"""

from __future__ import annotations

import difflib
from typing import Any

import psycopg

Conn = psycopg.Connection[Any]
Snapshot = dict[str, dict[str, tuple[Any, ...]]]


def _role(expr: str) -> str:
    """SQL naming the role with oid ``expr``: PUBLIC, <owner> (of the schema), or its name."""
    return (
        f"CASE WHEN {expr} = 0 THEN 'PUBLIC' "
        f"WHEN {expr} = (SELECT nspowner FROM pg_namespace WHERE nspname = 'runledger') "
        f"THEN '<owner>' ELSE (SELECT rolname FROM pg_roles WHERE oid = {expr})::text END"
    )


def _acl(acl: str) -> str:
    """SQL rendering an ACL as sorted 'grantee:privilege[*] by grantor' entries."""
    entry = (
        f"{_role('a.grantee')} || ':' || a.privilege_type "
        "|| CASE WHEN a.is_grantable THEN '*' ELSE '' END "
        f"|| ' by ' || {_role('a.grantor')}"
    )
    return (
        f"coalesce((SELECT string_agg(x.entry, ', ' ORDER BY x.entry) "
        f"FROM (SELECT {entry} AS entry FROM aclexplode({acl}) a) x), "
        f"CASE WHEN {acl} IS NULL THEN '<default>' ELSE '<none>' END)"
    )


QUERIES: dict[str, str] = {
    "schema": f"""
        SELECT n.nspname, {_role("n.nspowner")}, {_acl("n.nspacl")}
        FROM pg_namespace n WHERE n.nspname = 'runledger'
    """,
    "functions": f"""
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid),
               coalesce(array_to_string(p.proconfig, '; '), ''), p.prosecdef, p.prokind::text,
               p.provolatile::text, p.proparallel::text, p.proleakproof, p.proisstrict,
               {_role("p.proowner")}, {_acl("p.proacl")}
        FROM pg_proc p WHERE p.pronamespace = 'runledger'::regnamespace
    """,
    "relations": f"""
        SELECT c.relname, c.relkind::text, c.relpersistence::text, {_role("c.relowner")},
               {_acl("c.relacl")}, coalesce(array_to_string(c.reloptions, ','), ''),
               c.relrowsecurity, c.relforcerowsecurity, c.relreplident::text
        FROM pg_class c WHERE c.relnamespace = 'runledger'::regnamespace
    """,
    # attoptions without pg_attver=..., a per-database stamp some builds add to every column
    "columns": f"""
        SELECT c.relname || '.' || a.attname,
               -- the column's place among the live ones: a column a downgrade dropped and
               -- an upgrade added again leaves a hole in attnum, not in the order
               (SELECT count(*) FROM pg_attribute b
                WHERE b.attrelid = a.attrelid AND b.attnum > 0 AND b.attnum <= a.attnum
                  AND NOT b.attisdropped),
               format_type(a.atttypid, a.atttypmod),
               a.attnotnull, pg_get_expr(d.adbin, d.adrelid), a.attidentity::text,
               a.attgenerated::text, coalesce(co.collname, ''), a.attstattarget,
               array_to_string(ARRAY(SELECT o FROM unnest(a.attoptions) o
                                     WHERE o NOT LIKE 'pg\\_attver=%'), ','),
               {_acl("a.attacl")}
        FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
        WHERE c.relnamespace = 'runledger'::regnamespace AND c.relkind IN ('r', 'v', 'p')
          AND a.attnum > 0 AND NOT a.attisdropped
    """,
    "constraints": """
        SELECT c.relname || '.' || k.conname, k.contype::text, pg_get_constraintdef(k.oid),
               k.condeferrable, k.condeferred, k.convalidated
        FROM pg_constraint k JOIN pg_class c ON c.oid = k.conrelid
        WHERE k.connamespace = 'runledger'::regnamespace
    """,
    "indexes": """
        SELECT i.indexname, i.tablename, i.indexdef
        FROM pg_indexes i WHERE i.schemaname = 'runledger'
    """,
    "triggers": """
        SELECT c.relname || '.' || t.tgname, pg_get_triggerdef(t.oid), t.tgenabled::text
        FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = 'runledger'::regnamespace AND NOT t.tgisinternal
    """,
    "views": """
        SELECT c.relname, pg_get_viewdef(c.oid, true)
        FROM pg_class c
        WHERE c.relnamespace = 'runledger'::regnamespace AND c.relkind IN ('v', 'm')
    """,
    "sequences": """
        SELECT c.relname, format_type(s.seqtypid, NULL), s.seqstart, s.seqincrement, s.seqmax,
               s.seqmin, s.seqcache, s.seqcycle,
               coalesce((SELECT o.relname || '.' || a.attname || ' (' || d.deptype::text || ')'
                         FROM pg_depend d
                         JOIN pg_class o ON o.oid = d.refobjid
                         JOIN pg_attribute a ON a.attrelid = d.refobjid
                                             AND a.attnum = d.refobjsubid
                         WHERE d.classid = 'pg_class'::regclass AND d.objid = c.oid
                           AND d.refclassid = 'pg_class'::regclass AND d.refobjsubid > 0),
                        'owned by nothing')
        FROM pg_sequence s JOIN pg_class c ON c.oid = s.seqrelid
        WHERE c.relnamespace = 'runledger'::regnamespace
    """,
    "types": """
        SELECT t.typname, t.typtype::text, t.typcategory::text
        FROM pg_type t WHERE t.typnamespace = 'runledger'::regnamespace
    """,
    "comments": """
        SELECT d.classoid::regclass::text || ':' || d.objsubid || ':'
               || coalesce(pg_describe_object(d.classoid, d.objoid, d.objsubid), ''),
               d.description
        FROM pg_description d
        WHERE (d.classoid = 'pg_class'::regclass AND d.objoid IN (
                   SELECT oid FROM pg_class WHERE relnamespace = 'runledger'::regnamespace))
           OR (d.classoid = 'pg_proc'::regclass AND d.objoid IN (
                   SELECT oid FROM pg_proc WHERE pronamespace = 'runledger'::regnamespace))
           OR (d.classoid = 'pg_namespace'::regclass
               AND d.objoid = 'runledger'::regnamespace)
    """,
    "settings": """
        SELECT s.singleton::text, s.max_payload_bytes, s.clock_offset::text
        FROM runledger.settings s
    """,
    "alembic_version": "SELECT v.version_num FROM runledger.alembic_version v",
}


def snapshot(conn: Conn) -> Snapshot:
    """Every kind of object, keyed by its name (the first column of its query)."""
    out: Snapshot = {}
    for kind, sql in QUERIES.items():
        found: dict[str, tuple[Any, ...]] = {}
        table = {"settings": "runledger.settings", "alembic_version": "runledger.alembic_version"}
        if kind in table and conn.execute(  # an empty schema (the baseline downgraded)
            "SELECT to_regclass(%s) IS NULL", (table[kind],)
        ).fetchone() == (True,):
            out[kind] = found
            continue
        for row in conn.execute(sql).fetchall():  # type: ignore[call-overload]
            values = tuple(row.values()) if isinstance(row, dict) else tuple(row)
            name = str(values[0])
            assert name not in found, f"{kind}: {name} appears twice"
            found[name] = values[1:]
        out[kind] = found
    return out


def snapshot_of(url: str) -> Snapshot:
    with psycopg.connect(url, autocommit=True) as conn:
        return snapshot(conn)


def differences(left: Snapshot, right: Snapshot, names: tuple[str, str]) -> list[str]:
    """What differs, one entry per object, readable in a test failure."""
    a_name, b_name = names
    found: list[str] = []
    for kind in sorted(set(left) | set(right)):
        a, b = left.get(kind, {}), right.get(kind, {})
        for name in sorted(set(a) | set(b)):
            if name not in b:
                found.append(f"{kind} {name}: only in {a_name}")
            elif name not in a:
                found.append(f"{kind} {name}: only in {b_name}")
            elif a[name] != b[name]:
                text_a = "\n".join(str(v) for v in a[name]).splitlines()
                text_b = "\n".join(str(v) for v in b[name]).splitlines()
                diff = "\n".join(
                    difflib.unified_diff(text_a, text_b, a_name, b_name, lineterm="", n=1)
                )
                found.append(f"{kind} {name} differs:\n{diff}")
    return found
