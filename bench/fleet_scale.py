"""How the hub's cost grows with the fleet, on one hub node and on a three-node cluster (R3).

For each mode (``single``: one hub nats-server; ``cluster``: three, every stream R3;
``cluster5``: five, every stream R3) one hub is grown through `--sizes` simulated devices,
next to `--agents` real ones (agent + island, in this process). A simulated device is a bare
leaf island: a nats-server with the config `edge_agent.island.server` renders, its link open,
and its streams and the hub's consumers made by `edge_agent.island.streams.reconcile`, with
no agent. At each size:

- ``enrol``: the devices that bring the fleet to the size, enrolled in one `enrol_many` (one
  users-file write, one reload, one provisioning pass); seconds per device added;
- ``attach``: the hub records their incarnations and makes their mirrors (`observe` +
  `provision`, what ``hub-ingest watch`` does when a link comes up); seconds per device added;
- ``ready``: one fresh message published on every island's TELEMETRY and EVENTS until every
  hub mirror holds it (from the end of ``attach``);
- ``fanout``: a broadcast command sent at the hub until every island's COMMANDS mirror has it;
- ``rss``, ``cpu``: the hub's nats-server(s), summed over nodes: VmRSS, and CPU over an idle
  window of `--idle` seconds as percent of one core (utime + stime from /proc/<pid>/stat);
- ``fds``: the hub's open descriptors, summed over nodes, right after every island's streams
  and the broadcast were written (each stream's block file open: a fleet that is sending);
  ``rest_fds`` again after `--rest` seconds with nothing written (nats-server closes an idle
  block file within 150 s: the connections are what is left);
- ``report``, ``status``: ``report --json`` (`collect_report`) and ``command status`` of the
  broadcast (`command_status`), the median of `REPEATS` calls after a first one;
- ``add``: one device enrolled and attached into the fleet as it is (its island started and
  linked in between, not timed), the median of `ADDS` such devices one after the other;
- ``restart``: the hub SIGKILLed and started again (``cluster``: all three nodes killed, then
  all started, as after a power cut of the hub's rack), then a fresh message on every island
  and a broadcast command: ``up`` is until the hub's servers answer healthy, ``resume`` until
  every hub mirror has its device's fresh message, ``down`` until every island has the command.

Two single-node baselines are kept from before: `--compare` devices enrolled one at a time
against as many in bulk, and ``report`` / ``command status`` with `--small` then `--large`
commands in the history (ratio large over small; 1.0: the cost does not grow with history).

    .venv/bin/python bench/fleet_scale.py [--sizes 25,50,100,200] [--modes single,cluster]
    .venv/bin/python bench/fleet_scale.py --sizes 5 --compare 5 --large 200    # quick

The hub admits its devices by auth callout (`hub_ingest.fleet.admission`, the product's
default), answered from this process; ``--admission users_file`` makes each a user of the
hub's users file, and ``add`` then reloads the server.

Prints one line per (mode, size), the cluster-over-single ratio of each metric at each size,
the fitted cost per device (least-squares slope over the sizes) per mode, and last:
``devices=N enrol_s_per_device=… hub_rss_mb_per_device=… restart_resume_s=… report_s=…``
for the last cluster mode asked for, at the largest size asked for (the single node when
only it ran), with ``rss_per_node_5_over_3`` there when both clusters ran: the
per-device keys are fitted slopes over the sizes that completed, the others measured at that
size; more keys follow (``measured_up_to``: the largest size that completed). A size the hub
cannot do (a wait past `--timeout`, the hub's RSS past `--max-hub-rss`, a request it does not
answer) prints a ``FAILED`` line and ends that mode; its values in the last line are nan.
See docs/scaling.md for a run and what it says.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, no install


from bench.fleetscale.common import CLUSTER_NODES, kill_spawned
from bench.fleetscale.measure import run, stderr_to
from bench.fleetscale.table import summarise
from edge_agent.protocol.logs import configure_logging
from hub_ingest.core.config import ADMISSIONS


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="25,50,100,200", help="simulated devices, ascending")
    parser.add_argument(
        "--modes", default="single,cluster", help="any of single, cluster, cluster5"
    )
    parser.add_argument("--agents", type=int, default=2, help="real agents in each fleet")
    parser.add_argument(
        "--leaf-compression",
        default="accept",
        help="the hub's server.leaf_compression (default: the product's, accept)",
    )
    parser.add_argument(
        "--admission",
        default="callout",
        choices=ADMISSIONS,
        help="the hub's server.admission (callout: the bench answers, as its watcher would; "
        "default: the product's, callout)",
    )
    parser.add_argument(
        "--compressed",
        type=float,
        default=0.0,
        help="share of the islands whose link is compressed (s2_auto: a slow link); the "
        "others choose by round trip, which on loopback is off",
    )
    parser.add_argument(
        "--reconnect", default="250ms", help="the islands' hub.reconnect (the product's: 250ms)"
    )
    parser.add_argument(
        "--reconnect-spread",
        default="0s",
        help="the islands' hub.reconnect_spread (the product's: 0s)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the run's directory (servers' logs) and name it"
    )
    parser.add_argument("--idle", type=float, default=10.0, help="idle CPU window, seconds")
    parser.add_argument(
        "--rest",
        type=float,
        default=150.0,
        help="quiet before descriptors are counted again, at rest (0: not again, nan), seconds",
    )
    parser.add_argument("--timeout", type=float, default=180.0, help="for each awaited state")
    parser.add_argument(
        "--max-hub-rss", type=float, default=4096.0, help="MiB: a size is abandoned above it"
    )
    parser.add_argument(
        "--compare", type=int, default=50, help="baseline: one-by-one enrols (0: skip)"
    )
    parser.add_argument("--small", type=int, default=100, help="baseline: short history")
    parser.add_argument("--large", type=int, default=2000, help="baseline: long history (0: skip)")
    args = parser.parse_args()
    args.sizes = [int(s) for s in args.sizes.split(",")]
    args.modes = [m for m in args.modes.split(",") if m]
    if args.sizes != sorted(set(args.sizes)) or args.sizes[0] < 1:
        parser.error("--sizes: positive and ascending, like 25,50,100,200")
    if not set(args.modes) <= {"single", *CLUSTER_NODES}:
        parser.error(f"--modes: any of single, {', '.join(CLUSTER_NODES)}")
    configure_logging("warning")
    root = Path(tempfile.mkdtemp(prefix="bench-fleet-scale-"))
    try:
        with stderr_to(root / "children.log"):
            results = asyncio.run(run(root, args))
    except BaseException:
        log = root / "children.log"
        if log.exists():
            print(log.read_text(errors="replace")[-3000:], file=sys.stderr)
        for hub_log in sorted(root.glob("*/try*/hub/**/*.log")):
            notable = [
                ln for ln in hub_log.read_text(errors="replace").splitlines() if "[INF]" not in ln
            ]
            print(f"--- {hub_log} (not INF, last 30)", *notable[-30:], sep="\n", file=sys.stderr)
        raise
    finally:
        killed = kill_spawned(root)
        if killed:
            print(f"killed {killed} processes left running", file=sys.stderr)
        if args.keep:
            print(f"kept {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    summarise(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
