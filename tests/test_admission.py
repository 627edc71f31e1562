"""Devices admitted by the hub's auth callout (``server.admission = "callout"``, the
default): enrolment without a reload, and nobody let in the users file would have kept out."""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import nkeys
import pytest
import structlog

from edge_agent.island.server import read_seed
from edge_agent.status.health import TURNED_AWAY_S, collect_status, render_status
from hub_ingest.core.buckets import LINKS, bucket_stream, bucket_values
from hub_ingest.core.errors import ConfigError
from hub_ingest.fleet.admission import (
    REFRESH_S,
    Admission,
    claims_of,
    granted,
    issuer_key,
    sign,
)
from hub_ingest.fleet.admission_figures import (
    STALE_S,
    WRITE_S,
    AdmissionFigures,
    figure_warnings,
    read_figures,
)
from hub_ingest.fleet.auth import new_seed, public_key, render_auth, write_auth
from hub_ingest.fleet.cutoff import KEPT, Links
from hub_ingest.fleet.enrol import retire
from hub_ingest.fleet.registry import Device, Incarnation, Registry
from hub_ingest.fleet.server import render_server_config
from hub_ingest.fleet.shared_keys import (
    QUICK_S,
    REPLACED,
    SHARED_AT,
    WINDOW_S,
    SharedKeys,
    linked_twice,
    look_of,
    replaced_leaf,
)
from hub_ingest.local.fleet import loopback_hub_config
from hub_ingest.report.collect import collect_report
from tests.support.cluster import Hub, hub_has_reading, signs_in, stream_has
from tests.support.waiting import RESUME_TIMEOUT, eventually

RELOADED = "Reloaded server configuration"


def _reloads(hub: Hub) -> int:
    return hub.server.log_path.read_text(errors="replace").count(RELOADED)


async def test_a_device_links_without_a_reload_and_a_stranger_or_a_retired_one_does_not(
    hub: Hub,
) -> None:
    server_conf = hub.config.server.config_file.read_text()
    assert f"issuer: {issuer_key(hub.config)}" in server_conf
    before = _reloads(hub)

    a = await hub.device("a")  # the hub's first: its shard's account was made with the hub's
    b = await hub.device("b")

    assert _reloads(hub) == before
    await b.js.publish("tele.admitted", b"1")
    await hub.js.publish("cmd.b.admitted", b"{}")
    await eventually(
        lambda: hub_has_reading(hub.js, "b", "tele.admitted"),
        timeout=RESUME_TIMEOUT,
        what="b's reading at the hub",
    )
    await eventually(
        lambda: stream_has(b.js, "COMMANDS", "cmd.b.admitted"),
        timeout=RESUME_TIMEOUT,
        what="b's command on its island",
    )
    assert not await signs_in(hub.url, new_seed())
    b_seed = read_seed(hub.seed_file("b"))
    assert await signs_in(hub.url, b_seed)

    a_link = await a.link_id()

    await retire(hub.js, hub.config, "b")

    async def refused() -> bool:
        return not await signs_in(hub.url, b_seed)

    # The watcher reads the registry every REFRESH_S: a removed key is let in no longer, and
    # the link it let in is cut (nats-server would keep it up for its life).
    await eventually(refused, timeout=3 * REFRESH_S, what="b's key refused once removed")
    await b.wait_link(up=False, timeout=10 * REFRESH_S)
    assert await a.link_id() == a_link  # nobody else's link was cut


async def _links_saved(hub: Hub, *devices: Device) -> bool:
    saved = await bucket_values(hub.js, LINKS)
    return all(d.nkey in saved for d in devices)


async def test_a_watcher_started_since_cuts_a_link_it_did_not_let_in(hub: Hub) -> None:
    """The watchers keep the links they let in in ``FLEET_LINKS``: one killed and started
    again (or another node's) cuts a removed device's link within seconds, not at the end of
    the link's life (a day by default)."""
    a = await hub.device("a")
    b = await hub.device("b")
    a_link = await a.link_id()
    registry = await Registry.open(hub.js)
    devices = [await registry.get(d) for d in ("a", "b")]
    await eventually(lambda: _links_saved(hub, *devices), timeout=10, what="links saved")
    for watcher in hub.watchers:  # killed, not stopped: nothing more is written
        watcher.cancel()
    await asyncio.gather(*hub.watchers, return_exceptions=True)
    hub.watchers.clear()
    hub.start_watch()

    await retire(hub.js, hub.config, "b")

    await b.wait_link(up=False, timeout=10 * REFRESH_S)
    assert await a.link_id() == a_link  # a's link is let be
    await eventually(
        lambda: _links_saved(hub, devices[0]), timeout=10, what="a's links still saved"
    )
    assert devices[1].nkey not in await bucket_values(hub.js, LINKS)  # b's went with it


async def test_a_link_signs_in_again_within_its_life(hub: Hub) -> None:
    """A link lives `server.link_life` at most (from half of it on), then signs in again: a
    device removed while no watcher knew its link (its record lost, as when a watcher is
    killed in the second after it let the link in) is cut off then at the latest, and a
    registered one links again and its readings flow."""
    life = 10.0
    hub.config = replace(hub.config, server=replace(hub.config.server, link_life=life))
    await hub.stop_watching()
    hub.start_watch()
    a = await hub.device("a")
    b = await hub.device("b")
    a_link = await a.link_id()
    await hub.stop_watching()
    await hub.js.purge_stream(bucket_stream(LINKS))
    hub.start_watch()  # a watcher that knows neither link

    await retire(hub.js, hub.config, "b")

    await b.wait_link(up=False, timeout=3 * life)

    async def signed_in_again() -> bool:
        return await a.link_id() not in (None, a_link)

    await eventually(signed_in_again, timeout=3 * life, what="a signed in again")
    await a.js.publish("tele.after", b"1")
    await eventually(
        lambda: hub_has_reading(hub.js, "a", "tele.after"),
        timeout=RESUME_TIMEOUT,
        what="a's reading at the hub",
    )


async def test_a_device_turned_away_is_told_from_one_with_no_network(hub: Hub) -> None:
    """With its link down, ``edge-agent status`` asks whether the hub answers: a device whose
    key was removed sees it answer and, after `TURNED_AWAY_S`, a problem saying it is turned
    away; one whose network is gone (its link proxy cut) sees no answer and no such problem."""
    a = await hub.device("a")
    b = await hub.device("b")
    a.proxy.cut()
    await retire(hub.js, hub.config, "b")
    await a.wait_link(up=False)
    await b.wait_link(up=False, timeout=10 * REFRESH_S)

    offline = await collect_status(a.config, ask_hub=True)
    assert offline.hub is not None and not offline.hub.answered, offline.hub
    refused = await collect_status(b.config, ask_hub=True)
    assert refused.hub is not None and refused.hub.answered, refused.hub
    assert refused.hub.server == hub.config.server.server_name
    assert refused.to_dict()["hub"]["answered"] is True

    async def turned_away() -> bool:
        status = await collect_status(b.config, ask_hub=True)
        return any("the hub refuses this device" in p for p in status.problems)

    await eventually(turned_away, timeout=TURNED_AWAY_S + 30, what="b told it is turned away")
    offline = await collect_status(a.config, ask_hub=True)
    assert not any("refuses" in p for p in offline.problems), offline.problems
    assert "no answer" in render_status(offline)


async def test_a_key_refused_again_and_again_is_logged_once(hub: Hub) -> None:
    """A device with a wrong key asks again every second for as long as nobody looks: each
    refusal is counted, its reason logged once (then once a minute, with how many were not)."""
    stranger = new_seed()
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            assert not await signs_in(hub.url, stranger)
    refused = [e for e in logs if e["event"] == "connection_refused"]
    assert len(refused) == 1, refused
    assert public_key(stranger) in refused[0]["reason"] and refused[0]["not_logged_since"] == 0


async def test_a_registered_key_is_refused_unless_it_signed_this_nonce(hub: Hub) -> None:
    await hub.register("a")
    keys = nkeys.from_seed(bytearray(read_seed(hub.seed_file("a")).encode()))
    admission = Admission(hub.js, hub.config)
    await admission.refresh()

    def request(nonce: str, signed: str, key: str = keys.public_key.decode()) -> dict[str, Any]:
        sig = base64.urlsafe_b64encode(keys.sign(signed.encode())).rstrip(b"=").decode()
        return {"connect_opts": {"nkey": key, "sig": sig}, "client_info": {"nonce": nonce}}

    admitted = admission.decide(request("n0nce", "n0nce"))
    assert admitted.device is not None and admitted.device.device_id == "a"
    replayed = admission.decide(request("fresh", "n0nce"))
    assert replayed.device is None and "did not sign" in replayed.reason
    borrowed = admission.decide(request("n0nce", "n0nce", public_key(new_seed())))
    assert borrowed.device is None and "did not sign" in borrowed.reason
    assert (admission.decide({"connect_opts": {"user": "a"}})).device is None


def test_the_users_file_changes_only_when_a_shard_fills(tmp_path: Path) -> None:
    """Under the callout it names no device, and the account of the shard after the last."""
    config = loopback_hub_config(tmp_path, admission="callout", max_sources_per_stream=2)
    devices = [Device.new(f"d{i}", f"edge-d{i}", i // 2, public_key(new_seed())) for i in range(3)]
    assert write_auth(config, devices[:1]).changed
    assert not write_auth(config, devices[:2]).changed  # the first shard's second device
    text = config.server.auth_file.read_text()
    assert not any(d.nkey in text for d in devices)
    assert "  DEVICES_2: {" in text and "  DEVICES_3: {" not in text
    assert write_auth(config, devices).new_accounts  # the second shard opened the third's
    assert "  DEVICES_2: {" not in render_auth(public_key(new_seed()), devices[:2], "hub")


def test_a_users_file_the_server_would_read_without_the_callout_keeps_its_devices(
    tmp_path: Path,
) -> None:
    """A hub switched to the callout in hub.toml whose server config was not rendered again:
    a users file without the devices would lock them out at their next link. Refused, naming
    the file, and the users file stays as it was until the config asks the callout."""
    plain = loopback_hub_config(tmp_path, admission="users_file")
    callout = replace(plain, server=replace(plain.server, admission="callout"))
    devices = [Device.new("d0", "edge-d0", 0, public_key(new_seed()))]
    write_auth(plain, devices)
    plain.server.config_file.write_text(render_server_config(plain))
    before = plain.server.auth_file.read_text()

    with pytest.raises(ConfigError, match=str(plain.server.config_file)):
        write_auth(callout, devices)

    assert plain.server.auth_file.read_text() == before
    callout.server.config_file.write_text(render_server_config(callout))
    assert write_auth(callout, devices).changed
    assert devices[0].nkey not in callout.server.auth_file.read_text()


def test_an_answer_is_a_jwt_the_issuer_signed() -> None:
    keys = nkeys.from_seed(bytearray(nkeys.encode_seed(bytes(32), nkeys.PREFIX_BYTE_ACCOUNT)))
    token = sign(keys, {"sub": "U", "nats": {"type": "user"}})
    head, body, sig = token.split(".")
    assert claims_of(token)["iss"] == keys.public_key.decode()
    assert keys.verify(f"{head}.{body}".encode(), base64.urlsafe_b64decode(sig + "=="))


def test_a_link_is_marked_for_cutting_when_its_device_is_removed_or_granted_otherwise() -> None:
    """Which links the watcher has closed: a removed device's and one whose record now grants
    other permissions (another shard); not one whose record only gained an incarnation."""
    a, b, c = (Device.new(i, f"edge-{i}", 0, public_key(new_seed())) for i in "abc")
    links = Links(lambda d: granted(d, "hub"))
    for cid, device in enumerate((a, b, c)):
        links.admitted("server-1", cid, device.nkey, device)
    seen = Incarnation("TELEMETRY", "inc-1", "2026-12-01T00:00:00Z", 0)

    links.check({a.nkey: replace(a, incarnations=(seen,)), c.nkey: replace(c, shard=1)})

    assert {(cid, reason) for (_, cid), (_, reason) in links.to_cut.items()} == {
        (1, "removed"),
        (2, "changed"),
    }
    links.to_cut.clear()
    links.check({a.nkey: a})  # what b and c had is forgotten with their cut
    assert links.to_cut == {}


def test_links_read_back_are_cut_as_the_links_a_watcher_let_in() -> None:
    """A watcher that reads the links others let in (`Links.restore`) cuts a removed
    device's and one granted otherwise, lets one granted the same be, and keeps the newest."""
    a, b, c = (Device.new(i, f"edge-{i}", 0, public_key(new_seed())) for i in "abc")
    before = Links(lambda d: granted(d, "hub"))
    for cid, device in enumerate((a, b, c, a, a, a, a)):
        before.admitted("server-1", cid, device.nkey, device)
    saved = {d.nkey: before.saved(d.nkey) for d in (a, b, c)}
    assert len(json.loads(saved[a.nkey])) == KEPT
    after = Links(lambda d: granted(d, "hub"))
    after.admitted("server-2", 0, a.nkey, a)  # a signed in again since
    for key, value in saved.items():
        after.restore(key, value)

    after.check({a.nkey: a, c.nkey: replace(c, shard=1)})

    assert {(where, reason) for where, (_, reason) in after.to_cut.items()} == {
        (("server-1", 1), "removed"),
        (("server-1", 2), "changed"),
    }
    assert [link["server"] for link in json.loads(after.saved(a.nkey))] == ["server-1"] * (
        KEPT - 1
    ) + ["server-2"]
    assert after.saved(b.nkey) == b"" and after.unsaved >= {b.nkey, c.nkey}

    after.restore(c.nkey, b'{"not": "a list of links"}')  # written by something else
    after.restore(c.nkey, b"[1]")
    assert after.saved(c.nkey) == b""


async def test_the_report_shows_what_the_watchers_refused(hub: Hub) -> None:
    """A refused connection is a device whose data does not arrive: `report --json` has each
    watcher's figures and warns of the reasons seen lately."""
    await hub.device("a")
    stranger = new_seed()
    assert not await signs_in(hub.url, stranger)

    async def figures() -> list[AdmissionFigures]:
        found = await read_figures(hub.js)
        return found if found and found[0].refused and found[0].admitted else []

    (written,) = await eventually(figures, timeout=3 * WRITE_S, what="figures with a refusal")
    devices = await (await Registry.open(hub.js)).list()
    report = (await collect_report(hub.nc, hub.config, devices, silent_after=60)).to_dict()
    (shown,) = report["admission"]
    assert shown["node"] == written.node and shown["refused"] >= 1 and shown["admitted"] >= 1
    refusal = f"key {public_key(stranger)} is not registered"
    assert any(refusal in w for w in report["warnings"]), report["warnings"]


async def test_a_device_key_on_two_machines_is_flagged_and_held_off(hub: Hub) -> None:
    """A disk copied from an enrolled device onto a second machine: both islands link with
    the device's key and server name, nats-server keeps one link a name, and each pushes the
    other off. The watcher sees the device let in again and again: `report` flags it
    (``key_shared``) and names it, and both machines are refused for
    ``server.shared_key_hold``. The copy stopped, what the device took meanwhile reaches the
    hub once the hold ends; a device that linked once is not flagged."""
    hold = 30.0
    hub.config = replace(hub.config, server=replace(hub.config.server, shared_key_hold=hold))
    await hub.stop_watching()
    hub.start_watch()
    a = await hub.device("a")
    await hub.device("b")
    await a.stop()
    copy = await hub.copy_of(a)
    await a.start()

    async def flagged() -> dict[str, Any] | None:
        devices = await (await Registry.open(hub.js)).list()
        report = (await collect_report(hub.nc, hub.config, devices, silent_after=60)).to_dict()
        flags = {d["device_id"]: d["flags"] for d in report["devices"]}
        return report if "key_shared" in flags["a"] else None

    report = await eventually(
        flagged, timeout=WINDOW_S + 3 * WRITE_S, what="a flagged as on two machines"
    )
    (b,) = [d for d in report["devices"] if d["device_id"] == "b"]
    assert "key_shared" not in b["flags"]
    assert any("device a: its key links from two machines" in w for w in report["warnings"])
    assert report["admission"][0]["shared"]["a"]["count"] >= 1

    await copy.stop()  # what an operator does first
    for _ in range(10):  # alone now, and still held off: its link stays down
        assert not await a.link_up()
        await asyncio.sleep(0.5)
    await a.js.publish("tele.while_held", b"1")
    await eventually(
        lambda: hub_has_reading(hub.js, "a", "tele.while_held"),
        timeout=hold + RESUME_TIMEOUT,
        what="a's reading at the hub after the hold",
    )
    devices = await (await Registry.open(hub.js)).list()
    report = (await collect_report(hub.nc, hub.config, devices, silent_after=60)).to_dict()
    held = "device a's key is in use on two machines"
    assert any(held in w for w in report["warnings"]), report["warnings"]


def test_a_key_is_shared_when_its_links_keep_replacing_each_other() -> None:
    """Quick links (each within `QUICK_S` of the one before), `SHARED_AT` of them within
    `WINDOW_S` make a suspect; a restart's few redials, or links seconds apart, do not.
    Only links closed as replaced confirm it."""
    keys = SharedKeys(hold=0.0)
    assert not any(keys.admitted("storm", t * 0.5) for t in range(5))
    assert not any(keys.admitted("apart", t * (QUICK_S + 1)) for t in range(3 * SHARED_AT))
    seen = [keys.admitted("copied", t * 1.0) for t in range(SHARED_AT + 1)]
    assert seen[-1] and not any(seen[:-1])
    slow = [keys.admitted("slow", t * QUICK_S) for t in range(3 * SHARED_AT)]
    assert not any(slow)  # a quick link each 5 s: fewer than `SHARED_AT` in `WINDOW_S`

    assert not keys.hold("copied", 30.0) and not keys.held("copied", 30.0)  # 0: never held
    held = SharedKeys(hold=600.0)
    assert held.hold("copied", 30.0)
    assert held.held("copied", 629.0) and not held.held("copied", 630.0)

    def event(reason: str, kind: str = "Leafnode") -> dict[str, Any]:
        return {"client": {"kind": kind, "name": "edge-a"}, "reason": reason}

    assert replaced_leaf(event(REPLACED)) == "edge-a"
    assert replaced_leaf(event("Client Closed")) is None  # a link that dropped
    assert replaced_leaf(event(REPLACED, kind="Client")) is None


def test_a_name_is_linked_twice_when_both_its_links_carried_messages_since_the_last_look() -> None:
    def answer(server: str, *leafs: tuple[str, int, int]) -> dict[str, Any]:
        listed = [{"name": name, "id": cid, "in_msgs": n} for name, cid, n in leafs]
        return {"server": {"name": server}, "data": {"leafs": listed}}

    before = look_of([answer("hub-1", ("copied", 7, 10), ("moved", 8, 50)), answer("hub-2")])
    now = look_of(
        [
            answer("hub-1", ("copied", 7, 12), ("moved", 8, 50)),  # moved's machine went away
            answer("hub-2", ("copied", 3, 4), ("moved", 9, 2), ("copied", 5, 1)),
        ]
    )
    assert linked_twice(before, now) == set()  # the links on hub-2 are new: not yet compared
    later = look_of(
        [
            answer("hub-1", ("copied", 7, 14), ("moved", 8, 50)),
            answer("hub-2", ("copied", 3, 6), ("moved", 9, 4)),
        ]
    )
    assert linked_twice(now, later) == {"copied"}


def test_a_watcher_that_stopped_writing_or_never_did_is_warned_of() -> None:
    now = datetime.now(UTC)
    old = (now - timedelta(seconds=2 * STALE_S)).isoformat()
    stale = AdmissionFigures("hub-2", old, old, 5, 0, 0, {})
    (warning,) = figure_warnings([stale], now)
    assert "hub-ingest watch on node hub-2" in warning
    assert "no hub-ingest watch" in figure_warnings([], now)[0]
