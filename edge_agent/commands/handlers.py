"""Command handlers: a registry from command type to an async function.

A handler gets a `HandlerContext` and the command's ``args`` and returns the result's
``output`` (anything JSON can hold). It raises `CommandRefused` for arguments it will not act
on (a ``rejected`` result naming the argument) and `CommandFailed` when it ran and failed (an
``error`` result). The executor applies the timeout; handlers need not.
"""

from __future__ import annotations

import asyncio
import os
import shlex
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from edge_agent.core.config import Config
from edge_agent.core.errors import CommandFailed, CommandRefused
from edge_agent.protocol.units import utc_now_iso

# systemd's variables are for the agent alone: a program started by `exec` must not be able
# to report READY or feed the watchdog on the agent's behalf.
_PRIVATE_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


@dataclass(frozen=True, slots=True)
class HandlerContext:
    config: Config
    command_id: str
    request_restart: Callable[[], None]


Handler = Callable[[HandlerContext, Mapping[str, Any]], Awaitable[Any]]


async def ping(ctx: HandlerContext, args: Mapping[str, Any]) -> Any:
    return {"pong": True, "device_id": ctx.config.device_id, "time": utc_now_iso()}


async def config_get(ctx: HandlerContext, args: Mapping[str, Any]) -> Any:
    """The agent's configuration, or one value of it with ``key`` (``island.domain``)."""
    value: Any = asdict(ctx.config)
    key = args.get("key")
    if key is None:
        return value
    if not isinstance(key, str) or not key:
        raise CommandRefused("args.key", f"expected a dotted config key, got {key!r}")
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise CommandRefused("args.key", f"no config key {key!r}")
        value = value[part]
    return value


def exec_allowed(argv: list[str], allow: tuple[tuple[str, ...], ...]) -> bool:
    """Whether `argv` is an allow-list entry, or extends one that ends in ``"*"``."""
    for entry in allow:
        if entry[-1] == "*":
            if len(argv) >= len(entry) - 1 and tuple(argv[: len(entry) - 1]) == entry[:-1]:
                return True
        elif tuple(argv) == entry:
            return True
    return False


def _argv(value: object) -> list[str]:
    if isinstance(value, str):
        # Split like a shell would tokenise, but nothing is ever handed to a shell.
        try:
            argv = shlex.split(value)
        except ValueError as exc:
            raise CommandRefused("args.argv", f"cannot split {value!r}: {exc}") from None
    elif isinstance(value, list) and all(isinstance(a, str) for a in value):
        argv = list(value)
    else:
        raise CommandRefused("args.argv", f"expected a list of strings or a string, got {value!r}")
    if not argv:
        raise CommandRefused("args.argv", "empty")
    return argv


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Up to `cap` bytes of `stream`; the rest is read and dropped so the program never blocks."""
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if len(chunk) > room:
            truncated = True
        kept += chunk[: max(room, 0)]
    return bytes(kept), truncated


async def exec_argv(ctx: HandlerContext, args: Mapping[str, Any]) -> Any:
    """Run an allow-listed program directly (never through a shell), output capped."""
    argv = _argv(args.get("argv"))
    commands = ctx.config.commands
    if not exec_allowed(argv, commands.exec_allow):
        raise CommandRefused("args.argv", f"{argv!r} is not on commands.exec_allow")
    env = {k: v for k, v in os.environ.items() if k not in _PRIVATE_ENV}
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
    except OSError as exc:
        raise CommandFailed(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
    try:
        assert proc.stdout is not None
        data, truncated = await _read_capped(proc.stdout, commands.exec_max_output)
        code = await proc.wait()
    finally:
        if proc.returncode is None:  # timed out or the agent is stopping
            proc.kill()
            await proc.wait()
    output = {"exit_code": code, "output": data.decode(errors="replace"), "truncated": truncated}
    if code != 0:
        raise CommandFailed(f"{argv[0]} exited with code {code}", output)
    return output


async def agent_restart(ctx: HandlerContext, args: Mapping[str, Any]) -> Any:
    """Restart the agent once this command's result is recorded (the island stays up)."""
    ctx.request_restart()
    return {"restarting": True}


def builtin_handlers() -> dict[str, Handler]:
    return {
        "ping": ping,
        "config.get": config_get,
        "exec": exec_argv,
        "agent.restart": agent_restart,
    }
