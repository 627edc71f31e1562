"""The agent's SQLite file: the outbox and the command ledger, side by side.

One file in WAL mode, so that a command's ledger row and its result row commit in one
transaction, and so that ``edge-agent publish`` (another process) can append while the daemon
drains. ``synchronous = FULL``: a ledger row lost to a power cut could run a command twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sqlite3
from collections.abc import AsyncIterator, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import aiosqlite
import structlog

from edge_agent.core.errors import StateDBBusy, StateDBError

log = structlog.get_logger(__name__)

# How long a write waits for another process's write lock before it fails as `StateDBBusy`.
BUSY_TIMEOUT_S = 10.0

# `meta` key of the command fence (see `edge_agent.commands.fence`).
FENCE_KEY = "command_fence"

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- never reused: it is the Nats-Msg-Id
    subject TEXT NOT NULL,
    headers TEXT NOT NULL,
    data BLOB NOT NULL,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL
);
-- Running totals kept by triggers, so the budget check does not scan the table.
CREATE TABLE IF NOT EXISTS outbox_usage (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    rows INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
INSERT OR IGNORE INTO outbox_usage VALUES (1, 0, 0);
CREATE TRIGGER IF NOT EXISTS outbox_added AFTER INSERT ON outbox BEGIN
    UPDATE outbox_usage SET rows = rows + 1, bytes = bytes + NEW.size WHERE id = 1;
END;
CREATE TRIGGER IF NOT EXISTS outbox_removed AFTER DELETE ON outbox BEGIN
    UPDATE outbox_usage SET rows = rows - 1, bytes = bytes - OLD.size WHERE id = 1;
END;
-- Rows the island refused for a reason that waiting cannot fix (too large for it): moved
-- here, so that the rows behind them keep flowing; `edge-agent dead-letter` lists, retries
-- and drops them.
CREATE TABLE IF NOT EXISTS dead_letter (
    id INTEGER PRIMARY KEY,      -- the outbox row id it had
    subject TEXT NOT NULL,
    headers TEXT NOT NULL,
    data BLOB NOT NULL,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL,
    failed_at REAL NOT NULL,
    reason TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    key TEXT PRIMARY KEY,        -- the command id, or "@seq:<n>" when it has none
    seq INTEGER NOT NULL,        -- the hub COMMANDS sequence (mirrors keep it)
    type TEXT,
    state TEXT NOT NULL,         -- running | done
    status TEXT,                 -- ok | error | rejected | expired, once done
    received_at TEXT NOT NULL,
    finished_at TEXT
);
"""


class StateDB:
    """One aiosqlite connection; `transaction()` serialises writers within the process."""

    def __init__(self, conn: aiosqlite.Connection, path: Path, instance: str) -> None:
        self.conn = conn
        self.path = path
        # Prefix of every Nats-Msg-Id: a recreated file restarts row ids at 1, and the island
        # would drop those as duplicates of the old file's rows within its duplicate window.
        self.instance = instance
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, path: Path) -> StateDB:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            conn = await aiosqlite.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_S)
        except (OSError, sqlite3.Error) as exc:
            raise StateDBError(f"cannot open the agent database {path}: {exc}") from exc
        try:
            with _translated(path):
                await conn.execute("PRAGMA journal_mode = WAL")
                await conn.execute("PRAGMA synchronous = FULL")
                await conn.executescript(SCHEMA)
                await conn.execute(
                    "INSERT OR IGNORE INTO meta VALUES ('instance', ?)", (secrets.token_hex(4),)
                )
                async with conn.execute("SELECT value FROM meta WHERE key = 'instance'") as cur:
                    row = await cur.fetchone()
        except BaseException:
            await conn.close()
            raise
        assert row is not None
        return cls(conn, path, str(row[0]))

    async def close(self) -> None:
        await self.conn.close()

    async def __aenter__(self) -> StateDB:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT``, rolled back on any exception."""
        async with self._lock:
            with _translated(self.path):
                try:
                    await self.conn.execute("BEGIN IMMEDIATE")
                except asyncio.CancelledError:
                    # aiosqlite's thread runs the BEGIN all the same: queue its end (FIFO, after
                    # it) before the lock lets another transaction begin on this connection.
                    with contextlib.suppress(sqlite3.Error):
                        await self.conn.rollback()
                    raise
                try:
                    yield self.conn
                except BaseException:
                    await self.conn.rollback()
                    raise
                await self.conn.commit()

    async def fetchall(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        async with self._lock:
            with _translated(self.path):
                async with self.conn.execute(sql, tuple(params)) as cur:
                    return list(await cur.fetchall())


@contextmanager
def _translated(path: Path) -> Iterator[None]:
    """SQLite's errors leave as the agent's own: a busy file is retriable, never a crash."""
    try:
        yield
    except sqlite3.Error as exc:
        code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
        if code in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
            log.warning("state_db_busy", path=str(path), waited_s=BUSY_TIMEOUT_S)
            raise StateDBBusy(
                f"the agent database {path} is locked by another process's write "
                f"(waited {BUSY_TIMEOUT_S:g} s)"
            ) from exc
        raise StateDBError(f"the agent database {path}: {exc}") from exc


def open_readonly(path: Path) -> sqlite3.Connection | None:
    """A read-only connection for ``edge-agent status``; None while the file does not exist."""
    if not path.exists():
        return None
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5.0)
