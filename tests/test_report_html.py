"""``report --html``: one self-contained page, checked in headless Chromium (Debian's
``chromium``) with 500 devices: every device is in the grid, flagged ones first, the view
in the link filters and sorts, and the screenshot is a rendered page, not a blank one."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
from pathlib import Path

from hub_ingest.local.fleet import write_hub_toml
from hub_ingest.report.html import render_html
from hub_ingest.report.model import (
    CommandCounts,
    CommandError,
    DeviceReport,
    FleetReport,
    SourceState,
)
from tests.support.cluster import Hub, run_cli
from tests.support.waiting import eventually

CHROMIUM = shutil.which("chromium") or "chromium"  # `make tools` installs it
DEVICES = 500


def _device(i: int) -> DeviceReport:
    silent = i % 25 == 0
    return DeviceReport(
        device_id=f"truck-{i:04d}",
        domain=f"edge-truck-{i:04d}",
        shard=i // 100,
        link_connected=not silent,
        sources=(
            SourceState("FLEET_TELEMETRY", "TELEMETRY", True, i % 7, 1.0 + i % 30, None),
            SourceState("FLEET_EVENTS", "EVENTS", True, 0, 2.0, None),
        ),
        last_heartbeat_at=None,
        last_heartbeat_age_s=30.0 * (i % 10),
        last_seen_s=86400.0 * 3 if silent else 30.0 * (i % 10),
        telemetry_dropped=i % 3,
        dead_letters=0,
        commands=CommandCounts(pending=i % 2, done=3, failed=1 if silent else 0),
        last_error=CommandError("c-9", "error", "<b>disk</b> full") if silent else None,
        flags=("silent",) if silent else (),
    )


def _chromium(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _rows(dom: str) -> list[str]:
    return re.findall(r'<tr class="[^"]*" data-device="([^"]+)"', dom)


def test_a_500_device_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    report = FleetReport("2026-11-23T12:00:00Z", 86400.0, tuple(map(_device, range(DEVICES))))
    page = tmp_path / "fleet.html"
    page.write_text(render_html(report), encoding="utf-8")
    assert "http://" not in page.read_text() and "https://" not in page.read_text()

    dom = _chromium("--dump-dom", page.as_uri()).stdout
    rows = _rows(dom)
    flagged = [d.device_id for d in report.devices if d.flagged]
    assert len(rows) == DEVICES and rows[: len(flagged)] == flagged  # flagged first
    assert f"{DEVICES} of {DEVICES} devices" in dom
    assert "&lt;b&gt;disk&lt;/b&gt; full" in dom  # an error is text, never markup

    only = _rows(_chromium("--dump-dom", page.as_uri() + "#flagged=1").stdout)
    assert only == flagged
    by_lag = _rows(_chromium("--dump-dom", page.as_uri() + "#sort=lag&desc=1").stdout)
    assert by_lag[0] in {d.device_id for d in report.devices if d.lag == 6}

    shot, blank = tmp_path / "fleet.png", tmp_path / "blank.png"
    for target, url in ((shot, page.as_uri()), (blank, "about:blank")):
        _chromium(f"--screenshot={target}", "--window-size=1400,1000", url)
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # A rendered grid compresses far worse than an empty page of the same size.
    assert shot.stat().st_size > 10 * blank.stat().st_size


async def test_report_html_from_a_live_hub(hub: Hub, tmp_path: Path) -> None:
    """The CLI writes the page for a real fleet; its embedded report is the --json one."""
    await hub.device("a", register_when_ready=True)
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")
    page = tmp_path / "fleet.html"

    async def written() -> bool:
        run = await asyncio.to_thread(
            run_cli, "hub_ingest", "-c", str(config), "report", "--html", str(page)
        )
        return run.returncode == 0 and page.exists()

    await eventually(written, timeout=60, interval=1.0, what="a healthy report with a page")
    embedded = re.search(
        r'<script type="application/json" id="report">(.*?)</script>', page.read_text(), re.S
    )
    assert embedded is not None
    document = json.loads(embedded.group(1))
    assert [d["device_id"] for d in document["devices"]] == ["a"]
    assert _rows(_chromium("--dump-dom", page.as_uri()).stdout) == ["a"]
