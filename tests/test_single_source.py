"""Each artefact has one source: the role's units are the units in systemd/, and the version
`--version` prints is the installed distribution's."""

from __future__ import annotations

from importlib.metadata import version

import edge_agent
from tests.support.cluster import run_cli
from tests.support.scratch_root import REPO


def test_the_roles_install_the_units_in_systemd_and_nothing_else() -> None:
    """Every unit (and unit helper) the roles ship is a link to its one copy in systemd/:
    they cannot drift. Other role files (the device's key maker) are the role's own."""
    shipped = sorted(
        path
        for path in (REPO / "ansible/roles").glob("*/files/*")
        if path.suffix in (".service", ".timer") or (REPO / "systemd" / path.name).exists()
    )
    assert shipped
    for path in shipped:
        assert path.is_symlink(), f"{path} is a copy, not a link to systemd/{path.name}"
        assert path.resolve() == (REPO / "systemd" / path.name).resolve()


def test_version_comes_from_one_place() -> None:
    assert version("edge-agent") == edge_agent.__version__
    result = run_cli("edge_agent", "--version")
    assert result.stdout.strip() == edge_agent.__version__
