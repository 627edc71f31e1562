"""`make demo` as a user runs it: the README's first command, end to end (a hub, three devices
and their links on loopback, an outage, commands, the ingest and the audit). It once failed
for days unnoticed: it counted messages at the hub after devices began to pack their
readings."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent

pytestmark = [pytest.mark.slow, pytest.mark.spark]


@pytest.mark.timeout(600)
async def test_make_demo_passes_every_check(tmp_path: Path) -> None:
    """`bench/demo.py` (what `make demo` runs) from a directory of its own: exit 0, every
    check passed, and nothing of its fleet left running."""
    demo = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, str(ROOT / "bench/demo.py")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    out = demo.stdout
    assert demo.returncode == 0, out[-3000:] + demo.stderr[-3000:]
    assert "FAIL" not in out, out
    assert "demo passed" in out, out
    assert out.count("every reading at the hub once, in order") == 3, out
