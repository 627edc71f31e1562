"""Helpers for command tests: envelopes, a handler program that counts its runs, results."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from edge_agent.status.health import collect_status
from hub_ingest.commands.send import Envelope, new_envelope, send
from tests.support.cluster import Device, Hub, stream_messages

# Appends a line to argv[1], then sleeps argv[2] seconds: a handler whose runs can be counted
# and which can be caught in the middle.
COUNTER = """\
import sys, time
with open(sys.argv[1], "a") as f:
    f.write("ran\\n")
time.sleep(float(sys.argv[2]))
print("done")
"""


def counter_program(root: Path) -> list[str]:
    """argv prefix of the counting program; allow-list it as ``[*prefix, "*"]``."""
    script = root / "counter.py"
    script.write_text(COUNTER)
    return [sys.executable, str(script)]


def runs(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


async def send_command(
    hub: Hub, target: str, type_: str, args: dict[str, Any] | None = None, ttl: float = 3600
) -> Envelope:
    envelope = new_envelope(target, type_, args or {}, ttl)
    await send(hub.js, envelope)
    return envelope


async def results(js: JetStreamContext, stream: str) -> dict[str, dict[str, Any]]:
    """Result events in `stream` (the island's EVENTS or a hub FLEET_EVENTS), by ledger key."""
    out: dict[str, dict[str, Any]] = {}
    for msg in await stream_messages(js, stream):
        if msg.subject and msg.subject.endswith(".result") and msg.data:
            body = json.loads(msg.data)
            out.setdefault(body["command_id"] or f"@seq:{body['seq']}", body)
    return out


async def command_fence(device: Device) -> int | None:
    """The device's command fence as its `status` shows it (None until the agent has one)."""
    status = await collect_status(device.config)
    return None if status.commands is None else status.commands.fence
