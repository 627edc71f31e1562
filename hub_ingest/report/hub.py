"""Reading the hub for the report: JetStream API requests answered as raw JSON (nats-py's
dataclasses drop a source's ``external`` block, the only thing that says which device a
source reads from) and the servers' monitoring endpoints (which leaves are linked)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import nats.errors
from nats.aio.client import Client

from edge_agent.protocol.names import js_api
from hub_ingest.core.config import HubConfig, ServerConfig
from hub_ingest.core.errors import ReportError
from hub_ingest.core.replies import Stored, direct_get, last_messages

# JetStream's err_code for "stream not found" and "no message found".
_NOT_FOUND_CODES = (10059, 10037)
# "JetStream system temporarily unavailable": on a cluster, a stream whose node is down.
_UNAVAILABLE_CODE = 10008
# A stream whose node went down is not answered for at all; the report does not wait long.
_DEVICE_STREAM_TIMEOUT_S = 2.0
_BATCH = 256  # messages per direct get
# What `device_stream_info` answers for a device stream that cannot be read right now.
OFFLINE = "offline: the hub node that holds it is down"


class HubApi:
    """Raw JetStream API requests in the hub's domain, answered as plain JSON."""

    def __init__(
        self,
        nc: Client,
        domain: str,
        timeout: float = 5.0,
        listed: Iterable[Mapping[str, Any]] = (),
    ) -> None:
        """`listed`: stream infos as one STREAM.LIST answered them (a request per 256
        streams, where asking stream by stream costs one each); `stream_info` and
        `device_stream_info` answer from them, and ask the server only for a stream they
        lack (made since, or on a node that did not answer the listing)."""
        self._nc = nc
        self._prefix = js_api(domain)
        self._timeout = timeout
        self._listed = {str(info["config"]["name"]): dict(info) for info in listed}

    async def request(
        self, api: str, body: Mapping[str, Any] | None = None, *, timeout: float | None = None
    ) -> dict[str, Any] | None:
        """The response to ``<prefix>.<api>``; None when the stream or message does not exist."""
        payload = json.dumps(body).encode() if body is not None else b""
        wait = self._timeout if timeout is None else timeout
        try:
            msg = await self._nc.request(f"{self._prefix}.{api}", payload, timeout=wait)
        except nats.errors.NoRespondersError:
            raise ReportError(
                f"no JetStream answers on {self._prefix} (wrong hub domain?)"
            ) from None
        data: dict[str, Any] = json.loads(msg.data)
        error = data.get("error")
        if isinstance(error, dict):
            if error.get("err_code") in _NOT_FOUND_CODES or error.get("code") == 404:
                return None
            code = error.get("err_code")
            raise ReportError(f"{api}: {error.get('description')} (code {code})", err_code=code)
        return data

    async def stream_info(self, name: str) -> dict[str, Any] | None:
        if name in self._listed:
            return self._listed[name]
        return await self.request(f"STREAM.INFO.{name}")

    async def device_stream_info(self, name: str) -> dict[str, Any] | None:
        """`stream_info` of one of a device's own streams. On a cluster each lives on one
        node (``cluster.device_replicas``); while that node is down the answer is
        ``{"offline": OFFLINE}`` and the report goes on with the rest of the fleet."""
        if name in self._listed:
            return self._listed[name]
        try:
            return await self.request(f"STREAM.INFO.{name}", timeout=_DEVICE_STREAM_TIMEOUT_S)
        except nats.errors.TimeoutError:
            return {"offline": OFFLINE}
        except ReportError as exc:
            if exc.err_code == _UNAVAILABLE_CODE:
                return {"offline": OFFLINE}
            raise

    async def messages(self, stream: str, first: int, last: int) -> list[tuple[str, bytes]]:
        """(subject, payload) of each message of `stream` with a sequence in ``first..last``,
        by batched direct gets (the stream must allow them): a request per `_BATCH`
        messages, where a consumer made to read a few would cost four."""
        found: list[tuple[str, bytes]] = []
        while first <= last:
            batch = min(_BATCH, last - first + 1)
            page = await self._direct_get(stream, {"seq": first, "batch": batch})
            found += [(m.subject, m.data) for m in page if m.seq <= last]
            if not page:
                break
            first = page[-1].seq + 1
        return found

    async def last_messages(self, stream: str, subjects: Sequence[str]) -> dict[str, Stored]:
        """The last message on each of `subjects` in `stream` that has one, by subject."""
        return await last_messages(self._nc, self._prefix, stream, subjects, self._timeout)

    async def _direct_get(self, stream: str, request: dict[str, Any]) -> list[Stored]:
        msgs = await direct_get(self._nc, self._prefix, stream, request, self._timeout)
        return [Stored.of(msg) for msg in msgs]


def monitor_get(base_url: str, path: str, timeout: float = 5.0) -> dict[str, Any]:
    """What a hub server's monitoring endpoint answers at `path` (``/leafz``)."""
    try:
        with urllib.request.urlopen(f"{base_url}{path}", timeout=timeout) as resp:
            found = json.load(resp)
    except (OSError, ValueError) as exc:
        raise ReportError(f"hub monitoring endpoint {base_url}: {exc}") from exc
    if not isinstance(found, dict):
        raise ReportError(f"hub monitoring endpoint {base_url}{path}: not an object")
    return found


def leaf_names(base_url: str, timeout: float = 5.0) -> set[str]:
    """Names of the leaf nodes connected to the hub right now (``/leafz``)."""
    leafz = monitor_get(base_url, "/leafz", timeout)
    return {str(leaf.get("name")) for leaf in leafz.get("leafs") or []}


def monitor_url(server: ServerConfig, route: str | None = None) -> str:
    """Where `server`'s monitoring endpoint answers; a cluster node listening everywhere is
    reached at its route's host (loopback for a single server)."""
    host, _, port = server.monitor_listen.rpartition(":")
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = "127.0.0.1"
        if route is not None:
            host = urllib.parse.urlsplit(route).hostname or host
    return f"http://{host}:{port}"


def monitor_urls(config: HubConfig) -> dict[str, str]:
    """Every hub server's monitoring endpoint, by server name."""
    if config.cluster is None:
        return {config.server.server_name: monitor_url(config.server)}
    return {n.name: monitor_url(n.server, n.route) for n in config.cluster.nodes}


def linked_leaves(urls: Iterable[str], warnings: list[str]) -> set[str] | None:
    """The leaf nodes linked to any of the hub's servers (a leaf is linked to one); None when
    no server answered. A server that does not answer is named in `warnings`."""
    leaves: set[str] = set()
    answered = False
    for url in urls:
        try:
            leaves |= leaf_names(url)
            answered = True
        except ReportError as exc:
            warnings.append(f"link state unknown: {exc}")
    return leaves if answered else None
