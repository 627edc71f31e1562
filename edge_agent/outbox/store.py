"""The durable outbox: whatever the agent itself must send is committed to SQLite first.

Results, events, heartbeats and ``edge-agent publish`` from scripts become rows; the `Drainer`
publishes them to the island in batches with ``Nats-Msg-Id`` = ``<file instance>-<row id>``
and deletes a row only after its PubAck. While the island is down, restarting or refusing
("insufficient resources"), rows wait; a crash between PubAck and delete sends a row again,
and the island's duplicate window drops the copy.

The outbox has its own byte budget (`outbox.max_bytes`). `edge-agent publish` may fill only
three quarters of it and gets `OutboxFull` beyond that: the rest is kept for what the agent
itself must not lose. Command results are always accepted (a result refused after its handler
ran would be lost, and there is one per command); a heartbeat that does not fit replaces the
oldest heartbeat still queued (the newest says more). A message larger than the island takes
(`island.max_payload`) is refused up front (`TooLarge`). A row the island refuses for a reason
waiting cannot fix is moved to the *dead-letter* table, counted in ``status`` (which turns
degraded) and in heartbeats, so the rows behind it keep flowing; ``edge-agent dead-letter``
lists, retries and drops such rows.
"""

from __future__ import annotations

import asyncio
import json
import re
import sqlite3
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiosqlite
import structlog

from edge_agent.core.errors import (
    NoSuchDeadLetter,
    OutboxFull,
    TooLarge,
)
from edge_agent.core.statedb import StateDB

log = structlog.get_logger(__name__)

Kind = Literal["publish", "heartbeat", "result"]
PUBLISH_SHARE = 0.75  # of outbox.max_bytes that `edge-agent publish` may fill
# What the drainer adds to a message on the wire: the header block and its Nats-Msg-Id.
_WIRE_OVERHEAD = 64

# Only subjects the island stores: a row for any other subject could never be acknowledged.
_SUBJECT_RE = re.compile(r"^(tele|evt)(\.[^.\s*>]+)+$")


def check_subject(subject: str) -> str:
    if not _SUBJECT_RE.match(subject):
        raise ValueError(
            f"subject must be a literal subject under tele. or evt. (the island's streams), "
            f"got {subject!r}"
        )
    return subject


@dataclass(frozen=True, slots=True)
class Row:
    id: int
    subject: str
    headers: dict[str, str]
    data: bytes
    created_at: float


@dataclass(frozen=True, slots=True)
class DeadLetter:
    id: int
    subject: str
    size: int
    created_at: float
    failed_at: float
    reason: str


@dataclass(frozen=True, slots=True)
class OutboxStats:
    depth: int
    bytes: int
    max_bytes: int
    oldest_age_s: float | None
    dead_letters: int = 0  # rows the island refused for good, waiting for an operator


class Outbox:
    """Rows waiting for the island, in a `StateDB`."""

    def __init__(self, db: StateDB, max_bytes: int, max_payload: int | None = None) -> None:
        self.db = db
        self.max_bytes = max_bytes
        self.max_payload = max_payload  # None: not checked here (the island still checks)
        self.added = asyncio.Event()  # set on every append, so the drainer need not wait a poll

    def msg_id(self, row_id: int) -> str:
        return f"{self.db.instance}-{row_id}"

    async def append(
        self,
        subject: str,
        data: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        kind: Kind = "publish",
    ) -> int:
        """Commit one message; raises `OutboxFull` when it does not fit the budget."""
        async with self.db.transaction() as conn:
            row_id = await self.insert(conn, subject, data, headers, kind=kind)
        self.added.set()
        return row_id

    async def append_many(self, items: Iterable[tuple[str, bytes]]) -> int:
        """Commit many messages in one transaction (all or none); returns how many."""
        count = 0
        async with self.db.transaction() as conn:
            for subject, data in items:
                await self.insert(conn, subject, data)
                count += 1
        self.added.set()
        return count

    async def insert(
        self,
        conn: aiosqlite.Connection,
        subject: str,
        data: bytes,
        headers: Mapping[str, str] | None = None,
        *,
        kind: Kind = "publish",
    ) -> int:
        """Add a row inside the caller's transaction (the ledger writes results this way)."""
        check_subject(subject)
        header_text = json.dumps(dict(headers or {}), separators=(",", ":"))
        if self.max_payload is not None:
            wire = (
                len(data)
                + _WIRE_OVERHEAD
                + sum(len(k) + len(v) + 4 for k, v in (headers or {}).items())
            )
            if wire > self.max_payload:
                raise TooLarge(wire, self.max_payload)
        size = len(subject) + len(header_text) + len(data)
        used = await _used(conn)
        limit = self.max_bytes if kind != "publish" else int(self.max_bytes * PUBLISH_SHARE)
        if used + size > limit:
            if kind == "publish":
                raise OutboxFull(size, used, limit)
            if kind == "heartbeat":
                await _replace_heartbeats(conn, subject, used + size - limit)
            else:
                log.warning("outbox_over_budget", kind=kind, used=used, max_bytes=limit)
        cur = await conn.execute(
            "INSERT INTO outbox (subject, headers, data, size, created_at) VALUES (?, ?, ?, ?, ?)",
            (subject, header_text, data, size, time.time()),
        )
        assert cur.lastrowid is not None
        return cur.lastrowid

    async def batch(self, limit: int, after: int = 0) -> list[Row]:
        """The oldest `limit` rows with an id above `after`."""
        rows = await self.db.fetchall(
            "SELECT id, subject, headers, data, created_at FROM outbox WHERE id > ? "
            "ORDER BY id LIMIT ?",
            (after, limit),
        )
        return [
            Row(r[0], r[1], json.loads(r[2]) if r[2] != "{}" else {}, bytes(r[3]), r[4])
            for r in rows
        ]

    async def remove(self, ids: list[int]) -> None:
        async with self.db.transaction() as conn:
            if ids == list(range(ids[0], ids[-1] + 1)):
                await conn.execute("DELETE FROM outbox WHERE id BETWEEN ? AND ?", (ids[0], ids[-1]))
            else:
                await conn.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in ids])

    async def stats(self) -> OutboxStats:
        rows = await self.db.fetchall(STATS_SQL)
        return _stats(rows[0], self.max_bytes)

    async def dead_letter(self, row: Row, reason: str) -> None:
        """Move `row` aside: the island refused it for good, and the rows behind must flow."""
        async with self.db.transaction() as conn:
            await conn.execute(
                "INSERT OR REPLACE INTO dead_letter SELECT id, subject, headers, data, size, "
                "created_at, ?, ? FROM outbox WHERE id = ?",
                (time.time(), reason, row.id),
            )
            await conn.execute("DELETE FROM outbox WHERE id = ?", (row.id,))
        log.error("outbox_row_dead_lettered", row=row.id, subject=row.subject, reason=reason)

    async def dead_letters(self) -> list[DeadLetter]:
        rows = await self.db.fetchall(
            "SELECT id, subject, size, created_at, failed_at, reason FROM dead_letter ORDER BY id"
        )
        return [DeadLetter(*r) for r in rows]

    async def retry_dead(self, ids: Sequence[int] | None) -> int:
        """Queue dead letters again (all when `ids` is None), as new rows; how many."""
        where, params = _which(ids)
        async with self.db.transaction() as conn:
            await _refuse_unknown(conn, ids)
            cur = await conn.execute(
                "INSERT INTO outbox (subject, headers, data, size, created_at) "
                f"SELECT subject, headers, data, size, created_at FROM dead_letter {where} "
                "ORDER BY id",
                params,
            )
            await conn.execute(f"DELETE FROM dead_letter {where}", params)
        self.added.set()
        return cur.rowcount

    async def drop_dead(self, ids: Sequence[int] | None) -> int:
        """Forget dead letters for good (all when `ids` is None); how many."""
        where, params = _which(ids)
        async with self.db.transaction() as conn:
            await _refuse_unknown(conn, ids)
            cur = await conn.execute(f"DELETE FROM dead_letter {where}", params)
        log.warning("outbox_dead_letters_dropped", rows=cur.rowcount)
        return cur.rowcount


def _which(ids: Sequence[int] | None) -> tuple[str, tuple[int, ...]]:
    if ids is None:
        return "", ()
    return f"WHERE id IN ({', '.join('?' * len(ids))})", tuple(ids)


async def _refuse_unknown(conn: aiosqlite.Connection, ids: Sequence[int] | None) -> None:
    """Raise before changing anything when an id names no dead letter: a typo must not pass
    as "retried" (or drop some rows of a list and not others)."""
    if ids is None:
        return
    where, params = _which(ids)
    async with conn.execute(f"SELECT id FROM dead_letter {where}", params) as cur:
        found = {int(r[0]) for r in await cur.fetchall()}
    missing = sorted(set(ids) - found)
    if missing:
        raise NoSuchDeadLetter(missing)


async def _used(conn: aiosqlite.Connection) -> int:
    async with conn.execute("SELECT bytes FROM outbox_usage WHERE id = 1") as cur:
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _replace_heartbeats(conn: aiosqlite.Connection, subject: str, needed: int) -> None:
    """Delete the oldest queued heartbeats until `needed` bytes are free (or none are left)."""
    freed = 0
    while freed < needed:
        async with conn.execute(
            "SELECT id, size FROM outbox WHERE subject = ? ORDER BY id LIMIT 1", (subject,)
        ) as cur:
            row = await cur.fetchone()
        if row is None:
            return
        await conn.execute("DELETE FROM outbox WHERE id = ?", (row[0],))
        freed += int(row[1])
        log.info("heartbeat_replaced", row=row[0])


STATS_SQL = (
    "SELECT rows, bytes, (SELECT MIN(created_at) FROM outbox), "
    "(SELECT COUNT(*) FROM dead_letter) FROM outbox_usage WHERE id = 1"
)


def _stats(row: Sequence[Any], max_bytes: int) -> OutboxStats:
    depth, used, oldest, dead = row
    return OutboxStats(
        depth=int(depth),
        bytes=int(used),
        max_bytes=max_bytes,
        oldest_age_s=round(time.time() - float(oldest), 3) if oldest is not None else None,
        dead_letters=int(dead),
    )


def read_stats(conn: sqlite3.Connection, max_bytes: int) -> OutboxStats:
    """Outbox depth and age from a plain (read-only) sqlite3 connection, for ``status``."""
    return _stats(conn.execute(STATS_SQL).fetchone(), max_bytes)
