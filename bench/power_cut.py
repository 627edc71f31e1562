"""Power cuts on a device's disk and the hub's, under load: is anything acknowledged lost?

The run is `tests.chaos.powercut`'s (the test suite runs it with a bounded default): an app
publishes numbered readings and waits for each PubAck, the hub sends commands, and seeded
power cuts hit the device's disk and the hub's (`tests.support.powerfs`: unsynced writes are
dropped, sometimes torn). Afterwards every acknowledged reading must be at the hub once, no
command may have run twice and every command must have its result.

    .venv/bin/python bench/power_cut.py [--device-cuts 60] [--hub-cuts 10] [--seed 1]
    .venv/bin/python bench/power_cut.py --sync 2m   # JetStream's default policy: loses data
    .venv/bin/python bench/power_cut.py --no-pack   # a reading a message (hub.pack = false)

Last line: ``cuts=… acked=… lost=0 ran_twice=0`` and the rest of the outcome.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.logs import configure_logging
from tests.chaos.powercut import run_power_cuts
from tests.chaos.runner import Outcome


def summary_line(outcome: Outcome) -> str:
    faults = outcome.faults
    return (
        f"cuts={faults['device_cut'] + faults['hub_cut']} device_cuts={faults['device_cut']} "
        f"hub_cuts={faults['hub_cut']} torn={faults['torn']} "
        f"acked={sum(outcome.produced.values())} lost={outcome.losses} "
        f"duplicated={outcome.duplicates} out_of_order={outcome.out_of_order} "
        f"commands={outcome.commands_sent} ran_twice={outcome.double_runs} "
        f"missing_results={outcome.missing_results} archived={outcome.archived} "
        f"archive_lost={outcome.archive_losses} archive_twice={outcome.archive_duplicates} "
        f"wall_s={outcome.wall_s:.0f}"
    )


async def main(
    device_cuts: int, hub_cuts: int, seed: int, sync: str, keep: Path | None, *, packed: bool
) -> None:
    configure_logging("warning")
    with tempfile.TemporaryDirectory(prefix="power-cut-") as tmp:
        root = keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        outcome = await run_power_cuts(
            root, seed, device_cuts=device_cuts, hub_cuts=hub_cuts, sync=sync, packed=packed
        )
    print(outcome.summary())
    if outcome.unsettled:
        print(f"did not settle: {outcome.unsettled}")
    print(summary_line(outcome))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device-cuts", type=int, default=60)
    parser.add_argument("--hub-cuts", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--sync", default="always", help='island sync: "always" or a duration')
    parser.add_argument("--keep", type=Path, help="run under this directory and keep it (logs)")
    parser.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the device packs its telemetry (hub.pack, the default)",
    )
    args = parser.parse_args()
    asyncio.run(
        main(args.device_cuts, args.hub_cuts, args.seed, args.sync, args.keep, packed=args.pack)
    )
