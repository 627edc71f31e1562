"""Links cut when their device is removed or changed (under the auth callout).

nats-server never looks at a leaf connection again: the link keeps the account and the
permissions it was let in with for its life, whatever the registry says since. So each link
the watcher admits (`hub_ingest.fleet.admission`) is remembered (its server, its connection
id, the device record it was let in from), and when a read of the registry finds that device
removed, or its record changed in what its link is granted, the watcher has the server close
the link (the system account's ``$SYS.REQ.SERVER.<id>.KICK``, signed in as the system user
derived from the operators' seed, `auth.system_user`). The device dials again and is let in,
or refused, from the registry as it is now.

nats-server's ``/leafz`` does not say which key a link signed in with, so the watchers keep
what they let in in the ``FLEET_LINKS`` bucket (a device's key: its last `KEPT` links),
written every second (`save_links`), and a watcher that starts reads it (`load_links`): a
restarted watcher, or another node's, cuts a link it did not let in. A link let in in the
second before its watcher was killed is not in the bucket; it stays up until it drops or its
life ends (``server.link_life``, the expiry of the answer that let it in), as every link does
under ``server.admission = "users_file"`` until it drops; restarting the hub's nats-server cuts
every link (docs/security.md).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import nats
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.errors import BucketNotFoundError

from hub_ingest.core.buckets import LINKS, bucket_values
from hub_ingest.core.config import HubConfig
from hub_ingest.core.connect import close_quietly
from hub_ingest.core.gather import REQUESTS_AT_ONCE, gather_bounded
from hub_ingest.fleet.auth import system_user
from hub_ingest.fleet.registry import Device

log = structlog.get_logger(__name__)

# Links remembered a key: a device whose link dropped dials again, and its older links are
# closed; a handshake storm can leave a duplicate or two open for a moment.
KEPT = 4
KICK_TIMEOUT_S = 2.0
_GONE = "no such client or leafnode id"  # nats-server's answer: the link closed by itself

# What a device's link is let in with, as a digest (thousands of links are remembered).
Grant = Callable[[Device], str]


@dataclass(slots=True)
class Link:
    server: str  # the id of the server the link is on
    cid: int  # its connection id there
    device_id: str
    granted: str
    # The record it was let in from; None for a link read from the bucket until a read of the
    # registry finds its device granted the same.
    device: Device | None = None

    def record(self) -> dict[str, str | int]:
        return {
            "server": self.server,
            "cid": self.cid,
            "device_id": self.device_id,
            "granted": self.granted,
        }


class Links:
    """The links the watchers let in, and those to cut."""

    def __init__(self, grant: Grant) -> None:
        self._grant = grant
        self._by_key: dict[str, deque[Link]] = {}
        self.to_cut: dict[tuple[str, int], tuple[Link, str]] = {}
        self.cut = 0
        self.unsaved: set[str] = set()  # keys whose links changed since `save_links`

    def admitted(self, server: str, cid: int, key: str, device: Device) -> None:
        link = Link(server, cid, device.device_id, self._grant(device), device)
        self._by_key.setdefault(key, deque(maxlen=KEPT)).append(link)
        self.unsaved.add(key)

    def saved(self, key: str) -> bytes:
        """`key`'s links as `save_links` writes them; empty when none is left."""
        links = self._by_key.get(key)
        return json.dumps([link.record() for link in links]).encode() if links else b""

    def restore(self, key: str, saved: bytes) -> None:
        """Add the links `saved` names, unless known already; the next `check` decides. A
        value that is not such a list is logged and left (its links end with their life)."""
        known = self._by_key.get(key, ())
        seen = {(link.server, link.cid) for link in known}
        try:
            read = [Link(**r) for r in json.loads(saved) if (r["server"], r["cid"]) not in seen]
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("links_record_unreadable", bucket=LINKS, key=key, error=repr(exc))
            return
        self._by_key[key] = deque([*read, *known], maxlen=KEPT)  # the newest kept

    def cut_key(self, key: str, reason: str) -> None:
        """Mark every link of `key` for cutting."""
        if links := self._by_key.pop(key, None):
            self._mark(links, reason)
            self.unsaved.add(key)

    def check(self, registered: Mapping[str, Device]) -> None:
        """Mark for cutting the links whose device `registered` (by key) no longer has, or
        would let in with other permissions."""
        for key, links in list(self._by_key.items()):
            device = registered.get(key)
            if device is None:
                del self._by_key[key]
                self._mark(links, "removed")
                self.unsaved.add(key)
            elif any(link.device is not device for link in links):  # a record read since
                kept: deque[Link] = deque(maxlen=KEPT)
                for link in links:
                    if self._holds(link, device):
                        kept.append(link)
                    else:
                        self._mark([link], "changed")
                        self.unsaved.add(key)
                self._by_key[key] = kept

    def _holds(self, link: Link, device: Device) -> bool:
        """Whether `device`'s record lets `link` in as it was (a new incarnation does)."""
        if link.device == device or self._grant(device) == link.granted:
            link.device = device
            return True
        return False

    def _mark(self, links: Iterable[Link], reason: str) -> None:
        for link in links:
            self.to_cut[(link.server, link.cid)] = (link, reason)


async def load_links(js: JetStreamContext, links: Links) -> None:
    """Add every link the bucket holds to `links` (none before `provision` made it)."""
    for key, saved in (await bucket_values(js, LINKS)).items():
        links.restore(key, saved)


async def save_links(js: JetStreamContext, links: Links) -> None:
    """Write the links of every key whose links changed; a key with none left is deleted.
    Before `provision` made the bucket nothing is written (and a restarted watcher cuts only
    what it let in since)."""
    if not links.unsaved:
        return
    try:
        bucket = await js.key_value(LINKS)
    except BucketNotFoundError:
        links.unsaved.clear()
        return

    async def save(key: str) -> None:
        links.unsaved.discard(key)  # before the write: links admitted during it are saved next
        value = links.saved(key)
        try:
            await (bucket.put(key, value) if value else bucket.delete(key))
        except BaseException:
            links.unsaved.add(key)
            raise

    await gather_bounded([save(key) for key in list(links.unsaved)], REQUESTS_AT_ONCE)


async def _quiet(exc: Exception) -> None:
    log.debug("system_connection_error", error=repr(exc))


class Cutter:
    """Closes the links `Links` marked, over a connection of the system account's user; the
    watcher's looks at every server's links go over it too (`fleet.shared_keys`)."""

    def __init__(self, config: HubConfig, links: Links) -> None:
        self._config, self._links = config, links
        self._nc: Client | None = None
        self._failing = ""  # the last error, logged once

    async def cut_marked(self) -> None:
        """Cut every marked link; one that could not be is tried again at the next call."""
        for where, (link, reason) in list(self._links.to_cut.items()):
            try:
                closed = await self._kick(link)
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                if repr(exc) != self._failing:
                    log.warning(
                        "link_cut_failed",
                        device_id=link.device_id,
                        error=repr(exc),
                        hint="restart the hub's nats-server to cut every link",
                    )
                self._failing = repr(exc)
                return
            self._failing = ""
            del self._links.to_cut[where]
            if closed:
                self._links.cut += 1
                log.info(
                    "link_cut",
                    device_id=link.device_id,
                    reason=reason,
                    server=link.server,
                    cid=link.cid,
                )

    async def _kick(self, link: Link) -> bool:
        """Have `link`'s server close it; False if it was closed already."""
        nc = await self._connection()
        subject = f"$SYS.REQ.SERVER.{link.server}.KICK"
        try:
            reply = await nc.request(
                subject, json.dumps({"cid": link.cid}).encode(), KICK_TIMEOUT_S
            )
        except nats.errors.NoRespondersError:
            return False  # that server is gone (a restarted server has a new id)
        error = (json.loads(reply.data or b"{}").get("error") or {}).get("description")
        if error is None:
            return True
        if error == _GONE:
            return False
        raise nats.errors.Error(f"{subject}: {error}")

    async def subscribe(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> Subscription:
        """What the system account receives on `subject`, to `cb`."""
        return await (await self._connection()).subscribe(subject, cb=cb)

    async def every_leafz(self, servers: int) -> list[dict[str, Any]]:
        """The ``/leafz`` of every server that answers within `KICK_TIMEOUT_S` (up to
        `servers` of them), as the system account asks for it."""
        nc = await self._connection()
        sub = await nc.subscribe(inbox := nc.new_inbox())
        answers: list[dict[str, Any]] = []
        try:
            await nc.publish("$SYS.REQ.SERVER.PING.LEAFZ", b"{}", reply=inbox)
            async with asyncio.timeout(KICK_TIMEOUT_S):
                while len(answers) < servers:
                    answers.append(json.loads((await sub.next_msg(timeout=None)).data))
        except TimeoutError:
            pass  # a server that does not answer is left out of this look
        finally:
            await sub.unsubscribe()
        return answers

    async def _connection(self) -> Client:
        if self._nc is None or self._nc.is_closed:
            seed = system_user(self._config).seed.decode()
            # One try a call: a server config from before the system user (rendered at the
            # server's start) sends it to the callout, which refuses it.
            self._nc = await nats.connect(
                list(self._config.nats.servers),
                name="hub-ingest-watch-system",
                nkeys_seed_str=seed,
                connect_timeout=5,
                max_reconnect_attempts=1,
                error_cb=_quiet,
            )
            self._nc.options["max_reconnect_attempts"] = -1
        return self._nc

    async def close(self) -> None:
        if self._nc is not None:
            await close_quietly(self._nc)
