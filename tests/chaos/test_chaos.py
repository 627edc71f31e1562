"""The chaos run: three devices produce while links, agents, islands and the hub fail.

``CHAOS_SEED=<n>`` replays a run's schedule; ``CHAOS_FAULTS`` changes its length.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.runner import Chaos
from tests.chaos.schedule import seed_from_env
from tests.support.cluster import Hub

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
    chaos = Chaos(hub, tmp_path, seed, faults=int(os.environ.get("CHAOS_FAULTS", "34")))
    try:
        await chaos.setup()
        outcome = await chaos.run()
    finally:
        chaos.close()
    summary = outcome.summary()
    with capsys.disabled():
        print(summary)
    assert sum(outcome.faults.values()) >= 30, summary
    assert outcome.produced == outcome.at_hub and min(outcome.produced.values()) > 0, summary
    assert (outcome.duplicates, outcome.losses, outcome.out_of_order) == (0, 0, 0), summary
    assert outcome.commands_sent > 0 and outcome.double_runs == 0, summary
    assert (outcome.missing_results, outcome.extra_results) == (0, 0), summary
