"""Files that survive a power cut whole: the old content or the new, never a torn mix."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def write_durably(path: Path, text: str, *, mode: int = 0o644) -> Path:
    """Replace `path` with `text`: written to a temporary file (created with `mode`, so a
    secret is never briefly readable by others), fsynced, renamed over `path`, and the
    directory fsynced so that the rename itself is on disk. A crash at any point leaves the
    old file or the new one; without the fsyncs a power cut can leave an empty file behind
    the new name (ext4's delayed allocation does exactly that)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.fchmod(fd, mode)  # an older tmp file kept its own mode
        os.write(fd, text.encode("utf-8"))
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)
    fsync(path.parent)
    return path


def fsync(path: Path) -> None:
    """fsync a file, or a directory (which makes the names in it durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Mapping[str, Any], *, durable: bool = True) -> None:
    """`data` as the JSON file `path`, replaced whole; `durable` as `write_durably`, else
    only atomically (for state a power cut may take back, written by several processes)."""
    if durable:
        write_durably(path, json.dumps(data, sort_keys=True))
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    tmp.replace(path)


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`; None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
