"""``hub-ingest device add --from``: many devices, one users-file write, one reload, one
provisioning pass; resumable after a crash; conflicts refused before anything changes. (On a
hub that admits its devices by users file; under the auth callout, the default, enrolment
changes no file: `test_admission`.)"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from nats.js.api import KeyValueConfig

from hub_ingest.core import failpoints
from hub_ingest.core.connect import hub_connection, hub_jetstream
from hub_ingest.core.errors import EnrolmentError
from hub_ingest.fleet.auth import new_seed, public_key
from hub_ingest.fleet.enrol import Enrolment, parse_line, read_enrolments, valid_public_key
from hub_ingest.fleet.registry import BUCKET, Device, Incarnation, Registry
from hub_ingest.fleet.streams import stream_names
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import Hub
from tests.support.waiting import freeze

RELOADED = "Reloaded server configuration"


@pytest.fixture
def hub(users_file_hub: Hub) -> Hub:
    return users_file_hub


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str


async def _cli(
    hub: Hub,
    tmp_path: Path,
    *args: str,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
) -> Run:
    """The real CLI in its own session (a fail point kills its process group only)."""
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "hub_ingest", "-c", str(config), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )

    done = await asyncio.to_thread(run)
    return Run(done.returncode, done.stdout, done.stderr)


def _reloads(hub: Hub) -> int:
    return hub.server.log_path.read_text(errors="replace").count(RELOADED)


def _key() -> str:
    return public_key(new_seed())


async def _registered(hub: Hub) -> dict[str, str]:
    return {d.device_id: d.nkey for d in await (await Registry.open(hub.js)).list()}


async def test_bulk_add_enrols_a_file_with_one_reload(hub: Hub, tmp_path: Path) -> None:
    """30 devices (25 with hub-made keys, 5 with their own) from one file: one reload, seeds
    0600, every device's streams, progress on stderr and a JSON summary alone on stdout."""
    own = {f"own-{i}": _key() for i in range(5)}
    lines = ["id,public_key", "# the north depot", ""]
    lines += [f"truck-{i:02d}" for i in range(25)]
    lines += [f"{device},{key}  # bought with a TPM" for device, key in own.items()]
    devices = tmp_path / "devices.csv"
    devices.write_text("\n".join(lines) + "\n")
    before = _reloads(hub)

    run = await _cli(hub, tmp_path, "device", "add", "--from", str(devices), "--json")

    assert run.code == 0, run.stderr
    assert _reloads(hub) == before + 1
    summary = json.loads(run.stdout)
    assert len(summary["enrolled"]) == 30 and summary["already_present"] == []
    assert summary["seeds_written"] == 25 and summary["reloaded"] is True
    registered = await _registered(hub)
    assert len(registered) == 30
    for entry in summary["enrolled"]:
        device = entry["device_id"]
        if device in own:
            assert entry["seed_file"] is None and registered[device] == own[device]
            continue
        seed = Path(entry["seed_file"])
        assert seed == Path(summary["seeds_dir"]) / f"{device}.nk"
        assert seed.stat().st_mode & 0o777 == 0o600
        assert public_key(seed.read_text().strip()) == registered[device] == entry["nkey"]
    names = set(await stream_names(hub.js))
    assert {f"CMD_{device}" for device in registered} <= names
    progress = [line for line in run.stderr.splitlines() if line.startswith("enrol: ")]
    assert progress == [
        f"enrol: read 30 devices from {devices}",
        "enrol: planned 30/30",
        "enrol: registered 30/30",
        "enrol: auth_written 30/30",
        "enrol: reloaded 1/1",
        progress[-1],
    ]
    assert progress[-1].startswith("enrol: provisioned ")
    listing = await _cli(hub, tmp_path, "device", "list", "--json")
    assert sorted(d["device_id"] for d in json.loads(listing.stdout)) == sorted(registered)


async def test_bulk_add_finishes_a_batch_cut_short_by_a_crash(hub: Hub, tmp_path: Path) -> None:
    """Killed -9 half-way through registering, the same file run again enrols only the missing
    devices, keeps the keys (and seed files) of those already registered, reloads once."""
    await hub.register("a")
    seed_a = (hub.seed_file("a")).read_text()
    batch = "\n".join(["a", *(f"d{i}" for i in range(10))]) + "\n"
    killed = await _cli(
        hub,
        tmp_path,
        "device",
        "add",
        "--from",
        "-",
        stdin=batch,
        env={failpoints.VARIABLE: "mid_enrol"},
    )
    assert killed.code == -signal.SIGKILL, killed.stderr
    half = await _registered(hub)
    assert sorted(half) == ["a", *(f"d{i}" for i in range(5))]
    before = _reloads(hub)

    run = await _cli(hub, tmp_path, "device", "add", "--from", "-", "--json", stdin=batch)

    assert run.code == 0, run.stderr
    summary = json.loads(run.stdout)
    assert [e["device_id"] for e in summary["enrolled"]] == [f"d{i}" for i in range(5, 10)]
    assert summary["already_present"] == ["a", *(f"d{i}" for i in range(5))]
    after = await _registered(hub)
    assert {d: after[d] for d in half} == half
    assert hub.seed_file("a").read_text() == seed_a
    assert _reloads(hub) == before + 1
    # Every device, old and new, is in the users file the server now runs with.
    users = hub.config.server.auth_file.read_text()
    assert all(key in users for key in after.values())

    again = await _cli(hub, tmp_path, "device", "add", "--from", "-", stdin=batch)
    assert again.code == 0, again.stderr
    assert again.stdout.startswith("enrolled 0, already present 11; seeds written: 0")
    assert await _registered(hub) == after


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("a,{other}", "differs from the registered key"),
        ("bad.id", "device id: expected letters"),
        ("y,UNOTAKEY", "is not a NATS user public key"),
        ("x", "already asked for on line 1"),
        ("y,{key_a}", "is already used by device 'a'"),
    ],
)
async def test_bulk_add_refuses_a_bad_line_before_changing_anything(
    hub: Hub, tmp_path: Path, line: str, reason: str
) -> None:
    """A line that cannot be done as asked is named (line and id) and nothing changes: no
    device registered, no users file written, no reload."""
    await hub.register("a")
    registered = await _registered(hub)
    users = hub.config.server.auth_file.read_text()
    before = _reloads(hub)
    bad = line.format(other=_key(), key_a=registered["a"])
    devices = tmp_path / "devices.txt"
    devices.write_text(f"x\n# comment\n{bad}\nz\n")

    run = await _cli(hub, tmp_path, "device", "add", "--from", str(devices))

    assert run.code == 1, run.stdout + run.stderr
    device = bad.split(",")[0]
    assert f"{devices} line 3: device {device!r}: " in run.stderr and reason in run.stderr
    assert "nothing was enrolled" in run.stderr
    assert await _registered(hub) == registered
    assert hub.config.server.auth_file.read_text() == users
    assert _reloads(hub) == before
    assert run.stdout == ""


async def test_a_domain_that_is_a_token_of_the_servers_own_subjects_is_refused(
    hub: Hub, tmp_path: Path
) -> None:
    """`$JS.API.API.>` overlaps the hub's own API, which the users file imports the other
    way: nats-server would refuse the whole file as a cycle, locking every device out."""
    users = hub.config.server.auth_file.read_text()
    run = await _cli(hub, tmp_path, "device", "add", "x", "--domain", "API")
    assert run.code == 1, run.stdout + run.stderr
    assert "domain 'API' is a token of nats-server's own $JS subjects" in run.stderr
    assert "x" not in await _registered(hub)
    assert hub.config.server.auth_file.read_text() == users


def test_enrolment_lines_ids_keys_comments_and_header() -> None:
    """What a ``--from`` line may hold: an id, an id and a key, comments, a CSV header."""
    key = _key()
    assert valid_public_key(key)
    assert not valid_public_key(key[:-1] + ("A" if key[-1] != "A" else "B"))
    assert not valid_public_key("S" + key[1:])
    text = ["ID,Public_Key", "", "  # all of depot 4", f"a, {key} # own key", "b,", "c  "]
    assert read_enrolments(text, "f") == [
        Enrolment("a", key, 4),
        Enrolment("b", None, 5),
        Enrolment("c", None, 6),
    ]
    assert parse_line("#", 1, "f") is None
    with pytest.raises(EnrolmentError, match=r"^f line 2: device 'a': expected ID or ID,PUB"):
        parse_line("a,b,c", 2, "f")


async def test_the_registry_lists_each_device_once_as_it_is_now(hub: Hub) -> None:
    """The last value of each device, none that was removed, for many more devices than
    are read at once; then after another process's writes, which a listing reads alone."""
    registry = await Registry.open(hub.js)
    key = public_key(new_seed())
    for i in range(300):
        await registry.create(Device(f"r{i:04d}", f"edge-r{i:04d}", 0, "2026-11-26T00:00:00Z", key))
    await registry.remove("r0003")
    seen = Incarnation("TELEMETRY", "abc", "2026-11-26T00:00:00Z", 0)
    await registry.add_incarnation("r0007", seen)
    listed = await registry.list()
    ids = [d.device_id for d in listed]
    assert len(ids) == 299 and "r0003" not in ids and ids == sorted(set(ids))
    assert next(d for d in listed if d.device_id == "r0007").incarnations == (seen,)

    # Another process writes; this one's next listing reads only those writes, and matches
    # what a process listing afresh reads.
    async with hub_connection(hub.config, "other") as nc:
        other = await Registry.open(nc.jetstream(domain=hub.config.nats.domain))
        await other.create(Device("r9999", "edge-r9999", 1, "2026-11-26T00:00:00Z", key))
        await other.remove("r0010")
        later = Incarnation("EVENTS", "def", "2026-11-26T01:00:00Z", 4)
        for device_id in ("r0007", "r0011"):
            await other.add_incarnation(device_id, later)
        await other.remove("r0011")
        await other.create(Device("r0011", "edge-r0011", 2, "2026-11-26T02:00:00Z", key))
        caught_up = await registry.list()
        assert caught_up == await other.list()
    by_id = {d.device_id: d for d in caught_up}
    assert len(by_id) == 299 and "r0010" not in by_id and "r9999" in by_id
    assert by_id["r0007"].incarnations == (seen, later)
    assert by_id["r0011"].shard == 2 and by_id["r0011"].incarnations == ()

    # A bucket made again is read afresh, not caught up from where the old one stood.
    await hub.js.delete_key_value(BUCKET)
    await hub.js.create_key_value(KeyValueConfig(bucket=BUCKET, history=5))
    await registry.create(Device("fresh", "edge-fresh", 0, "2026-11-26T03:00:00Z", key))
    assert [d.device_id for d in await registry.list()] == ["fresh"]


async def test_a_hub_that_answers_late_delays_the_tools_rather_than_failing_them(
    hub: Hub,
) -> None:
    """A JetStream request a stalled hub answers after 8 s (a busy cluster: an election, a
    node catching up) is waited for; nats-py's own 5 s would fail `device add` as if the hub
    were unreachable."""
    assert hub.server.proc is not None
    pid = hub.server.proc.pid
    async with hub_connection(hub.config) as nc:
        js = hub_jetstream(nc, hub.config)
        await js.stream_info("COMMANDS")
        try:
            await freeze(pid)
            asked = asyncio.create_task(js.stream_info("COMMANDS"))
            await asyncio.sleep(8)  # the stall's length, longer than nats-py's 5 s
            assert not asked.done(), asked
        finally:
            os.kill(pid, signal.SIGCONT)
        assert (await asked).config.name == "COMMANDS"
