"""The client of a nats-server's monitoring endpoint: the island's, or the hub's."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

from edge_agent.protocol.errors import MonitorUnavailable


@dataclass(frozen=True, slots=True)
class Monitor:
    """Reads a nats-server's monitoring endpoint (``/healthz``, ``/leafz``, ``/jsz``)."""

    base_url: str
    timeout: float = 2.0

    async def get(self, path: str) -> dict[str, Any]:
        return await asyncio.to_thread(self._get, path)

    def _get(self, path: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(self.base_url + path, timeout=self.timeout) as resp:
                body: dict[str, Any] = json.load(resp)
                return body
        except urllib.error.HTTPError as exc:
            # /healthz answers 503 with a JSON body when JetStream is not ready.
            with contextlib.suppress(ValueError):
                body = json.load(exc)
                return body
            raise MonitorUnavailable(f"{self.base_url}{path}: HTTP {exc.code}") from exc
        except http.client.HTTPException as exc:  # e.g. a client port, which greets with INFO
            raise MonitorUnavailable(
                f"{self.base_url}{path}: not an HTTP monitoring endpoint ({type(exc).__name__})"
            ) from exc
        except (OSError, ValueError) as exc:
            raise MonitorUnavailable(f"{self.base_url}{path}: {exc}") from exc

    async def healthy(self) -> bool:
        try:
            return (await self.get("/healthz")).get("status") == "ok"
        except MonitorUnavailable:
            return False

    async def leaf_connected(self) -> bool:
        """Whether the leaf link to the hub is up right now."""
        leafz = await self.get("/leafz")
        return any(leaf.get("is_spoke") for leaf in leafz.get("leafs") or [])

    async def leaf_rtt(self) -> float | None:
        """The leaf link's round trip in seconds, as the server last measured it (None: no
        link, or not measured yet)."""
        leafz = await self.get("/leafz")
        for leaf in leafz.get("leafs") or []:
            if leaf.get("is_spoke") and (rtt := go_duration(str(leaf.get("rtt") or ""))):
                return rtt
        return None


@dataclass(slots=True)
class LeafRtt:
    """The leaf link's round trip in seconds, as the island's server measured it (when it
    connected, then every ping interval), read again at most every `every` seconds; the last
    one read stands while the link is down or the endpoint does not answer (0: none yet)."""

    monitor: Monitor
    every: float = 5.0
    seconds: float = 0.0
    _read_at: float = field(default=-float("inf"), repr=False)

    async def read(self) -> float:
        if time.monotonic() - self._read_at >= self.every:
            self._read_at = time.monotonic()
            with contextlib.suppress(MonitorUnavailable):
                if (rtt := await self.monitor.leaf_rtt()) is not None:
                    self.seconds = rtt
        return self.seconds


_GO_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_GO_PART = re.compile(r"([0-9.]+)(ns|us|µs|ms|s|m|h)")


def go_duration(text: str) -> float | None:
    """Seconds in a Go duration string as the monitoring endpoint prints one ("1.2ms",
    "1m3.5s"); None for an empty or unreadable one."""
    parts = _GO_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        return None
    return sum(float(number) * _GO_UNITS[unit] for number, unit in parts)
