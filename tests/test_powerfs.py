"""The power-cut filesystem itself: what was fsynced survives a cut, nothing else does."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.powerfs import PAGE, SECTOR
from tests.support.powerswitch import PowerCut, users


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[PowerCut]:
    fs = PowerCut(tmp_path / "backing", tmp_path / "mnt").start()
    try:
        yield fs
    finally:
        fs.stop()


def _write(path: Path, data: bytes, *, sync: bool) -> None:
    with open(path, "ab") as out:
        out.write(data)
        out.flush()
        if sync:
            os.fsync(out.fileno())


def test_synced_data_survives_and_unsynced_data_is_dropped(disk: PowerCut) -> None:
    kept, lost = disk.mount / "kept", disk.mount / "lost"
    _write(kept, b"a" * 10_000, sync=True)
    _write(kept, b"b" * 100, sync=False)
    _write(lost, b"c" * 5000, sync=False)
    assert kept.read_bytes() == b"a" * 10_000 + b"b" * 100  # readers see unsynced data
    assert lost.stat().st_size == 5000

    cut = disk.cut()

    assert cut.dropped_bytes >= 5100
    assert kept.read_bytes() == b"a" * 10_000
    assert lost.exists() and lost.read_bytes() == b""  # the name was durable, the data not


def test_writes_through_an_o_sync_descriptor_are_durable(disk: PowerCut) -> None:
    """nats-server's ``sync_interval: always`` opens its files O_SYNC instead of fsyncing."""
    f = disk.mount / "osync"
    fd = os.open(f, os.O_WRONLY | os.O_CREAT | os.O_SYNC, 0o644)
    try:
        os.write(fd, b"s" * 5000)
    finally:
        os.close(fd)
    _write(f, b"t" * 10, sync=False)

    disk.cut()

    assert f.read_bytes() == b"s" * 5000


def test_a_torn_page_keeps_a_sector_aligned_prefix_of_the_last_write(disk: PowerCut) -> None:
    f = disk.mount / "torn"
    _write(f, b"x" * PAGE, sync=True)
    _write(f, b"y" * PAGE, sync=False)

    cut = disk.cut(torn=True, seed=7)

    assert 0 < cut.torn_bytes < PAGE and cut.torn_bytes % SECTOR == 0
    assert f.read_bytes() == b"x" * PAGE + b"y" * cut.torn_bytes


def test_overwrites_truncates_and_renames_follow_the_inode(disk: PowerCut) -> None:
    f, g = disk.mount / "f", disk.mount / "g"
    _write(f, b"1" * (3 * PAGE), sync=True)
    with open(f, "r+b") as out:
        out.seek(PAGE + 10)
        out.write(b"2" * 20)
        out.truncate(2 * PAGE)
    assert f.read_bytes() == b"1" * (PAGE + 10) + b"2" * 20 + b"1" * (PAGE - 30)
    os.rename(f, g)
    assert g.stat().st_size == 2 * PAGE

    disk.cut()

    assert g.read_bytes() == b"1" * (2 * PAGE)  # the shrink was durable, the overwrite was not


def test_a_cut_kills_every_process_using_the_disk_and_only_those(
    disk: PowerCut, tmp_path: Path
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; f=open(sys.argv[1],'w'); f.write('x'); f.flush(); "
            "print('ready', flush=True); time.sleep(600)",
            str(disk.mount / "held"),
        ],
        stdout=subprocess.PIPE,
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"ready\n"
        assert users(disk.mount) == [holder.pid]

        cut = disk.cut()

        assert cut.killed == [holder.pid]
        assert holder.wait(10) == -9
        assert bystander.poll() is None
        assert (disk.mount / "held").read_bytes() == b""
    finally:
        holder.kill()
        bystander.kill()
        holder.communicate()
        bystander.wait()


def test_sqlite_keeps_committed_transactions_under_synchronous_full(disk: PowerCut) -> None:
    db = disk.mount / "state.db"
    script = (
        "import sqlite3,sys\n"
        "c=sqlite3.connect(sys.argv[1], isolation_level=None)\n"
        "c.execute('PRAGMA journal_mode=WAL'); c.execute('PRAGMA synchronous=FULL')\n"
        "c.execute('CREATE TABLE IF NOT EXISTS t (n INTEGER PRIMARY KEY)')\n"
        "for n in range(200): c.execute('INSERT INTO t VALUES (?)', (n,)); print(n, flush=True)\n"
        "c.execute('PRAGMA synchronous=OFF')\n"
        "for n in range(200, 400): c.execute('INSERT INTO t VALUES (?)', (n,))\n"
        "print('done', flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", script, str(db)], stdout=subprocess.PIPE)
    try:
        assert writer.stdout is not None
        lines = [writer.stdout.readline() for _ in range(201)]
        assert lines[-1] == b"done\n"
        disk.cut()
    finally:
        writer.kill()
        writer.communicate()

    rows = {n for (n,) in sqlite3.connect(db).execute("SELECT n FROM t")}
    assert set(range(200)) <= rows  # every commit made under synchronous=FULL
    assert len(rows) < 400  # and the unsynced ones are gone: the cut was real
