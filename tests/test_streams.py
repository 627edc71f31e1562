"""Reconciliation of the island's streams: idempotent, and budgets follow the config."""

from __future__ import annotations

from dataclasses import replace

from edge_agent.core.config import StreamBudget
from edge_agent.island.streams import reconcile
from tests.support.cluster import UNPACKED, Hub


async def test_reconcile_twice_changes_nothing(hub: Hub) -> None:
    """Unpacked: a packing island has its `READINGS` stream too (tests/test_pack.py)."""
    a = await hub.device("a", sections=UNPACKED)
    results = await reconcile(a.js, a.config)
    assert [(r.name, r.change) for r in results] == [
        ("TELEMETRY", "unchanged"),
        ("EVENTS", "unchanged"),
        ("COMMANDS", "unchanged"),
    ]


async def test_budget_change_is_applied_on_restart_and_keeps_data(hub: Hub) -> None:
    """A new telemetry budget and max_age in the config reach the stream at the next start."""
    a = await hub.device("a", sections=UNPACKED)
    await a.js.publish("tele.temp", b"kept")
    await a.stop()
    budget = StreamBudget(max_bytes=8 * 1024**2, max_age=3600.0)
    a.config = replace(a.config, streams=replace(a.config.streams, telemetry=budget))
    await a.start()
    info = await a.js.stream_info("TELEMETRY")
    assert info.config.max_bytes == 8 * 1024**2
    assert info.config.max_age == 3600.0
    assert info.state.messages == 1


async def test_changed_mirror_origin_is_rebuilt(hub: Hub) -> None:
    """A mirror cannot be edited in place: a new hub domain recreates it (logged as such)."""
    a = await hub.device("a")
    moved = replace(a.config, hub=replace(a.config.hub, domain="hub2"))
    results = {r.name: r for r in await reconcile(a.js, moved)}
    assert results["COMMANDS"].change == "recreated"
    assert "mirror" in results["COMMANDS"].fields
    info = await a.js.stream_info("COMMANDS")
    assert info.config.mirror is not None
    assert info.config.mirror.external is not None
    assert info.config.mirror.external.api == "$JS.hub2.API"
