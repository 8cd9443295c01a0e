"""``runledger approve`` and ``runledger deny``: a person decides a call awaiting approval.

A call of a tool declared ``@flow.tool(..., approval=True)`` (or a ``ToolCall(...,
approval=True)``) is recorded awaiting approval and never sent before a person decides;
the run pauses on it. Registered on the ``runledger`` group by :mod:`runledger.cli`;
errors are one line and exit 1 there, as for every command.
"""

from __future__ import annotations

import click

from runledger.cli.options import CONTEXT, _client, _opt, connect_option, database_option
from runledger.client import Client
from runledger.model import Approval, Call, CallStatus

APPROVABLE = ("queued", "paused", "cancelled", "failed")  # runs approve_call/deny_call accept

_SHOWN = {
    Approval.PENDING: "awaiting approval",
    Approval.APPROVED: "approved",
    Approval.DENIED: "denied",
}


def approval_lines(key: str) -> tuple[str, str]:
    """The two lines ``runledger status`` prints (whole) for a call awaiting approval."""
    return f"runledger approve {key}", f'runledger deny {key} --reason "..."'


def shown_status(call: Call) -> str:
    """A call's status with its approval, if it has one: ``planned (awaiting approval)``."""
    if call.approval is None:
        return str(call.status)
    return f"{call.status} ({_SHOWN[call.approval]})"


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


def _not_empty(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value == "":
        raise click.BadParameter("must not be empty (leave it out for cli:$USER).")
    return value


actor_option = _opt(
    "--actor",
    default=None,
    callback=_not_empty,
    help="Who decides, kept with the call and in the event (default: cli:$USER).",
)

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
@_opt("--note", default=None, help="Why; kept with the call and in the event.")
def approve(
    database_url: str | None,
    connect_timeout: float,
    key: str,
    actor: str | None,
    note: str | None,
) -> None:
    """Approve a call awaiting approval (KEY as `runledger status` shows it): it is sent
    with its idempotency key when the run goes on."""
    with _client(database_url, connect_timeout, actor) as client:
        client.approve(key, note)
        click.echo(f"{key} approved; {what_the_run_does(client, key)}")


@click.command(context_settings=CONTEXT, epilog=DECIDE_EPILOG)
@database_option
@connect_option
@click.argument("key")
@_opt("--reason", required=True, help="Why; the policy sees it in the call's error.")
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
    with _client(database_url, connect_timeout, actor) as client:
        client.deny(key, reason)
        click.echo(f"{key} denied; {what_the_run_does(client, key)}")
