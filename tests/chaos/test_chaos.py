"""The chaos run: three devices (one packing its telemetry) produce while links, agents,
islands and the hub fail; and again on a three-node hub cluster, whose nodes are SIGKILLed one
at a time among the faults.

``CHAOS_SEED=<n>`` replays a run's schedule; ``CHAOS_FAULTS`` (``CHAOS_CLUSTER_FAULTS``)
changes its length.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.runner import Chaos
from tests.chaos.schedule import SKIP_EVERY, seed_from_env
from tests.support.cluster import Hub
from tests.support.hubcluster import ClusterHub

pytestmark = pytest.mark.slow


@pytest.mark.timeout(600)
async def test_nothing_lost_nothing_twice_under_chaos(
    hub: Hub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At least 30 faults; afterwards the hub holds each device's readings exactly once and in
    device order, every command ran at most once per device with one result at the hub, and
    every outbox is empty."""
    seed = seed_from_env()
    with capsys.disabled():
        print(f"\nchaos seed={seed} (replay with CHAOS_SEED={seed})")
    faults = int(os.environ.get("CHAOS_FAULTS", "34"))
    chaos = Chaos(hub, tmp_path, seed, faults=faults, skip_every=SKIP_EVERY)
    try:
        await chaos.setup()
        outcome = await chaos.run()
    finally:
        chaos.close()
    summary = outcome.summary()
    with capsys.disabled():
        print(summary)
    assert sum(outcome.faults.values()) >= 30, summary
    outcome.assert_exact()
    assert outcome.faults["skip"] == 0 or outcome.refilled > 0, summary
    assert outcome.packs > 0, summary  # device b's telemetry crossed packed


@pytest.mark.timeout(600)
async def test_nothing_lost_nothing_twice_under_chaos_on_a_hub_cluster(
    cluster_hub: ClusterHub, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same guarantees with the hub on three nodes, one of them SIGKILLed now and then
    (a fleet report is taken while it is down) among cuts and agent and island kills."""
    seed = seed_from_env()
    faults = int(os.environ.get("CHAOS_CLUSTER_FAULTS", "14"))
    chaos = Chaos(cluster_hub, tmp_path, seed, faults=faults, skip_every=SKIP_EVERY)
    try:
        await chaos.setup()
        outcome = await chaos.run()
    finally:
        chaos.close()
    summary = outcome.summary()
    with capsys.disabled():
        print(f"\n{summary}")
    assert outcome.faults["node_kill"] >= 1 and outcome.reports == outcome.faults["node_kill"]
    outcome.assert_exact()
    assert outcome.packs > 0, summary
