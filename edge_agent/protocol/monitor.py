"""The client of a nats-server's monitoring endpoint: the island's, or the hub's."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass
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
