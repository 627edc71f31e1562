"""Hub provisioning and the device registry, against a real hub nats-server."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
from nats.js import JetStreamContext
from nats.js.api import StreamConfig, StreamInfo

from edge_agent.island.streams import bound_consumer
from edge_agent.protocol.names import (
    ISLAND_CONSUMER,
    command_stream,
    hub_consumer,
    island_consumer,
)
from edge_agent.protocol.reconcile import reconcile_stream
from hub_ingest.commands.send import new_envelope, send
from hub_ingest.core.errors import RegistryError
from hub_ingest.fleet.auth import (
    ensure_operator_key,
    new_seed,
    public_key,
    render_auth,
    sync_users,
    write_secret,
)
from hub_ingest.fleet.clashes import subjects_overlap
from hub_ingest.fleet.enrol import enrol, retire
from hub_ingest.fleet.provision import provision
from hub_ingest.fleet.registry import Device as Enrolled
from hub_ingest.fleet.registry import Incarnation, Registry, shard_api
from hub_ingest.fleet.reload import reload_server
from hub_ingest.fleet.requests import island_stream
from hub_ingest.fleet.streams import stream_names
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import (
    NATS_SERVER,
    Device,
    Hub,
    hub_has_reading,
    run_cli,
    start_hub,
    stream_has,
)
from tests.support.waiting import RESUME_TIMEOUT, eventually, freeze


async def _sources(hub: Hub, stream: str) -> list[dict[str, object]]:
    """The stream's sources but FLEET_REFILL (every aggregate with devices sources it)."""
    reply = await hub.nc.request(f"$JS.hub.API.STREAM.INFO.{stream}", b"", timeout=5)
    sources: list[dict[str, object]] = json.loads(reply.data)["config"].get("sources") or []
    return [s for s in sources if s["name"] != "FLEET_REFILL"]


async def _seen(hub: Hub, device_id: str, incarnation: str = "i1") -> None:
    """Record what `hub-ingest watch` would on the device's first contact, and provision."""
    registry = await Registry.open(hub.js)
    for stream in ("TELEMETRY", "EVENTS"):
        seen = Incarnation(stream, incarnation, "2026-01-01T00:00:00Z", 0)
        await registry.add_incarnation(device_id, seen)
    await provision(hub.js, hub.config, await registry.list())


async def test_provision_is_idempotent_and_listens_on_no_device_subject(hub: Hub) -> None:
    """A second run changes nothing; aggregates have no subjects, only per-device sources,
    and no de-duplication window (an older hub's is taken away)."""
    await hub.register("a")
    await _seen(hub, "a")
    registry = await Registry.open(hub.js)
    older = (await hub.js.stream_info("FLEET_EVENTS")).config
    older.duplicate_window = 120.0
    await hub.js.update_stream(older)
    mended = await provision(hub.js, hub.config, await registry.list())
    assert [(r.name, r.change, r.fields) for r in mended if r.change != "unchanged"] == [
        ("FLEET_EVENTS", "updated", ("duplicate_window",))
    ]
    again = await provision(hub.js, hub.config, await registry.list())
    assert {r.change for r in again} == {"unchanged"}
    for stream in ("FLEET_TELEMETRY", "FLEET_EVENTS"):
        info = await hub.js.stream_info(stream)
        assert not info.config.subjects and not info.config.duplicate_window
    (telemetry,) = await _sources(hub, "FLEET_TELEMETRY")
    # The aggregate sources the hub's mirror: device data crosses the link once.
    assert telemetry["name"] == "EDGE_TELEMETRY_a_i1"
    assert "external" not in telemetry
    assert telemetry["subject_transforms"] == [{"src": "tele.>", "dest": "fleet.a.tele.>"}]
    reply = await hub.nc.request("$JS.hub.API.STREAM.INFO.EDGE_TELEMETRY_a_i1", b"", timeout=5)
    config = json.loads(reply.data)["config"]
    # Read through the durable consumer of this incarnation, delivering on a subject that
    # only device a may publish to.
    assert config["mirror"]["external"]["api"] == f"{shard_api(0)}.edge-a.API"
    assert config["mirror"]["consumer"] == {
        "name": "HUB_i1",
        "deliver_subject": "hubin.a.i1.TELEMETRY",
    }
    assert config["metadata"]["incarnation"] == "i1"
    commands = await hub.js.stream_info("COMMANDS")
    assert commands.config.subjects == ["cmd.>"]
    (mine,) = await _sources(hub, "CMD_a")
    assert mine["name"] == "COMMANDS"
    assert mine["subject_transforms"] == [
        {"src": "cmd.a.>", "dest": "cmd.a.>"},
        {"src": "cmd.all.>", "dest": "cmd.all.>"},
    ]


async def test_devices_spread_over_shards_and_keep_them(tmp_path: Path) -> None:
    """With two sources per stream, a third device opens FLEET_*_2; removal frees a slot
    that the next device takes, and nobody moves."""
    hub = await start_hub(tmp_path, max_sources_per_stream=2)
    try:
        for device_id in ("a", "b", "c"):
            await hub.register(device_id)
            await _seen(hub, device_id)
        first = [s["name"] for s in await _sources(hub, "FLEET_TELEMETRY")]
        second = [s["name"] for s in await _sources(hub, "FLEET_TELEMETRY_2")]
        assert first == ["EDGE_TELEMETRY_a_i1", "EDGE_TELEMETRY_b_i1"]
        assert second == ["EDGE_TELEMETRY_c_i1"]
        assert len(await _sources(hub, "FLEET_EVENTS_2")) == 1

        registry = await Registry.open(hub.js)
        await registry.remove("c")
        await provision(hub.js, hub.config, await registry.list())
        assert await _sources(hub, "FLEET_TELEMETRY_2") == []

        await hub.register("d")
        assert (await registry.get("d")).shard == 1
        assert (await registry.get("a")).shard == 0
    finally:
        await hub.close()


async def test_registry_refuses_duplicates_and_unknown_devices(hub: Hub) -> None:
    registry = await Registry.open(hub.js)
    await registry.add("a", "edge-a", 10, "UA")
    with pytest.raises(RegistryError, match="'a' is already registered"):
        await registry.add("a", "edge-a", 10, "UB")
    with pytest.raises(RegistryError, match="domain 'edge-a' is already used by device 'a'"):
        await registry.add("b", "edge-a", 10, "UC")
    with pytest.raises(RegistryError, match="'zz' is not registered"):
        await registry.remove("zz")


async def test_device_cli_round_trip(hub: Hub, tmp_path: Path) -> None:
    """`hub-ingest device add|list|remove` through the real CLI and a TOML config."""
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")

    def cli(*args: str) -> tuple[int, str, str]:
        result = run_cli("hub_ingest", "-c", str(config), *args)
        return result.returncode, result.stdout, result.stderr

    code, out, _ = await asyncio.to_thread(cli, "device", "add", "truck-7")
    assert code == 0
    assert "added truck-7 (domain edge-truck-7, shard 0, key U" in out
    seed = Path(hub.config.state_dir) / "credentials" / "truck-7.nk"
    assert f"credentials: {seed}" in out
    assert seed.stat().st_mode & 0o777 == 0o600
    assert seed.read_text().startswith("SU")
    code, out, _ = await asyncio.to_thread(cli, "device", "list", "--json")
    assert [d["device_id"] for d in json.loads(out)] == ["truck-7"]
    await _seen(hub, "truck-7")
    assert [s["name"] for s in await _sources(hub, "FLEET_EVENTS")] == ["EDGE_EVENTS_truck-7_i1"]
    code, _, err = await asyncio.to_thread(cli, "device", "add", "truck-7")
    assert code == 1
    assert "already registered" in err
    code, _, err = await asyncio.to_thread(cli, "device", "add", "bad.id")
    assert code == 2
    assert "bad.id" in err
    code, out, _ = await asyncio.to_thread(cli, "device", "remove", "truck-7")
    assert code == 0
    assert await _sources(hub, "FLEET_EVENTS") == []
    # A users file an older release wrote (or one edited by hand) is rewritten and the hub
    # reloaded: an upgraded hub takes the permissions this release renders.
    auth = hub.config.server.auth_file
    current = auth.read_text()
    auth.write_text(current + "# edited by hand\n")
    code, out, _ = await asyncio.to_thread(cli, "provision")
    assert code == 0
    assert "COMMANDS" in out
    assert f"{auth} rewritten" in out  # a change, for Ansible's changed_when
    assert auth.read_text() == current


def _one_account(auth_text: str) -> str:
    """The users file of releases before 2026-11-28: the devices' users in the streams'
    account, with the mirrors' set-up answers (``$JSC.R.>``) and the hub's requests'
    (``_HUBINBOX.<id>.>``) theirs to publish."""
    users = [line.strip().rstrip(",") for line in auth_text.splitlines() if '"nkey"' in line]
    for i, user in enumerate(users):
        users[i] = user.replace('"_R_.>"', '"_R_.>", "$JSC.R.>", "_HUBINBOX.a.>"')
    return "accounts {{\nFLEET: {{ jetstream: enabled, users: [ {} ] }}\nSYS: {{}}\n}}\n".format(
        ",\n".join(users)
    )


async def _enrolled_by_an_older_release(hub: Hub, device_id: str) -> Registry:
    """`device_id` registered as a release before 2026-11-29 enrolled it: its island bound
    to `ISLAND`, its island's API reached under its own domain."""
    seed = new_seed()
    write_secret(hub.seed_file(device_id), seed)
    registry = await Registry.open(hub.js)
    key = public_key(seed)
    await registry.create(Enrolled(device_id, f"edge-{device_id}", 0, "2026-11-28T00:00:00Z", key))
    await sync_users(hub.js, hub.config)
    return registry


async def _bound_to(hub: Hub, account: str) -> bool:
    """Whether the hub's one leaf connection is bound to `account`."""
    leafs = (await hub.server.monitor.get("/leafz"))["leafs"] or []
    return [leaf["account"] for leaf in leafs] == [account]


async def test_an_upgraded_hub_moves_its_linked_devices_to_their_own_account(
    users_file_hub: Hub, tmp_path: Path
) -> None:
    """A hub upgraded from a release that bound the devices to the streams' account (in its
    users file) takes the new accounts at `provision`. nats-server leaves a linked device
    where it was until its link drops (a reload does not move leaf connections), and it
    carries on both ways there, then in its own account."""
    hub = users_file_hub
    await _enrolled_by_an_older_release(hub, "a")
    device = await hub.device("a", register_when_ready=True, start=False)
    auth = hub.config.server.auth_file
    auth.write_text(_one_account(auth.read_text()))
    await reload_server(hub.config)
    await device.start()
    await hub.register("a")
    await eventually(lambda: _bound_to(hub, "FLEET"), timeout=30, what="a linked to FLEET")
    await _both_ways(hub, device, "old")

    config = write_hub_toml(hub.config, tmp_path / "hub.toml")
    result = await asyncio.to_thread(run_cli, "hub_ingest", "-c", str(config), "provision")
    assert result.returncode == 0, result.stderr
    assert f"{auth} rewritten" in result.stdout
    assert await _bound_to(hub, "FLEET")
    await _both_ways(hub, device, "reloaded")

    device.proxy.cut()
    await device.wait_link(up=False)
    device.proxy.restore()
    await eventually(lambda: _bound_to(hub, "DEVICES"), timeout=30, what="a moved to DEVICES")
    await _both_ways(hub, device, "new")


async def _both_ways(
    hub: Hub, device: Device, label: str, aggregate: str = "FLEET_TELEMETRY"
) -> None:
    """A reading reaches the hub's `aggregate` and a command the island's mirror."""
    await device.js.publish(f"tele.{label}", b"1")
    await hub.js.publish(f"cmd.{device.id}.{label}", b"{}")
    await eventually(
        lambda: hub_has_reading(hub.js, device.id, f"tele.{label}", aggregate),
        timeout=RESUME_TIMEOUT,
        what=f"{device.id}'s {label} reading at the hub",
    )
    await eventually(
        lambda: stream_has(device.js, "COMMANDS", f"cmd.{device.id}.{label}"),
        timeout=RESUME_TIMEOUT,
        what=f"the {label} command on {device.id}'s island",
    )


async def _flow_control_answered(hub: Hub, device: Device, enrolled: Enrolled) -> None:
    """Both ways, the consumer a mirror binds to has all it delivered acknowledged: a mirror
    acknowledges by answering flow control, across the accounts as much as the deliveries
    (a window's worth unanswered, the link stalls)."""
    incarnation = enrolled.current("TELEMETRY")
    assert incarnation is not None
    hub_consumer_of = (hub.js, command_stream(device.id), enrolled.command_consumer)
    island_consumer_of = (device.js, "TELEMETRY", hub_consumer(incarnation.id))
    for js, stream, consumer in (hub_consumer_of, island_consumer_of):
        await eventually(
            partial(_all_acknowledged, js, stream, consumer),
            timeout=30,
            what=f"{device.id}'s {stream} acknowledged by its mirror",
        )


async def _all_acknowledged(js: JetStreamContext, stream: str, consumer: str) -> bool:
    last = (await js.stream_info(stream)).state.last_seq
    floor = (await js.consumer_info(stream, consumer)).ack_floor.stream_seq
    return last > 0 and floor == last


async def test_each_shard_links_in_an_account_of_its_own(tmp_path: Path) -> None:
    """With one device per shard, each links in its shard's account (a link connecting is
    told of its account's subscriptions only), and both carry on both ways: readings to
    their shard's aggregate, commands to their island, the hub's requests to their island."""
    hub = await start_hub(tmp_path, max_sources_per_stream=1)
    try:
        a = await hub.device("a")
        b = await hub.device("b")

        async def linked_apart() -> bool:
            leafs = (await hub.server.monitor.get("/leafz"))["leafs"] or []
            return sorted(leaf["account"] for leaf in leafs) == ["DEVICES", "DEVICES_2"]

        await eventually(linked_apart, timeout=30, what="a in DEVICES, b in DEVICES_2")
        registry = await Registry.open(hub.js)
        for device, aggregate in ((a, "FLEET_TELEMETRY"), (b, "FLEET_TELEMETRY_2")):
            await _both_ways(hub, device, "split", aggregate)
            answer = await island_stream(
                hub.nc, await registry.get(device.id), "TELEMETRY", timeout=10
            )
            assert answer is not None, f"{device.id}'s island did not answer the hub"
            assert answer["config"]["name"] == "TELEMETRY"
            enrolled = await registry.get(device.id)
            # The one its `CMD_<id>`'s metadata names, read by its agent.
            assert await bound_consumer(device.js) == island_consumer(enrolled.shard)
            await _flow_control_answered(hub, device, enrolled)
    finally:
        await hub.close()


async def test_a_device_enrolled_before_consumers_were_named_keeps_its_own(hub: Hub) -> None:
    """A device a release before 2026-11-29 enrolled has `ISLAND` in its record: its
    ``CMD_<id>`` names no consumer, its island stays bound to `ISLAND`, and its flow control
    crosses under an import of its own. Removed and enrolled again, it gets its shard's
    consumer, `ISLAND` goes (both deliver to the same subject), and its island binds again."""
    registry = await _enrolled_by_an_older_release(hub, "old")
    device = await hub.device("old", register_when_ready=True)

    await _both_ways(hub, device, "kept")
    assert await bound_consumer(device.js) == ISLAND_CONSUMER
    await _flow_control_answered(hub, device, await registry.get("old"))

    key = (await registry.get("old")).nkey
    await retire(hub.js, hub.config, "old")
    await enrol(hub.js, hub.config, "old", key=key)
    await hub.provision()
    consumers = {c.name for c in await hub.js.consumers_info(command_stream("old"))}
    assert consumers == {island_consumer(0)}
    # A link keeps the permissions it was made with: the new consumer's from the next one.
    device.proxy.cut()
    await device.wait_link(up=False)
    device.proxy.restore()
    await _both_ways(hub, device, "again")
    assert await bound_consumer(device.js) == island_consumer(0)
    await _flow_control_answered(hub, device, await registry.get("old"))


def test_a_device_brings_no_import_nor_does_an_incarnation() -> None:
    """A reload that changes an account's stream imports makes nats-server examine each of
    its subscriptions against each of them (seconds for a hub of 500 devices), and each
    import is set up again at every reload: a device's command consumer is named after its
    shard, whose import takes its flow control, its deliveries cross under its shard's, and
    its island's API under its shard's prefix, so neither a device nor a new incarnation
    brings an import. A device enrolled before (its island bound to `ISLAND`, or its API
    reached under its own domain) and a mirror made before each shard's deliveries were
    renamed keep an import of their own."""

    def enrolled(i: int, *incarnations: Incarnation) -> Enrolled:
        device = Enrolled.new(f"d{i}", f"edge-d{i}", i % 2, public_key(new_seed()))
        return replace(device, incarnations=incarnations)

    def seen(incarnation: str, via_shard: bool = True) -> Incarnation:
        return Incarnation("TELEMETRY", incarnation, "2026-11-29T00:00:00Z", 0, False, via_shard)

    def fleet_imports(fleet: list[Enrolled]) -> list[str]:
        text = render_auth(public_key(new_seed()), fleet, "hub")
        return [line.strip().rstrip(",") for line in text.splitlines() if '"DEVICES' in line]

    fleet = [enrolled(i, seen(f"i{i}")) for i in range(4)]
    before = fleet_imports(fleet)
    # Each shard's islands' APIs under its prefix, and its deliveries renamed.
    assert sum('"subject": "shardapi.' in line for line in before) == 2
    assert sum('"to": "shardin.' in line for line in before) == 2
    assert fleet_imports([*fleet, enrolled(4)]) == before
    api = '{"service": {"account": "DEVICES", "subject": "$JS.edge-d4.API.>"}}'
    older = replace(enrolled(4), island_api="")
    assert sorted(fleet_imports([*fleet, older])) == sorted([*before, api])
    oldest = replace(older, command_consumer=ISLAND_CONSUMER)
    control = '{"stream": {"account": "DEVICES", "subject": "$JS.FC.CMD_d4.ISLAND.*"}}'
    assert sorted(fleet_imports([*fleet, oldest])) == sorted([*before, api, control])
    fleet[1] = replace(fleet[1], incarnations=(seen("i1"), seen("later")))
    assert fleet_imports(fleet) == before
    fleet[2] = replace(fleet[2], incarnations=(seen("old", via_shard=False), seen("i2")))
    legacy = '{"stream": {"account": "DEVICES", "subject": "hubin.d2.>"}}'
    assert sorted(fleet_imports(fleet)) == sorted([*before, legacy])


async def test_a_key_the_hub_refuses_is_an_error_naming_it(hub: Hub, tmp_path: Path) -> None:
    """A wrong operator key fails within seconds, saying why and which file was used;
    nats-py on its own would retry the first connection for ever."""
    stranger = tmp_path / "stranger.nk"
    nats_config = replace(hub.config.nats, credentials=stranger)
    ensure_operator_key(replace(hub.config, nats=nats_config))  # a valid key the hub never saw
    config = write_hub_toml(replace(hub.config, nats=nats_config), tmp_path / "hub.toml")

    result = await asyncio.to_thread(
        run_cli, "hub_ingest", "-c", str(config), "device", "list", timeout=45
    )

    assert result.returncode == 3  # no connection to the hub, whatever the reason
    error = result.stderr.strip().splitlines()[-1]
    assert "authorization violation" in error.lower()
    assert f"nats.credentials = {stranger}" in error


def test_hub_config_errors_exit_2(tmp_path: Path) -> None:
    path = tmp_path / "hub.toml"
    path.write_text("[aggregates]\nmax_sources_per_stream = 0\n")
    result = run_cli("hub_ingest", "-c", str(path), "provision")
    assert result.returncode == 2
    assert "aggregates.max_sources_per_stream" in result.stderr


def test_render_writes_server_config_users_file_and_operator_key(tmp_path: Path) -> None:
    """First render: a config nats-server accepts, an operators-only users file and the
    operators' seed, both readable by their owner only; a second render keeps the users."""
    path = tmp_path / "hub.toml"
    path.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    first = run_cli("hub_ingest", "-c", str(path), "render-nats-config")
    assert first.returncode == 0, first.stderr
    conf = tmp_path / "state" / "nats-server.conf"
    auth = tmp_path / "state" / "auth.conf"
    seed = tmp_path / "state" / "operator.nk"
    assert first.stdout.strip() == str(conf)
    assert "operators only" in first.stderr
    for secret in (auth, seed):
        assert secret.stat().st_mode & 0o777 == 0o600
    assert public_key(seed.read_text().strip()) in auth.read_text()
    assert 'include "auth.conf"' in conf.read_text()
    check = subprocess.run(
        [NATS_SERVER, "-t", "-c", str(conf)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stderr
    auth.write_text(auth.read_text() + "# kept\n")
    again = run_cli("hub_ingest", "-c", str(path), "render-nats-config")
    assert again.returncode == 0 and "operators only" not in again.stderr
    assert auth.read_text().endswith("# kept\n")


@pytest.mark.parametrize(
    ("subjects", "clash"),
    [
        (["hubin.>"], "hubin.>"),
        (["fleet.a.tele.*"], "fleet.a.tele.*"),
        (["x", "tele.temp"], "tele.temp"),
    ],
)
async def test_a_foreign_stream_on_fleet_subjects_is_refused_and_nothing_changes(
    hub: Hub, tmp_path: Path, subjects: list[str], clash: str
) -> None:
    """`provision` and `device add` name the stream and its subject, exit 1, change nothing."""
    await hub.js.add_stream(StreamConfig(name="SNOOP", subjects=subjects))
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")
    registry = await Registry.open(hub.js)  # its stream exists before the snapshot
    before = await stream_names(hub.js)

    for args in (("provision",), ("device", "add", "z")):
        run = await asyncio.to_thread(run_cli, "hub_ingest", "-c", str(config), *args)
        assert run.returncode == 1, run.stderr
        assert f"stream SNOOP listens on {clash!r}" in run.stderr
        assert "Traceback" not in run.stderr

    assert await stream_names(hub.js) == before
    assert await registry.list() == []


async def test_a_same_named_stream_is_adopted_only_when_asked(hub: Hub, tmp_path: Path) -> None:
    """A CMD_z made by someone else is refused by `device add z`; `--adopt` takes it over."""
    await hub.js.add_stream(StreamConfig(name="CMD_z", subjects=["other.z"]))
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")

    refused = await asyncio.to_thread(
        run_cli, "hub_ingest", "-c", str(config), "device", "add", "z"
    )
    assert refused.returncode == 1
    assert "stream CMD_z exists but was not created by hub-ingest" in refused.stderr
    assert "--adopt" in refused.stderr
    assert await (await Registry.open(hub.js)).list() == []

    adopted = await asyncio.to_thread(
        run_cli, "hub_ingest", "-c", str(config), "device", "add", "z", "--adopt"
    )
    assert adopted.returncode == 0, adopted.stderr
    info = await hub.js.stream_info("CMD_z")
    assert (info.config.metadata or {}).get("managed-by") == "hub-ingest"
    assert not info.config.subjects  # now the device's slice of COMMANDS, as provisioned


async def test_provision_of_an_empty_fleet_changes_nothing_the_second_time(
    hub: Hub, tmp_path: Path
) -> None:
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")
    first = await asyncio.to_thread(run_cli, "hub_ingest", "-c", str(config), "provision")
    second = await asyncio.to_thread(run_cli, "hub_ingest", "-c", str(config), "provision")
    assert first.returncode == second.returncode == 0
    assert second.stdout.split()[1::2] == ["unchanged"] * 10, second.stdout


async def test_a_stream_made_while_provision_lists_the_streams_does_not_stall_it(
    hub: Hub, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stream made between two pages of the server's stream listing (another provisioner,
    a device's first contact) shifts the next page back by one: a name comes twice. A full
    pass must still finish (it once asked for the same page for as long as that stream
    existed)."""
    await provision(hub.js, hub.config, [])
    listed = hub.js.streams_info
    made = False

    async def listing_while_a_stream_is_made(offset: int = 0) -> list[StreamInfo]:
        nonlocal made
        page = await listed(offset=offset)
        if not made:  # sorts before every stream the first page held
            made = True
            await hub.js.add_stream(StreamConfig("AAA_MADE_MEANWHILE", subjects=["meanwhile"]))
        return page

    monkeypatch.setattr(hub.js, "streams_info", listing_while_a_stream_is_made)
    changed = await asyncio.wait_for(provision(hub.js, hub.config, []), timeout=30)
    assert made
    assert {r.change for r in changed} == {"unchanged"}


def test_subject_overlap_follows_nats_wildcards() -> None:
    assert subjects_overlap("hubin.>", "hubin.a.b")
    assert subjects_overlap("tele.*", "tele.>")
    assert subjects_overlap("*.a", "fleet.*")
    assert not subjects_overlap("tele", "tele.>")
    assert not subjects_overlap("tele.a", "tele.b")
    assert not subjects_overlap("tele.*", "tele.a.b")


async def test_a_device_enrolled_after_a_broadcast_does_not_receive_it(hub: Hub) -> None:
    """`CMD_<id>` sources `COMMANDS` from the device's enrolment on: a broadcast sent before
    it was enrolled is not its to run, one sent after is; provisioning again (also over a
    `CMD_<id>` of an earlier version, sourced from the start) copies nothing twice."""
    await hub.register("early")
    await send(hub.js, new_envelope("all", "noop", {}, ttl=3600))
    await eventually(lambda: _holds(hub, "CMD_early", 1), timeout=30, what="first broadcast")
    await hub.register("late")
    await send(hub.js, new_envelope("all", "noop", {}, ttl=3600))
    await eventually(lambda: _holds(hub, "CMD_late", 1), timeout=30, what="second broadcast")
    await eventually(lambda: _holds(hub, "CMD_early", 2), timeout=30, what="both at early")
    # A CMD_<id> made before sources started at enrolment gets the start time in place.
    old = (await hub.js.stream_info("CMD_early")).config
    assert old.sources is not None
    sources = [replace(source, opt_start_time=None) for source in old.sources]
    await hub.js.update_stream(replace(old, sources=sources))
    await hub.provision()
    await send(hub.js, new_envelope("all", "noop", {}, ttl=3600))
    await eventually(lambda: _holds(hub, "CMD_early", 3), timeout=30, what="third at early")
    await eventually(lambda: _holds(hub, "CMD_late", 2), timeout=30, what="third at late")
    for stream, count in (("CMD_early", 3), ("CMD_late", 2)):
        assert (await hub.js.stream_info(stream)).state.messages == count, stream


async def _holds(hub: Hub, stream: str, count: int) -> bool:
    return (await hub.js.stream_info(stream)).state.messages >= count


async def test_a_stream_is_reconciled_across_a_server_that_stops_answering_for_a_moment(
    hub: Hub,
) -> None:
    """A busy cluster node can leave a stream request unanswered for a while (a stream made a
    moment ago has no leader yet): reconciling asks again instead of failing `provision`."""
    want = StreamConfig(name="PAUSED", subjects=["paused.>"], metadata={"x": "1"})
    js = hub.nc.jetstream(domain=hub.config.nats.domain, timeout=0.5)
    assert hub.server.proc is not None
    pid = hub.server.proc.pid
    resumed: asyncio.TimerHandle | None = None
    try:
        await freeze(pid)
        resumed = asyncio.get_running_loop().call_later(1.2, os.kill, pid, signal.SIGCONT)
        result = await reconcile_stream(js, want)
    finally:
        if resumed is not None:
            resumed.cancel()
        os.kill(pid, signal.SIGCONT)
    assert result.change == "created"
    assert (await hub.js.stream_info("PAUSED")).config.subjects == ["paused.>"]


async def test_commands_kept_shorter_than_the_dedup_window_still_provision(hub: Hub) -> None:
    """``commands.max_age`` under ten minutes: ``COMMANDS``' duplicate window shrinks to it
    (the server refuses a window longer than the stream keeps messages)."""
    short = replace(hub.config, commands=replace(hub.config.commands, max_age=60.0))
    await provision(hub.js, short, [])
    config = (await hub.js.stream_info("COMMANDS")).config
    assert (config.max_age, config.duplicate_window) == (60.0, 60.0)
