"""The device-hub contract lives in one place: `hub_ingest` imports the agent only through
`edge_agent.protocol`, and the protocol imports nothing else of the agent."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.scratch_root import REPO


def _imports(package: Path) -> dict[str, set[str]]:
    """Module file → every module it imports (``from x import y`` counts as ``x``)."""
    found: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(REPO))] = names
    return found


def _agent_modules(names: set[str]) -> set[str]:
    return {n for n in names if n == "edge_agent" or n.startswith("edge_agent.")}


def test_the_hub_imports_the_agent_only_through_the_protocol() -> None:
    leaks = {
        module: sorted(n for n in _agent_modules(names) if not n.startswith("edge_agent.protocol"))
        for module, names in _imports(REPO / "hub_ingest").items()
    }
    assert {m: n for m, n in leaks.items() if n} == {}


def test_the_protocol_imports_nothing_else_of_the_agent() -> None:
    leaks = {
        module: sorted(n for n in _agent_modules(names) if not n.startswith("edge_agent.protocol"))
        for module, names in _imports(REPO / "edge_agent" / "protocol").items()
    }
    assert {m: n for m, n in leaks.items() if n} == {}
