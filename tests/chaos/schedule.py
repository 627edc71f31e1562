"""A seeded chaos schedule: which fault hits what, when, and for how long.

The schedule is drawn in full before anything runs, so a seed always names the same faults
in the same order; only the timing of the real processes around them varies.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Literal

DEFAULT_SEED = 3  # a schedule with every kind of fault, 3 hub restarts among them
SKIP_EVERY = 3  # every third cut makes the hub's mirror skip, and the refill heal it

Kind = Literal[
    "cut", "skip", "agent_kill", "island_kill", "hub_restart", "node_kill", "node_wipe",
    "rolling_restart", "command",
]  # fmt: skip
FAULTS: tuple[Kind, ...] = (
    "cut", "skip", "agent_kill", "island_kill", "hub_restart", "node_kill", "node_wipe",
    "rolling_restart",
)  # fmt: skip
# Relative weights: cuts are what devices see most; hub restarts are rare and slow to heal.
_WEIGHTS: dict[Kind, float] = {
    "cut": 0.32,
    "agent_kill": 0.18,
    "island_kill": 0.14,
    "hub_restart": 0.08,
    "command": 0.28,
}
# On a hub cluster one node at a time is SIGKILLed instead (two would cost the quorum).
_CLUSTER_WEIGHTS: dict[Kind, float] = {**_WEIGHTS, "hub_restart": 0.0, "node_kill": 0.12}


@dataclass(frozen=True, slots=True)
class Action:
    at: float  # seconds after the chaos phase starts
    kind: Kind
    # A device id; "hub" for hub restarts; for a node kill, a node or "leader"; for a node
    # wipe, "<device>:commands" or "<device>:telemetry", the node holding that device stream.
    target: str
    duration: float  # how long the fault lasts (link down, agent dead); 0 for the rest

    @property
    def is_fault(self) -> bool:
        return self.kind in FAULTS


def seed_from_env() -> int:
    """``CHAOS_SEED`` replays a run; without it the fixed default keeps CI's schedule fixed."""
    return int(os.environ.get("CHAOS_SEED", DEFAULT_SEED))


def draw_schedule(
    seed: int,
    devices: list[str],
    *,
    faults: int,
    gap: tuple[float, float] = (1.2, 3.0),
    nodes: tuple[str, ...] = (),
    skip_every: int = 0,
) -> list[Action]:
    """Actions until `faults` faults are drawn. A device's next fault starts after its last
    one has healed, so every fault is a clean pair (cut/restore, kill/start). With hub
    `nodes` (a cluster), node kills take the place of hub restarts. With `skip_every`, every
    so many cuts is a *skip*: the cut during which the hub's mirror is made to skip what the
    island stored (as nats-server does when a mirror binds above what it holds)."""
    rng = random.Random(seed)
    table = _CLUSTER_WEIGHTS if nodes else _WEIGHTS
    kinds = list(table)
    weights = list(table.values())
    busy_until = dict.fromkeys([*devices, "hub"], 0.0)
    actions: list[Action] = []
    t = 0.0
    cuts = 0
    while sum(a.is_fault for a in actions) < faults:
        t += rng.uniform(*gap)
        kind = rng.choices(kinds, weights)[0]
        if kind == "command":
            target = rng.choice([*devices, "all"])
            actions.append(Action(round(t, 2), kind, target, 0.0))
            continue
        on_hub = kind in ("hub_restart", "node_kill")
        target = "hub" if on_hub else rng.choice(devices)
        if busy_until[target] > t or (on_hub and busy_until["hub"] + 15 > t):
            continue  # still healing from its last fault; hub faults at least 15 s apart
        duration = 0.0 if kind in ("hub_restart", "island_kill") else rng.uniform(0.5, 6.0)
        busy_until[target] = t + duration + 1.0
        if kind == "node_kill":
            target = rng.choice(nodes)
        if kind == "cut" and skip_every:
            cuts += 1
            kind = "skip" if cuts % skip_every == 0 else kind
        actions.append(Action(round(t, 2), kind, target, round(duration, 2)))
    return actions
