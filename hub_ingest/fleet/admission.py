"""Devices admitted by nats-server's auth callout (``server.admission = "callout"``).

With the default (``"users_file"``) each device is a user of the hub's users file, and
enrolling one rewrites the file and reloads the server: at 500 devices the reload is most of
an enrolment's 0.3 s (docs/scaling.md). With the callout the users file names no device: the
hub's nats-server asks ``$SYS.REQ.USER.AUTH`` about every connection whose key is not an
operator's, leaf connections included, and `Admission` (run by ``hub-ingest watch`` on every
node, in one queue group) answers from the registry. Enrolling a device into a shard that
exists changes no file and reloads nothing; the users file makes each shard's account one
shard ahead, so the first device of a shard needs no reload either.

A device is admitted when its key is registered and it signed the server's nonce with it; it is
bound to its shard's account with the permissions the users file would give it
(`auth.device_permissions`). The answers are JWTs signed by an account key derived from the
operators' seed, so every node that holds that seed answers alike and no new secret is made.
Without a running watcher no device links: the operators' own connections never ask. A link
let in stays as it was let in for its life, so the links of a device removed since are cut
(`hub_ingest.fleet.cutoff`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import nacl.exceptions
import nacl.signing
import nats.errors
import nkeys
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from hub_ingest.core.config import HubConfig
from hub_ingest.core.rounds import next_round
from hub_ingest.fleet.admission_figures import WRITE_S, Tally, write_figures
from hub_ingest.fleet.auth import derived_keys, device_permissions, devices_account
from hub_ingest.fleet.cutoff import Cutter, Links, load_links, save_links
from hub_ingest.fleet.registry import Device, Registry
from hub_ingest.fleet.shared_keys import (
    CONFIRM_S,
    DISCONNECTS,
    LOOK_S,
    REPLACED_AT,
    Look,
    SharedKeys,
    linked_twice,
    look_of,
    replaced_leaf,
)

log = structlog.get_logger(__name__)

AUTH_SUBJECT = "$SYS.REQ.USER.AUTH"
QUEUE = "hub-admission"  # every node's watcher answers; each request once
_HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
_ISSUER_CONTEXT = b"hub-ingest admission issuer v1"
# The registry is read again every REFRESH_S, and before an answer when the last read began
# over FRESH_S before it, the answer waiting for that read until READ_WAIT_S after it began
# (then it is from the read before: a hub recovering its streams keeps a read for seconds,
# and a restart's storm of handshakes must not wait for it). A link keeps the permissions it
# was let in with, so an answer from a record stale by a removal and enrolment again (an
# older device's way to its shard's consumer) would hold its link to what the device was.
REFRESH_S = 1.0
FRESH_S = 0.1
READ_WAIT_S = 0.25
# A device with a wrong key asks again every second or so, for as long as nobody looks: each
# reason is logged once, then once a `REFUSAL_LOG_S` with how many were not, and at most
# `_REASONS_KEPT` reasons are remembered (a stranger may try a new key each time).
REFUSAL_LOG_S = 60.0
SHARED_LOG_EVERY = 100  # times a device's key is seen on two machines, between two logs
_REASONS_KEPT = 1000


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def issuer(config: HubConfig) -> nkeys.KeyPair:
    """The account key the answers are signed with, derived from the operators' seed."""
    return derived_keys(config, _ISSUER_CONTEXT, nkeys.PREFIX_BYTE_ACCOUNT)


def issuer_key(config: HubConfig) -> str:
    """The issuer's public key, which the server config names (`server.render_server_config`)."""
    key: bytes = issuer(config).public_key
    return key.decode()


def sign(keys: nkeys.KeyPair, claims: dict[str, Any]) -> str:
    """A nats JWT (v2, ``ed25519-nkey``) of `claims`, issued by `keys`."""
    claims = {"iat": int(time.time()), "iss": keys.public_key.decode(), **claims}
    # The JWT library names a claim set by its hash; nats-server does not check it.
    claims["jti"] = _b64(hashlib.sha256(json.dumps(claims).encode()).digest())
    head = f"{_b64(json.dumps(_HEADER).encode())}.{_b64(json.dumps(claims).encode())}"
    return f"{head}.{_b64(keys.sign(head.encode()))}"


def claims_of(token: str) -> dict[str, Any]:
    """A JWT's claims, unchecked: the server's own request, over its own connection."""
    claims: dict[str, Any] = json.loads(_unb64(token.split(".")[1]))
    return claims


def signed_nonce(user_key: str, nonce: str, signature: str) -> bool:
    """Whether `signature` (base64url) is `user_key`'s signature of the server's `nonce`."""
    try:
        raw = base64.b32decode(user_key + "=" * (-len(user_key) % 8))
        nacl.signing.VerifyKey(raw[1:33]).verify(nonce.encode(), _unb64(signature))
    except (binascii.Error, ValueError, nacl.exceptions.CryptoError):
        return False
    return True


def user_claims(device: Device, user_key: str, hub_domain: str) -> dict[str, Any]:
    """The user JWT's claims for `device`: its shard's account and its permissions."""
    perms = device_permissions(device, hub_domain)
    return {
        "sub": user_key,
        "name": device.device_id,
        "aud": devices_account(device.shard),
        "nats": {
            "type": "user",
            "version": 2,
            "pub": {"allow": perms["publish"]["allow"]},
            "sub": {"allow": perms["subscribe"]["allow"]},
            # The users file's `allow_responses: true`: 0 takes nats-server's defaults.
            "resp": {"max": 0, "ttl": 0},
            "subs": -1,
            "data": -1,
            "payload": -1,
        },
    }


def granted(device: Device, hub_domain: str) -> str:
    """A digest of what a link of `device` is let in with, whatever key the server made it."""
    claims = user_claims(device, "", hub_domain)
    return hashlib.sha256(json.dumps(claims, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Verdict:
    device: Device | None  # None: refused
    reason: str


class Admission:
    """Answers the hub's authorization requests from the registry as last read, read again
    (what was written since) every `REFRESH_S` and before an answer when the last read is
    older than `FRESH_S`. Answers share one read and wait for it `READ_WAIT_S` from its start
    at most, so a restart's storm of 500 handshakes is answered in a second, hub busy or not
    (one registry read per answer was not: its answers came after nats-server had given up,
    and the devices asked again)."""

    def __init__(self, js: JetStreamContext, config: HubConfig) -> None:
        self._js, self._config = js, config
        self._issuer = issuer(config)
        self._registry: Registry | None = None
        self._by_key: dict[str, Device] = {}
        self._read_at = -REFRESH_S  # when the last read of the registry began (monotonic)
        self._reading: asyncio.Task[None] | None = None
        self.tally = Tally(config.server.server_name)
        self._refusals: dict[str, tuple[float, int]] = {}  # reason → (last logged, since)
        self.links = Links(lambda device: granted(device, config.nats.domain))
        self._shared = SharedKeys(config.server.shared_key_hold)
        self._look: Look = {}  # every node's links, as last looked at (a cluster's)
        self._system_failing = ""  # the last error of the system connection, logged once
        # By device: the count of its replaced links under way (`_confirm`).
        self._suspects: dict[str, asyncio.Task[None]] = {}
        self._cutter = Cutter(config, self.links)

    async def refresh(self) -> None:
        """Read the registry again (what was written since the last read): the read under
        way, if one is."""
        await asyncio.shield(self._read_soon())

    def _read_soon(self) -> asyncio.Task[None]:
        """The registry read under way, or a new one."""
        if self._reading is None or self._reading.done():
            self._read_at = time.monotonic()
            self._reading = asyncio.create_task(self._read())
            # Its error is taken by whoever awaits it, and by no one if all stopped waiting.
            self._reading.add_done_callback(lambda t: t.cancelled() or t.exception())
        return self._reading

    async def _read(self) -> None:
        if self._registry is None:
            self._registry = await Registry.open(self._js)
        self._by_key = {d.nkey: d for d in await self._registry.list()}
        self.links.check(self._by_key)

    async def _fresh(self) -> None:
        """Until the registry read begun at most `FRESH_S` ago ends, or `READ_WAIT_S` after it
        began: answers that arrive while a read is held up (a hub recovering its streams)
        wait for it no longer than that, together, then each is answered from the read
        before (waiting a quarter second each answered four handshakes a second)."""
        if time.monotonic() - self._read_at > FRESH_S:
            self._read_soon()
        reading, left = self._reading, self._read_at + READ_WAIT_S - time.monotonic()
        if reading is not None and not reading.done() and left > 0:
            # A failed read is the run loop's to log.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(reading), left)

    async def run(self, nc: Client, stop: asyncio.Event) -> None:
        """Answer on `nc` until `stop`; the subscription outlives reconnects."""
        failing = ""  # the last refresh's error, logged once
        sub = await nc.subscribe(AUTH_SUBJECT, queue=QUEUE, cb=self._answer)
        log.info("admission_started", subject=AUTH_SUBJECT, queue=QUEUE)
        written_at = looked_at = -WRITE_S
        loaded = False  # the links the watchers let in before
        try:
            while not stop.is_set():
                try:
                    await self.refresh()
                    if not loaded:
                        await load_links(self._js, self.links)
                        loaded = True
                    await self._cutter.cut_marked()
                    await save_links(self._js, self.links)
                    if self._config.cluster and time.monotonic() - looked_at >= LOOK_S:
                        looked_at = time.monotonic()
                        await self._as_system(self._look_at_links(len(self._config.cluster.nodes)))
                    if time.monotonic() - written_at >= WRITE_S:
                        figures = self.tally.figures(self.links.cut)
                        await write_figures(self._js, figures)
                        written_at = time.monotonic()
                    if failing:
                        log.info("admission_refresh_recovered")
                    failing = ""
                except Exception as exc:  # the hub restarting: answer from what was read
                    if repr(exc) != failing:
                        log.warning("admission_refresh_failed", error=repr(exc))
                    failing = repr(exc)
                await next_round(stop, REFRESH_S)
        finally:
            if self._reading is not None:
                self._reading.cancel()
            for task in list(self._suspects.values()):
                task.cancel()
            await sub.unsubscribe()
            await self._cutter.close()

    def _log_refusal(self, reason: str) -> None:
        now = time.monotonic()
        last, since = self._refusals.get(reason, (now - REFUSAL_LOG_S, 0))
        if now - last < REFUSAL_LOG_S:
            self._refusals[reason] = (last, since + 1)
            return
        if len(self._refusals) >= _REASONS_KEPT:
            self._refusals = {
                r: seen for r, seen in self._refusals.items() if now - seen[0] < REFUSAL_LOG_S
            }
            if len(self._refusals) >= _REASONS_KEPT:
                self._refusals.clear()
        self._refusals[reason] = (now, 0)
        log.warning(
            "connection_refused",
            reason=reason,
            refused=self.tally.refused,
            not_logged_since=since,
        )

    async def _as_system(self, step: Awaitable[None]) -> None:
        """Run `step` on the system account's connection; a failure is logged once (as the
        cutter's, sharing that connection, is)."""
        try:
            await step
        except (nats.errors.Error, OSError) as exc:
            if repr(exc) != self._system_failing:
                log.warning("system_connection_failed", error=repr(exc))
            self._system_failing = repr(exc)
        else:
            self._system_failing = ""

    def _note_link(self, device: Device, cid: int) -> None:
        log.debug("device_admitted", device_id=device.device_id, cid=cid)
        device_id = device.device_id
        if self._shared.admitted(device_id, time.monotonic()) and device_id not in self._suspects:
            task = asyncio.create_task(self._as_system(self._confirm(device)))
            self._suspects[device_id] = task
            task.add_done_callback(lambda _: self._suspects.pop(device_id, None))

    async def _confirm(self, device: Device) -> None:
        """Count `device`'s links closed as replaced for `CONFIRM_S`: a machine pushing
        another off, not a device linking again and again on its own."""
        hosts: list[str] = []

        async def on_event(msg: Msg) -> None:
            with contextlib.suppress(ValueError, AttributeError):
                event = json.loads(msg.data)
                if replaced_leaf(event) in device.leaf_names:
                    hosts.append(str(event["client"].get("host")))

        sub = await self._cutter.subscribe(DISCONNECTS, on_event)
        try:
            await asyncio.sleep(CONFIRM_S)  # a window of events, not a wait for a state
        finally:
            await sub.unsubscribe()
        if len(hosts) >= REPLACED_AT:
            self._on_two_machines(device, f"{len(hosts)} links replaced, from {sorted(set(hosts))}")

    async def _look_at_links(self, nodes: int) -> None:
        """Mark shared the devices linked on two nodes at once (`shared_keys.linked_twice`)."""
        look = look_of(await self._cutter.every_leafz(nodes))
        by_leaf = {name: d for d in self._by_key.values() for name in d.leaf_names}
        for name in linked_twice(self._look, look):
            if (device := by_leaf.get(name)) is not None:
                on = sorted({server for server, _ in look[name]})
                self._on_two_machines(device, f"linked on nodes {', '.join(on)}")
        self._look = look

    def _on_two_machines(self, device: Device, where: str) -> None:
        """Count it, and hold the device's links off: cut those up, refuse the next ones."""
        device_id = device.device_id
        links = self.tally.shared_link(device_id)
        if links % SHARED_LOG_EVERY == 1:  # with no hold, seen again and again while both run
            log.error("device_key_on_two_machines", device_id=device_id, links=links, where=where)
        if self._shared.hold(device_id, time.monotonic()):
            self.links.cut_key(device.nkey, "key on two machines")

    def decide(self, request: dict[str, Any]) -> Verdict:
        """Whether the connection `request` describes is a registered device's."""
        opts = request.get("connect_opts") or {}
        key, sig = str(opts.get("nkey", "")), str(opts.get("sig", ""))
        nonce = str((request.get("client_info") or {}).get("nonce", ""))
        if not key:
            return Verdict(None, "no device key")
        if not (nonce and sig and signed_nonce(key, nonce, sig)):
            return Verdict(None, f"key {key} did not sign the nonce")
        device = self._by_key.get(key)
        if device is None:
            return Verdict(None, f"key {key} is not registered")
        if self._shared.held(device.device_id, time.monotonic()):
            return Verdict(None, f"device {device.device_id}'s key is in use on two machines")
        return Verdict(device, "registered")

    async def _answer(self, msg: Msg) -> None:
        asked = claims_of(msg.data.decode())
        request = asked["nats"]
        user_key, server = request["user_nkey"], request["server_id"]["id"]
        # By the server's clock, which decides when the answer expires: this node's may be
        # off (a cluster node answers for the others).
        now = int(asked.get("iat") or time.time())
        cid = int((request.get("client_info") or {}).get("id", 0))
        await self._fresh()
        verdict = self.decide(request)
        response: dict[str, Any] = {"type": "authorization_response", "version": 2}
        if verdict.device is not None:
            claims = user_claims(verdict.device, user_key, self._config.nats.domain)
            # The server closes the link then, and the device signs in again: spread, so that
            # links let in together (a restart's storm) do not all sign in again together.
            life = self._config.server.link_life
            claims["exp"] = int(now + random.uniform(life / 2, life))
            response["jwt"] = sign(self._issuer, claims)
            self.tally.admitted += 1
            self.links.admitted(server, cid, verdict.device.nkey, verdict.device)
            self._note_link(verdict.device, cid)
        else:
            response["error"] = f"not admitted: {verdict.reason}"
            self.tally.refusal(verdict.reason)
            self._log_refusal(verdict.reason)
        answer = sign(self._issuer, {"sub": user_key, "aud": server, "nats": response})
        await msg.respond(answer.encode())
