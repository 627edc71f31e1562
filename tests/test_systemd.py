"""The units in systemd/: clean under ``systemd-analyze verify``, hardened, and as specified."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from edge_agent.core.config import parse_config
from edge_agent.update.updater import update_paths
from hub_ingest.fleet.server import SERVER_ENV
from tests.support.scratch_root import REPO, UNITS, VERIFY_UNIT, scratch_root, stub_executables

EXPOSURE_LIMIT = 2.0


@pytest.fixture
def root(tmp_path: Path) -> Path:
    """A scratch root with systemd's own units, ours, and stubs for every command they run."""
    root = scratch_root(tmp_path / "root")
    unit_dir = root / "etc/systemd/system"
    for unit in UNITS:
        (unit_dir / unit).write_bytes((REPO / "systemd" / unit).read_bytes())
    stub_executables(root, [REPO / "systemd" / u for u in UNITS])
    return root


def _verify(path: Path, name: str, root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VERIFY_UNIT), str(path), name, str(root)],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )


def _settings(unit: str) -> list[tuple[str, str]]:
    pairs = []
    for line in (REPO / "systemd" / unit).read_text().splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            pairs.append((key, value))
    return pairs


@pytest.mark.parametrize("unit", UNITS)
def test_unit_verifies_without_any_output(unit: str, root: Path) -> None:
    """systemd 252 loads the unit with not even a warning (unknown options only warn)."""
    result = _verify(REPO / "systemd" / unit, unit, root)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_verify_unit_fails_on_an_option_systemd_252_does_not_know(
    root: Path, tmp_path: Path
) -> None:
    """RestartSteps= came in systemd 254: 252 only warns, and any warning fails the check."""
    text = (REPO / "systemd/edge-agent.service").read_text()
    bad = tmp_path / "bad.service"
    bad.write_text(text.replace("[Service]\n", "[Service]\nRestartSteps=5\n"))
    result = _verify(bad, "edge-agent.service", root)
    assert result.returncode == 1
    assert "RestartSteps" in result.stderr


def test_edge_agent_exposure_is_at_most_two(root: Path) -> None:
    """``systemd-analyze security --offline=true`` rates the agent's sandbox 2.0 or better."""
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", f"--root={root}", "edge-agent.service"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    match = re.search(r"Overall exposure level for edge-agent\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= EXPOSURE_LIMIT


def test_agent_unit_restarts_for_ever_under_a_watchdog() -> None:
    """Type=notify with a watchdog, on-failure restarts and no start limit to give up at."""
    settings = _settings("edge-agent.service")
    values = dict(settings)
    assert values["Type"] == "notify"
    assert values["Restart"] == "on-failure"
    assert values["StartLimitIntervalSec"] == "0"
    assert values["WatchdogSec"] and values["MemoryMax"]
    assert values["CapabilityBoundingSet"] == ""
    assert values["ProtectSystem"] == "strict"
    assert values["StateDirectory"] == "edge-agent"
    filters = [v for k, v in settings if k == "SystemCallFilter"]
    assert len(filters) >= 2 and any(v.startswith("~") for v in filters)


def test_island_unit_stops_in_lame_duck_mode_within_its_timeout() -> None:
    """SIGUSR2 is lame duck; nats-server takes 2m plus a 10s grace period by default."""
    values = dict(_settings("edge-nats.service"))
    assert values["KillSignal"] == "SIGUSR2"
    assert int(values["TimeoutStopSec"].removesuffix("s")) > 130
    assert "render-nats-config --link-closed" in values["ExecStartPre"]
    assert "open-link" in values["ExecStartPost"]
    assert values["ExecStart"].split()[0].endswith("/nats-server")


def test_hub_server_unit_renders_per_node_reloads_and_stops_in_lame_duck_mode() -> None:
    """The hub's nats-server: config rendered from hub.toml (for the node the role names) on
    each start, SIGHUP reload for `device add`, and the island's lame-duck stop."""
    values = dict(_settings("hub-nats.service"))
    pre, start = values["ExecStartPre"].split(), values["ExecStart"].split()
    assert pre[0].endswith("/hub-ingest") and pre[1:4] == [
        "render-nats-config",
        "$HUB_NODE_ARGS",
        "-o",
    ]
    assert start[0].endswith("/nats-server") and start[1:] == ["-c", pre[4]]
    assert values["ExecReload"].endswith("--signal reload=$MAINPID")
    assert values["EnvironmentFile"] == "-/etc/hub-ingest/node.env"
    environment = {v for k, v in _settings("hub-nats.service") if k == "Environment"}
    assert {f"{k}={v}" for k, v in SERVER_ENV.items()} <= environment  # as tests run it
    assert values["KillSignal"] == "SIGUSR2"
    assert int(values["TimeoutStopSec"].removesuffix("s")) > 130
    assert values["User"] == "hub-ingest" and values["StateDirectory"] == "hub-ingest"
    assert values["CapabilityBoundingSet"] == "" and values["ProtectSystem"] == "strict"


def test_hub_watch_runs_beside_its_node() -> None:
    """`hub-ingest watch` takes the same node arguments as the server it runs beside."""
    values = dict(_settings("hub-ingest-watch.service"))
    assert values["ExecStart"].endswith("hub-ingest watch $HUB_NODE_ARGS")
    assert values["EnvironmentFile"] == "-/etc/hub-ingest/node.env"
    assert "hub-nats.service" in values["After"].split()


def test_the_installer_starts_when_the_agent_stages_a_release() -> None:
    """The path unit watches the file the agent's default config stages releases in, and
    starts the installer as root (the agent cannot write /opt/edge-agent)."""
    config = parse_config(
        {"device_id": "d", "island": {"max_file_store": "1GiB"}, "hub": {"urls": ["nats://h"]}}
    )
    path = dict(_settings("edge-agent-update.path"))
    assert path["PathExists"] == str(update_paths(config).staged)
    assert path["Unit"] == "edge-agent-update.service"
    service = dict(_settings("edge-agent-update.service"))
    assert service["Type"] == "oneshot" and "User" not in service
    assert service["ExecStart"] == f"{config.update.prefix}/current/bin/edge-agent update install"
