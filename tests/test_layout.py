"""The tree keeps the shape CONTRIBUTING.md describes: code lives in packages by concern, no
module grows past what a reader takes in at once, and each package imports only what its
docstring's ``Imports:`` line allows (so imports go one way, and the hub reaches the agent
only through `edge_agent.protocol`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("edge_agent", "hub_ingest")
ENTRY_MODULES = {"__init__.py", "__main__.py", "app.py", "cli.py"}
MAX_LINES = 450


def _packages() -> list[Path]:
    return sorted(p.parent for top in PRODUCT for p in (ROOT / top).glob("*/__init__.py"))


def _allowed(package: Path) -> set[str]:
    """Absolute module prefixes the package may import, read from its ``Imports:`` line."""
    top = package.parent.name
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    line = re.search(r"^Imports: (.*)", doc, re.MULTILINE | re.DOTALL)
    allowed = {f"{top}.{package.name}"}  # and `top` itself, which holds only `__version__`
    if top == "hub_ingest":
        allowed.add("edge_agent.protocol")
    if line is None:
        return allowed
    if line.group(1).startswith("any hub package except"):
        excluded = set(re.findall(r"`(\w+)`", line.group(1)))
        return allowed | {f"hub_ingest.{p.name}" for p in _packages() if p.name not in excluded}
    for name in re.findall(r"`([\w.]+)`", line.group(1)):
        allowed.add(name if "." in name else f"{top}.{name}")
    return allowed


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name.split(".")[0] in PRODUCT}


def test_product_code_lives_in_packages_by_concern() -> None:
    loose = [
        str(path.relative_to(ROOT))
        for top in PRODUCT
        for path in (ROOT / top).glob("*.py")
        if path.name not in ENTRY_MODULES
    ]
    assert loose == []


def test_no_module_is_longer_than_a_reader_takes_in() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for top in PRODUCT
        for path in (ROOT / top).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


@pytest.mark.parametrize("package", _packages(), ids=lambda p: f"{p.parent.name}.{p.name}")
def test_a_package_imports_only_what_its_docstring_allows(package: Path) -> None:
    allowed = _allowed(package)
    upward = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in package.rglob("*.py")
        for name in _imports(path)
        if name != package.parent.name
        and not any(name == ok or name.startswith(f"{ok}.") for ok in allowed)
    }
    assert upward == set()
