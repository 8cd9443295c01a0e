"""What each adapter assumes of its framework holds for the installed version, and when it
does not, the failure names the framework and its version.

The extras pin the major version (``pydantic-ai-slim>=2.68,<3``, ``openai-agents>=0.24,<1``):
a minor release may still change what an adapter uses. Each adapter lists its needs
(``needs.NEEDS``, checked when a flow is built); the behaviour only a run shows is checked
here.
"""

from __future__ import annotations

import re
from importlib import metadata
from typing import Any

import pytest

from runledger.integrations._flows import FrameworkMismatch, mismatch, require, unmet


def test_a_broken_need_names_the_framework_and_its_version() -> None:
    version = metadata.version("pydantic-ai-slim")
    with pytest.raises(FrameworkMismatch) as raised:
        require("Pydantic AI", "pydantic-ai-slim", [("X()", lambda: False), ("Y", lambda: 1 / 0)])
    assert str(raised.value) == (
        f"runledger's Pydantic AI adapter needs X(); Y; pydantic-ai-slim {version} does not "
        "have them"
    )
    require("Pydantic AI", "pydantic-ai-slim", [("X()", lambda: True)])  # holds: no error


# -- Pydantic AI -------------------------------------------------------------------------


def test_pydantic_ai_has_what_the_adapter_needs() -> None:
    from runledger.integrations.pydantic_ai import needs

    missing = unmet(needs.NEEDS)
    if missing:
        pytest.fail(mismatch(needs.ADAPTER, needs.DISTRIBUTION, missing))


def test_a_pydantic_ai_flow_is_refused_when_a_need_is_not_met(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.test import TestModel

    from runledger.integrations.pydantic_ai import agent_flow, needs

    needs.check.cache_clear()
    monkeypatch.setattr(needs, "NEEDS", [*needs.NEEDS, ("Agent.journal()", lambda: False)])
    version = re.escape(metadata.version("pydantic-ai-slim"))
    try:
        with pytest.raises(FrameworkMismatch, match=f"pydantic-ai-slim {version} does not"):
            agent_flow(Agent(TestModel()), name="a", safety={})
    finally:
        needs.check.cache_clear()


async def test_pydantic_ai_captures_the_first_request_without_asking_the_model() -> None:
    """The capability's hooks run on a run-time capability (``iter(capabilities=)``), and
    a wrapper model that answers without its model keeps the run going."""
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelMessage, ModelResponse
    from pydantic_ai.models.function import AgentInfo, FunctionModel

    from runledger.integrations.pydantic_ai import agent_flow

    def unreachable(messages: list[ModelMessage], info: AgentInfo) -> ModelResponse:
        raise AssertionError("the model was asked")

    agent: Agent[None, str] = Agent(FunctionModel(unreachable), system_prompt="S", retries=4)
    flow = agent_flow(agent, name="a", safety={})
    adapter: Any = getattr(flow.policy_fn, "__self__", None)
    assert adapter is not None
    captured = await adapter.capture("hello", None)
    assert [p.part_kind for p in captured.sent.parts] == ["system-prompt", "user-prompt"]
    assert captured.run.max_retries == 4
    assert isinstance(captured.run.model, FunctionModel)


# -- the OpenAI Agents SDK ---------------------------------------------------------------


def test_the_agents_sdk_has_what_the_adapter_needs() -> None:
    from runledger.integrations.openai_agents import needs

    missing = unmet(needs.NEEDS)
    if missing:
        pytest.fail(mismatch(needs.ADAPTER, needs.DISTRIBUTION, missing))


def test_an_agents_sdk_flow_is_refused_when_a_need_is_not_met(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from agents import Agent

    from runledger.integrations.openai_agents import agent_flow, needs

    needs.check.cache_clear()
    monkeypatch.setattr(needs, "NEEDS", [*needs.NEEDS, ("Runner.journal()", lambda: False)])
    version = re.escape(metadata.version("openai-agents"))
    try:
        with pytest.raises(FrameworkMismatch, match=f"openai-agents {version} does not"):
            agent_flow(Agent(name="a"), name="a", safety={})
    finally:
        needs.check.cache_clear()


async def test_runner_run_lets_the_models_exception_through_unchanged() -> None:
    """The policy ends ``Runner.run`` by raising from the model once it has answered: the
    runner must neither retry nor wrap that exception, nor run anything after it."""
    from agents import Agent, ModelRetrySettings, ModelSettings, RunConfig, Runner
    from agents.models.interface import Model

    class Stop(Exception):
        pass

    asked: list[int] = []

    class Raising(Model):
        async def get_response(self, *args: Any, **kwargs: Any) -> Any:
            asked.append(1)
            raise Stop

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    config = RunConfig(
        model_settings=ModelSettings(retry=ModelRetrySettings(max_retries=0)),
        tracing_disabled=True,
    )
    try:
        await Runner.run(Agent(name="a", model=Raising()), "x", max_turns=1, run_config=config)
    except Stop:
        pass
    except Exception as exc:
        version = metadata.version("openai-agents")
        pytest.fail(
            "runledger's OpenAI Agents SDK adapter needs Runner.run to let a model's exception "
            f"through; openai-agents {version} raised {exc!r} instead"
        )
    else:
        pytest.fail("Runner.run ended without the model's exception")
    assert asked == [1]
