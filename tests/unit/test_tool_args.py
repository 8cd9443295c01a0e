"""Tool.check_args accepts exactly the arguments that bind to the tool's signature: the
shortcut for the common case (names known, required ones present) never accepts what
binding refuses, nor refuses what it accepts."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import pytest

from runledger.flows import Flow, InvalidDecision


def plain(ctx: Any, a: int, b: int = 1) -> None: ...
def keyword_only(ctx: Any, *, a: int, b: int = 1) -> None: ...
def var_keyword(ctx: Any, a: int, **more: Any) -> None: ...
def var_positional(ctx: Any, *rest: Any, a: int = 0) -> None: ...
def positional_only(ctx: Any, a: int, /, b: int = 1) -> None: ...
def nothing(ctx: Any) -> None: ...


SIGNATURES = [plain, keyword_only, var_keyword, var_positional, positional_only, nothing]
ARGS = [dict(zip(names, itertools.repeat(1))) for n in range(4)
        for names in itertools.combinations(["a", "b", "c", "rest", "more"], n)]  # fmt: skip


@pytest.mark.parametrize("fn", SIGNATURES, ids=lambda f: f.__name__)
def test_check_args_agrees_with_binding(fn: Any) -> None:
    flow = Flow("args-check")
    tool = flow.tool(safety="idempotent")(fn)
    signature = inspect.signature(fn)
    for args in ARGS:
        try:
            signature.bind(None, **args)
            binds = True
        except TypeError:
            binds = False
        if binds:
            tool.check_args(args)
        else:
            with pytest.raises(InvalidDecision, match=f"tool {fn.__name__}: "):
                tool.check_args(args)


@pytest.mark.parametrize("timeout", [-1, -0.5, float("nan")])
def test_a_tool_timeout_below_zero_is_refused_where_the_tool_is_declared(timeout: float) -> None:
    """Every attempt of such a tool would time out at once, ambiguous: one clear error at
    the declaration instead (0 and None keep the worker's default)."""
    flow = Flow("t", "1")
    with pytest.raises(ValueError, match="timeout must be a number of seconds, 0 or more"):
        flow.tool(safety="idempotent", timeout=timeout)(nothing)
    for kept in (0, None, 2.5):
        assert Flow("t", "1").tool(safety="idempotent", timeout=kept)(nothing).timeout == kept
