"""Scratch roots for ``systemd-analyze --root``: systemd's own units, plus what a test adds."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VERIFY_UNIT = REPO / "systemd/verify-unit"
UNITS = (
    "edge-nats.service",
    "edge-agent.service",
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
