"""``hub-ingest report [--json] [--dot FILE]``: the fleet view as a table, JSON or GraphViz.

Exit 0 when every device was heard from within ``--silent-after``, 1 when any is flagged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

from edge_agent.protocol.files import write_durably
from edge_agent.protocol.units import parse_duration
from hub_ingest.cli.args import duration
from hub_ingest.core.config import HubConfig
from hub_ingest.core.connect import hub_connection
from hub_ingest.fleet.registry import Registry
from hub_ingest.fleet.streams import AGGREGATES
from hub_ingest.report.collect import Collection, start_report
from hub_ingest.report.html import render_html
from hub_ingest.report.metrics import render_prometheus
from hub_ingest.report.model import DeviceReport, FleetReport

WIDTH = 80
ARCHIVE = "archive"


def register(sub: Any) -> None:
    p = sub.add_parser("report", help="per-device link, lag, heartbeat and command backlog")
    p.add_argument("--json", action="store_true", help="machine-readable output (see README)")
    p.add_argument(
        "--json-lines",
        action="store_true",
        help="the same, one JSON object a line, each device's written as soon as it is read "
        "(for large fleets)",
    )
    p.add_argument("--dot", type=Path, metavar="FILE", help="also write the replication graph")
    p.add_argument(
        "--prometheus", action="store_true", help="Prometheus text format, one series per device"
    )
    p.add_argument(
        "--html",
        type=Path,
        metavar="FILE",
        help="also write one self-contained page: a sortable, filterable health grid",
    )
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
        collection = await start_report(
            nc, config, devices, silent_after=args.silent_after, monitor=args.monitor_url
        )
        report = await (_json_lines(collection) if args.json_lines else collection.report())
    if args.dot is not None:
        args.dot.write_text(render_dot(report), encoding="utf-8")
    if args.html is not None:
        write_durably(args.html, render_html(report))
    if args.json_lines:
        pass  # written as it was read
    elif args.prometheus:
        sys.stdout.write(render_prometheus(report))
    elif args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        sys.stdout.write(render_table(report))
    return 1 if report.flagged else 0


async def _json_lines(collection: Collection) -> FleetReport:
    """``--json-lines``: the ``--json`` document's parts, one object a line, each device's
    written and flushed as soon as it is read: a ``report`` line (schema, time, threshold),
    a ``device`` line per device, a ``summary`` line (flagged, totals, warnings) last."""
    reports: list[DeviceReport] = []
    try:
        _line({"type": "report", **collection.header()})
        async for device in collection.devices():
            reports.append(device)
            _line({"type": "device", **device.to_dict()})
        report = collection.finish(reports)
        _line({"type": "summary", **report.summary()})
    except BrokenPipeError:  # the reader stopped early (`| head`): it has whole lines
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # for the exit's flush
        report = collection.finish(reports)
    return report


def _line(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def age(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 10:
        return f"{seconds:.1f}s"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit}"
    return f"{seconds:.0f}s"


def _link(device: DeviceReport) -> str:
    return {True: "up", False: "down", None: "?"}[device.link_connected]


_ID = 16  # an id this long or shorter shares its row with the figures
_ROW = "{:<16} {:<4} {:>9} {:>7} {:>7} {:>5} {:>5} {:>5}  {}"
LEGEND = (
    "LINK up, down, or ? when the hub's monitoring endpoint did not answer. HEARTBEAT: age "
    "of the newest heartbeat. LAG: messages the hub's aggregates still lack. ACTIVE: last "
    "contact of the device's streams with the hub. PEND, DONE, FAIL: commands waiting, "
    "answered ok, failed. SILENT: not heard from within --silent-after; NEVER SEEN: never "
    "heard from; HUB GAP: the hub's copy of a stream skipped more than the device dropped "
    "and the refill has not looked yet; GAP PENDING: skipped readings wait for the device's "
    "island to refill them; LOST: skipped readings the island no longer had "
    "(see the warnings). Flagged devices come first; > lines say what went wrong."
)


def _wrap(text: str, first: str, rest: str) -> list[str]:
    """`text` over as many lines as it needs (never cut): a device id or an error is read
    to be acted on."""
    return textwrap.wrap(
        text, WIDTH, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    )


def _device_lines(d: DeviceReport) -> list[str]:
    active = [s.last_active_s for s in d.sources if s.last_active_s is not None]
    figures = (
        _link(d),
        age(d.last_heartbeat_age_s),
        "-" if d.lag is None else d.lag,
        age(min(active)) if active else "never",
        d.commands.pending,
        d.commands.done,
        d.commands.failed,
        " ".join(f.replace("_", " ").upper() for f in d.flags),
    )
    # A long id gets a line of its own, in full; the figures follow under it.
    lines = [] if len(d.device_id) <= _ID else [d.device_id]
    lines.append(_ROW.format(d.device_id if len(d.device_id) <= _ID else "", *figures).rstrip())
    details = [f"{s.stream}: {s.error}" for s in d.sources if s.error]
    if d.last_error is not None:
        e = d.last_error
        details.append(f"last error: command {e.command_id} {e.status}: {e.error or '-'}")
    for text in details:
        lines.extend(_wrap(text, "  > ", "    "))
    return lines


def render_table(report: FleetReport) -> str:
    """The report as text for an 80-column terminal: flagged devices first, ids and errors
    in full (wrapped), detail lines starting with ``  > ``, totals, warnings and a legend."""
    lines = [
        _ROW.format("DEVICE", "LINK", "HEARTBEAT", "LAG", "ACTIVE", "PEND", "DONE", "FAIL", "")
    ]
    for d in sorted(report.devices, key=lambda d: (not d.flagged, d.device_id)):
        lines.extend(_device_lines(d))
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
    for warning in report.warnings:
        lines.extend(_wrap(warning, "warning: ", "  "))
    lines.append("")
    lines.extend(_wrap(LEGEND, "", ""))
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
