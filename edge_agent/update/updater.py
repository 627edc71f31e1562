"""The agent's side of a rollout: while the link is up, read the release the hub wants this
device to run (``desired.<id>``), and if it is another one, fetch its signed record and its
bundle, check both, stage it for the installer (`edge_agent.update.install`) and report each
step as an ``evt.<id>.update`` event through the outbox, so the hub hears of it even when the
link drops in between. Nothing unsigned, signed by another key or altered is staged: it is
refused, reported, and not tried again until the hub wants another version.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from typing import Any

import nats.errors
import structlog
from nats.aio.client import Client

from edge_agent import __version__
from edge_agent.core.config import Config
from edge_agent.core.errors import StateDBBusy
from edge_agent.island.link import LinkTracker
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.files import read_json, write_json
from edge_agent.protocol.release import (
    ROLLOUT_BUCKET,
    ReleaseRecord,
    ReleaseRejected,
    UpdateState,
    desired_key,
    read_manifest,
    release_key,
    update_subject,
    verify_record,
)
from edge_agent.protocol.units import utc_now_iso
from edge_agent.update.download import REQUEST_TIMEOUT_S, HubReadUnavailable, download
from edge_agent.update.paths import Progress, UpdatePaths

log = structlog.get_logger(__name__)

PROGRESS_EVERY_S = 10.0  # a "downloading" event at most this often
# A version in one of these states is not tried again until the hub wants another.
SETTLED = (UpdateState.REFUSED, UpdateState.FAILED, UpdateState.ROLLED_BACK)
_TRANSIENT = (nats.errors.Error, TimeoutError, HubReadUnavailable, StateDBBusy)


def update_paths(config: Config) -> UpdatePaths:
    return UpdatePaths(config.agent.state_dir / "updates")


def update_report(config: Config) -> dict[str, Any]:
    """``edge-agent update status``: the running release, the staged one, and the last state
    reported for each release the hub asked for (refusals and rollbacks among them)."""
    paths = update_paths(config)
    return {
        "running": __version__,
        "enabled": config.update.enabled,
        "staged": (read_json(paths.staged) or {}).get("version"),
        "versions": read_json(paths.state) or {},
    }


class Updater:
    def __init__(self, config: Config, nc: Client, link: LinkTracker, outbox: Outbox) -> None:
        self._config = config
        self._nc = nc
        self._link = link
        self._outbox = outbox
        self._paths = update_paths(config)
        self._progress_at = 0.0
        self._fetched: Progress | None = None  # the last chunk's progress

    async def run(self) -> None:
        self._paths.root.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(StateDBBusy):  # kept in result.json for the next step
            await self._report_outcome()
        if self._paths.staged.exists():  # staged before a crash or a power cut
            self._start_installer()
        while True:
            await self._link.is_up.wait()
            try:
                await self.step()
            except _TRANSIENT as exc:
                log.info("update_check_failed", error=repr(exc))
            except (OSError, ValueError) as exc:  # a full disk, a malformed file: never fatal
                log.warning("update_step_failed", error=repr(exc))
            await asyncio.sleep(self._config.update.check_interval)

    async def step(self) -> None:
        await self._report_outcome()
        desired = await self._get(desired_key(self._config.device_id))
        if desired is None:
            return
        version = desired.decode(errors="replace")
        if version == __version__:
            await self._report(version, UpdateState.HEALTHY, once=True)
            return
        if self._state(version) in SETTLED or self._paths.staged.exists():
            return
        try:
            record = await self._record(version)
            verify_record(record, self._config.update.operator_key)
            bundle = await download(
                self._nc,
                self._config.hub.api_prefix,
                self._paths,
                record,
                max_rate=self._config.update.max_rate,
                on_progress=lambda progress: self._downloading(record, progress),
            )
            if (manifest := read_manifest(bundle)).version != version:
                raise ReleaseRejected(f"the bundle of {version} says it is {manifest.version}")
        except ReleaseRejected as exc:
            log.error("update_refused", version=version, reason=str(exc))
            for path in (self._paths.part, self._paths.progress, self._paths.bundle):
                path(version).unlink(missing_ok=True)
            await self._report(version, UpdateState.REFUSED, reason=str(exc))
            return
        if await self._get(desired_key(self._config.device_id)) != desired:
            return  # the rollout was aborted or moved on while the bundle came
        write_json(self._paths.staged, {"version": version, "record": json.loads(record.to_json())})
        fetched = self._fetched.fetched if self._fetched else 0
        await self._report(version, UpdateState.STAGED, size=record.size, fetched=fetched)
        if self._config.update.installer == "spawn":
            self._start_installer()

    async def _get(self, key: str) -> bytes | None:
        """A value of the hub's rollout bucket (direct get through the leaf); None if absent."""
        stream = f"KV_{ROLLOUT_BUCKET}"
        subject = f"{self._config.hub.api_prefix}.DIRECT.GET.{stream}.$KV.{ROLLOUT_BUCKET}.{key}"
        reply = await self._nc.request(subject, b"", timeout=REQUEST_TIMEOUT_S)
        headers = reply.headers or {}
        if headers.get("Status") == "404" or headers.get("KV-Operation") in ("DEL", "PURGE"):
            return None
        if headers.get("Status"):
            raise HubReadUnavailable(f"{key}: status {headers.get('Status')}")
        return reply.data

    async def _record(self, version: str) -> ReleaseRecord:
        try:
            key = release_key(version)
        except ValueError as exc:
            raise ReleaseRejected(f"the hub wants release {version!r}: {exc}") from None
        data = await self._get(key)
        if data is None:
            raise ReleaseRejected(f"release {version} has no record on the hub")
        return ReleaseRecord.from_json(data)

    async def _downloading(self, record: ReleaseRecord, progress: Progress) -> None:
        self._fetched = progress
        if time.monotonic() - self._progress_at >= PROGRESS_EVERY_S:
            self._progress_at = time.monotonic()
            await self._report(
                record.version,
                UpdateState.DOWNLOADING,
                bytes=progress.received,
                fetched=progress.fetched,
                size=record.size,
            )

    async def _report_outcome(self) -> None:
        """Report what the installer did (``result.json``), once."""
        outcome = read_json(self._paths.result)
        if outcome is None:
            return
        try:
            version, state = str(outcome["version"]), UpdateState(outcome["state"])
        except (KeyError, ValueError):
            log.warning("update_outcome_unreadable", outcome=outcome)
        else:
            await self._report(version, state, reason=outcome.get("reason", ""), once=True)
        self._paths.result.unlink(missing_ok=True)

    def _state(self, version: str) -> str | None:
        entry = (read_json(self._paths.state) or {}).get(version)
        return entry.get("state") if isinstance(entry, dict) else None

    async def _report(
        self, version: str, state: UpdateState, *, once: bool = False, **extra: Any
    ) -> None:
        if once and self._state(version) == state:
            return
        body = {
            "device_id": self._config.device_id,
            "version": version,
            "state": state.value,
            "running": __version__,
            "at": utc_now_iso(),
            **extra,
        }
        # The state first: the hub may hear of the report before this function returns.
        states = read_json(self._paths.state) or {}
        # Merged: the figures of earlier steps (bytes fetched) stay beside the last state.
        kept = {k: v for k, v in states.get(version, {}).items() if k != "reason"}
        states[version] = {**kept, "state": state.value, "at": body["at"], **extra}
        write_json(self._paths.state, states)
        await self._outbox.append(update_subject(self._config.device_id), json.dumps(body).encode())
        log.info("update_reported", version=version, state=state.value)

    def _start_installer(self) -> None:
        """``edge-agent update install`` in its own session: it outlives the agent it restarts."""
        if self._config.update.installer != "spawn":
            return
        config = self._config.source
        # -I: this release's own code, never a checkout in the working directory.
        argv = [sys.executable, "-I", "-m", "edge_agent", "-c", str(config), "update", "install"]
        log_path = self._paths.root / "install.log"
        with log_path.open("ab") as out:
            subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        log.info("update_installer_started", log=str(log_path))
