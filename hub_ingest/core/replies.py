"""Requests answered by several messages (a batched direct get), over one subscription.

A subscription made per request is an interest change, and the hub sends each one to every
leaf node of the account (checking that leaf's permissions): with hundreds of devices linked,
that loop was the largest part of the hub's CPU (docs/scaling.md). nats-py's own requests
share one inbox subscription; this does the same for answers that come in several messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import weakref
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg


class SharedInbox:
    """One wildcard inbox subscription, made at the first request (see `shared_inbox`)."""

    def __init__(self, nc: Client) -> None:
        # Neither the connection nor its subscription is held: `shared_inbox` keys its cache
        # by the connection, weakly, and a value holding its key would never let it go.
        self._nc = weakref.ref(nc)
        self._prefix = nc.new_inbox()
        self._subscribed = False
        self._subscribing = asyncio.Lock()
        self._waiting: dict[str, asyncio.Queue[Msg]] = {}
        self._tokens = itertools.count()

    async def replies(
        self, subject: str, payload: bytes, timeout: float
    ) -> AsyncGenerator[Msg, None]:
        """The messages answering `payload` sent to `subject`, as they come; raises nats-py's
        TimeoutError when the next one is `timeout` seconds late. The caller stops reading
        when an answer says it is the last."""
        nc = self._nc()
        if nc is None:
            raise nats.errors.ConnectionClosedError
        async with self._subscribing:  # one subscription, however many ask at once
            if not self._subscribed:
                await nc.subscribe(f"{self._prefix}.*", cb=self._deliver)
                self._subscribed = True
        token = str(next(self._tokens))
        queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._waiting[token] = queue
        try:
            await nc.publish(subject, payload, reply=f"{self._prefix}.{token}")
            while True:
                try:
                    yield await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    raise nats.errors.TimeoutError from None
        finally:
            del self._waiting[token]

    async def _deliver(self, msg: Msg) -> None:
        queue = self._waiting.get(msg.subject.rsplit(".", 1)[-1])
        if queue is not None:  # else: the answer to a request given up on
            queue.put_nowait(msg)


_SHARED: weakref.WeakKeyDictionary[Client, SharedInbox] = weakref.WeakKeyDictionary()


def shared_inbox(nc: Client) -> SharedInbox:
    """The connection's one `SharedInbox`: its subscription lives as long as the connection
    (nats-py makes it again after a reconnect)."""
    inbox = _SHARED.get(nc)
    if inbox is None:
        inbox = _SHARED[nc] = SharedInbox(nc)
    return inbox


async def direct_get(
    nc: Client, api: str, stream: str, request: dict[str, Any], timeout: float
) -> list[Msg]:
    """The messages a batched direct get on `stream` answers (`request`: ``seq``, ``batch``,
    maybe ``next_by_subj``), without the status that ends the answer (``204 EOB``, or
    ``404`` when there is none); `api` is the JetStream API prefix of the hub's domain."""
    got: list[Msg] = []
    subject = f"{api}.DIRECT.GET.{stream}"
    answers = shared_inbox(nc).replies(subject, json.dumps(request).encode(), timeout)
    async with contextlib.aclosing(answers) as replies:
        async for msg in replies:
            if "Status" in (msg.headers or {}):
                break
            got.append(msg)
    return got


_LAST_BATCH = 256  # subjects one batched direct get asks the last message of


@dataclass(frozen=True, slots=True)
class Stored:
    """A stream's message as a direct get answers it."""

    seq: int
    subject: str
    time: str  # when the stream stored it (RFC 3339)
    data: bytes

    @classmethod
    def of(cls, msg: Msg) -> Stored:
        headers = msg.headers or {}
        return cls(
            int(headers["Nats-Sequence"]),
            headers["Nats-Subject"],
            headers.get("Nats-Time-Stamp", ""),
            msg.data,
        )


async def last_messages(
    nc: Client, api: str, stream: str, subjects: Sequence[str], timeout: float = 10.0
) -> dict[str, Stored]:
    """The last message on each of `subjects` in `stream` that has one, by subject: a
    batched direct get per 256 subjects, where asking subject by subject costs a request
    each."""
    found: dict[str, Stored] = {}
    for first in range(0, len(subjects), _LAST_BATCH):
        chunk = list(subjects[first : first + _LAST_BATCH])
        request = {"multi_last": chunk, "batch": len(chunk)}
        for msg in await direct_get(nc, api, stream, request, timeout):
            stored = Stored.of(msg)
            found[stored.subject] = stored
    return found
