"""The trace context of a run (no database): the derived context is a function of the
run id; traceparents parse and format as W3C says; the tracing hooks are inert without
OpenTelemetry; the CLI's --otel and --traceparent refuse bad values in one line."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import pytest
from click.testing import CliRunner

from runledger import cli, errors
from runledger.db.validate import check_traceparent
from runledger.tracecontext import derived, format_traceparent, parse_traceparent, run_context

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_the_derived_context_is_the_sha256_of_the_run_id() -> None:
    digest = hashlib.sha256(b"run-1").digest()
    assert derived("run-1") == (
        int.from_bytes(digest[:16], "big"),
        int.from_bytes(digest[16:24], "big"),
        1,
    )
    assert derived("run-1") == derived("run-1") != derived("run-2")


def test_a_stored_traceparent_wins_over_the_derived_context() -> None:
    assert run_context("r", TP) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, 1)
    assert run_context("r", None) == derived("r")
    assert format_traceparent(*run_context("r", TP)) == TP


@pytest.mark.parametrize(
    "value",
    [
        "",
        TP.upper(),
        "01" + TP[2:],
        TP + "\n",
        f"00-{'0' * 32}-b7ad6b7169203331-01",
        f"00-0af7651916cd43dd8448eb211c80319c-{'0' * 16}-01",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
    ],
)
def test_malformed_traceparents_are_refused_client_side_as_the_database_does(value: str) -> None:
    assert parse_traceparent(value) is None
    with pytest.raises(errors.InvalidInput, match="traceparent"):
        check_traceparent(value)


def test_runledger_imports_no_opentelemetry() -> None:
    """Importing the package, the worker, the client and the CLI loads no OpenTelemetry
    module (the spans follow the process's own use of it)."""
    code = (
        "import sys, runledger, runledger.client, runledger.cli, runledger.worker, "
        "runledger.worker.executor, runledger.worker.tracing, runledger.tracecontext\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_otel_with_an_exporter_no_package_provides_is_one_usage_line() -> None:
    result = CliRunner().invoke(
        cli.main,
        ["worker", "--flows", "m:f", "--otel", "--database-url", "postgresql://h/db"],
        env={"OTEL_TRACES_EXPORTER": "nope"},
    )
    assert result.exit_code == 2, result.output
    assert "OTEL_TRACES_EXPORTER=nope: no installed package provides it" in result.output
    assert "console" in result.output  # the installed ones are named


def test_submit_refuses_a_malformed_traceparent_before_connecting() -> None:
    result = CliRunner().invoke(
        cli.main,
        ["submit", "demo@1", "--traceparent", "00-x-y-01", "--database-url", "postgresql://h/db"],
    )
    assert result.exit_code == 2, result.output
    assert "invalid traceparent '00-x-y-01'" in result.output


def test_the_provider_snippet_of_operating_md_runs_as_shown() -> None:
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "operating.md").read_text()
    section = text[text.index("\n## Tracing") :]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    code = snippet + (
        "\nwith trace.get_tracer('t').start_as_current_span('shown'):\n    pass\n"
        "provider.shutdown()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert '"name": "shown"' in out.stdout


def test_spans_are_made_only_once_a_tracer_provider_is_set() -> None:
    """With the API imported and no provider (OpenTelemetry's no-op) the hooks make no
    span; a provider set later counts from the next run."""
    code = (
        "from runledger.worker import tracing\n"
        "assert tracing._api() is None\n"
        "from opentelemetry import trace\n"
        "assert tracing._api() is None\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "assert tracing._api() is not None\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
