"""A device's credentials grant nothing over another device's commands or data.

The attacker holds device a's seed and runs a leaf node of their own, without the deny lists
the agent renders, so everything here is refused by the hub's permissions alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, ExternalStream, StreamConfig, StreamSource
from nats.js.errors import NotFoundError, ServiceUnavailableError

from edge_agent.island import read_seed
from edge_agent.naming import inbox_prefix
from tests.support.cluster import Device, Hub, NatsServer, free_port, stream_messages
from tests.support.waiting import eventually

# Refused requests never reach a responder: nats-py says "no responders" or times out.
REFUSED = (
    nats.errors.NoRespondersError,
    nats.errors.TimeoutError,
    TimeoutError,
    ServiceUnavailableError,
)


@pytest.fixture
async def rogue(hub: Hub, tmp_path: Path) -> AsyncIterator[Client]:
    """A client on a leaf node that signs in to the hub with device a's key."""
    await hub.device("a")
    port, monitor = free_port(), free_port()
    conf = tmp_path / "rogue.conf"
    conf.write_text(
        f"""server_name: rogue
listen: "127.0.0.1:{port}"
http: "127.0.0.1:{monitor}"
jetstream {{ domain: rogue, store_dir: "{tmp_path / "rogue"}", max_file_store: 64MiB }}
leafnodes {{ remotes: [ {{ urls: ["nats-leaf://127.0.0.1:{hub.leaf_port}"],
  nkey: "{read_seed(hub.seed_file("a"))}" }} ] }}
"""
    )
    server = await NatsServer(conf, f"http://127.0.0.1:{monitor}").start()
    await eventually(server.monitor.leaf_connected, timeout=30, what="rogue leaf connected")
    # Replies come back only on the prefix a's key may subscribe to, as the agent's do.
    nc = await nats.connect(f"nats://127.0.0.1:{port}", inbox_prefix=inbox_prefix("a"))
    try:
        yield nc
    finally:
        await nc.close()
        await server.stop()


async def _sync(rogue: Client) -> None:
    """A round trip a's key is allowed: everything sent before it has reached the hub."""
    with contextlib.suppress(NotFoundError):  # an answer, even "no message", is the point
        await rogue.jetstream(domain="hub", timeout=5).get_msg("CMD_a", 1, direct=True)


async def test_a_cannot_read_b_commands_or_fleet_data(hub: Hub, rogue: Client) -> None:
    """Direct gets, consumers and stream info on B's or the fleet's streams are refused."""
    b = await hub.device("b")
    await hub.js.publish("cmd.b.secret", b"{}")
    await hub.js.publish("cmd.a.mine", b"{}")
    await eventually(lambda: _has(b, "cmd.b.secret"), timeout=30, what="b has its command")
    await b.js.publish("tele.temp", b"b-reading")
    await eventually(lambda: _fleet_has(hub, "fleet.b.tele.temp"), timeout=60)
    hub_js = rogue.jetstream(domain="hub", timeout=2)
    b_mirror = await hub.mirror("b")

    attempts: dict[str, Callable[[], Awaitable[object]]] = {
        "direct get CMD_b": lambda: hub_js.get_msg("CMD_b", 1, direct=True),
        "get CMD_b": lambda: hub_js.get_msg("CMD_b", 1),
        "direct get COMMANDS": lambda: hub_js.get_msg("COMMANDS", 1, direct=True),
        "consumer on COMMANDS": lambda: hub_js.add_consumer(
            "COMMANDS", ConsumerConfig(filter_subject="cmd.b.>")
        ),
        "consumer on CMD_b": lambda: hub_js.add_consumer("CMD_b", ConsumerConfig()),
        "info FLEET_TELEMETRY": lambda: hub_js.stream_info("FLEET_TELEMETRY"),
        "direct get FLEET_TELEMETRY": lambda: hub_js.get_msg("FLEET_TELEMETRY", 1, direct=True),
        "direct get b's mirror": lambda: hub_js.get_msg(b_mirror, 1, direct=True),
    }
    for what, attempt in attempts.items():
        with pytest.raises(REFUSED):
            await attempt()
            pytest.fail(f"{what} was allowed")

    # The same connection and key still read a's own commands: the refusals above are
    # the hub's permissions, not a broken link.
    mine = await hub_js.get_msg("CMD_a", 1, subject="cmd.a.mine", next=True, direct=True)
    assert mine.subject == "cmd.a.mine"


async def test_a_cannot_mirror_b_commands_or_publish_commands(hub: Hub, rogue: Client) -> None:
    """A mirror of cmd.b.> stays empty while the same mirror of a's own stream fills; cmd.>
    publishes vanish."""
    b = await hub.device("b")
    island = rogue.jetstream()
    for name, origin, only in (("STOLEN", "COMMANDS", "cmd.b.>"), ("OWN", "CMD_a", None)):
        await island.add_stream(
            StreamConfig(
                name=name,
                mirror=StreamSource(
                    name=origin,
                    filter_subject=only,
                    external=ExternalStream(api="$JS.hub.API", deliver="devin.a"),
                ),
            )
        )
    await hub.js.publish("cmd.b.ping", b"{}")
    await hub.js.publish("cmd.a.ping", b"{}")
    await eventually(lambda: _has(b, "cmd.b.ping"), timeout=30, what="b's mirror has it")
    await eventually(
        lambda: _count(island, "OWN", 1), timeout=60, what="the rogue's mirror of CMD_a"
    )

    before = (await hub.js.stream_info("COMMANDS")).state.messages
    await rogue.publish("cmd.b.reboot", b'{"id": "forged"}')
    await rogue.publish("cmd.all.reboot", b'{"id": "forged"}')
    await _sync(rogue)
    assert (await hub.js.stream_info("COMMANDS")).state.messages == before
    assert (await island.stream_info("STOLEN")).state.messages == 0


async def _count(js: JetStreamContext, stream: str, expected: int) -> bool:
    return (await js.stream_info(stream)).state.messages == expected


async def _has(device: Device, subject: str) -> bool:
    return subject in [m.subject for m in await stream_messages(device.js, "COMMANDS")]


async def _fleet_has(hub: Hub, subject: str) -> bool:
    try:
        await hub.js.get_msg("FLEET_TELEMETRY", subject=subject, direct=True)
    except NotFoundError:
        return False
    return True
