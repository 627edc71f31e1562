"""``hub-ingest report [--json] [--dot FILE]``: the fleet view as a table, JSON or GraphViz.

Exit 0 when every device was heard from within ``--silent-after``, 1 when any is flagged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from edge_agent.protocol.units import parse_duration
from hub_ingest.cliargs import duration
from hub_ingest.config import HubConfig
from hub_ingest.connect import hub_connection
from hub_ingest.provision import AGGREGATES
from hub_ingest.registry import Registry
from hub_ingest.report import DeviceReport, FleetReport, collect_report

WIDTH = 80
ARCHIVE = "archive"


def register(sub: Any) -> None:
    p = sub.add_parser("report", help="per-device link, lag, heartbeat and command backlog")
    p.add_argument("--json", action="store_true", help="machine-readable output (see README)")
    p.add_argument("--dot", type=Path, metavar="FILE", help="also write the replication graph")
    p.add_argument(
        "--silent-after",
        type=duration,
        default=parse_duration("24h"),
        metavar="DURATION",
        help="flag devices not heard from for longer than this (default 24h)",
    )
    p.add_argument(
        "--monitor-url",
        help="the hub's monitoring endpoint (default: every hub server's, from "
        "server.monitor_listen or each [[cluster.nodes]] entry)",
    )
    p.set_defaults(handler=lambda config, args: asyncio.run(_report(config, args)))


async def _report(config: HubConfig, args: argparse.Namespace) -> int:
    async with hub_connection(config, name="hub-ingest-report") as nc:
        devices = await (await Registry.open(nc.jetstream(domain=config.nats.domain))).list()
        report = await collect_report(
            nc, config, devices, silent_after=args.silent_after, monitor=args.monitor_url
        )
    if args.dot is not None:
        args.dot.write_text(render_dot(report), encoding="utf-8")
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        sys.stdout.write(render_table(report))
    return 1 if report.flagged else 0


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 10:
        return f"{seconds:.1f}s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def _link(device: DeviceReport) -> str:
    return {True: "up", False: "down", None: "?"}[device.link_connected]


_ROW = "{:<16} {:<4} {:>9} {:>7} {:>7} {:>5} {:>5} {:>5}  {}"


def render_table(report: FleetReport) -> str:
    """The report as text for an 80-column terminal; detail lines start with ``  `` + ``>``."""
    lines = [
        _ROW.format("DEVICE", "LINK", "HEARTBEAT", "LAG", "ACTIVE", "PEND", "DONE", "FAIL", "")
    ]
    for d in report.devices:
        active = [s.last_active_s for s in d.sources if s.last_active_s is not None]
        row = _ROW.format(
            _clip(d.device_id, 16),
            _link(d),
            age(d.last_heartbeat_age_s),
            "-" if d.lag is None else d.lag,
            age(min(active)) if active else "never",
            d.commands.pending,
            d.commands.done,
            d.commands.failed,
            " ".join(f.replace("_", " ").upper() for f in d.flags),
        )
        lines.append(row.rstrip())
        details = [f"{s.stream}: {s.error}" for s in d.sources if s.error]
        if d.last_error is not None:
            e = d.last_error
            details.append(f"last error: command {e.command_id} {e.status}: {e.error or '-'}")
        lines.extend(_clip(f"  > {text}", WIDTH) for text in details)
    t = report.totals
    lines.append("")
    lines.append(
        f"{t.devices} devices, {t.connected} connected, {t.flagged} flagged "
        f"(silent after {age(report.silent_after_s)}), lag {t.lag}"
    )
    lines.append(
        f"commands: {t.commands_pending} pending, {t.commands_expired} expired unanswered, "
        f"{t.commands_done} done, {t.commands_failed} failed"
    )
    lines.extend(_clip(f"warning: {w}", WIDTH) for w in report.warnings)
    return "\n".join(lines) + "\n"


def _q(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid GraphViz quoted ID


def render_dot(report: FleetReport) -> str:
    """GraphViz of device streams -> aggregate streams -> archive, like ``nats s report --dot``.

    A dashed edge is a link that is down now; red marks flagged devices and source errors.
    """
    out = [
        "digraph fleet {",
        "  rankdir=LR;",
        '  node [shape=box, fontname="Helvetica"];',
        '  edge [fontname="Helvetica", fontsize=10];',
        f'  {_q(ARCHIVE)} [shape=folder, label="archive (hub-ingest run)"];',
    ]
    aggregates = sorted({s.stream for d in report.devices for s in d.sources})
    for name in aggregates:
        out.append(f"  {_q('hub/' + name)} [shape=cylinder, label={_q(name)}];")
        out.append(f"  {_q('hub/' + name)} -> {_q(ARCHIVE)};")
    for d in report.devices:
        color = "red" if d.flagged else "black"
        title = f"{d.device_id} ({d.domain})" + "".join(f"\n{f}" for f in d.flags)
        out.append(f"  subgraph {_q('cluster_' + d.device_id)} {{")
        out.append(f"    label={_q(title)};")
        out.append(f"    color={color};")
        for agg in AGGREGATES:
            out.append(
                f"    {_q(d.domain + '/' + agg.device_stream)} [label={_q(agg.device_stream)}];"
            )
        out.append("  }")
        for s in d.sources:
            if not s.sourced:
                continue
            label = f"lag {s.lag if s.lag is not None else '?'}, active {age(s.last_active_s)}"
            if s.error:
                label += f"\n{s.error}"
            style = "solid" if d.link_connected else "dashed"
            edge_color = "red" if s.error or d.flagged else "black"
            out.append(
                f"  {_q(d.domain + '/' + s.device_stream)} -> {_q('hub/' + s.stream)} "
                f"[label={_q(label)}, style={style}, color={edge_color}];"
            )
    out.append("}")
    return "\n".join(out) + "\n"
