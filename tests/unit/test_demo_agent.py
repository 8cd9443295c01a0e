"""The demo's scripted model answers from what the adapter told it: an email an operator
gave up on (``runledger resolve KEY abandoned``) may have gone out."""

from __future__ import annotations

from typing import Any

from runledger.demo import prompt_for
from runledger.flows import HistoryCall, HistoryTurn, PolicyContext


async def final_answer(email_error: dict[str, Any]) -> Any:
    from runledger.demo.agent import flow

    assert flow.policy_fn is not None
    run_input = {"prompt": prompt_for("ana@example.com", "o-1234", 12)}
    history: list[HistoryTurn] = []
    results = {"create_ticket": {"ticket_id": "T-1"}, "charge": {"charge_id": "ch-2"}}
    for turn in range(4):
        ctx = PolicyContext(run_id="r", flow=flow.ref, input=run_input, turn=turn)
        decision = await flow.policy_fn(ctx, tuple(history))
        if not decision.calls:
            return decision.output
        [call] = decision.calls
        failed = call.tool == "send_email"
        history.append(
            HistoryTurn(
                turn=turn,
                calls=(
                    HistoryCall(
                        call_id="c0",
                        tool=call.tool,
                        args=call.args,
                        status="failed" if failed else "succeeded",
                        result=None if failed else results[call.tool],
                        error=email_error if failed else None,
                        provider_id=call.provider_id,
                    ),
                ),
                record=decision.record,
            )
        )
    raise AssertionError("the agent did not answer")


async def test_an_abandoned_email_is_not_reported_as_not_sent() -> None:
    answer = await final_answer({"reason": "abandoned", "note": "checked the provider"})
    assert answer == (
        "o-1234: ticket T-1, charged 12 EUR (ch-2), may or may not have emailed ana@example.com."
    )


async def test_an_email_that_failed_without_effect_is_reported_as_not_sent() -> None:
    answer = await final_answer({"reason": "lookup found nothing", "attempts": 3})
    assert answer == "o-1234: ticket T-1, charged 12 EUR (ch-2), did not email ana@example.com."
