"""How full the hub's store is: each node's JetStream file store, as its ``/jsz`` says.

Full, a node stores nothing more that any device sends: every hub mirror and aggregate on it
is refused ("insufficient resources" in its log, no error in the streams' info), readings,
heartbeats and command results alike, and they wait on the devices until their budgets
evict them. The aggregates and the hub mirrors keep what they hold until their limits
(``aggregates.max_age``, ``aggregates.max_bytes``) remove it, so a hub without limits fills
in time, and one device that floods fills it sooner. `report` warns from `FILLING` on and
names the largest device mirrors (on a single server, where one listing has them all).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from edge_agent.protocol.units import format_size
from hub_ingest.core.errors import ReportError
from hub_ingest.fleet.streams import MIRROR_PREFIX
from hub_ingest.report.hub import monitor_get

FILLING = 0.8  # of a node's store used: warned of
_NAMED = 3  # largest device mirrors a warning names


@dataclass(frozen=True, slots=True)
class StoreFigures:
    """One node's JetStream file store."""

    node: str
    used_bytes: int
    max_bytes: int  # ``server.max_file_store``
    reserved_bytes: int  # held back for streams with a ``max_bytes`` (COMMANDS, …)

    @property
    def used(self) -> float:
        """The share of the store used."""
        return self.used_bytes / self.max_bytes if self.max_bytes > 0 else 0.0


def read_store(urls: Mapping[str, str]) -> list[StoreFigures]:
    """Each node's figures, by node name; a node whose monitoring endpoint does not answer is
    left out (the report's warning of unknown link state names it)."""
    found = []
    for node, url in urls.items():
        try:
            jsz = monitor_get(url, "/jsz")
        except ReportError:
            continue
        config = jsz.get("config") or {}
        found.append(
            StoreFigures(
                node,
                int(jsz.get("storage", 0)),
                int(config.get("max_storage", 0)),
                int(jsz.get("reserved_storage", 0)),
            )
        )
    return found


def store_warnings(
    figures: Iterable[StoreFigures], listed: Iterable[Mapping[str, Any]]
) -> list[str]:
    """A warning per node whose store is `FILLING`, naming the largest device mirrors in
    `listed` (stream infos; none on a cluster)."""
    largest = sorted(
        (
            (int((info.get("state") or {}).get("bytes", 0)), str(info["config"]["name"]))
            for info in listed
            if str(info["config"]["name"]).startswith(MIRROR_PREFIX)
        ),
        reverse=True,
    )[:_NAMED]
    named = ", ".join(f"{name} {format_size(size)}" for size, name in largest)
    return [
        f"hub node {f.node}: its store is {f.used:.0%} full ({format_size(f.used_bytes)} of "
        f"server.max_file_store {format_size(f.max_bytes)}); full, no device's readings, "
        "heartbeats or results are stored (they wait on the devices until their budgets "
        "evict them). Is the ingest archiving (it trims what it archived)? Else raise "
        "server.max_file_store or set aggregates.max_age (docs/operations.md, "
        f'"The hub\'s store fills").' + (f" Largest device mirrors: {named}." if named else "")
        for f in figures
        if f.used >= FILLING
    ]
