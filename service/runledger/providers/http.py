"""A tool for any HTTP API: the call's key in the ``Idempotency-Key`` header (the IETF
draft, ``draft-ietf-httpapi-idempotency-key-header``), and a lookup by a URL template.

```python
from runledger.providers import http

create_order = http.tool(
    flow,
    name="create_order",
    url="https://api.example.com/orders",
    lookup_url="https://api.example.com/orders?idempotency_key={key}",
    retention=http.Retention(datetime.timedelta(hours=24), name="the orders API"),
)
```

The model calls ``create_order(body={...})``; the tool sends ``POST url`` with the body as
JSON and ``Idempotency-Key: <the call's key>``.

What settles each crash window:

- *before the request left*: the lookup finds nothing, and the call is sent (same key);
- *sent, answer lost* (a crash, a timeout, a 5xx, a dropped connection): the lookup.
  Found: its answer is the receipt. Not found: once the send can no longer land (the
  lookup waits until ``landing`` seconds after it, the API's own bound on acting on a
  request), within ``retention``, sent again with the same key (an API that
  deduplicates keys answers a late duplicate with the first answer anyway); past
  ``retention``, ``unknown``, for a person;
- *answered, not journaled*: the lookup finds it.

``lookup_url`` names the key as ``{key}`` (URL-quoted): a search by key, or the resource
itself when the API lets the client name it (``PUT /orders/{key}``). A ``200`` is found
(a JSON list: when not empty, its one element being the receipt), a ``404`` or an empty
list is not found, anything else is a failed lookup (asked again). ``found=`` replaces
that judgment.

Answers to the send: ``2xx`` returns the JSON body as the result, with the status, the
``Location`` and the request id as the receipt; ``429`` and ``503`` are waited out
(``Retry-After``, within the lease) and sent again, then, still refused, the call is not
applied and tried again later; ``409`` (the key's first request still in progress) is
waited for the same way, then looked up; ``422`` (the key used for another body) leaves
the effect unknown: looked up; any
other ``4xx`` is a refusal, certainly not applied; ``5xx``, a timeout or a dropped
connection are ambiguous: looked up.
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from runledger.flows import Flow, NotApplied, Receipt, Tool, ToolContext
from runledger.providers.base import Retention, await_landing, landing_wait, retry_after

__all__ = ["AmbiguousAnswer", "Retention", "tool"]

KEY_HEADER = "Idempotency-Key"
# the request id headers a lookup and the evidence keep, first found wins
REQUEST_ID_HEADERS = ("request-id", "x-request-id", "x-amzn-requestid", "cf-ray")
RATE_LIMITED = (429, 503)  # not processed: waited out, then sent again
IN_PROGRESS = 409  # the key's first request is still being processed: waited for too


class AmbiguousAnswer(Exception):
    """The API answered in a way that leaves the effect unknown (``409``, ``422``,
    ``5xx``): the call is looked up."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:300]}")
        self.status = status


def _request_id(response: httpx.Response) -> str | None:
    for name in REQUEST_ID_HEADERS:
        if name in response.headers:
            return response.headers[name]
    return None


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _default_found(response: httpx.Response) -> dict[str, Any] | None:
    if response.status_code == 404:
        return None
    if response.status_code != 200:
        raise AmbiguousAnswer(response.status_code, response.text)
    body = _json(response)
    if isinstance(body, list):  # a search: the one thing it found, or all of them
        if not body:
            return None
        return body[0] if len(body) == 1 and isinstance(body[0], dict) else {"found": body}
    if isinstance(body, dict):
        for name in ("data", "items", "results"):  # a list wrapped in an envelope
            if isinstance(body.get(name), list) and not body[name]:
                return None
        return body
    return {"found": body}


def tool(
    flow: Flow,
    *,
    name: str,
    url: str,
    lookup_url: str,
    method: str = "POST",
    retention: Retention,
    landing: float = 30.0,
    headers: Mapping[str, str] | None = None,
    timeout: float = 10.0,
    found: Callable[[httpx.Response], dict[str, Any] | None] | None = None,
    client: Callable[[], httpx.AsyncClient] | None = None,
    max_attempts: int = 3,
    rate_limit_tries: int = 3,
) -> Tool[Any]:
    """Register ``name(body: dict)`` on ``flow``: ``method url`` with ``body`` as JSON and
    the call's key in ``Idempotency-Key``, and its lookup (a ``lookup`` tool).

    - ``retention``: how long the API keeps what ``lookup_url`` reads; past it, nothing
      found is ``unknown``;
    - ``landing``: the API's own bound, in seconds, on acting on a request it received
      (its request timeout): a lookup says "not found" only that long after the last
      send, for a request the client gave up on may still land until then;
    - ``client``: makes the ``httpx.AsyncClient`` each send and lookup uses (and closes);
      default: a new one with ``timeout`` and ``headers``;
    - ``found``: the lookup's judgment of the ``GET lookup_url`` answer: a receipt dict,
      None for not found; raise for a failed lookup.
    """
    method = method.upper()
    if method not in ("POST", "PUT", "PATCH"):
        raise ValueError(f"method must be POST, PUT or PATCH, got {method!r}")
    if "{key}" not in lookup_url:
        raise ValueError(f"lookup_url must name the key as {{key}}, got {lookup_url!r}")
    for what, value in (("url", url), ("lookup_url", lookup_url)):
        if urllib.parse.urlsplit(value).scheme not in ("http", "https"):
            raise ValueError(f"{what} must be an http or https URL, got {value!r}")
    if not landing >= 0 or not timeout > 0 or rate_limit_tries < 1:
        raise ValueError("landing must be 0 or more, timeout positive, rate_limit_tries >= 1")
    fixed = dict(headers or {})
    judge = found or _default_found

    def connect() -> httpx.AsyncClient:
        if client is not None:
            return client()
        return httpx.AsyncClient(timeout=timeout, headers=fixed)

    async def send(ctx: ToolContext, body: dict[str, Any]) -> Receipt:
        """Send ``body`` to the API."""
        if not isinstance(body, dict):
            raise NotApplied(f"body must be a JSON object, got {type(body).__name__}")
        async with connect() as http_client:
            for tries in range(1, rate_limit_tries + 1):
                response = await http_client.request(
                    method, url, json=body, headers={KEY_HEADER: ctx.idempotency_key}
                )
                rid = _request_id(response)
                ctx.observe(asked=f"{method} {url}", status=response.status_code, request_id=rid)
                if response.status_code not in (*RATE_LIMITED, IN_PROGRESS):
                    break
                wait = retry_after(response.headers)
                if tries == rate_limit_tries or wait >= ctx.remaining():
                    if response.status_code == IN_PROGRESS:
                        raise AmbiguousAnswer(response.status_code, response.text)
                    raise NotApplied(
                        f"HTTP {response.status_code}: rate limited (Retry-After {wait:g} s)",
                        retry=True,
                    )
                await asyncio.sleep(wait)
        status = response.status_code
        if 200 <= status < 300:
            return Receipt(
                result=_json(response),
                receipt={
                    "status": status,
                    "location": response.headers.get("location"),
                    "request_id": rid,
                },
            )
        if status in (IN_PROGRESS, 422) or status >= 500:
            raise AmbiguousAnswer(status, response.text)
        raise NotApplied(f"HTTP {status}: {response.text[:300]}")

    send.__name__ = name
    registered = flow.tool(safety="lookup", name=name, max_attempts=max_attempts)(send)

    @registered.lookup
    async def lookup(ctx: ToolContext) -> dict[str, Any] | None:
        where = lookup_url.replace("{key}", urllib.parse.quote(ctx.idempotency_key, safe=""))
        while True:
            # asked before the last send can no longer land, "not found" proves nothing
            # (the worker takes it for certain): asked again once it cannot
            early = landing_wait(ctx, landing) > 0
            async with connect() as http_client:
                response = await http_client.get(where)
            ctx.observe(
                asked=f"GET {where}",
                status=response.status_code,
                request_id=_request_id(response),
            )
            receipt = judge(response)
            if receipt is not None:
                return receipt
            if not early:
                break
            await await_landing(ctx, landing)
        retention.not_found(ctx, asked=f"GET {where}")  # raises past the window
        return None

    return registered
