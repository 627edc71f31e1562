"""The agent config: defaults, checked values, and errors that name the key (exit code 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge_agent.cli import main
from edge_agent.core.config import Config, load_config, parse_config
from edge_agent.core.errors import ConfigError
from edge_agent.island.server import check_config, leaf_reconnect, render_config
from hub_ingest.fleet.auth import new_seed
from tests.support.cluster import NATS_SERVER, run_cli

MINIMAL = """
device_id = "d1"
[island]
max_file_store = "1GiB"
[hub]
urls = ["nats-leaf://127.0.0.1:7422"]
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.toml"
    path.write_text(text)
    return path


def test_minimal_config_gets_documented_defaults(tmp_path: Path) -> None:
    """Domain and server name derive from the device id; budgets split the store."""
    config = load_config(_write(tmp_path, MINIMAL))
    assert config.island.domain == "edge-d1"
    assert config.island.server_name == "edge-d1"
    assert config.island.max_file_store == 1024**3
    assert config.island.supervise == "external"
    assert str(config.island.client_listen) == "127.0.0.1:4222"
    assert config.hub.domain == "hub"
    assert config.hub.reconnect == 0.25
    assert config.island.sync is None  # "always"
    assert config.streams.telemetry.max_bytes == 1024**3 * 70 // 100


@pytest.mark.parametrize(
    ("text", "key", "fragment"),
    [
        ("colour = 'red'\n" + MINIMAL, "colour", "unknown key"),
        (MINIMAL.replace('"1GiB"', '"lots"'), "island.max_file_store", "lots"),
        (MINIMAL.replace('device_id = "d1"', ""), "device_id", "missing"),
        (MINIMAL.replace('device_id = "d1"', 'device_id = "a.b"'), "device_id", "a.b"),
        (
            MINIMAL.replace("[island]", '[island]\nclient_listen = "0.0.0.0:4222"'),
            "island.client_listen",
            "loopback",
        ),
        (MINIMAL.replace("[island]", '[island]\nsupervise = "maybe"'), "island.supervise", "maybe"),
        (MINIMAL.replace("[hub]", '[hub]\ncompression = "zip"'), "hub.compression", "s2_auto"),
        (MINIMAL + '[streams.telemetry]\nmax_bytes = "2GiB"\n', "streams", "max_file_store"),
        (MINIMAL + "[streams.events]\nmax_msgs = 3\n", "streams.events.max_msgs", "unknown key"),
        (MINIMAL.replace("[hub]", "[hub]\nreconnect = 'soon'"), "hub.reconnect", "soon"),
        (MINIMAL.replace("[island]", '[island]\nsync = "never"'), "island.sync", "always"),
        # A message larger than the hub takes would stall the uplink behind it for good.
        (
            MINIMAL.replace("[island]", '[island]\nmax_payload = "4MiB"'),
            "island.max_payload",
            "stall the device's uplink",
        ),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str, fragment: str) -> None:
    """Every rejected value is reported with its dotted key and the offending value."""
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, text))
    assert err.value.key == key
    assert fragment in str(err.value)


def test_cli_exits_2_and_names_the_key(tmp_path: Path) -> None:
    """A bad size is a usage error: exit 2, the key and the value on stderr."""
    path = _write(tmp_path, MINIMAL.replace('"1GiB"', '"lots"'))
    result = run_cli("edge_agent", "-c", str(path), "check-config")
    assert result.returncode == 2
    assert "island.max_file_store" in result.stderr
    assert "lots" in result.stderr


def test_cli_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-c", str(tmp_path / "nope.toml"), "check-config"]) == 2
    assert "nope.toml: no such file" in capsys.readouterr().err


def test_rendered_island_config_passes_nats_server_t(tmp_path: Path) -> None:
    """The rendered config is accepted by the real nats-server and keeps data local."""
    data = {
        "device_id": "d1",
        "agent": {"state_dir": str(tmp_path)},
        "island": {"max_file_store": "1GiB", "nats_server": NATS_SERVER},
        "hub": {
            "urls": ["nats-leaf://127.0.0.1:7422", "nats-leaf://127.0.0.2:7422"],
            "credentials": str(tmp_path / "d1.creds"),
        },
    }
    (tmp_path / "d1.creds").write_text(new_seed() + "\n")
    config = parse_config(data)
    text = render_config(config)
    assert 'domain: "edge-d1"' in text
    assert "max_file_store: 1073741824" in text
    assert 'reconnect: "250ms"' in text
    assert "sync_interval: always" in text  # a PubAck means on disk, by default
    assert '"tele.>"' in text
    assert 'nkey: "SU' in text
    path = tmp_path / "island.conf"
    path.write_text(text)
    check_config(NATS_SERVER, path)


def test_each_device_gets_its_own_share_of_the_reconnect_spread(tmp_path: Path) -> None:
    """`hub.reconnect_spread` adds to `hub.reconnect` a share fixed by the device id: one
    device always renders the same interval, and a fleet's are spread over the whole range
    (after a hub restart its devices arrive over seconds, not in one quarter second)."""

    def config(device_id: str, spread: str) -> Config:
        hub = {"urls": ["nats-leaf://127.0.0.1:7422"], "reconnect_spread": spread}
        return parse_config(
            {"device_id": device_id, "island": {"max_file_store": "1GiB"}, "hub": hub}
        )

    fleet = [leaf_reconnect(config(f"sim{i:04d}", "4s")) for i in range(200)]
    assert all(0.25 <= s < 4.25 for s in fleet)
    assert min(fleet) < 0.5 and max(fleet) > 4.0  # the whole range is used
    assert len({round(s, 3) for s in fleet}) > 150  # and not in a few clumps
    assert leaf_reconnect(config("sim0007", "4s")) == fleet[7]
    assert {leaf_reconnect(config(f"d{i}", "0s")) for i in range(10)} == {0.25}  # the default
    one = config("d1", "4s")
    path = tmp_path / "island.conf"
    path.write_text(render_config(one))
    assert f'reconnect: "{round(leaf_reconnect(one) * 1000)}ms"' in path.read_text()
    check_config(NATS_SERVER, path)
    with pytest.raises(ConfigError, match=r"hub\.reconnect_spread"):
        config("d1", "-1s")


def test_bad_credentials_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "d1.creds").write_text("not a seed\n")
    config = parse_config(
        {
            "device_id": "d1",
            "island": {"max_file_store": "1GiB"},
            "hub": {
                "urls": ["nats-leaf://127.0.0.1:7422"],
                "credentials": str(tmp_path / "d1.creds"),
            },
        }
    )
    with pytest.raises(ConfigError, match=r"hub.credentials: .*d1.creds does not hold a NATS"):
        render_config(config)


def test_render_command_writes_checked_file_for_owner_only(tmp_path: Path) -> None:
    """The rendered island config holds the device's seed: mode 0600."""
    path = _write(tmp_path, MINIMAL + f'[agent]\nstate_dir = "{tmp_path}"\n')
    out = tmp_path / "out.conf"
    assert main(["-c", str(path), "render-nats-config", "-o", str(out)]) == 0
    assert 'server_name: "edge-d1"' in out.read_text()
    assert out.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    ("written", "size"),
    [
        ("2G", 2 * 1000**3),
        ("2GB", 2 * 1024**3),
        ("2Gi", 2 * 1024**3),
        ("2GiB", 2 * 1024**3),
        ("512M", 512 * 1000**2),
        ("512mb", 512 * 1024**2),
        ("1048576", 1048576),
    ],
)
def test_sizes_mean_what_nats_server_reads_them_as(written: str, size: int) -> None:
    """nats-server's config takes "2G" as 2 * 10**9 and "2GB" as 2 GiB (conf/parse.go):
    the same spelling means the same size in the agent's and the hub's configs."""
    config = parse_config(
        {
            "device_id": "d1",
            "island": {"max_file_store": written},
            "hub": {"urls": ["nats-leaf://h:7422"]},
        }
    )
    assert config.island.max_file_store == size


def test_a_derived_budget_too_small_names_the_key_that_was_written(tmp_path: Path) -> None:
    """A store too small for the default budgets is an error about island.max_file_store,
    the key the user wrote, not about a stream budget they never set."""
    with pytest.raises(ConfigError, match=r"^island\.max_file_store: 10 bytes leaves streams"):
        load_config(_write(tmp_path, MINIMAL.replace('"1GiB"', '"10B"')))
