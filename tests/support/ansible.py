"""Running this repository's playbooks for real with ``-c local``, and reading their recap."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.scratch_root import REPO

ANSIBLE = REPO / "ansible"
BIN = Path(sys.executable).parent


def playbook(name: str, inventory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """`ansible-playbook -i inventory name *extra` from ansible/, with this venv's tools."""
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
        "ANSIBLE_CONFIG": str(ANSIBLE / "ansible.cfg"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_LOCALHOST_WARNING": "0",
    }
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inventory), name, *extra],
        capture_output=True,
        text=True,
        cwd=ANSIBLE,
        env=env,
        timeout=900,
        check=False,
    )


def recap(output: str) -> dict[str, dict[str, int]]:
    """Per host counters from the PLAY RECAP."""
    tail = output.rpartition("PLAY RECAP")[2]
    return {
        m.group(1): {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(2))}
        for m in re.finditer(r"^(\S+)\s+: (.*)$", tail, re.MULTILINE)
    }
