"""The soak: the chaos run, the cluster node-kill run and the power-cut run, seed after seed.

Each kind is the test suite's own run (`tests.chaos`), here for several seeds back to back:
- ``chaos``: three devices on one hub; link cuts, agent and island kills, hub restarts;
- ``cluster``: the same on a three-node hub cluster, nodes SIGKILLed among the faults;
- ``power``: a device's disk and the hub's lose power under load (unsynced writes dropped,
  sometimes torn), the ingest archiving throughout.

Every acknowledged reading must reach the hub once (the power-cut run: the archive too), no
command may run twice, and ``refilled`` counts the readings the hub's mirrors skipped and
the refill (`hub_ingest.fleet.refill`) read again from the islands.

    .venv/bin/python bench/soak.py                 # one seed of each kind
    .venv/bin/python bench/soak.py --runs 15       # five seeds of each
    .venv/bin/python bench/soak.py --kinds power --runs 3 --first-seed 7

Last line: ``runs=… faults=… acked=… lost=0 duplicated=0 refilled=… ran_twice=0``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install

from edge_agent.protocol.logs import configure_logging
from tests.chaos.powercut import run_power_cuts
from tests.chaos.runner import Chaos, Outcome
from tests.chaos.schedule import SKIP_EVERY
from tests.support.cluster import Hub, start_hub
from tests.support.hubcluster import start_cluster_hub

KINDS = ("chaos", "cluster", "power")


async def _chaos(root: Path, seed: int, hub: Hub, faults: int) -> Outcome:
    chaos = Chaos(hub, root, seed, faults=faults, skip_every=SKIP_EVERY)
    try:
        await chaos.setup()
        return await chaos.run()
    finally:
        chaos.close()
        await hub.close()


async def run_chaos(root: Path, seed: int) -> Outcome:
    return await _chaos(root, seed, await start_hub(root), faults=34)


async def run_cluster(root: Path, seed: int) -> Outcome:
    return await _chaos(root, seed, await start_cluster_hub(root), faults=14)


async def run_power(root: Path, seed: int) -> Outcome:
    return await run_power_cuts(root, seed, device_cuts=20, hub_cuts=5)


RUNS: dict[str, Callable[[Path, int], Awaitable[Outcome]]] = {
    "chaos": run_chaos,
    "cluster": run_cluster,
    "power": run_power,
}


@dataclass
class Totals:
    runs: int = 0
    failed: int = 0  # runs that did not settle or whose checks failed
    faults: int = 0
    acked: int = 0
    lost: int = 0
    duplicated: int = 0
    out_of_order: int = 0
    refilled: int = 0
    ran_twice: int = 0
    missing_results: int = 0

    def add(self, outcome: Outcome) -> None:
        self.runs += 1
        self.faults += sum(n for kind, n in outcome.faults.items() if kind != "torn")
        self.acked += sum(outcome.produced.values())
        self.lost += outcome.losses + outcome.archive_losses
        self.duplicated += outcome.duplicates + outcome.archive_duplicates
        self.out_of_order += outcome.out_of_order
        self.refilled += outcome.refilled
        self.ran_twice += outcome.double_runs
        self.missing_results += outcome.missing_results
        try:
            outcome.assert_exact()
        except AssertionError:
            self.failed += 1
        else:
            self.failed += bool(outcome.unsettled)

    def line(self) -> str:
        return (
            f"runs={self.runs} failed={self.failed} faults={self.faults} acked={self.acked} "
            f"out_of_order={self.out_of_order} missing_results={self.missing_results} "
            f"lost={self.lost} duplicated={self.duplicated} refilled={self.refilled} "
            f"ran_twice={self.ran_twice}"
        )


async def main(kinds: list[str], runs: int, first_seed: int, keep: Path | None) -> None:
    configure_logging("warning")
    totals = Totals()
    plan = list(itertools.islice(itertools.cycle(kinds), runs))
    for index, kind in enumerate(plan):
        seed = first_seed + index // len(kinds)
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=f"soak-{kind}-") as tmp:
            root = (keep / f"{kind}-{seed}") if keep else Path(tmp)
            root.mkdir(parents=True, exist_ok=True)
            outcome = await RUNS[kind](root, seed)
        totals.add(outcome)
        print(f"{kind} seed={seed} {time.monotonic() - started:.0f}s: {outcome.summary()}")
        if outcome.unsettled:
            print(f"  did not settle: {outcome.unsettled}")
        sys.stdout.flush()
    print(totals.line())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=len(KINDS), help="in all (kinds take turns)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"of {', '.join(KINDS)}")
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="run under this directory and keep it (logs)")
    args = parser.parse_args()
    chosen = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := sorted(set(chosen) - set(KINDS)):
        parser.error(f"--kinds: unknown {', '.join(unknown)} (choose from {', '.join(KINDS)})")
    asyncio.run(main(chosen, args.runs, args.first_seed, args.keep))
