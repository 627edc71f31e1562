"""Errors a user sees are one line naming the key or the cause, with the documented exit code
(0 ok, 1 failed, 2 usage or config), never a traceback; `--json` output always parses."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from edge_agent.protocol.errors import MonitorUnavailable
from edge_agent.protocol.monitor import Monitor
from hub_ingest.fleet.auth import new_seed
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import NATS_SERVER, Hub, free_port, run_cli


def _agent_config(tmp_path: Path, credentials: Path | None, **island: str) -> Path:
    lines = [
        'device_id = "d1"',
        "[agent]",
        f'state_dir = "{tmp_path / "state"}"',
        "[island]",
        'max_file_store = "64MiB"',
        'supervise = "child"',
        f'client_listen = "127.0.0.1:{free_port()}"',
        f'monitor_listen = "127.0.0.1:{free_port()}"',
        f'nats_server = "{island.get("nats_server", NATS_SERVER)}"',
        "[hub]",
        f'urls = ["nats-leaf://127.0.0.1:{free_port()}"]',
    ]
    if credentials is not None:
        lines.append(f'credentials = "{credentials}"')
    path = tmp_path / "agent.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _seed(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "hub.nk"
    path.write_text(text)
    path.chmod(mode)
    return path


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr and "ExceptionGroup" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("edge-agent:")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_check_config_names_missing_or_bad_credentials(tmp_path: Path) -> None:
    missing = run_cli("edge_agent", "-c", str(_agent_config(tmp_path, None)), "check-config")
    assert missing.returncode == 2
    assert "hub.credentials: missing" in _one_line(missing.stderr)

    bad = _agent_config(tmp_path, _seed(tmp_path, "not a seed\n"))
    result = run_cli("edge_agent", "-c", str(bad), "check-config")
    assert result.returncode == 2
    assert "hub.credentials:" in _one_line(result.stderr) and "NATS user seed" in result.stderr

    nowhere = _agent_config(tmp_path, tmp_path / "absent.nk")
    result = run_cli("edge_agent", "-c", str(nowhere), "check-config")
    assert result.returncode == 2
    assert "hub.credentials: cannot read" in _one_line(result.stderr)


def test_check_config_warns_on_a_seed_others_can_read(tmp_path: Path) -> None:
    config = _agent_config(tmp_path, _seed(tmp_path, new_seed() + "\n", mode=0o644))
    result = run_cli("edge_agent", "-c", str(config), "check-config")
    assert result.returncode == 0
    assert "readable by others" in result.stderr
    assert result.stdout.strip() == f"{config}: ok"


def test_a_misspelt_required_key_is_reported_as_unknown(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('device_id = "d1"\n[island]\nmax_file_stor = "1GiB"\n')
    result = run_cli("edge_agent", "-c", str(config), "check-config")
    assert result.returncode == 2
    line = _one_line(result.stderr)
    assert "island.max_file_stor: unknown key (did you mean 'max_file_store'?)" in line


def test_run_with_a_bad_seed_or_no_nats_server_is_one_line(tmp_path: Path) -> None:
    """The daemon's task group lets the agent's own error out once, as itself."""
    bad_seed = _agent_config(tmp_path, _seed(tmp_path, "SUnot-a-seed\n"))
    result = run_cli("edge_agent", "-c", str(bad_seed), "run", timeout=60)
    assert result.returncode == 2
    assert "hub.credentials:" in _one_line(result.stderr)

    no_server = _agent_config(
        tmp_path, _seed(tmp_path, new_seed() + "\n"), nats_server="/nonexistent/nats-server"
    )
    result = run_cli("edge_agent", "-c", str(no_server), "run", timeout=60)
    assert result.returncode == 2  # a config error: the setting is named
    assert "island.nats_server: /nonexistent/nats-server" in _one_line(result.stderr)


async def test_hub_reload_without_its_monitoring_endpoint_is_one_line(
    users_file_hub: Hub, tmp_path: Path
) -> None:
    """`device add` on a hub that admits by users file signals the hub's nats-server through
    its pid file and watches its monitoring endpoint; an endpoint that does not answer is an
    error naming the key."""
    hub = users_file_hub
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        config = write_hub_toml(hub.config, tmp_path / "hub.toml")
        pid_file = tmp_path / "fake.pid"
        pid_file.write_text(str(sleeper.pid))
        text = config.read_text()
        text = text.replace(hub.config.server.monitor_listen, f"127.0.0.1:{free_port()}")
        text = text.replace("[server]\n", f'[server]\npid_file = "{pid_file}"\n')
        config.write_text(text)
        result = await asyncio.to_thread(
            run_cli, "hub_ingest", "-c", str(config), "device", "add", "z"
        )
        assert result.returncode == 3  # the hub cannot be reached
        assert "Traceback" not in result.stderr
        assert "server.monitor_listen" in result.stderr and "does not answer" in result.stderr
    finally:
        sleeper.kill()
        sleeper.wait()


async def test_report_json_with_the_hub_down_keeps_stdout_clean(hub: Hub, tmp_path: Path) -> None:
    """Connection errors are logged on stderr: stdout holds only what `--json` prints; the
    exit code is 3 (the hub cannot be reached), said in one last line."""
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")
    config.write_text(config.read_text().replace(hub.url, f"nats://127.0.0.1:{free_port()}"))
    result = await asyncio.to_thread(
        run_cli, "hub_ingest", "-c", str(config), "report", "--json", timeout=120
    )
    assert result.returncode == 3
    assert result.stdout == ""
    assert result.stderr.splitlines()[-1].startswith("hub-ingest: cannot connect to the hub")


def test_render_refuses_a_nats_server_older_than_supported(tmp_path: Path) -> None:
    """Fast resume needs nats-server 2.15: both renders name the binary and both versions."""
    old = tmp_path / "nats-server-2.12"
    old.write_text('#!/bin/sh\necho "nats-server: v2.12.8"\n')
    old.chmod(0o755)
    agent = _agent_config(tmp_path, _seed(tmp_path, new_seed() + "\n"), nats_server=str(old))
    result = run_cli("edge_agent", "-c", str(agent), "render-nats-config", "-o", "-")
    assert result.returncode == 2
    line = _one_line(result.stderr)
    assert f"island.nats_server: {old} is nats-server 2.12.8; 2.15.0 or newer" in line

    hub_toml = tmp_path / "hub.toml"
    hub_toml.write_text(f'state_dir = "{tmp_path / "hub"}"\n')
    result = run_cli(
        "hub_ingest",
        "-c",
        str(hub_toml),
        "render-nats-config",
        "-o",
        "-",
        "--nats-server",
        str(old),
    )
    assert result.returncode == 2, result.stderr
    assert f"--nats-server: {old} is nats-server 2.12.8; 2.15.0 or newer" in result.stderr
    current = run_cli("hub_ingest", "-c", str(hub_toml), "render-nats-config", "-o", "-")
    assert current.returncode == 0, current.stderr
    assert "jetstream" in current.stdout


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("hub_ingest", ["device", "list"]),
        ("hub_ingest", ["device", "add", "--from", "-"]),
        ("hub_ingest", ["command", "status", "x"]),
        ("hub_ingest", ["report", "--json"]),
        ("edge_agent", ["status", "--json"]),
        ("edge_agent", ["dead-letter", "list"]),
    ],
)
def test_config_option_is_taken_after_every_subcommand(
    tmp_path: Path, module: str, argv: list[str]
) -> None:
    """`-c FILE` after the subcommand reads FILE, as before it: the error names that file."""
    missing = tmp_path / "named-after.toml"
    result = run_cli(module, "-c", str(tmp_path / "named-before.toml"), *argv, "-c", str(missing))
    assert result.returncode == 2
    assert str(missing) in result.stderr and "named-before" not in result.stderr


async def test_a_monitoring_url_naming_a_client_port_is_a_clear_error(hub: Hub) -> None:
    """A client port greets with NATS's INFO line, not HTTP: the error says so, and callers
    that tolerate an unreachable endpoint (report, status, the watcher) tolerate this too."""
    client = hub.url.removeprefix("nats://")
    with pytest.raises(MonitorUnavailable, match="not an HTTP monitoring endpoint"):
        await Monitor(f"http://{client}").get("/healthz")
    assert not await Monitor(f"http://{client}").healthy()
