"""Commands end to end: hub → mirror or fast resume → executor → outbox → FLEET_EVENTS."""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nats.js import JetStreamContext

from edge_agent.commands.handlers import HandlerContext, builtin_handlers
from edge_agent.island.streams import bound_consumer
from edge_agent.protocol.names import ISLAND_CONSUMER, island_consumer
from edge_agent.status.health import collect_status
from hub_ingest.local.fleet import write_hub_toml
from tests.support.cluster import (
    Device,
    Hub,
    mirror_live,
    mirror_silent_for,
    run_cli,
    stream_messages,
)
from tests.support.commands import counter_program, results, runs, send_command
from tests.support.waiting import RESUME_TIMEOUT, eventually

MIRROR_STALLED_S = 12  # past this, nats-server 2.15 resumes the mirror 10-40 s after restore


async def _result(device: Device, key: str, timeout: float = 30) -> dict[str, Any]:
    async def probe() -> dict[str, Any] | None:
        return (await results(device.js, "EVENTS")).get(key)

    return await eventually(probe, timeout=timeout, what=f"result {key} on {device.id}")


async def _hub_cli(hub: Hub, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``hub-ingest`` in a thread: the in-process agents must keep running meanwhile."""
    config = write_hub_toml(hub.config, tmp_path / "hub.toml")
    return await asyncio.to_thread(run_cli, "hub_ingest", "-c", str(config), *args)


async def test_command_issued_offline_runs_once_after_link_returns(
    hub: Hub, tmp_path: Path
) -> None:
    """Issued during a long cut, the command runs once (fast resume, then the mirror's copy is
    skipped), and ``command status`` at the hub shows its result."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    a = await hub.device(
        "a", sections={"commands": {"exec_allow": [[*counter, "*"]]}}, register_when_ready=True
    )
    await eventually(
        lambda: mirror_live(a.js, "COMMANDS"), timeout=RESUME_TIMEOUT, what="mirror in contact"
    )
    a.proxy.cut()
    await a.wait_link(up=False)
    sent = await _hub_cli(
        hub,
        tmp_path,
        "command",
        "send",
        "--device",
        "a",
        "exec",
        "--arg",
        f"argv={json.dumps([*counter, str(ran), '0'])}",
    )
    assert sent.returncode == 0, sent.stderr
    command_id = sent.stdout.strip()
    await eventually(
        lambda: mirror_silent_for(a.js, "COMMANDS", MIRROR_STALLED_S),
        timeout=60,
        what="a long outage",
    )
    assert runs(ran) == 0
    a.proxy.restore()

    async def status_ok() -> dict[str, Any] | None:
        out = await _hub_cli(hub, tmp_path, "command", "status", command_id, "--json")
        body: dict[str, Any] = json.loads(out.stdout)
        ok = body["devices"]["a"]["status"] == "ok"
        assert out.returncode == (0 if ok else 1), out.stderr  # as `send --wait` exits
        return body if ok else None

    status = await eventually(status_ok, timeout=60, interval=0.5, what="ok at the hub")
    assert status["devices"]["a"]["result"]["output"]["output"] == "done\n"
    # The stalled mirror catches up later; its copy of the command must not run again.
    await eventually(
        lambda: _mirror_has(a, command_id), timeout=90, what="the mirror's copy of the command"
    )
    await eventually(lambda: _ledger_idle(a), timeout=30, what="mirror copy consumed")
    assert runs(ran) == 1
    local = await collect_status(a.config)
    assert local.commands is not None and local.commands.executed == 1


async def _mirror_has(device: Device, command_id: str) -> bool:
    msgs = await stream_messages(device.js, "COMMANDS")
    return any((m.headers or {}).get("Nats-Msg-Id") == command_id for m in msgs)


async def _ledger_idle(device: Device) -> bool:
    info = await device.js.consumer_info("COMMANDS", "edge-agent")
    return info.num_pending == 0 and info.num_ack_pending == 0


async def test_bad_commands_are_answered_and_the_executor_keeps_serving(hub: Hub) -> None:
    """Expired, malformed, unknown-type, oversized and wrong-device commands each get a
    result naming the reason; a good command after them still runs."""
    a = await hub.device("a", sections={"commands": {"max_payload": 2048}})
    now = datetime.now(UTC)

    def env(**fields: Any) -> bytes:
        body = {"id": "x", "type": "ping", "args": {}, "issued_at": now.isoformat()}
        return json.dumps({**body, **fields}).encode()

    past = (now - timedelta(minutes=1)).isoformat()
    cases = [
        ("cmd.a.ping", env(id="expired", expires_at=past), "expired", "expires_at: expired at"),
        ("cmd.a.ping", b"{not json", "rejected", "payload: not JSON"),
        ("cmd.a.ping", env(id="args", args=[1]), "rejected", "args: expected an object"),
        ("cmd.a.ping", env(id=17), "rejected", "id: expected"),
        ("cmd.a.ping", json.dumps({"type": "ping"}).encode(), "rejected", "id: missing"),
        ("cmd.a.when", env(id="when", type="when", issued_at=5), "rejected", "issued_at:"),
        ("cmd.a.reboot", env(id="unknown", type="reboot"), "rejected", "unknown command type"),
        ("cmd.a.ping", env(id="big", args={"pad": "x" * 4000}), "rejected", "max_payload"),
        ("cmd.a.ping", env(id="other", device_id="b"), "rejected", "device_id: command for 'b'"),
        ("cmd.a.ping", env(id="mismatch", type="exec"), "rejected", "does not match"),
    ]
    seqs = [(await hub.js.publish(subject, data)).seq for subject, data, _, _ in cases]
    good = await send_command(hub, "a", "ping")

    result = await _result(a, good.id)
    assert result["status"] == "ok" and result["output"]["pong"] is True
    answered = await results(a.js, "EVENTS")
    for (_, _, status, reason), seq in zip(cases, seqs, strict=True):
        match = [r for r in answered.values() if r["seq"] == seq]
        assert len(match) == 1, (seq, reason)
        assert match[0]["status"] == status and reason in match[0]["error"], match[0]
    assert len(answered) == len(cases) + 1
    local = await collect_status(a.config)
    assert local.commands is not None
    assert (local.commands.rejected, local.commands.expired, local.commands.executed) == (9, 1, 1)
    assert local.commands.last_seq == max(seqs) + 1


async def test_exec_refuses_argv_off_the_allow_list_and_never_uses_a_shell(
    hub: Hub, tmp_path: Path
) -> None:
    """Only allow-listed argv runs, directly: shell syntax reaches the program as plain text."""
    marker = tmp_path / "pwned"
    a = await hub.device(
        "a",
        sections={"commands": {"exec_allow": [["echo", "*"]], "exec_max_output": 200}},
    )
    refused = await send_command(hub, "a", "exec", {"argv": ["sh", "-c", f"touch {marker}"]})
    literal = await send_command(hub, "a", "exec", {"argv": f"echo $HOME; touch {marker}"})
    capped = await send_command(hub, "a", "exec", {"argv": ["echo", "y" * 500]})
    prefix = await send_command(hub, "a", "exec", {"argv": ["/bin/echo", "hi"]})

    result = await _result(a, refused.id)
    assert result["status"] == "rejected"
    assert "args.argv" in result["error"] and "exec_allow" in result["error"]
    result = await _result(a, literal.id)
    assert result["status"] == "ok"
    assert result["output"]["output"] == f"$HOME; touch {marker}\n"
    result = await _result(a, capped.id)
    assert result["output"]["truncated"] is True and len(result["output"]["output"]) == 200
    assert (await _result(a, prefix.id))["status"] == "rejected"
    assert not marker.exists()


async def test_handler_that_raises_or_hangs_yields_an_error_result(hub: Hub) -> None:
    """A raising handler and one past its timeout each end in an error; the next runs."""

    async def boom(ctx: HandlerContext, args: Mapping[str, Any]) -> Any:
        raise RuntimeError("boom")

    async def hang(ctx: HandlerContext, args: Mapping[str, Any]) -> Any:
        await asyncio.Event().wait()

    handlers = {**builtin_handlers(), "boom": boom, "hang": hang}
    a = await hub.device("a", sections={"commands": {"handler_timeout": "0.5s"}}, handlers=handlers)
    raising = await send_command(hub, "a", "boom")
    hanging = await send_command(hub, "a", "hang")
    after = await send_command(hub, "a", "config.get", {"key": "island.domain"})

    assert (await _result(a, raising.id))["error"] == "RuntimeError: boom"
    assert (await _result(a, hanging.id))["error"] == "timed out after 0.5s"
    result = await _result(a, after.id)
    assert result["status"] == "ok" and result["output"] == "edge-a"


async def test_send_wait_prints_results_from_every_device(hub: Hub, tmp_path: Path) -> None:
    """``command send --all --wait`` prints each device's result; ``status`` agrees, with the
    same exit code (0 only when every device answered ok)."""
    await hub.device("a", register_when_ready=True)
    await hub.device("b", register_when_ready=True)
    sent = await _hub_cli(hub, tmp_path, "command", "send", "--all", "ping", "--wait", "60")
    assert sent.returncode == 0, sent.stdout + sent.stderr
    command_id, *lines = sent.stdout.splitlines()
    assert sorted(line.split()[:2] for line in lines) == [["a", "ok"], ["b", "ok"]]
    status = await _hub_cli(hub, tmp_path, "command", "status", command_id, "--json")
    body = json.loads(status.stdout)
    assert {d: v["status"] for d, v in body["devices"].items()} == {"a": "ok", "b": "ok"}

    failing = await _hub_cli(
        hub,
        tmp_path,
        "command",
        "send",
        "--device",
        "a",
        "exec",
        "--arg",
        'argv=["rm", "-rf", "/"]',
        "--wait",
        "60",
    )
    assert failing.returncode == 1
    assert "rejected" in failing.stdout
    same = await _hub_cli(hub, tmp_path, "command", "status", failing.stdout.split()[0])
    assert same.returncode == 1 and "rejected" in same.stdout  # the same exit rule


async def test_a_command_stream_made_again_at_the_hub_still_reaches_the_device(
    hub: Hub, tmp_path: Path
) -> None:
    """``CMD_a`` deleted and made again by ``provision`` (as after a hub node lost its disk)
    once ``COMMANDS`` has dropped older commands: the new stream numbers what is left from 1,
    below what the island's mirror has seen, so the mirror would ignore the next commands.
    The agent notices when its link comes up, makes its mirror again, and the next command
    runs; none of the earlier ones runs twice."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    a = await hub.device(
        "a", sections={"commands": {"exec_allow": [[*counter, "*"]]}}, register_when_ready=True
    )

    async def run_one() -> None:
        argv = [*counter, str(ran), "0"]
        envelope = await send_command(hub, "a", "exec", {"argv": argv})
        await _result(a, envelope.id)

    for _ in range(3):
        await run_one()
    await hub.js.purge_stream("COMMANDS")  # as if the first three had expired
    await run_one()  # the only command `CMD_a` made again will hold, at its sequence 1
    # Its result does not say the mirror has it: fast resume may have read it first.
    await eventually(lambda: _last_seq(a.js, "COMMANDS", 4), timeout=30, what="mirror at 4")
    await hub.js.delete_stream("CMD_a")
    await hub.register("a")
    await eventually(lambda: _last_seq(hub.js, "CMD_a", 1), timeout=30, what="CMD_a refilled")
    assert a.agent is not None
    a.proxy.cut()
    await asyncio.wait_for(a.agent.link.is_down.wait(), 30)  # the agent saw it go
    a.proxy.restore()
    await run_one()  # `CMD_a`'s sequence 2: invisible to the old mirror, whose last is 4
    assert runs(ran) == 5
    # The mirror made again holds what CMD_a holds, and hands none of it to run a second time.
    await eventually(lambda: _last_seq(a.js, "COMMANDS", 2), timeout=60, what="mirror made again")
    await eventually(lambda: _ledger_idle(a), timeout=30, what="the new mirror consumed")
    assert runs(ran) == 5


async def test_an_island_made_offline_binds_to_its_consumer_when_it_links(
    hub: Hub, tmp_path: Path
) -> None:
    """An island made while its link is down cannot ask which consumer on ``CMD_<id>`` to
    bind to: its mirror binds to `ISLAND`, which a device enrolled now does not have. When
    the link comes up the agent makes it again bound to its shard's; a command sent while
    it was offline runs once and reaches the mirror, and so does the next."""
    counter = counter_program(tmp_path)
    ran = tmp_path / "runs"
    sections = {"commands": {"exec_allow": [[*counter, "*"]]}}
    a = await hub.device("a", sections=sections, start=False, register_when_ready=True)
    a.proxy.cut()
    await a.start()
    assert await bound_consumer(a.js) == ISLAND_CONSUMER
    offline = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "0"]})

    a.proxy.restore()
    await hub.register("a")
    await _result(a, offline.id, timeout=RESUME_TIMEOUT)
    linked = await send_command(hub, "a", "exec", {"argv": [*counter, str(ran), "0"]})
    await _result(a, linked.id)
    await eventually(lambda: _last_seq(a.js, "COMMANDS", 2), timeout=30, what="mirror at 2")
    assert await bound_consumer(a.js) == island_consumer(0)
    await eventually(lambda: _ledger_idle(a), timeout=30, what="the mirror consumed")
    assert runs(ran) == 2


async def _last_seq(js: JetStreamContext, stream: str, seq: int) -> bool:
    return (await js.stream_info(stream)).state.last_seq == seq
