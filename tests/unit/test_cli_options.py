"""The CLI's options: one env rule for all of them, one range per setting, NaN refused.

No database here: every invocation below stops at option parsing (a usage error or
``--help``) before any command body runs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator

import annotated_types
import click
import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from runledger import cli
from runledger.cli.options import FiniteFloatRange
from runledger.config import Settings

# Eager informational flags, not settings: they read no environment variable.
INFORMATIONAL = {"--help", "--version"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RUNLEDGER_") or name == "DATABASE_URL":
            monkeypatch.delenv(name)


def commands(
    group: click.Group = cli.main, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, group
    for name, command in sorted(group.commands.items()):
        if isinstance(command, click.Group):
            yield from commands(command, (*path, name))
        else:
            yield (*path, name), command


def options() -> Iterator[tuple[tuple[str, ...], click.Option]]:
    for path, command in commands():
        for param in command.params:
            if isinstance(param, click.Option) and not set(param.opts) & INFORMATIONAL:
                yield path, param


def long_name(option: click.Option) -> str:
    [long] = [o for o in option.opts if o.startswith("--")]
    return long


# The demo migrates the database it runs in, creates runledger's roles and leaves its runs
# there: it takes one only from an explicit --database-url, never from the environment.
NO_ENVVAR = {(("demo",), "--database-url")}


def expected_envvars(path: tuple[str, ...], option: click.Option) -> list[str]:
    if (path, long_name(option)) in NO_ENVVAR:
        return []
    rule = "RUNLEDGER_" + long_name(option)[2:].upper().replace("-", "_")
    return [rule, "DATABASE_URL"] if long_name(option) == "--database-url" else [rule]


def envvars(option: click.Option) -> list[str]:
    return [option.envvar] if isinstance(option.envvar, str) else list(option.envvar or ())


ALL_OPTIONS = list(options())


def test_the_walk_finds_every_command_and_the_options_people_use() -> None:
    names = {path for path, _ in commands()}
    assert {
        ("worker",),
        ("submit",),
        ("wait",),
        ("status",),
        ("resolve",),
        ("cancel",),
        ("retry",),
        ("approve",),
        ("deny",),
        ("audit",),
        ("demo",),
        ("migrate",),
    } <= names
    found = {(path, long_name(o)) for path, o in ALL_OPTIONS}
    assert {
        (("submit",), "--input"),
        (("submit",), "--run-id"),
        (("submit",), "--json"),
        (("worker",), "--flows"),
        (("worker",), "--lease-seconds"),
        (("wait",), "--timeout"),
        (("migrate",), "--check"),
        (("approve",), "--actor"),
        (("deny",), "--reason"),
    } <= found


@pytest.mark.parametrize(
    ("path", "option"), ALL_OPTIONS, ids=[f"{' '.join(p)} {long_name(o)}" for p, o in ALL_OPTIONS]
)
def test_every_option_reads_runledger_option_and_says_so(
    path: tuple[str, ...], option: click.Option
) -> None:
    assert envvars(option) == expected_envvars(path, option)
    assert option.show_envvar


@pytest.mark.parametrize("path", [p for p, _ in commands()], ids=lambda p: " ".join(p) or "main")
def test_help_shows_every_env_var(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli.main, [*path, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    for opt_path, option in ALL_OPTIONS:
        if opt_path == path:
            for name in envvars(option):
                assert name in result.output, (long_name(option), name)


def test_no_command_derives_env_names_from_parameter_names() -> None:
    for path, command in commands():
        assert "auto_envvar_prefix" not in command.context_settings, path


def test_json_reads_runledger_json_only() -> None:
    json_options = [o for _, o in ALL_OPTIONS if long_name(o) == "--json"]
    assert len(json_options) >= 4  # submit, status, wait, audit
    for option in json_options:
        assert envvars(option) == ["RUNLEDGER_JSON"]


# -- worker options are the Settings fields ----------------------------------------------


def worker_options() -> dict[str, click.Option]:
    return {
        str(p.name): p
        for p in cli.main.commands["worker"].params
        if isinstance(p, click.Option) and p.name in Settings.model_fields
    }


def declared_range(name: str) -> tuple[float | None, float | None, bool, bool]:
    """(min, max, min_open, max_open) straight from the field's constraints."""
    lo: float | None = None
    hi: float | None = None
    lo_open = hi_open = False
    for item in Settings.model_fields[name].metadata:
        if isinstance(item, annotated_types.Ge):
            lo = item.ge  # type: ignore[assignment]
        elif isinstance(item, annotated_types.Gt):
            lo, lo_open = item.gt, True  # type: ignore[assignment]
        elif isinstance(item, annotated_types.Le):
            hi = item.le  # type: ignore[assignment]
        elif isinstance(item, annotated_types.Lt):
            hi, hi_open = item.lt, True  # type: ignore[assignment]
    return lo, hi, lo_open, hi_open


def test_every_setting_is_a_worker_option_with_its_default_and_help() -> None:
    opts = worker_options()
    assert set(opts) == set(Settings.model_fields)
    for name, option in opts.items():
        field = Settings.model_fields[name]
        assert long_name(option) == "--" + name.replace("_", "-")
        assert option.default == field.default, name
        assert option.help == field.description, name


NUMERIC = [n for n, f in Settings.model_fields.items() if f.annotation in (int, float)]


@pytest.mark.parametrize("name", NUMERIC)
def test_the_cli_range_is_the_settings_range(name: str) -> None:
    option = worker_options()[name]
    assert isinstance(option.type, click.IntRange | click.FloatRange), name
    kind = click.IntRange if Settings.model_fields[name].annotation is int else click.FloatRange
    assert isinstance(option.type, kind)
    got = (option.type.min, option.type.max, option.type.min_open, option.type.max_open)
    assert got == declared_range(name)
    assert got[0] is not None, f"{name} has no lower bound"


def _cli_accepts(name: str, text: str) -> bool:
    option = worker_options()[name]
    ctx = click.Context(cli.main.commands["worker"])
    try:
        option.type.convert(text, option, ctx)
    except click.BadParameter:
        return False
    return True


def _settings_accept(name: str, text: str) -> bool:
    try:
        Settings(**{name: text})  # type: ignore[arg-type]
    except ValidationError:
        return False
    return True


@given(
    name=st.sampled_from(NUMERIC),
    value=st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.floats(min_value=-5, max_value=5),
        st.integers(min_value=-10, max_value=100_000),
        st.sampled_from([0.05, 0.049999, 1, 0.999, 86_400, 86_400.001, 3600, 1000, 1001]),
    ),
)
def test_the_cli_and_settings_accept_the_same_values(name: str, value: float) -> None:
    text = repr(value)
    if Settings.model_fields[name].annotation is int and not isinstance(value, int):
        return  # "1.5" for an int: both refuse, each with its own parser
    assert _cli_accepts(name, text) == _settings_accept(name, text), (name, text)


# -- NaN, infinities and bad values are one-line usage errors ----------------------------


def _error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("Error:")]


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "1e999"])
def test_wait_timeout_refuses_nan_and_infinities(value: str) -> None:
    result = CliRunner().invoke(
        cli.main, ["wait", "some-run", "--timeout", value, "--database-url", "postgresql://x/y"]
    )
    assert result.exit_code == 2, result.output
    [line] = _error_lines(result.output)
    assert "'--timeout' (env var: RUNLEDGER_TIMEOUT)" in line
    assert "finite" in line or "range" in line


def test_wait_timeout_refuses_a_negative_timeout() -> None:
    result = CliRunner().invoke(cli.main, ["wait", "r", "--timeout", "-1"])
    assert result.exit_code == 2
    assert "--timeout" in _error_lines(result.output)[0]


@pytest.mark.parametrize(
    "name", [n for n in NUMERIC if Settings.model_fields[n].annotation is float]
)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_worker_float_options_refuse_nan_from_flag_and_env(name: str, value: str) -> None:
    flag = "--" + name.replace("_", "-")
    env = "RUNLEDGER_" + name.upper()
    runner = CliRunner()
    by_flag = runner.invoke(cli.main, ["worker", "--flows", "m:f", flag, value])
    by_env = runner.invoke(cli.main, ["worker", "--flows", "m:f"], env={env: value})
    for result in (by_flag, by_env):
        assert result.exit_code == 2, result.output
        [line] = _error_lines(result.output)
        assert f"'{flag}' (env var: {env})" in line
        assert "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--concurrency", "0"], {}, "'--concurrency' (env var: RUNLEDGER_CONCURRENCY)"),
        ([], {"RUNLEDGER_LEASE_SECONDS": "0.5"}, "'--lease-seconds'"),
        ([], {"RUNLEDGER_MAX_TURNS": "many"}, "'--max-turns' (env var: RUNLEDGER_MAX_TURNS)"),
        (["--log-level", "loud"], {}, "'--log-level' (env var: RUNLEDGER_LOG_LEVEL)"),
        ([], {"RUNLEDGER_LOG_JSON": "maybe"}, "'--log-json' (env var: RUNLEDGER_LOG_JSON)"),
        # refused by Settings itself (click has no length check): still one line, named
        (["--worker-id", "w" * 201], {}, "'--worker-id' (env var: RUNLEDGER_WORKER_ID)"),
        (["--worker-id", ""], {}, "'--worker-id' (env var: RUNLEDGER_WORKER_ID)"),
        (["--http-port", "65536"], {}, "'--http-port' (env var: RUNLEDGER_HTTP_PORT)"),
        ([], {"RUNLEDGER_HTTP_PORT": "-1"}, "'--http-port' (env var: RUNLEDGER_HTTP_PORT)"),
        ([], {"RUNLEDGER_HTTP_PORT": "web"}, "'--http-port' (env var: RUNLEDGER_HTTP_PORT)"),
    ],
)
def test_a_bad_worker_setting_is_a_one_line_usage_error(
    args: list[str], env: dict[str, str], named: str
) -> None:
    result = CliRunner().invoke(
        cli.main,
        ["worker", "--flows", "m:f", "--database-url", "postgresql://x/y", *args],
        env=env,
    )
    assert result.exit_code == 2, result.output
    [line] = _error_lines(result.output)
    assert named in line
    assert "validation error" not in result.output and "Traceback" not in result.output
    assert not isinstance(result.exception, ValidationError)


def test_http_port_without_prometheus_client_names_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "prometheus_client" else real(name, *a),
    )
    result = CliRunner().invoke(
        cli.main,
        ["worker", "--flows", "m:f", "--database-url", "postgresql://x/y", "--http-port", "9464"],
    )
    assert result.exit_code == 2, result.output
    [line] = _error_lines(result.output)
    assert "pip install 'runledger-pg[metrics]'" in line


def test_worker_without_a_database_url_is_a_usage_error() -> None:
    result = CliRunner().invoke(cli.main, ["worker", "--flows", "m:f"])
    assert result.exit_code == 2
    [line] = _error_lines(result.output)
    assert "RUNLEDGER_DATABASE_URL" in line


def test_finite_float_range_keeps_its_range() -> None:
    t = FiniteFloatRange(0, 10)
    assert t.convert("10", None, None) == 10.0
    for bad in ("nan", "inf", "10.5", "-0.1"):
        with pytest.raises(click.BadParameter):
            t.convert(bad, None, None)
    assert math.isclose(FiniteFloatRange().convert("1e300", None, None), 1e300)


# -- exit codes, the connect timeout, hostile arguments stopped before connecting ----------

CONNECTING = [
    "submit",
    "status",
    "wait",
    "resolve",
    "cancel",
    "retry",
    "approve",
    "deny",
    "audit",
    "migrate",
    "worker",
]


@pytest.mark.parametrize("name", CONNECTING)
def test_every_command_that_connects_has_connect_timeout(name: str) -> None:
    [option] = [
        o
        for o in cli.main.commands[name].params
        if isinstance(o, click.Option) and "--connect-timeout" in o.opts
    ]
    assert envvars(option) == ["RUNLEDGER_CONNECT_TIMEOUT"]
    assert option.default == Settings.model_fields["connect_timeout"].default == 5.0


def test_help_documents_every_exit_code() -> None:
    result = CliRunner().invoke(cli.main, ["--help"], terminal_width=200)
    assert result.exit_code == 0
    assert set(cli.EXIT_CODES) == {0, 1, 2, 3}
    for code, what in cli.EXIT_CODES.items():
        assert f"{code}  {what}" in result.output


def test_resolve_help_says_what_each_resolution_does() -> None:
    result = CliRunner().invoke(cli.main, ["resolve", "--help"], terminal_width=200)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    for word in ("applied", "not_applied", "abandoned"):
        assert f"{word}: " in text
    assert "sent again under the same idempotency key" in text
    assert "a policy that ends on any history makes the run SUCCEED" in text


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _deep(depth: int, kind: str = "[") -> str:
    close = "]" if kind == "[" else "}"
    if kind == "[":
        return "[" * depth + close * depth
    return '{"a":' * depth + "1" + close * depth


# Each stops before any connection: the URL points at a port nothing listens on, so
# reaching the database would be exit 3, not 2.
USAGE = [
    (["submit", "f@1", "--run-id", ""], "'--run-id'"),
    (["submit", "f@1", "--input", _deep(65, "{")], "--input nests deeper than the limit of 64"),
    (["submit", "f@1", "--input", '{"a":' + _deep(30_000) + "}"], "--input nests deeper"),
    (["submit", "f@1", "--input", '{"a":' + _deep(64) + "}"], "--input nests deeper"),
    (["submit", "f@1", "--input", '{"a": NaN}'], "--input is not JSON"),
    (["submit", "f@1", "--input", '{"a": 1e999}'], "--input is not JSON"),
    (["submit", "f@1", "--input", '{"a": "\\u0000"}'], "NUL"),
    (["submit", "f@1", "--input", "[1]"], "--input must be a JSON object"),
    (["submit", "f@1", "--priority", "3000000000"], "'--priority'"),
    (["submit", "f@1", "--priority", "-2147483649"], "'--priority'"),
    (["submit", "f@1", "--priority", "nan"], "'--priority'"),
    (["submit", "f@1", "--priority", "1.5"], "'--priority'"),
    (
        ["resolve", "k:0:c0", "applied", "--receipt", '{"a":' + _deep(30_000) + "}"],
        "--receipt nests",
    ),
    (["resolve", "k:0:c0", "applied", "--receipt", _deep(65, "{")], "--receipt nests deeper"),
    (["resolve", "k:0:c0", "applied", "--receipt", "[]"], "--receipt must be a JSON object"),
    (["resolve", "k:0:c0", "applied", "--receipt", "{x"], "--receipt is not JSON"),
    (["resolve", "k:0:c0", "maybe"], "'maybe' is not one of"),
    (["status", "r", "--connect-timeout", "nan"], "'--connect-timeout'"),
    (["status", "r", "--connect-timeout", "0"], "'--connect-timeout'"),
    (["status", "r", "--connect-timeout", "soon"], "'--connect-timeout'"),
    (["migrate", "--connect-timeout", "inf"], "'--connect-timeout'"),
    (["worker", "--flows", "m:f", "--connect-timeout", "-1"], "'--connect-timeout'"),
]


@pytest.mark.parametrize(("argv", "named"), USAGE, ids=[" ".join(a)[:50] for a, _ in USAGE])
def test_hostile_arguments_are_one_usage_line_before_connecting(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    named: str,
) -> None:
    import sys

    monkeypatch.setenv("RUNLEDGER_DATABASE_URL", f"postgresql://u@127.0.0.1:{_closed_port()}/db")
    monkeypatch.setattr(sys, "argv", ["runledger", *argv])
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    out, err = capsys.readouterr()
    assert exit_.value.code == 2, err
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith("error: ") and named in line, line
    assert "Traceback" not in err and "RecursionError" not in err


def test_an_env_connect_timeout_that_is_not_a_number_is_a_usage_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import sys

    monkeypatch.setenv("RUNLEDGER_CONNECT_TIMEOUT", "soon")
    monkeypatch.setattr(
        sys, "argv", ["runledger", "status", "r", "--database-url", "postgresql://h/d"]
    )
    with pytest.raises(SystemExit) as exit_:
        cli.run()
    assert exit_.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "RUNLEDGER_CONNECT_TIMEOUT" in line


def test_the_event_loop_setting_picks_the_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import sys

    import uvloop

    from runledger.worker import event_loop_runner

    assert event_loop_runner("auto") is uvloop.run
    assert event_loop_runner("uvloop") is uvloop.run
    assert event_loop_runner("asyncio") is asyncio.run
    monkeypatch.setitem(sys.modules, "uvloop", None)  # not installed: import fails
    assert event_loop_runner("auto") is asyncio.run
    with pytest.raises(ValueError, match="uvloop is not installed"):
        event_loop_runner("uvloop")


def test_an_unknown_event_loop_is_a_usage_error() -> None:
    result = CliRunner().invoke(
        cli.main, ["worker", "--flows", "x:y", "--event-loop", "trio"], env={}
    )
    assert result.exit_code == 2
    assert "'trio' is not one of 'auto', 'asyncio', 'uvloop'" in result.output
