"""A local Slack Web API for the Slack adapter's tests (runledger.providers.slack).

The documented shapes of the two methods the adapter uses (docs.slack.dev, Web API):

- ``chat.postMessage`` (JSON or form body; ``channel``, ``text``, ``metadata`` as an
  object or a JSON string): ``{"ok": true, "channel", "ts", "message"}``, or HTTP 200
  ``{"ok": false, "error": "channel_not_found" | "not_authed" | "no_text" |
  "invalid_metadata_format" ...}``;
- ``conversations.history`` (GET query or POST form; ``channel``, ``oldest``,
  ``latest``, ``inclusive``, ``limit``, ``cursor``, ``include_all_metadata``): newest
  first, ``has_more`` and ``response_metadata.next_cursor``; a message's ``metadata``
  only with ``include_all_metadata``.

Rate limits are HTTP 429 with ``Retry-After`` and ``{"ok": false, "error":
"ratelimited"}``. Slack has no idempotency key, hence no key conflict: its documented
refusal is an ``ok: false`` error. The switches are those of
:class:`tests.providers.fake_github.FakeHTTP`. Every posted message is recorded, per
key (its metadata).
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from runledger.providers.base import KEY_FIELD
from tests.providers.fake_github import Answer, FakeHTTP, Request


class FakeSlack(FakeHTTP):
    """A workspace with the given channels (ids); the bot is a member of each."""

    def __init__(self, channels: tuple[str, ...] = ("C0GENERAL1",), token: str = "xoxb-test"):
        self.token = token
        self.channels: dict[str, list[dict[str, Any]]] = {c: [] for c in channels}
        self._last_ts = 0.0
        self._ts_lock = threading.Lock()
        super().__init__()

    @property
    def api_url(self) -> str:
        return self.url + "/api/"

    # -- what happened -------------------------------------------------------------------

    def effects(self, key: str) -> list[dict[str, Any]]:
        with self.lock:
            return [
                m
                for msgs in self.channels.values()
                for m in msgs
                if (m.get("metadata") or {}).get("event_payload", {}).get(KEY_FIELD) == key
            ]

    def seed_message(self, channel: str, text: str, age: dt.timedelta) -> str:
        """A message posted ``age`` ago by someone else."""
        with self.lock:
            ts = self._ts(time.time() - age.total_seconds())
            self.channels[channel].append(
                {"type": "message", "user": "U0PERSON1", "text": text, "ts": ts}
            )
            return ts

    def delete_message(self, channel: str, ts: str) -> None:
        with self.lock:
            self.channels[channel] = [m for m in self.channels[channel] if m["ts"] != ts]

    # -- the API ------------------------------------------------------------------------

    def _ts(self, at: float | None = None) -> str:
        with self._ts_lock:
            t = time.time() if at is None else at
            if at is None:
                t = max(t, self._last_ts + 0.000001)
                self._last_ts = t
            return f"{t:.6f}"

    def error(self, status: int, message: str) -> Answer:
        if status >= 500:
            return status, self._headers(), {"ok": False, "error": "internal_error"}
        return 200, self._headers(), {"ok": False, "error": message}

    def _headers(self) -> dict[str, str]:
        return {"x-slack-req-id": uuid.uuid4().hex}

    def refusal(self, error: str) -> Answer:
        return 200, self._headers(), {"ok": False, "error": error}

    def route(self, req: Request) -> Callable[[], Answer]:
        args: dict[str, Any] = dict(req.query)
        if isinstance(req.body, dict):
            args.update(req.body)
        auth = req.headers.get("Authorization") or ""
        if auth != f"Bearer {self.token}" and args.get("token") != self.token:
            return lambda: self.refusal("not_authed" if not auth else "invalid_auth")
        if req.path == "/api/chat.postMessage" and req.method == "POST":
            return lambda: self._post(args)
        if req.path == "/api/conversations.history":
            return lambda: self._history(args)
        return lambda: (404, self._headers(), {"ok": False, "error": "unknown_method"})

    def _post(self, args: dict[str, Any]) -> Answer:
        channel = args.get("channel")
        if channel not in self.channels:
            return self.refusal("channel_not_found")
        text = args.get("text")
        if not text and not args.get("blocks"):
            return self.refusal("no_text")
        metadata = args.get("metadata")
        if isinstance(metadata, str):
            try:
                metadata = json.loads(metadata)
            except ValueError:
                return self.refusal("invalid_metadata_format")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or not isinstance(metadata.get("event_type"), str)
            or not isinstance(metadata.get("event_payload"), dict)
        ):
            return self.refusal("invalid_metadata_schema")
        ts = self._ts()
        message: dict[str, Any] = {
            "type": "message",
            "subtype": "bot_message",
            "text": text,
            "user": "U0BOT0001",
            "bot_id": "B0BOT0001",
            "app_id": "A0APP0001",
            "ts": ts,
        }
        if metadata is not None:
            message["metadata"] = metadata
        self.channels[channel].append(message)
        return 200, self._headers(), {"ok": True, "channel": channel, "ts": ts, "message": message}

    def _history(self, args: dict[str, Any]) -> Answer:
        channel = args.get("channel")
        if channel not in self.channels:
            return self.refusal("channel_not_found")
        truthy = ("1", "true", "True", True)
        inclusive = args.get("inclusive") in truthy
        with_meta = args.get("include_all_metadata") in truthy
        limit = min(int(args.get("limit") or 100), 999)
        msgs = sorted(self.channels[channel], key=lambda m: float(m["ts"]), reverse=True)
        if args.get("oldest"):
            o = float(args["oldest"])
            msgs = [m for m in msgs if float(m["ts"]) > o or (inclusive and float(m["ts"]) == o)]
        if args.get("latest"):
            la = float(args["latest"])
            msgs = [m for m in msgs if float(m["ts"]) < la or (inclusive and float(m["ts"]) == la)]
        start = 0
        if args.get("cursor"):
            start = int(base64.b64decode(str(args["cursor"])).decode().split(":")[1])
        page = msgs[start : start + limit]
        has_more = start + limit < len(msgs)
        out = []
        for m in page:
            m = dict(m)
            if not with_meta:
                m.pop("metadata", None)
            out.append(m)
        body: dict[str, Any] = {"ok": True, "messages": out, "has_more": has_more, "pin_count": 0}
        if has_more:
            cursor = base64.b64encode(f"next_ts:{start + limit}".encode()).decode()
            body["response_metadata"] = {"next_cursor": cursor}
        return 200, self._headers(), body
