"""Slack messages as a ready tool, on ``slack_sdk`` (docs/providers.md)::

    from slack_sdk import WebClient
    from runledger.providers import slack as slack_tools

    client = WebClient(token, timeout=5, retry_handlers=[])
    slack_tools.post_message(flow, client, channel="C0123456789")

Slack does not deduplicate: a message posted twice is two messages. The tool is a
``lookup`` tool. ``chat.postMessage`` carries the call's idempotency key in the
message's metadata (``{"event_type": "runledger_call", "event_payload":
{"runledger_key": KEY}}``), invisible in the channel; the lookup reads the channel's
history (``conversations.history`` with ``include_all_metadata=true``) back to the
key's first send less a margin, and matches the key.

How a call found in flight settles (the crash windows):

- before the send (``before_dispatch``): sent, once;
- sent, no answer journaled (``after_dispatch``, ``after_effect``, a timeout, a 5xx,
  ``internal_error`` or ``fatal_error``, a dropped connection): the lookup waits until
  the last send can no longer land (the client's timeout plus ``processing_bound``;
  Slack documents no bound of its own), then reads the history. Found: the call
  succeeds with that message, nothing is sent. Not found within the retention window:
  sent again with the same key. Not found past it: :class:`runledger.Unknowable`;
- the receipt is journaled (``after_complete``): reused, nothing is sent.

A documented refusal (``ok: false`` with ``channel_not_found``, ``not_in_channel``,
``is_archived``, ``invalid_auth``, ...) is :class:`runledger.NotApplied`; a rate limit
(HTTP 429 with ``Retry-After``, or ``ratelimited``) waits as asked (within the lease)
and is not applied either, to be sent again. Every other answer is ambiguous.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler
from slack_sdk.web import SlackResponse

from runledger.flows import Flow, NotApplied, Receipt, Tool, ToolContext, Unknowable
from runledger.providers.base import KEY_FIELD, Retention, retry_after, wait_landing

__all__ = [
    "DEFAULT_RETENTION",
    "EVENT_TYPE",
    "SlackAmbiguous",
    "SlackConfigError",
    "post_message",
]

EVENT_TYPE = "runledger_call"

# Slack keeps messages for the workspace's lifetime unless told otherwise, but owners can
# set a retention policy (workspace-wide, or per channel on paid plans, down to days) and
# members may be allowed to shorten it for private channels and DMs; free workspaces
# delete messages after a year and may choose 90 days. "Deletions run once per day". The
# default is the shortest a policy can keep a message: pass retention= for a channel
# whose policy is known to be longer.
DEFAULT_RETENTION = Retention(dt.timedelta(days=1), name="Slack")

# Slack documents no bound on how long it may act on a request it received: this is an
# assumption, on top of the client's own timeout. processing_bound= overrides it.
PROCESSING_BOUND = 10.0
NETWORK_MARGIN = 2.0
MAX_RATE_WAIT = 60.0
MAX_PAGES = 20
PAGE_LIMIT = 200

# chat.postMessage errors (docs.slack.dev/reference/methods/chat.postMessage, "Errors")
# that say the message was not posted. Any other error is ambiguous: internal_error and
# fatal_error say "It's possible some aspect of the operation succeeded before the error
# was raised"; service_unavailable and codes this list does not know are treated alike.
REFUSED = frozenset(
    {
        "access_denied",
        "account_inactive",
        "as_user_not_supported",
        "attachment_payload_limit_exceeded",
        "cannot_reply_to_message",
        "channel_not_found",
        "deprecated_endpoint",
        "duplicate_channel_not_found",
        "duplicate_message_not_found",
        "ekm_access_denied",
        "enterprise_is_restricted",
        "invalid_arg_name",
        "invalid_arguments",
        "invalid_array_arg",
        "invalid_auth",
        "invalid_blocks",
        "invalid_blocks_format",
        "invalid_charset",
        "invalid_form_data",
        "invalid_metadata_format",
        "invalid_metadata_schema",
        "invalid_post_type",
        "is_archived",
        "messages_tab_disabled",
        "metadata_must_be_sent_from_app",
        "metadata_too_large",
        "method_deprecated",
        "missing_post_type",
        "missing_scope",
        "msg_too_long",
        "no_permission",
        "no_text",
        "not_allowed_token_type",
        "not_authed",
        "not_in_channel",
        "org_login_required",
        "restricted_action",
        "restricted_action_non_threadable_channel",
        "restricted_action_read_only_channel",
        "restricted_action_thread_locked",
        "restricted_action_thread_only_channel",
        "team_access_not_granted",
        "team_added_to_org",
        "token_expired",
        "token_revoked",
        "too_many_attachments",
        "too_many_contact_cards",
        "two_factor_setup_required",
    }
)
# refusals worth sending again later (same key): the rate limits, and "request_timeout":
# "the POST data was either missing or truncated" (the request did not arrive whole)
REFUSED_FOR_NOW = frozenset({"ratelimited", "rate_limited", "request_timeout"})

# conversations.history reads a conversation by its id; a name ("#general") or a user id
# would post somewhere the lookup cannot read
CHANNEL_ID = re.compile(r"[CGD][A-Z0-9]{6,}")


class SlackConfigError(ValueError):
    """The Slack tool cannot be registered as configured (one line says why)."""


class SlackAmbiguous(Exception):
    """A send whose outcome is unknown: the call is looked up, never simply sent again."""


@dataclass(frozen=True, slots=True)
class _Slack:
    client: WebClient
    retention: Retention
    landing_bound: float
    margin: dt.timedelta
    max_pages: int


def _check_client(client: Any) -> WebClient:
    if not isinstance(client, WebClient):
        raise SlackConfigError(f"client must be a slack_sdk.WebClient, got {type(client).__name__}")
    others = [
        type(h).__name__
        for h in client.retry_handlers
        if not isinstance(h, RateLimitErrorRetryHandler)
    ]
    if others:
        raise SlackConfigError(
            f"the Slack client retries requests itself ({', '.join(others)}): a message "
            "whose connection dropped after it was sent would be posted twice; build it "
            "with WebClient(..., retry_handlers=[])"
        )
    return client


def _check_channel(channel: str) -> None:
    if not isinstance(channel, str) or not CHANNEL_ID.fullmatch(channel):
        raise ValueError(
            f"channel must be a conversation id (C..., G... or D...), got {channel!r}: "
            "the lookup reads conversations.history, which takes ids only"
        )


def _error(resp: SlackResponse) -> str:
    data = resp.data if isinstance(resp.data, dict) else {}
    return str(data.get("error") or f"HTTP {resp.status_code}")


def _request_id(resp: SlackResponse) -> str | None:
    headers = {k.lower(): v for k, v in (resp.headers or {}).items()}
    value = headers.get("x-slack-req-id")
    if isinstance(value, list):
        value = value[0] if value else None
    return None if value is None else str(value)


def _headers(resp: SlackResponse) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in (resp.headers or {}).items():
        out[str(k)] = str(v[0] if isinstance(v, list) and v else v)
    return out


def _rate_wait(ctx: ToolContext, resp: SlackResponse) -> float | None:
    """Seconds Slack asks to wait when ``resp`` is a rate limit, else None."""
    if resp.status_code == 429 or _error(resp) in ("ratelimited", "rate_limited"):
        return retry_after(_headers(resp), default=1.0, cap=3600.0)
    return None


def _post(ctx: ToolContext, s: _Slack, channel: str, text: str) -> Receipt:
    _check_channel(channel)
    asked = f"chat.postMessage channel={channel}"
    metadata = {"event_type": EVENT_TYPE, "event_payload": {KEY_FIELD: ctx.idempotency_key}}
    try:
        resp = s.client.chat_postMessage(channel=channel, text=text, metadata=metadata)
    except SlackApiError as exc:
        answer: SlackResponse = exc.response
        error = _error(answer)
        ctx.observe(
            asked=asked, status=answer.status_code, request_id=_request_id(answer), saw=error
        )
        wait = _rate_wait(ctx, answer)
        if wait is not None:
            wait = max(0.0, min(wait, MAX_RATE_WAIT, ctx.remaining() / 2))
            time.sleep(wait)
            raise NotApplied(
                f"{asked}: rate limited ({error}), waited {wait:.0f} s", retry=True
            ) from None
        if answer.status_code == 200 and error in REFUSED:
            raise NotApplied(f"{asked}: refused: {error}") from None
        if answer.status_code == 200 and error in REFUSED_FOR_NOW:
            raise NotApplied(f"{asked}: refused for now: {error}", retry=True) from None
        raise SlackAmbiguous(
            f"{asked}: answered {error} (HTTP {answer.status_code}): it may have been posted"
        ) from exc
    except Exception as exc:  # no answer: a timeout, a dropped connection
        ctx.observe(asked=asked, saw=f"no answer: {type(exc).__name__}: {exc}")
        raise SlackAmbiguous(
            f"{asked}: no answer ({type(exc).__name__}: {exc}): it may have been posted"
        ) from exc
    ctx.observe(asked=asked, status=resp.status_code, request_id=_request_id(resp))
    ts = str(resp["ts"])
    posted_in = str(resp.get("channel") or channel)
    return Receipt(
        result={"channel": posted_in, "ts": ts},
        receipt={"channel": posted_in, "ts": ts, "found_by": "send"},
    )


def _history(ctx: ToolContext, s: _Slack, asked: str, **params: Any) -> SlackResponse:
    """One page of history. A rate limit is waited for when the lease allows it, else
    it raises (the lookup failed: asked again later)."""
    while True:
        try:
            return s.client.conversations_history(**params)
        except SlackApiError as exc:
            answer: SlackResponse = exc.response
            error = _error(answer)
            ctx.observe(asked=asked, status=answer.status_code, saw=error)
            if error in ("channel_not_found", "not_in_channel"):
                raise Unknowable(
                    f"{asked}: {error}: the conversation cannot be read any more (a deleted "
                    "channel's messages are deleted with it)",
                    error=error,
                ) from None
            wait = _rate_wait(ctx, answer)
            if wait is None or wait >= ctx.remaining() / 2:
                raise
            time.sleep(wait)


def _find(ctx: ToolContext, s: _Slack, channels: Sequence[str]) -> dict[str, Any] | None:
    wait_landing(ctx, s.landing_bound)
    oldest = None if ctx.first_sent_at is None else ctx.first_sent_at - s.margin
    seen = 0
    for channel in channels:
        found, n = _find_in(ctx, s, channel, oldest)
        if found is not None:
            return found
        seen += n
    s.retention.not_found(ctx, channels=list(channels), messages_seen=seen)
    return None  # within the window: the key did not take effect


def _find_in(
    ctx: ToolContext, s: _Slack, channel: str, oldest: dt.datetime | None
) -> tuple[dict[str, Any] | None, int]:
    key = ctx.idempotency_key
    params: dict[str, Any] = {
        "channel": channel,
        "include_all_metadata": True,
        "limit": PAGE_LIMIT,
    }
    if oldest is not None:
        params["oldest"] = f"{oldest.timestamp():.6f}"
        params["inclusive"] = True
    asked = f"conversations.history channel={channel} oldest={params.get('oldest')}"
    seen = 0
    for _ in range(s.max_pages):
        resp = _history(ctx, s, asked, **params)
        for message in resp.get("messages") or []:
            seen += 1
            meta = message.get("metadata") or {}
            payload = meta.get("event_payload") or {}
            if meta.get("event_type") == EVENT_TYPE and payload.get(KEY_FIELD) == key:
                ctx.observe(asked=asked, saw=f"message {message.get('ts')} carries the key")
                found = {"channel": channel, "ts": message.get("ts"), "found_by": "lookup"}
                return found, seen
        cursor = (resp.get("response_metadata") or {}).get("next_cursor")
        if not resp.get("has_more") or not cursor:
            break
        params["cursor"] = cursor
    else:
        raise RuntimeError(
            f"more than {s.max_pages * PAGE_LIMIT} messages in {channel} since the first "
            f"send of {key}: the lookup stops there (raise max_pages)"
        )
    ctx.observe(asked=asked, saw=f"{seen} messages since the first send, none with the key")
    return None, seen


def post_message(
    flow: Flow,
    client: WebClient,
    *,
    channel: str | Sequence[str],
    name: str = "post_slack_message",
    retention: Retention = DEFAULT_RETENTION,
    processing_bound: float = PROCESSING_BOUND,
    margin: dt.timedelta = dt.timedelta(minutes=10),
    max_pages: int = MAX_PAGES,
    max_attempts: int = 3,
) -> Tool[Any]:
    """Register ``name(text)`` posting to ``channel`` (a conversation id); given several
    ids, ``name(channel, text)`` posting to the one the model names among them.

    Safety ``lookup``. The lookup waits until ``client.timeout + processing_bound + 2``
    seconds have passed since the last send (``WebClient(timeout=5)`` with the default
    bound: 17 s; slack_sdk's default timeout of 30 s: 42 s), then reads
    ``conversations.history`` of the channel (each of them, given several: a lookup is
    not handed the call's arguments) from the key's first send less ``margin``. Nothing
    found past ``retention`` (default one day, the shortest retention Slack lets an
    owner set) is :class:`~runledger.Unknowable`. A message a person deleted before the
    lookup reads the channel is not seen: it is posted again.
    """
    web = _check_client(client)
    channels = [channel] if isinstance(channel, str) else list(channel)
    if not channels:
        raise SlackConfigError("channel must name at least one conversation id")
    for c in channels:
        try:
            _check_channel(c)
        except ValueError as exc:
            raise SlackConfigError(str(exc)) from None
    if max_pages < 1:
        raise SlackConfigError("max_pages must be at least 1")
    s = _Slack(
        client=web,
        retention=retention,
        landing_bound=float(web.timeout) + processing_bound + NETWORK_MARGIN,
        margin=margin,
        max_pages=max_pages,
    )

    if len(channels) == 1:
        (only,) = channels

        @flow.tool(safety="lookup", name=name, max_attempts=max_attempts)
        def post(ctx: ToolContext, text: str) -> Receipt:
            return _post(ctx, s, only, text)

        tool = post
    else:
        allowed = frozenset(channels)

        @flow.tool(safety="lookup", name=name, max_attempts=max_attempts)
        def post_to(ctx: ToolContext, channel: str, text: str) -> Receipt:
            if channel not in allowed:
                raise NotApplied(f"channel {channel!r} is not one of {sorted(allowed)}")
            return _post(ctx, s, channel, text)

        tool = post_to

    @tool.lookup
    def find(ctx: ToolContext) -> dict[str, Any] | None:
        return _find(ctx, s, channels)

    return tool
