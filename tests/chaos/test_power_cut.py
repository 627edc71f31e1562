"""The power-cut run: the device's disk and the hub's lose power under load.

``CHAOS_SEED=<n>`` replays a run's schedule; ``POWER_CUTS=<device>,<hub>`` changes its length
(`bench/power_cut.py` runs longer ones).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.powercut import run_power_cuts
from tests.chaos.schedule import seed_from_env

pytestmark = pytest.mark.slow


@pytest.mark.timeout(900)
async def test_a_power_cut_loses_nothing_acknowledged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """20 device cuts and 5 hub cuts (half of them tearing the last page written), the device
    packing its telemetry as by default: the hub then has every reading the app had a PubAck
    for, once and in order; no command ran twice; every command's result is at the hub; the
    ingest, cut with the hub, archived every reading once."""
    seed = seed_from_env()
    device_cuts, hub_cuts = map(int, os.environ.get("POWER_CUTS", "20,5").split(","))
    with capsys.disabled():
        print(f"\npower-cut seed={seed} (replay with CHAOS_SEED={seed})")
    outcome = await run_power_cuts(tmp_path, seed, device_cuts=device_cuts, hub_cuts=hub_cuts)
    summary = outcome.summary()
    with capsys.disabled():
        print(summary)
    assert not outcome.unsettled, outcome.unsettled
    assert (outcome.faults["device_cut"], outcome.faults["hub_cut"]) == (device_cuts, hub_cuts)
    outcome.assert_exact()
    archive = (outcome.archived, outcome.archive_losses, outcome.archive_duplicates)
    assert archive == (outcome.produced["p"], 0, 0), f"archived, lost, twice: {archive}"
