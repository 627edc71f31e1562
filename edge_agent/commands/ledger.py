"""The command ledger: which command ids this device has taken on, and how each ended.

A command id gets a ledger row *before* its handler starts (state ``running``) and is never
run again once it has one, so a command runs at most once per device across redeliveries,
the fast-resume path and crashes. The final ledger row and the result's outbox row commit in
one SQLite transaction: either both exist or neither. A ``running`` row found at start-up is
a command interrupted by a crash; it is answered with an error, not run again.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass, replace
from typing import Any

from edge_agent.core.errors import TooLarge
from edge_agent.core.statedb import FENCE_KEY, StateDB
from edge_agent.outbox.store import Outbox
from edge_agent.protocol.envelope import Result
from edge_agent.protocol.names import result_subject


@dataclass(frozen=True, slots=True)
class Unfinished:
    key: str
    seq: int
    type: str | None
    received_at: str


@dataclass(frozen=True, slots=True)
class CommandStats:
    last_seq: int | None
    executed: int
    failed: int
    rejected: int
    expired: int
    running: int
    # Commands up to this hub sequence are answered, not run (see `edge_agent.commands.fence`); None
    # while a fresh ledger waits for the hub to set it: no command runs meanwhile.
    fence: int | None = None


class Ledger:
    def __init__(self, db: StateDB, outbox: Outbox, device_id: str) -> None:
        self._db = db
        self._outbox = outbox
        self.subject = result_subject(device_id)

    async def seen(self, key: str) -> bool:
        rows = await self._db.fetchall("SELECT 1 FROM ledger WHERE key = ?", (key,))
        return bool(rows)

    async def start(self, key: str, seq: int, type_: str, received_at: str) -> None:
        """Claim `key` before its handler runs; from here on it is never run again."""
        async with self._db.transaction() as conn:
            await conn.execute(
                "INSERT INTO ledger (key, seq, type, state, received_at) "
                "VALUES (?, ?, ?, 'running', ?)",
                (key, seq, type_, received_at),
            )

    async def finish(self, key: str, seq: int, result: Result, received_at: str) -> int:
        """Record how `key` ended and queue its result, in one transaction; the outbox row id."""
        async with self._db.transaction() as conn:
            await conn.execute(
                "INSERT INTO ledger (key, seq, type, state, status, received_at, finished_at) "
                "VALUES (?, ?, ?, 'done', ?, ?, ?) ON CONFLICT (key) DO UPDATE SET "
                "state = 'done', status = excluded.status, finished_at = excluded.finished_at",
                (key, seq, result.type, result.status, received_at, result.finished_at),
            )
            try:
                row_id = await self._outbox.insert(
                    conn, self.subject, result.to_json(), kind="result"
                )
            except TooLarge as exc:
                # The run happened: its result must reach the hub, if without its output (and
                # with the head of its error only: a handler's error text can be large too).
                smaller = replace(result, output=None, error=_shortened(result.error, exc))
                row_id = await self._outbox.insert(
                    conn, self.subject, smaller.to_json(), kind="result"
                )
        self._outbox.added.set()
        return row_id

    async def unfinished(self) -> list[Unfinished]:
        rows = await self._db.fetchall(
            "SELECT key, seq, type, received_at FROM ledger WHERE state = 'running' ORDER BY seq"
        )
        return [Unfinished(r[0], r[1], r[2], r[3]) for r in rows]


_ERROR_HEAD = 1024  # characters of a too-large result's own error that are kept


def _shortened(error: str | None, why: TooLarge) -> str:
    if error and len(error) > _ERROR_HEAD:
        error = f"{error[:_ERROR_HEAD]}… ({len(error)} characters, cut)"
    return f"{error or ''} {why}".strip()


STATS_SQL = (
    "SELECT (SELECT MAX(seq) FROM ledger), status, state, COUNT(*) FROM ledger "
    "GROUP BY status, state"
)


def _stats(rows: list[Any], fence: int | None = None) -> CommandStats:
    counts: dict[str, int] = {}
    last_seq = None
    for max_seq, status, state, count in rows:
        last_seq = max_seq
        counts[status if state == "done" else "running"] = count
    return CommandStats(
        last_seq=last_seq,
        executed=counts.get("ok", 0),
        failed=counts.get("error", 0),
        rejected=counts.get("rejected", 0),
        expired=counts.get("expired", 0),
        running=counts.get("running", 0),
        fence=fence,
    )


def read_stats(conn: sqlite3.Connection) -> CommandStats:
    """Ledger counts from a plain (read-only) sqlite3 connection, for ``status``."""
    fence = conn.execute("SELECT value FROM meta WHERE key = ?", (FENCE_KEY,)).fetchone()
    return _stats(conn.execute(STATS_SQL).fetchall(), None if fence is None else int(fence[0]))
