"""A filesystem that can lose power, for tests (after LazyFS, as Jepsen uses it).

`PowerFS` passes a backing directory through FUSE, but keeps every write that has not been
fsynced in memory, the way a kernel's page cache does; ``fsync`` writes a file's pages to the
backing directory and fsyncs it there. On a cut (`tests.support.powerswitch.PowerCut`) every
process with a file open under the mount is stopped, the unsynced pages are dropped
(optionally tearing one: a random prefix of the last page written, in 512-byte sectors,
reaches the disk) and the processes are SIGKILLed. What was fsynced (or written through a
descriptor opened ``O_SYNC``/``O_DSYNC``) survives; nothing else does.

The model is a journaling filesystem whose *metadata* is durable at once: creating, renaming,
removing and truncating files reach the backing directory immediately, only file *data* waits
for fsync (so a file renamed into place before its data was synced is found empty or short
after a cut, as on ext4). Directory fsyncs are therefore no-ops.

The daemon runs in its own process (``python -m tests.support.powerfs BACKING MOUNT SOCKET``)
and takes commands on a UNIX socket, one JSON line each way: ``{"op": "cut", "torn": true,
"seed": 1}``, ``{"op": "on"}``, ``{"op": "stats"}``.
"""

from __future__ import annotations

import errno
import json
import os
import random
import socket
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mfusepy

PAGE = 4096
SECTOR = 512


@dataclass
class _File:
    """One inode's state as the processes see it: its size and its unsynced pages."""

    size: int
    pages: dict[int, bytearray] = field(default_factory=dict)
    fd: int | None = None  # the filesystem's own descriptor while pages are unsynced

    def forget_pages(self) -> None:
        self.pages.clear()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class PowerFS(mfusepy.Operations):  # type: ignore[misc]
    use_ns = True

    def __init__(self, backing: Path) -> None:
        self.root = str(backing)
        self._mutex = threading.RLock()
        self.files: dict[int, _File] = {}  # by backing inode, while the inode has a name
        self.handles: dict[int, _File] = {}  # by open file handle (outlives an unlink)
        self.synchronous: set[int] = set()  # handles opened O_SYNC / O_DSYNC
        self.powered = True
        self.last_write: tuple[_File, int] | None = None  # file, page index
        self.synced_bytes = 0
        self.dropped_bytes = 0
        self.cuts = 0

    # -- helpers ----------------------------------------------------------------------------
    def _full(self, path: str) -> str:
        return self.root + path

    def _file(self, fd: int) -> _File:
        st = os.fstat(fd)
        return self.files.setdefault(st.st_ino, _File(st.st_size))

    def _check_power(self) -> None:
        if not self.powered:
            raise _fuse_error(errno.EIO)

    def _forget_if_last_link(self, path: str) -> None:
        try:
            st = os.lstat(self._full(path))
        except FileNotFoundError:
            return
        if st.st_nlink <= 1:
            self.files.pop(st.st_ino, None)  # the inode number may be reused by a new file

    def _page(self, fd: int, f: _File, index: int) -> bytearray:
        page = f.pages.get(index)
        if page is None:
            valid = min(PAGE, max(0, f.size - index * PAGE))  # past the size it reads zeros
            page = bytearray(os.pread(fd, valid, index * PAGE).ljust(PAGE, b"\0"))
            f.pages[index] = page
            if f.fd is None:  # kept past the writer's close(): its data is still unsynced
                f.fd = os.dup(fd)
        return page

    def _flush(self, f: _File) -> None:
        if f.fd is None:
            return
        for index in sorted(f.pages):
            data = f.pages[index][: max(0, min(PAGE, f.size - index * PAGE))]
            os.pwrite(f.fd, data, index * PAGE)
            self.synced_bytes += len(data)
        if os.fstat(f.fd).st_size != f.size:
            os.ftruncate(f.fd, f.size)
        os.fsync(f.fd)
        f.forget_pages()

    # -- data -------------------------------------------------------------------------------
    def open(self, path: str, flags: int) -> int:
        with self._mutex:
            fd = os.open(self._full(path), _backing_flags(flags))
            f = self._file(fd)
            if flags & os.O_TRUNC:
                f.pages.clear()
                f.size = 0
            self._track(fd, f, flags)
            return fd

    def create(self, path: str, mode: int, flags: int = os.O_RDWR) -> int:
        with self._mutex:
            self._check_power()
            fd = os.open(self._full(path), _backing_flags(flags) | os.O_CREAT, mode)
            self._track(fd, self._file(fd), flags)
            return fd

    def _track(self, fd: int, f: _File, flags: int) -> None:
        self.handles[fd] = f
        if flags & (os.O_SYNC | os.O_DSYNC):
            self.synchronous.add(fd)  # each write is durable when it returns (nats-server)

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        with self._mutex:
            f = self.handles[fh]
            end = min(offset + size, f.size)
            if end <= offset:
                return b""
            out = bytearray(os.pread(fh, end - offset, offset).ljust(end - offset, b"\0"))
            for index in range(offset // PAGE, (end - 1) // PAGE + 1):
                page = f.pages.get(index)
                if page is not None:
                    lo, hi = max(offset, index * PAGE), min(end, (index + 1) * PAGE)
                    out[lo - offset : hi - offset] = page[lo - index * PAGE : hi - index * PAGE]
            return bytes(out)

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        with self._mutex:
            self._check_power()
            f = self.handles[fh]
            pos = offset
            while pos < offset + len(data):
                index = pos // PAGE
                page = self._page(fh, f, index)
                n = min(PAGE - pos % PAGE, offset + len(data) - pos)
                page[pos % PAGE : pos % PAGE + n] = data[pos - offset : pos - offset + n]
                pos += n
                self.last_write = (f, index)
            f.size = max(f.size, offset + len(data))
            if fh in self.synchronous:
                self._flush(f)
            return len(data)

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        with self._mutex:
            self._check_power()
            fd = fh if fh is not None else os.open(self._full(path or ""), os.O_RDWR)
            try:
                f = self.handles.get(fd) or self._file(fd)
                for index in [i for i in f.pages if i * PAGE >= length]:
                    del f.pages[index]
                if (tail := f.pages.get(length // PAGE)) is not None:
                    tail[length % PAGE :] = bytes(PAGE - length % PAGE)
                if length < os.fstat(fd).st_size:
                    os.ftruncate(fd, length)  # a shrink is metadata: durable at once
                f.size = length
            finally:
                if fh is None:
                    os.close(fd)
            return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        with self._mutex:
            self._check_power()
            self._flush(self.handles[fh])
            os.fsync(fh)  # a size change made without pages (a truncate up)
            return 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        return 0

    def flush(self, path: str | None, fh: int) -> int:
        return 0  # close() does not sync, on a real disk either

    def release(self, path: str | None, fh: int) -> int:
        with self._mutex:
            self.handles.pop(fh, None)
            self.synchronous.discard(fh)
            os.close(fh)
            return 0

    def fallocate(self, path: str | None, mode: int, offset: int, size: int, fh: int) -> int:
        raise _fuse_error(errno.EOPNOTSUPP)

    # -- metadata: passed through, durable at once -------------------------------------------
    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, Any]:
        with self._mutex:
            st = os.fstat(fh) if fh is not None else os.lstat(self._full(path or ""))
            attrs = {k: getattr(st, k) for k in _STAT_KEYS}
            for k in ("st_atime", "st_mtime", "st_ctime"):
                attrs[k] = getattr(st, k + "_ns")
            f = self.handles.get(fh) if fh is not None else self.files.get(st.st_ino)
            if f is not None:
                attrs["st_size"] = f.size
            return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._full(path))]

    def mkdir(self, path: str, mode: int) -> int:
        self._check_power()
        os.mkdir(self._full(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._check_power()
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        with self._mutex:
            self._check_power()
            self._forget_if_last_link(path)
            os.unlink(self._full(path))
            return 0

    def rename(self, old: str, new: str) -> int:
        with self._mutex:
            self._check_power()
            self._forget_if_last_link(new)
            os.rename(self._full(old), self._full(new))
            return 0

    def link(self, target: str, source: str) -> int:
        self._check_power()
        os.link(self._full(source), self._full(target))
        return 0

    def symlink(self, target: str, source: str) -> int:
        self._check_power()
        os.symlink(source, self._full(target))
        return 0

    def readlink(self, path: str) -> str:
        return os.readlink(self._full(path))

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._full(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        os.utime(self._full(path), ns=times)
        return 0

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise _fuse_error(errno.EACCES)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._full(path))
        return {k: getattr(st, k) for k in _STATVFS_KEYS}

    # -- power --------------------------------------------------------------------------------
    def cut(self, torn: bool, seed: int) -> dict[str, int]:
        """Lose power: drop every unsynced page (tearing the last one written, if asked)."""
        with self._mutex:
            self.powered = False
            self.cuts += 1
            torn_bytes = 0
            if torn and self.last_write is not None:
                f, index = self.last_write
                if index in f.pages and f.fd is not None:
                    keep = random.Random(seed).randrange(1, PAGE // SECTOR) * SECTOR
                    torn_bytes = min(keep, max(0, f.size - index * PAGE))
                    os.pwrite(f.fd, f.pages[index][:torn_bytes], index * PAGE)
            dropped = 0
            for f in {id(f): f for f in [*self.files.values(), *self.handles.values()]}.values():
                dropped += sum(len(p) for p in f.pages.values())
                f.forget_pages()
            self.files.clear()  # sizes are re-read from the disk on the next open
            for fh, f in self.handles.items():
                f.size = os.fstat(fh).st_size
            self.last_write = None
            self.dropped_bytes += dropped
            return {"dropped_bytes": dropped, "torn_bytes": torn_bytes}

    def power_on(self) -> None:
        with self._mutex:
            self.powered = True

    def stats(self) -> dict[str, int]:
        with self._mutex:
            files = {id(f): f for f in [*self.files.values(), *self.handles.values()]}.values()
            unsynced = sum(len(p) for f in files for p in f.pages.values())
            return {
                "cuts": self.cuts,
                "synced_bytes": self.synced_bytes,
                "dropped_bytes": self.dropped_bytes,
                "unsynced_bytes": unsynced,
            }


_STAT_KEYS = ("st_mode", "st_ino", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks")
_STATVFS_KEYS = (
    "f_bsize",
    "f_frsize",
    "f_blocks",
    "f_bfree",
    "f_bavail",
    "f_files",
    "f_ffree",
    "f_favail",
    "f_flag",
    "f_namemax",
)


def _backing_flags(flags: int) -> int:
    """A writer's backing descriptor can also read (unsynced pages are filled from the disk)
    and writes at the offsets the kernel gives (it resolves O_APPEND itself)."""
    if flags & os.O_ACCMODE != os.O_RDONLY:
        flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
    return (flags & ~os.O_APPEND) | os.O_CLOEXEC


def _fuse_error(code: int) -> Exception:
    return mfusepy.FuseOSError(code)


def _control(fs: PowerFS, sock_path: str) -> None:
    """Answer the test's commands, one JSON line per connection."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen()
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as stream:
            ask = json.loads(stream.readline())
            if ask["op"] == "cut":
                answer = fs.cut(bool(ask.get("torn")), int(ask.get("seed", 0)))
            elif ask["op"] == "on":
                fs.power_on()
                answer = {}
            else:
                answer = fs.stats()
            stream.write(json.dumps(answer) + "\n")


def serve(backing: str, mount: str, sock_path: str) -> None:
    fs = PowerFS(Path(backing))
    threading.Thread(target=_control, args=(fs, sock_path), daemon=True).start()
    # No kernel caching of attributes or names: a size or file that a cut took back must not
    # be served from the kernel's memory afterwards.
    mfusepy.FUSE(
        fs,
        mount,
        foreground=True,
        nothreads=True,
        fsname="powerfs",
        attr_timeout=0,
        entry_timeout=0,
        negative_timeout=0,
    )


if __name__ == "__main__":
    serve(*sys.argv[1:4])
