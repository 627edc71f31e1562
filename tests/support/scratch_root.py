"""Scratch roots for ``systemd-analyze --root``: systemd's own units, plus what a test adds;
and the units installed in one, run as systemd would run them where systemd is not PID 1."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERIFY_UNIT = REPO / "systemd/verify-unit"
UNITS = (
    "edge-nats.service",
    "edge-agent.service",
    "edge-agent-update.service",
    "edge-agent-update.path",
    "hub-nats.service",
    "hub-ingest.service",
    "hub-ingest.timer",
    "hub-ingest-watch.service",
)
SYSTEM_UNITS = Path("/usr/lib/systemd/system")


def scratch_root(root: Path) -> Path:
    """`root` with a copy of the host's system units (targets units depend on) and a /tmp."""
    shutil.copytree(SYSTEM_UNITS, root / SYSTEM_UNITS.relative_to("/"), symlinks=True)
    for sub in ("tmp", "etc/systemd/system"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return root


def stub_executables(root: Path, units: Iterable[Path]) -> None:
    """An executable under `root` for every command the units run (verify checks they exist)."""
    for unit in units:
        for command in re.findall(r"^Exec\w+=[-@:+!]*(/\S+)", unit.read_text(), re.MULTILINE):
            stub = root / command.lstrip("/")
            stub.parent.mkdir(parents=True, exist_ok=True)
            stub.write_text("#!/bin/sh\n")
            stub.chmod(0o755)


@dataclass(frozen=True, slots=True)
class ServiceCommands:
    """What systemd would run for an installed service, with its paths under a scratch root."""

    env: dict[str, str]
    runtime_dirs: tuple[Path, ...]
    start_pre: tuple[tuple[str, ...], ...]
    start: tuple[str, ...]


def service_commands(root: Path, unit: str) -> ServiceCommands:
    """The [Service] commands of `unit` as installed under `root`, read the way systemd reads
    them: ``Environment=`` and ``EnvironmentFile=`` (``-``: optional) applied, ``%t`` the
    system manager's /run, a ``$VAR`` word split into zero or more words. Every absolute path
    (the unit's /opt, /etc, /run, and those in its environment) is moved under `root`."""
    settings: list[tuple[str, str]] = []
    section = ""
    for line in (root / "etc/systemd/system" / unit).read_text().splitlines():
        if line.startswith("["):
            section = line
        elif section == "[Service]" and line and not line.startswith("#"):
            key, _, value = line.partition("=")
            settings.append((key, value.replace("%t", "/run")))

    def rebase(word: str) -> str:
        return str(root / word.lstrip("/")) if word.startswith("/") else word

    env: dict[str, str] = {}
    for key, value in settings:
        if key == "Environment":
            name, _, val = value.partition("=")
            env[name] = rebase(val)
        elif key == "EnvironmentFile":
            path = Path(rebase(value.removeprefix("-")))
            if path.exists() or not value.startswith("-"):
                for line in path.read_text().splitlines():
                    if line.strip() and not line.startswith("#"):
                        name, _, val = line.partition("=")
                        env[name.strip()] = val.strip().strip('"')

    def argv(line: str) -> tuple[str, ...]:
        words: list[str] = []
        for word in line.split():
            if word.startswith("$"):
                words.extend(env.get(word[1:], "").split())
            else:
                words.append(rebase(word))
        return tuple(words)

    return ServiceCommands(
        env=env,
        runtime_dirs=tuple(root / "run" / v for k, v in settings if k == "RuntimeDirectory"),
        start_pre=tuple(argv(v) for k, v in settings if k == "ExecStartPre"),
        start=argv(next(v for k, v in settings if k == "ExecStart")),
    )


@asynccontextmanager
async def running_service(root: Path, unit: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """Run `unit` under `root` as systemd would start it (`service_commands`): create its
    runtime directories, run each ``ExecStartPre`` to success, then ``ExecStart``, logging to
    ``<root>/<unit>.log``; SIGTERM when done (a test does not wait out a lame-duck stop)."""
    commands = service_commands(root, unit)
    env = {**os.environ, **commands.env}
    for directory in commands.runtime_dirs:
        directory.mkdir(parents=True, exist_ok=True)
    for pre in commands.start_pre:
        done = subprocess.run(
            pre, env=env, capture_output=True, text=True, timeout=120, check=False
        )
        assert done.returncode == 0, f"{unit}: {' '.join(pre)} failed:\n{done.stderr}"
    with (root / f"{unit}.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            *commands.start, env=env, stdout=log, stderr=subprocess.STDOUT
        )
        try:
            yield proc
        finally:
            if proc.returncode is None:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 60)
