"""What the bench prints: one line per mode and size, the fitted cost per device, and the
last ``name=value`` line."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence

from bench.fleetscale.common import CLUSTER_NODES, METRICS, SLOPES


def line(mode: str, row: dict[str, float], agents: int) -> str:
    return (
        f"{mode:7} devices={int(row['size']):4d}+{agents} "
        f"enrol={row['enrol'] * 1000:.0f}ms/dev attach={row['attach'] * 1000:.0f}ms/dev "
        f"provision_pass={row['pass']:.2f}s "
        f"ready={row['ready']:.1f}s fanout={row['fanout']:.1f}s "
        f"hub_rss={row['rss']:.0f}MiB (peak {row['peak']:.0f}) hub_fds={row['fds']:.0f} "
        f"at_rest={row['rest_fds']:.0f} "
        f"hub_cpu={row['cpu']:.1f}%core "
        f"report={row['report'] * 1000:.0f}ms (first {row['report_first'] * 1000:.0f}) "
        f"status={row['status'] * 1000:.0f}ms "
        f"raft_groups={row['raft']:.0f} add_one={row['add']:.2f}s "
        f"restart: up={row['up']:.1f}s resume={row['resume']:.1f}s down={row['down']:.1f}s "
        f"peak={row['restart_peak']:.0f}MiB leaf_connections<={row['leafs']:.0f}"
    )


def slope(rows: Sequence[dict[str, float]], key: str) -> float:
    """Least-squares slope of `key` against the fleet size (through zero for one size)."""
    xs = [r["size"] for r in rows]
    ys = [r[key] for r in rows]
    if len(rows) == 1:
        return ys[0] / xs[0]
    return statistics.linear_regression(xs, ys).slope


def fitted(mode: str, rows: Sequence[dict[str, float]]) -> dict[str, float]:
    costs = {name: slope(rows, key) for name, (key, _) in SLOPES.items()}
    parts = []
    for name, (_, unit) in SLOPES.items():
        scale, shown = (1000, f"m{unit}") if unit == "s" else (1, unit)
        parts.append(f"{name}={costs[name] * scale:.3g}{shown}")
    print(f"{mode:7} per device (fitted): " + " ".join(parts), flush=True)
    return costs


# The baselines kept from before: bulk against one-by-one enrolment, and a long history.


def summarise(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    single = {int(r["size"]): r for r in results.get("single", [])}
    cluster = {int(r["size"]): r for r in results.get("cluster", [])}
    for size in sorted(single.keys() & cluster.keys()):
        a, b = single[size], cluster[size]
        ratios = " ".join(f"{m}={b[m] / a[m]:.2f}" for m in METRICS if a[m] > 0)
        print(f"cluster/single devices={size}: {ratios}")
    five = {int(r["size"]): r for r in results.get("cluster5", [])}
    per_node = {}  # five nodes' RSS a node over three's (each mode's RSS is their sum)
    for size in sorted(cluster.keys() & five.keys()):
        nodes = CLUSTER_NODES["cluster5"], CLUSTER_NODES["cluster"]
        per_node[size] = (five[size]["rss"] / nodes[0]) / (cluster[size]["rss"] / nodes[1])
        print(f"cluster5/cluster devices={size}: rss_per_node={per_node[size]:.2f}")
    costs = {mode: fitted(mode, rows) for mode, rows in results.items() if rows}
    # The last cluster mode asked for, at the largest size asked for; a size a hub could not
    # do shows as nan.
    mode = next((m for m in reversed(args.modes) if m != "single"), "single")
    target = max(args.sizes)
    nan = dict.fromkeys(
        (*METRICS, "up", "down", "peak", "restart_peak", "leafs", "shared"), float("nan")
    )
    runs = {int(r["size"]): r for r in results.get(mode, [])}
    last = runs.get(target, nan)
    cost = costs.get(mode, {name: float("nan") for name in SLOPES})
    devices = float(target)
    extra = "".join(f" {k}={v:.2f}" for k, v in args.baseline.items())
    if target in per_node:
        extra += f" rss_per_node_5_over_3={per_node[target]:.2f}"
    print(
        f"devices={target} rss_mib_per_device={cost['rss']:.3f} "
        f"fds_per_device={cost['fds']:.2f} "
        f"fds_at_rest_per_device={cost['rest_fds']:.2f} idle_cpu_pct_per_device={cost['cpu']:.4f} "
        f"resume_s={last['resume']:.1f} "
        f"report_ms_per_device={last['report'] * 1000 / devices:.2f} "
        f"report_first_ms_per_device={last['report_first'] * 1000 / devices:.2f} "
        f"raft_groups_per_device={cost['raft']:.3f} "
        f"add_one_s={last['add']:.3f} "
        f"restart_peak_over_steady={last['restart_peak'] / last['rss']:.2f} "
        f"leaf_connections_per_device={last['leafs'] / (devices + args.agents + 1):.2f} "
        f"mode={mode} measured_up_to={max(runs, default=0)} agents={args.agents} "
        f"compressed={args.compressed} leaf_compression={args.leaf_compression} "
        f"reconnect={args.reconnect} reconnect_spread={args.reconnect_spread} "
        f"enrol_s_per_device={cost['enrol']:.4f} attach_s_per_device={cost['attach']:.4f} "
        f"provision_pass_s={last['pass']:.2f} hub_rss_mb={last['rss']:.0f} "
        f"status_s={last['status']:.3f} restart_up_s={last['up']:.1f} "
        f"restart_down_s={last['down']:.1f} hub_fds={last['fds']:.0f} "
        f"keys_shared={last['shared']:.0f} "
        f"trim_ms_per_device={last['trim'] * 1000 / devices:.2f}{extra}"
    )
