"""Every code block of the README and of `docs/`, checked so that no page can rot: the
analysts' lines run as written (readings per device per hour with pandas, pyarrow, Polars,
DuckDB and Spark, all giving the same counts; the README tour's query), every TOML block is
read by the config parser it is for, every ``edge-agent`` / ``hub-ingest`` line is parsed by
the command line itself, every YAML block names what exists, and every link resolves."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import tomllib
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyspark.sql import SparkSession

from edge_agent import cli as agent_cli
from edge_agent.core.config import parse_config
from hub_ingest.cli import main as hub_cli
from hub_ingest.core.config import parse_hub_config
from tests.support import archives

ROOT = Path(__file__).parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
README_ARCHIVE = "/var/lib/hub-ingest/archive"
TOUR_ARCHIVE = "demo-state/archive"
TOOLS = ("pandas", "pyarrow", "polars", "duckdb", "spark")
HUB_SECTIONS = {"state_dir", "nats", "commands", "aggregates", "server", "cluster", "ingest"}


def blocks(language: str) -> Iterator[tuple[str, str]]:
    """(page, text) of every ```<language> block in the README and docs/."""
    for page in PAGES:
        for found in re.finditer(rf"```{language}\n(.*?)```", page.read_text(), re.S):
            yield page.relative_to(ROOT).as_posix(), found[1]


def snippet(name: str) -> str:
    """The python block after ``<!-- analyst:<name> -->`` in the README or docs/."""
    for page in PAGES:
        found = re.search(rf"<!-- analyst:{name} -->\n```python\n(.*?)```", page.read_text(), re.S)
        if found:
            return found[1]
    raise AssertionError(f"no analyst:{name} block in the README or docs/")


def _hour(value: Any) -> str:
    when = value if isinstance(value, datetime) else value.to_pydatetime()
    if when.tzinfo is None:  # Spark's session time zone is UTC
        when = when.replace(tzinfo=UTC)
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H")


def _counts(tool: str, per_hour: Any) -> dict[tuple[str, str], int]:
    if tool == "pandas":
        items = [(d, h, n) for (d, h), n in per_hour.items()]
    elif tool == "pyarrow":
        items = [
            tuple(r.values())
            for r in per_hour.select(["device_id", "hour", "device_id_count"]).to_pylist()
        ]
    elif tool == "spark":
        items = [(r["device_id"], r["hour"], r["count"]) for r in per_hour.collect()]
    elif tool == "polars":
        items = per_hour.select("device_id", "hour", "len").rows()
    else:
        items = per_hour
    return {(d, _hour(h)): int(n) for d, h, n in items}


@pytest.mark.spark
def test_the_readme_lines_count_readings_per_device_per_hour(
    tmp_path: Path, spark: SparkSession
) -> None:
    config = parse_hub_config({"state_dir": str(tmp_path)}).ingest
    # a: 30 readings 4 minutes apart (two hours); b: 5 an hour apart; committed in two batches
    # and a third day's file, as the ingest leaves them.
    archives.commit(config, archives.readings("a", 30, timedelta(minutes=4)))
    archives.commit(config, archives.readings("b", 5, timedelta(hours=1), first_hub_seq=31))
    want = {("a", "2026-11-20T09"): 15, ("a", "2026-11-20T10"): 15}
    want |= {("b", f"2026-11-20T{h:02d}"): 1 for h in range(9, 14)}

    opened: dict[str, Any] = {}
    exec(snippet("open").replace(README_ARCHIVE, str(config.archive)), opened)
    for tool in TOOLS:
        scope = {**opened, "spark": spark}
        exec(snippet(tool), scope)
        assert _counts(tool, scope["per_hour"]) == want, tool

    tour: dict[str, Any] = {}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(snippet("tour").replace(TOUR_ARCHIVE, str(config.archive)), tour)
    assert tour["per_device"] == [("a", 30), ("b", 5)]


def _merged(base: dict[str, Any], part: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in part.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if both else value
    return out


def test_every_toml_block_is_read_by_its_config_parser(tmp_path: Path) -> None:
    """A hub.toml block (its sections are the hub's) goes through the hub's parser; any other
    through the agent's, merged onto the docs' full agent.toml (a block may show one table)."""
    found = list(blocks("toml"))
    agents = [tomllib.loads(text) for _, text in found if "device_id" in tomllib.loads(text)]
    assert agents, "no full agent.toml in the docs"
    for page, text in found:
        data = tomllib.loads(text)
        try:
            if set(data) <= HUB_SECTIONS:
                parse_hub_config(_merged({"state_dir": str(tmp_path)}, data))
            else:
                parse_config(_merged(agents[0], data))
        except Exception as exc:
            raise AssertionError(f"{page}: a TOML block is refused: {exc}\n{text}") from exc


def _command_lines() -> Iterator[tuple[str, list[str]]]:
    """(page, argv) of every line of a shell block that runs edge-agent or hub-ingest, with
    its comment dropped and each optional ``[…]`` part taken (its first alternative)."""
    for page, text in blocks("sh"):
        for raw in text.splitlines():
            line = raw.strip()
            if re.match(r"(\.venv/bin/)?(edge-agent|hub-ingest) ", line):
                taken = re.sub(r"\[([^\]|]+)(\|[^\]]*)?\]", r"\1", line)
                yield page, shlex.split(taken, comments=True)


def test_every_command_line_in_the_docs_parses() -> None:
    lines = list(_command_lines())
    assert len(lines) > 30, lines
    for page, argv in lines:
        parser = agent_cli._parser() if argv[0].endswith("edge-agent") else hub_cli._parser()
        with contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                parser.parse_args(argv[1:])
            except SystemExit as exc:
                raise AssertionError(f"{page}: {shlex.join(argv)}: {err.getvalue()}") from exc


def test_every_link_between_pages_resolves() -> None:
    """Links are relative and land on a file of the repository; the README links nowhere
    else (a clone is all a reader has)."""
    for page in (*PAGES, ROOT / "CONTRIBUTING.md"):
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith("https://") and page.name != "README.md":
                continue
            assert (page.parent / target).exists(), f"{page.name}: a link to {target}"


def _source_text(*trees: str) -> str:
    return "\n".join(p.read_text() for tree in trees for p in (ROOT / tree).rglob("*.*"))


def test_every_yaml_block_names_what_exists() -> None:
    """An alert's expression names metrics the agent or the hub exports; an inventory's
    variables are the Ansible roles' own."""
    metrics = _source_text("edge_agent/status", "hub_ingest/report")
    roles = _source_text("ansible/roles")
    found = list(blocks("yaml"))
    assert found
    for page, text in found:
        data = yaml.safe_load(text)
        if isinstance(data, list):
            for alert in data:
                for name in re.findall(r"\b(?:hub|edge_agent)_[a-z_]+", alert["expr"]):
                    assert f'"{name}' in metrics, f"{page}: {alert['alert']} uses {name}"
        else:
            for group in data.values():
                for name in group.get("vars", {}):
                    assert name in roles, f"{page}: inventory variable {name}"
