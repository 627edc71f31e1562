"""Gaps heal themselves: what a hub mirror skipped is refilled from the island, once, and what
the island no longer holds is counted lost with its reason (`hub_ingest.fleet.refill`).

The devices here send reading by reading (`UNPACKED`): the skips are made per message on the
island's `TELEMETRY`; tests/test_pack.py heals the packed path's."""

from __future__ import annotations

import json

from nats.aio.msg import Msg
from pyspark.sql import SparkSession

from edge_agent.island.streams import bound_consumer
from edge_agent.protocol.names import ISLAND_CONSUMER
from hub_ingest.archive.audit import Gap, audit_archive, missing_range
from hub_ingest.fleet.gaps import REFILL_HEADER, MirrorGaps, healed, read_gaps, refill_of
from hub_ingest.fleet.provision import provision
from hub_ingest.fleet.registry import Registry
from hub_ingest.report.collect import collect_report
from hub_ingest.report.flags import hub_gaps
from hub_ingest.report.model import SourceState
from tests.support.cluster import UNPACKED, Device, Hub, reset_uplink
from tests.support.hubcluster import ClusterHub
from tests.support.ingest import ingest_config, run_once, telemetry
from tests.support.scan import scan
from tests.support.waiting import RESUME_TIMEOUT, eventually


async def _skip(hub: Hub, a: Device, *, floor: int = 9, before_restore: bool = False) -> str:
    """Readings 0..9 (device seqs 1..10); the hub's mirror made to skip 6..`floor - 1` the way
    nats-server does when it binds: the island consumer's floor moved past the hub's copy
    while the link was cut. With `before_restore` the link stays cut; the mirror's name."""
    for i in range(5):
        await a.js.publish("tele.temp", str(i).encode())
    mirror = await eventually(lambda: hub.mirror(a.id), timeout=30, what="the mirror")
    await eventually(lambda: _last_seq(hub, mirror, 5), timeout=RESUME_TIMEOUT, what="5 at hub")
    a.proxy.cut()
    await a.wait_link(up=False)
    for i in range(5, 10):
        await a.js.publish("tele.temp", str(i).encode())
    await reset_uplink(a, floor)
    if not before_restore:
        a.proxy.restore()
        await eventually(lambda: _last_seq(hub, mirror, 10), timeout=RESUME_TIMEOUT, what="10")
    return mirror


async def _last_seq(hub: Hub, stream: str, seq: int) -> bool:
    return (await hub.js.stream_info(stream)).state.last_seq >= seq


async def _aggregate_rows(hub: Hub) -> list[tuple[int, bytes, bool]]:
    """(device seq, payload, refilled) of device a's rows in FLEET_TELEMETRY, in order."""
    rows = []
    for msg in await scan(hub.js, "FLEET_TELEMETRY", "fleet.a.tele.>"):
        headers = msg.headers or {}
        origin = headers.get(REFILL_HEADER) or headers["Nats-Stream-Source"]
        rows.append((int(origin.split()[1]), msg.data, REFILL_HEADER in headers))
    return rows


async def _bound_as_named(device: Device) -> bool:
    return await bound_consumer(device.js) not in (None, ISLAND_CONSUMER)


async def _record(hub: Hub, mirror: str) -> MirrorGaps | None:
    return (await read_gaps(hub.js)).get(mirror)


async def test_a_mirror_skip_is_refilled_from_the_island_once(
    hub: Hub, spark: SparkSession
) -> None:
    """The hub's mirror skips 6..8 for good; within seconds the watcher reads them from the
    island into FLEET_REFILL, the aggregate gets each once (as ``fleet.a.tele.temp``), the
    archive has every reading once with its device time, and the report says refilled."""
    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    mirror = await _skip(hub, a)

    async def all_ten() -> bool:
        return len(await _aggregate_rows(hub)) >= 10

    await eventually(all_ten, timeout=30, what="the aggregate refilled")
    rows = await _aggregate_rows(hub)
    assert sorted((seq, data) for seq, data, _ in rows) == [
        (n + 1, str(n).encode()) for n in range(10)
    ]
    assert sorted(seq for seq, _, refilled in rows if refilled) == [6, 7, 8]
    record = await _record(hub, mirror)
    assert record is not None
    assert (record.refilled, record.lost, record.pending) == (3, {}, [])
    info = await hub.js.stream_info(mirror)
    assert info.state.messages == 7  # the mirror itself never gets them back

    devices = await (await Registry.open(hub.js)).list()
    report = await collect_report(hub.nc, hub.config, devices, silent_after=60)
    (device,) = report.devices
    assert device.skipped == 3 and device.gaps.refilled == 3
    assert device.flags == () and report.warnings == ()
    assert report.to_dict()["devices"][0]["gaps"]["refilled"] == 3

    config = ingest_config(hub)
    await run_once(spark, config)
    archived = telemetry(config).to_pylist()
    assert [r["device_seq"] for r in archived] == list(range(1, 11))
    assert [r["payload"] for r in archived] == [str(n).encode() for n in range(10)]
    assert all(r["device_time"] is not None and r["incarnation"] for r in archived)
    audit = audit_archive(config.ingest, await healed(hub.js))
    (tele,) = [d for d in audit.devices if d.hub_stream == "FLEET_TELEMETRY"]
    assert (tele.refilled, tele.refilled_archived, tele.duplicates) == (3, 3, 0) and audit.ok
    assert [REFILL_HEADER in dict(r["headers"]) for r in archived] == [False] * 5 + [True] * 3 + [
        False
    ] * 2


async def test_what_a_mirror_made_again_starts_above_is_refilled_from_the_island(
    hub: Hub,
) -> None:
    """The aggregate has sourced a's readings 1..5 when it stops (as when it lags), the mirror
    holds 1..10, and then the mirror is lost with its node's store and made again: it binds
    at the island consumer's floor and starts at 11, showing nothing deleted (seen on a
    cluster; here the mirror is deleted and provisioned anew over a consumer moved to 11).
    The watcher compares the aggregate's rows below the mirror's first sequence with it and
    refills 6..10 once."""
    a = await hub.device("a", sections=UNPACKED)
    for i in range(5):
        await a.js.publish("tele.temp", str(i).encode())
    mirror = await eventually(lambda: hub.mirror("a"), timeout=30, what="a's mirror")
    await eventually(lambda: _rows(hub, 5), timeout=RESUME_TIMEOUT, what="5 in the aggregate")
    aggregate = (await hub.js.stream_info("FLEET_TELEMETRY")).config
    sourced = aggregate.sources or []
    aggregate.sources = [s for s in sourced if s.name != mirror]
    await hub.js.update_stream(aggregate)
    for i in range(5, 10):
        await a.js.publish("tele.temp", str(i).encode())
    await eventually(lambda: _last_seq(hub, mirror, 10), timeout=RESUME_TIMEOUT, what="10")
    await hub.js.delete_stream(mirror)
    # As the engine did when it made a lost mirror again: it bound at the consumer's floor.
    await reset_uplink(a, 11)
    await provision(hub.js, hub.config, await (await Registry.open(hub.js)).list())
    await a.js.publish("tele.temp", b"10")

    got = await eventually(lambda: _rows(hub, 11), timeout=RESUME_TIMEOUT, what="11 at the hub")
    assert sorted((seq, refilled) for seq, _, refilled in got) == [
        (n, 6 <= n <= 10) for n in range(1, 12)
    ]
    assert (await hub.js.stream_info(mirror)).state.first_seq == 11
    record = await _record(hub, mirror)
    assert record is not None and (record.head, record.refilled, record.lost) == (11, 5, {})


async def _rows(hub: Hub, n: int) -> list[tuple[int, bytes, bool]] | None:
    got = await _aggregate_rows(hub)
    return got if len(got) >= n else None


async def test_a_skip_at_the_mirrors_tail_is_refilled_before_the_device_publishes_again(
    hub: Hub,
) -> None:
    """The island consumer's floor moves past every reading the hub lacks (6..10) and the
    device then stays quiet: the mirror receives nothing, so it shows no deleted sequence. The
    watcher compares the mirror's tail with the island's floor and refills 6..10; the next
    reading makes the mirror skip them, and nothing is refilled twice."""
    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    mirror = await _skip(hub, a, floor=11, before_restore=True)
    a.proxy.restore()

    async def rows(n: int) -> list[tuple[int, bytes, bool]] | None:
        got = await _aggregate_rows(hub)
        return got if len(got) >= n else None

    got = await eventually(lambda: rows(10), timeout=RESUME_TIMEOUT, what="the tail refilled")
    assert sorted((seq, refilled) for seq, _, refilled in got) == [(n, n > 5) for n in range(1, 11)]
    assert (await hub.js.stream_info(mirror)).state.last_seq == 5
    await a.js.publish("tele.temp", b"10")
    got = await eventually(lambda: rows(11), timeout=RESUME_TIMEOUT, what="reading 11")

    async def checked() -> MirrorGaps | None:
        record = await _record(hub, mirror)
        info = await hub.js.stream_info(mirror)
        return record if record and info.state.num_deleted == 5 else None

    record = await eventually(checked, timeout=30, what="the skip seen by the mirror")
    assert (record.refilled, record.lost, record.pending) == (5, {}, [])
    assert sorted(seq for seq, _, _ in await _aggregate_rows(hub)) == list(range(1, 12))


async def test_an_island_whose_reads_fail_holds_up_no_other_device(hub: Hub) -> None:
    """b's island answers its stream's info but serves no direct gets (as a link dropping in
    the middle of each read): its skipped 6..8 wait as pending, and a's tail skip is refilled
    all the same (one island's failing read used to end the whole round, every round)."""
    b = await hub.device("b", sections=UNPACKED)
    # Its command mirror made again bound to the consumer the hub names (at its first link)
    # makes every stream again too, which would undo the change below.
    await eventually(lambda: _bound_as_named(b), timeout=RESUME_TIMEOUT, what="b's mirror bound")
    b_mirror = await _skip(hub, b, before_restore=True)
    telemetry = (await b.js.stream_info("TELEMETRY")).config
    telemetry.allow_direct = False
    await b.js.update_stream(telemetry)
    b.proxy.restore()
    await eventually(lambda: _last_seq(hub, b_mirror, 10), timeout=RESUME_TIMEOUT, what="b's 10")

    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    await _skip(hub, a, floor=11, before_restore=True)
    a.proxy.restore()

    async def a_refilled() -> bool:
        return len(await _aggregate_rows(hub)) >= 10

    await eventually(a_refilled, timeout=RESUME_TIMEOUT, what="a's tail refilled")
    record = await _record(hub, b_mirror)
    assert record is not None and (record.refilled, record.pending) == (0, [(6, 8)]), record


async def test_what_the_island_no_longer_holds_is_lost_with_its_reason(hub: Hub) -> None:
    """Of the skipped 6..8, the island's budget took 6 and 7 (purged below 8) before the link
    came back: those are lost as ``evicted``, 8 is refilled; evictions are the budget's
    drops, so the device is not flagged."""
    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    mirror = await _skip(hub, a, before_restore=True)
    assert a.nc is not None
    reply = await a.nc.request("$JS.API.STREAM.PURGE.TELEMETRY", b'{"seq": 8}', timeout=5)
    assert json.loads(reply.data).get("success"), reply.data
    a.proxy.restore()

    async def settled() -> MirrorGaps | None:
        record = await _record(hub, mirror)
        return record if record and record.refilled == 1 else None

    record = await eventually(settled, timeout=RESUME_TIMEOUT, what="the refill")
    assert record.lost == {"evicted": [(6, 7)]} and record.pending == []

    async def resumed() -> list[int] | None:  # 9 and 10 come through the mirror, maybe later
        seqs = sorted(seq for seq, _, _ in await _aggregate_rows(hub))
        return seqs if len(seqs) >= 8 else None

    assert await eventually(resumed, timeout=RESUME_TIMEOUT, what="9, 10") == [
        1,
        2,
        3,
        4,
        5,
        8,
        9,
        10,
    ]
    devices = await (await Registry.open(hub.js)).list()
    report = await collect_report(hub.nc, hub.config, devices, silent_after=60)
    (device,) = report.devices
    assert dict(device.gaps.lost) == {"evicted": 2} and "lost" not in device.flags


async def test_what_the_mirror_lost_but_the_aggregate_kept_is_not_refilled(hub: Hub) -> None:
    """A hub power cut takes each stream's unsynced tail on its own: here the mirror loses
    sequence 3 (deleted by hand) while the aggregate had already sourced it. The refill finds
    it in the aggregate and leaves it: it is there once."""
    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    for i in range(5):
        await a.js.publish("tele.temp", str(i).encode())
    mirror = await eventually(lambda: hub.mirror("a"), timeout=30, what="a's mirror")

    async def sourced() -> bool:
        return len(await _aggregate_rows(hub)) >= 5

    await eventually(sourced, timeout=RESUME_TIMEOUT, what="5 in the aggregate")
    await hub.js.delete_msg(mirror, 3)

    async def checked() -> MirrorGaps | None:
        record = await _record(hub, mirror)
        return record if record and record.in_aggregate else None

    record = await eventually(checked, timeout=30, what="the gap checked")
    assert (record.refilled, record.kept, record.lost) == (0, [(3, 3)], {})
    assert [seq for seq, _, _ in await _aggregate_rows(hub)] == [1, 2, 3, 4, 5]


async def test_a_range_deleted_from_the_aggregate_by_hand_is_put_back_once(
    hub: Hub, spark: SparkSession
) -> None:
    """Rows of two devices are deleted from FLEET_TELEMETRY by hand before the ingest read
    them; the mirrors still hold them, so the watcher puts each back once (from the hub's
    mirror, through FLEET_REFILL) and the archive ends complete."""
    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    b = await hub.device("b", heartbeat_interval="1s", sections=UNPACKED)
    for i in range(6):
        for device in (a, b):
            await device.js.publish("tele.temp", str(i).encode())

    async def rows() -> list[Msg]:
        return await scan(hub.js, "FLEET_TELEMETRY", "fleet.*.tele.>")

    async def all_rows(n: int) -> list[Msg] | None:
        got = await rows()
        return got if len(got) >= n else None

    sourced = await eventually(lambda: all_rows(12), timeout=RESUME_TIMEOUT, what="12 rows")
    seqs = [m.metadata.sequence.stream for m in sourced]
    for seq in seqs[3:8]:  # the middle rows, of both devices
        await hub.js.delete_msg("FLEET_TELEMETRY", seq)
    for device in (a, b):  # the mirrors' next rows reach the aggregate after the deleted span
        await device.js.publish("tele.temp", b"6")

    await eventually(lambda: all_rows(14), timeout=30, what="the deleted rows put back")
    for name in ("a", "b"):
        mine = [
            int(origin.split()[1])
            for m in await rows()
            if m.subject.startswith(f"fleet.{name}.")
            for origin in [(m.headers or {}).get(REFILL_HEADER) or m.headers["Nats-Stream-Source"]]
        ]
        assert sorted(mine) == list(range(1, 8)), (name, mine)
    records = await read_gaps(hub.js)
    assert sum(r.refilled for r in records.values()) == 5
    config = ingest_config(hub)
    await run_once(spark, config)
    archived = telemetry(config).to_pylist()
    assert sorted((r["device_id"], r["device_seq"]) for r in archived) == [
        (d, n) for d in ("a", "b") for n in range(1, 8)
    ]
    assert audit_archive(config.ingest, await healed(hub.js)).ok


async def test_a_gap_waits_for_the_island_and_is_refilled_when_it_links(hub: Hub) -> None:
    """The mirror skipped while the watcher was down, and the link is cut again before it
    came back: the gap is pending, with its age, in the record and the report; once the link
    returns it is refilled."""
    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    await eventually(lambda: hub.mirror("a"), timeout=30, what="a's mirror")
    await hub.look_away()
    mirror = await _skip(hub, a)
    a.proxy.cut()
    await a.wait_link(up=False)
    hub.start_watch()

    async def pending() -> MirrorGaps | None:
        record = await _record(hub, mirror)
        return record if record and record.pending else None

    record = await eventually(pending, timeout=30, what="the gap pending")
    assert record.pending == [(6, 8)] and record.pending_since
    devices = await (await Registry.open(hub.js)).list()
    report = await collect_report(hub.nc, hub.config, devices, silent_after=60)
    (device,) = report.devices
    assert device.gaps.pending == 3 and device.gaps.pending_age_s is not None
    assert "gap_pending" in device.flags and "hub_gap" not in device.flags

    a.proxy.restore()

    async def refilled() -> MirrorGaps | None:
        record = await _record(hub, mirror)
        return record if record and record.refilled == 3 and not record.pending else None

    await eventually(refilled, timeout=RESUME_TIMEOUT, what="the gap refilled")
    assert sorted(seq for seq, _, _ in await _aggregate_rows(hub)) == list(range(1, 11))


async def test_on_a_cluster_a_new_mirror_leader_above_its_copy_is_refilled_once(
    cluster_hub: ClusterHub,
) -> None:
    """Three nodes, one watcher each (three refillers racing): the mirror's leader is
    SIGKILLed and, before a new one binds, the island consumer is moved to sequence 9 while
    6..10 are stored. The mirror skips 6..8; they are refilled exactly once (FLEET_REFILL's
    one subject per sequence), and reach the R3 aggregate once."""
    hub = cluster_hub
    a = await hub.device("a", heartbeat_interval="1s", sections=UNPACKED)
    for i in range(5):
        await a.js.publish("tele.temp", str(i).encode())
    mirror = await eventually(lambda: hub.mirror("a"), timeout=60, what="a's mirror")
    await eventually(lambda: _last_seq(hub, mirror, 5), timeout=RESUME_TIMEOUT, what="5 at hub")
    cluster = (await hub.js.stream_info(mirror)).cluster
    assert cluster is not None and cluster.leader is not None
    await hub.kill(cluster.leader)
    await reset_uplink(a, 9)
    for i in range(5, 10):
        await a.js.publish("tele.temp", str(i).encode())
    await hub.start(cluster.leader)

    async def all_ten() -> bool:
        return len(await _aggregate_rows(hub)) >= 10

    await eventually(all_ten, timeout=RESUME_TIMEOUT, what="the aggregate refilled")
    rows = await _aggregate_rows(hub)
    assert sorted(seq for seq, _, _ in rows) == list(range(1, 11))
    assert sorted(seq for seq, _, refilled in rows if refilled) == [6, 7, 8]
    refills = await scan(hub.js, "FLEET_REFILL", "refill.>")
    assert len(refills) == 3


def test_a_refill_header_counts_only_on_rows_sourced_from_the_refill_stream() -> None:
    """The refill's own rows are sourced from FLEET_REFILL; an app on a device can set the
    header on its messages, which its mirror keeps: there it names nothing (else a device
    could make the refill take a skipped reading of its own for one the aggregate holds)."""
    said = "EDGE_TELEMETRY_a_i1 7 tele.x 2026-01-01T00:00:00Z"
    assert refill_of({REFILL_HEADER: said, "Nats-Stream-Source": "FLEET_REFILL 3 x y z"}) == said
    assert refill_of({REFILL_HEADER: said, "Nats-Stream-Source": "FLEET_REFILL:ab12 3"}) == said
    assert refill_of({REFILL_HEADER: said, "Nats-Stream-Source": "EDGE_TELEMETRY_a_i1 9"}) is None
    assert refill_of({REFILL_HEADER: said}) is None


def test_skips_the_refill_has_looked_at_are_not_flagged() -> None:
    """A hub gap is flagged only for skips beyond the device's drops and what the refill has
    accounted for (refilled, kept by the aggregate, lost, pending)."""
    sources = [SourceState("FLEET_TELEMETRY", "TELEMETRY", True, 0, 0.0, None, 5)]
    assert hub_gaps(sources, None) == {"TELEMETRY": (5, 0)}
    assert hub_gaps(sources, None, {"TELEMETRY": 5}) == {}
    assert hub_gaps(sources, None, {"TELEMETRY": 4}) == {"TELEMETRY": (1, 0)}


def test_a_missing_range_the_refill_counted_lost_is_explained_with_its_reason() -> None:
    lost = {"evicted": [(6, 7)], "reimaged": [(20, 30)]}
    assert missing_range(6, 7, 0, lost) == Gap(6, 7, True, "evicted")
    assert missing_range(21, 22, 0, lost) == Gap(21, 22, True, "reimaged")
    assert missing_range(6, 8, 0, lost) == Gap(6, 8, False)
    assert missing_range(6, 8, 9, lost) == Gap(6, 8, True, "dropped")
