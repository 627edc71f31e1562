"""The files of an update on the device, in ``<state_dir>/updates``, and their contents.

``<version>.part`` and ``<version>.progress.json`` while a bundle downloads; ``<version>.bundle``
once it matches its signed record; ``staged.json`` (the installer's input) and
``result.json`` (its output); ``state.json``, the last state the agent reported per version.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class UpdatePaths:
    root: Path  # <state_dir>/updates

    def part(self, version: str) -> Path:
        return self.root / f"{version}.part"

    def progress(self, version: str) -> Path:
        return self.root / f"{version}.progress.json"

    def bundle(self, version: str) -> Path:
        return self.root / f"{version}.bundle"

    @property
    def staged(self) -> Path:
        return self.root / "staged.json"

    @property
    def result(self) -> Path:
        return self.root / "result.json"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def lock(self) -> Path:
        return self.root / "install.lock"


@dataclass(frozen=True, slots=True)
class Progress:
    """How far a download got: everything before `next_seq` is in the .part file."""

    nuid: str
    next_seq: int  # the object store stream sequence to ask from
    received: int  # bytes in the .part file
    fetched: int  # bytes taken from the link for this version, over every attempt


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the installer did with a staged version (``result.json``)."""

    version: str
    state: str  # an UpdateState
    reason: str = ""
    previous: str = ""  # the release it replaced (or went back to)


def running_file(state_dir: Path) -> Path:
    """Written by the agent when it is ready: its version and pid, for the health gate, which
    must see the new release's agent running, not only a healthy island."""
    return state_dir / "agent.json"
