"""The test's side of the power-cut filesystem (`tests.support.powerfs`): `PowerCut` mounts
it in its own process, cuts the power (freezes every process using the mount, drops the
unsynced pages, SIGKILLs them) and turns it back on."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def users(mount: Path) -> list[int]:
    """Processes (other than this one) with a file or directory under `mount` open."""
    prefix = str(mount).rstrip("/") + "/"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            links = [os.readlink(f"/proc/{entry}/cwd")]
            links += [
                os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")
            ]
        except OSError:
            continue  # gone, or a kernel thread
        if any(link == str(mount) or link.startswith(prefix) for link in links):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Cut:
    killed: list[int]
    dropped_bytes: int
    torn_bytes: int


class PowerCut:
    """A `PowerFS` mounted at `mount` over `backing`, for one test."""

    def __init__(self, backing: Path, mount: Path) -> None:
        self.backing, self.mount = backing, mount
        self.socket = str(mount.parent / f".{mount.name}.powerfs.sock")
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20) -> PowerCut:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        if os.path.exists(self.socket):
            os.unlink(self.socket)
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.support.powerfs",
                str(self.backing),
                str(self.mount),
                self.socket,
            ],
            cwd=Path(__file__).resolve().parents[2],
        )
        deadline = time.monotonic() + timeout
        while not (os.path.ismount(self.mount) and os.path.exists(self.socket)):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"powerfs did not mount {self.mount}")
            time.sleep(0.02)
        return self

    def _ask(self, **ask: object) -> dict[str, int]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket)
            conn.sendall((json.dumps(ask) + "\n").encode())
            reply: dict[str, int] = json.loads(conn.makefile().readline())
            return reply

    def stats(self) -> dict[str, int]:
        return self._ask(op="stats")

    def cut(self, *, torn: bool = False, seed: int = 0, timeout: float = 20) -> Cut:
        """Lose power: freeze every process using the mount, drop what it had not synced, kill
        them, and power on again (the processes stay dead: the caller restarts them)."""
        killed = users(self.mount)
        for pid in killed:
            os.kill(pid, signal.SIGSTOP)
        lost = self._ask(op="cut", torn=torn, seed=seed)
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while any(_alive(pid) for pid in killed):
            if time.monotonic() > deadline:
                raise RuntimeError(f"processes {killed} outlived a power cut")
            time.sleep(0.01)
        self._ask(op="on")
        return Cut(killed, lost["dropped_bytes"], lost["torn_bytes"])

    def stop(self) -> None:
        for pid in users(self.mount):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(
            ["fusermount3", "-u", "-z", str(self.mount)], check=False, capture_output=True
        )
        if self.process is not None:
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
