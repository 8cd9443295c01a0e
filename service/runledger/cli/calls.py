"""A person settles a call: ``runledger resolve`` (an unknown call, once the provider
said what happened) and ``runledger approve`` / ``deny`` (a call awaiting approval).

A call of a tool declared ``@flow.tool(..., approval=True)`` (or a ``ToolCall(...,
approval=True)``) is recorded awaiting approval and never sent before a person decides;
the run pauses on it. ``runledger unknown`` lists every call waiting for a person
(:mod:`runledger.cli.reads`). Registered on the ``runledger`` group by
:mod:`runledger.cli`; errors are one line and exit 1 there, as for every command.
"""

from __future__ import annotations

import click

from runledger.cli.options import (
    CONTEXT,
    actor_option,
    connect_option,
    database_option,
    json_arg,
    open_client,
    opt,
)
from runledger.client import Client
from runledger.model import Approval, CallStatus


def what_the_run_does(client: Client, key: str) -> str:
    """After a decision: whether the run goes on, or what it still waits for (each key
    whole), so that a person is never left guessing why it is still paused."""
    run_id = key.rsplit(":", 2)[0]  # keys are {run_id}:{turn}:{call_id}
    run = client.get(run_id)
    if run.status != "paused":
        return f"run {run_id} is {run.status}"
    calls = client.calls(run_id)
    waits = [x.idempotency_key for x in calls if x.approval is Approval.PENDING]
    unknown = [x.idempotency_key for x in calls if x.status is CallStatus.UNKNOWN]
    left = []
    if waits:
        left.append(f"{', '.join(waits)} still {'awaits' if len(waits) == 1 else 'await'} approval")
    if unknown:
        left.append(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} unknown")
    return f"run {run_id} stays paused: {'; '.join(left)} (`runledger status {run_id}`)"


RESOLUTIONS = {
    "applied": (
        "the effect happened",
        "succeeded, result = --receipt ({} without one); never sent again",
        "the call succeeded, with that result",
    ),
    "not_applied": (
        "the effect did not happen",
        "planned; sent again under the same idempotency key",
        "the outcome of that new attempt",
    ),
    "abandoned": (
        "give up on the call, effect or not",
        "failed, error {reason: abandoned, note}; never sent again",
        "a failed call: a policy that ends on any history\n                 makes the run SUCCEED",
    ),
}


def _resolutions_help() -> str:
    rows = []
    for word, (means, call, policy) in RESOLUTIONS.items():
        rows.append(f"  {word}: {means}\n    call:        {call}\n    policy sees: {policy}")
    return "\n".join(rows)


RESOLVE_EPILOG = (
    "\b\nWhat each RESOLUTION does:\n"
    + _resolutions_help()
    + "\n\n\b\nThe run: a paused run with no unknown call left is queued again, and its"
    "\npolicy decides the next turn from the history above. A cancelled or failed"
    "\nrun stays as it is: only the call (the ledger) changes."
)


@click.command(context_settings=CONTEXT, epilog=RESOLVE_EPILOG)
@database_option
@connect_option
@click.argument("key")
@click.argument("resolution", type=click.Choice(list(RESOLUTIONS)))
@opt("--receipt", default=None, help="Provider receipt (JSON object) for 'applied'.")
@opt("--note", default=None, help="Why; kept in the ledger.")
@actor_option
def resolve(
    database_url: str | None,
    connect_timeout: float,
    key: str,
    resolution: str,
    receipt: str | None,
    note: str | None,
    actor: str | None,
) -> None:
    """Resolve an unknown call (KEY is its idempotency key, as `runledger status` shows it)."""
    receipt_obj = json_arg("--receipt", receipt, obj=True) if receipt else None
    with open_client(database_url, connect_timeout, actor) as client:
        client.resolve(key, resolution, receipt_obj, note)
    click.echo(f"{key} resolved as {resolution}")


DECIDE_EPILOG = (
    "\b\nThe run: a paused run with no call left that is unknown or awaiting approval is"
    "\nqueued again. A call of a running run is refused: its worker pauses the run when it"
    "\nreaches the call (`runledger status RUN` shows it paused, with these lines)."
)


@click.command(context_settings=CONTEXT, epilog=DECIDE_EPILOG)
@database_option
@connect_option
@click.argument("key")
@actor_option
@opt("--note", default=None, help="Why; kept with the call and in the event.")
def approve(
    database_url: str | None,
    connect_timeout: float,
    key: str,
    actor: str | None,
    note: str | None,
) -> None:
    """Approve a call awaiting approval (KEY as `runledger status` shows it): it is sent
    with its idempotency key when the run goes on."""
    with open_client(database_url, connect_timeout, actor) as client:
        client.approve(key, note)
        click.echo(f"{key} approved; {what_the_run_does(client, key)}")


@click.command(context_settings=CONTEXT, epilog=DECIDE_EPILOG)
@database_option
@connect_option
@click.argument("key")
@opt("--reason", required=True, help="Why; the policy sees it in the call's error.")
@actor_option
def deny(
    database_url: str | None,
    connect_timeout: float,
    key: str,
    reason: str,
    actor: str | None,
) -> None:
    """Deny a call awaiting approval: it fails, never sent, and the policy sees a failed
    call with error {reason: denied, note: REASON, actor}."""
    with open_client(database_url, connect_timeout, actor) as client:
        client.deny(key, reason)
        click.echo(f"{key} denied; {what_the_run_does(client, key)}")
