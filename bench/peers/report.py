"""The peer benchmark's table (medians, [min-max], same-rep ratios) and its JSON."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from _common import table
from peers.harness import Batch


def _med(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _span(values: Sequence[float], fmt: str) -> str:
    if not values:
        return "-"
    med = format(_med(values), fmt)
    if len(values) == 1:
        return med
    return f"{med} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def summarize(batches: Sequence[Batch], systems: Sequence[str]) -> list[dict[str, Any]]:
    """One summary per system; ratios pair each rep's throughput (and sequential time per
    call) with runledger's in the same rep."""
    base = {b.rep: b.calls_per_s for b in batches if b.system == "runledger" and
            b.kind == "throughput"}  # fmt: skip
    base_seq = {b.rep: b.cycle_ms_per_call for b in batches if b.system == "runledger" and
                b.kind == "sequential"}  # fmt: skip
    out = []
    for name in systems:
        tp = [b for b in batches if b.system == name and b.kind == "throughput"]
        seq = [b for b in batches if b.system == name and b.kind == "sequential"]
        ratios = [b.calls_per_s / base[b.rep] for b in tp if b.rep in base]
        seq_ratios = [b.cycle_ms_per_call / base_seq[b.rep] for b in seq if b.rep in base_seq]
        out.append(
            {
                "system": name,
                "setup": tp[0].setup if tp else "",
                "sequential_setup": seq[0].setup if seq else "",
                "reps": len(tp),
                "calls_per_s": [b.calls_per_s for b in tp],
                "ratio_to_runledger": ratios,
                "xact_per_call": [b.xact_per_call for b in tp],
                "worker_ms_per_call": [b.worker_ms_per_call for b in tp],
                "postgres_ms_per_call": [b.postgres_ms_per_call for b in tp],
                "cpu_ms_per_call": [b.worker_ms_per_call + b.postgres_ms_per_call for b in tp],
                "sequential_ms_per_call": [b.cycle_ms_per_call for b in seq],
                "sequential_ratio_to_runledger": seq_ratios,
                "other_cores": [b.other_cores for b in tp],
                "worker_rss_mb": [b.worker_rss_mb for b in tp],
            }
        )
    return out


def _ratio(s: dict[str, Any], key: str) -> str:
    """A system's same-rep ratios to runledger: the median with x, and [min-max]."""
    if s["system"] == "runledger":
        return "1.00x"
    span = _span(s[key], ".2f")
    if not s[key]:
        return span
    return span.replace(" [", "x [") if "[" in span else span + "x"


def render(summary: Sequence[dict[str, Any]]) -> str:
    rows = []
    for s in summary:
        cpu = (
            f"{_med(s['cpu_ms_per_call']):.2f} ({_med(s['worker_ms_per_call']):.2f} + "
            f"{_med(s['postgres_ms_per_call']):.2f})"
            if s["cpu_ms_per_call"]
            else "-"
        )
        ratio = _ratio(s, "ratio_to_runledger")
        seq = _span(s["sequential_ms_per_call"], ".2f")
        if s["system"] != "runledger" and s["sequential_ratio_to_runledger"]:
            seq = f"{seq}; {_ratio(s, 'sequential_ratio_to_runledger')}"
        rows.append(
            [
                s["system"],
                s["setup"],
                _span(s["calls_per_s"], ",.0f"),
                ratio,
                f"{_med(s['xact_per_call']):.2f}" if s["xact_per_call"] else "-",
                cpu,
                seq,
                f"{_med(s['other_cores']):.2f}" if s["other_cores"] else "-",
                f"{max(s['worker_rss_mb']):.0f}" if s["worker_rss_mb"] else "-",
            ]
        )
    return table(
        [
            "system",
            "setup",
            "tool calls/s",
            "vs runledger (same rep)",
            "xact/call",
            "CPU ms/call (worker + PostgreSQL)",
            "sequential ms/call (vs runledger, same rep)",
            "other jobs cores",
            "worker RSS MB (max)",
        ],
        rows,
    )
