"""How large the packer's packs are: one window of the hub's mirror crosses in `ROUND_S`.

The hub's mirror takes packs through a consumer on the island that acknowledges by flow
control: it sends up to its window (`max_ack_pending` packs), then waits for the hub's reply
before the next. Everything else the device sends up the link (the fence, fast resume's
reads, status replies) queues behind that window. Full packs over a 256 kbit/s link made it
9 s deep, and a new device's first command waited 22 s for its fence.

So each round (one reply of the hub) is measured: when the window was full in it, the link
set its pace, and a pack becomes what the link carried per second times `ROUND_S`, divided
by the window; a round then settles at `ROUND_S` (the window's crossing plus the reply's
round trip), whatever the link, and a request queues behind at most about that. When the
window was not full but packs were cut to size (readings were left for the next one), the
link could take more: packs double, up to `MAX_BYTES`. Packs start at `MIN_BYTES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUND_S = 2.0  # what one window of packs may take, reply included
MIN_BYTES = 2 * 1024  # about ten readings: below it, per-message costs come back
# The first packs, before a round is measured: 32 of them at ~3x compression (or 6 without)
# cross the slowest link planned for, 256 kbit/s, in about 2.5 s.
START_BYTES = 8 * 1024
MAX_BYTES = 32 * 1024  # of payload per pack, at most (a larger reading goes alone)
_STALL_S = 4 * ROUND_S  # a round longer than this was a link down, not a measure


@dataclass(slots=True)
class Pace:
    pack_bytes: int = START_BYTES
    rate: float | None = None  # bytes a second the hub acknowledged, in the last full round
    _unacked: dict[int, int] = field(default_factory=dict)  # pack sequence → its bytes
    _floor: int = 0
    _since: float | None = None  # when the last round ended
    _full: bool = False  # the window was full in this round: the link set the pace
    _cut: bool = False  # a pack was cut to size in this round: readings were waiting

    def sent(self, seq: int, size: int, cut: bool) -> None:
        """Pack `seq` of `size` bytes was published; `cut`: readings were left over."""
        self._unacked[seq] = size
        self._cut = self._cut or cut

    def observe(self, floor: int, in_flight: int, window: int, now: float) -> None:
        """The hub's consumer acknowledged up to pack `floor` and has `in_flight` packs
        delivered and not acknowledged, of `window` at most."""
        if floor < self._floor:  # a TELEMETRY made again: its sequences start over
            self._unacked.clear()
            self._floor, self._since = floor, None
        if floor > self._floor:  # a round ended
            acked = sum(self._unacked.pop(s) for s in [s for s in self._unacked if s <= floor])
            self._floor = floor
            if self._since is not None and 0 < now - self._since <= _STALL_S:
                self._resize(acked / (now - self._since), window)
            self._since, self._full, self._cut = now, False, False
        self._full = self._full or in_flight >= window

    def _resize(self, rate: float, window: int) -> None:
        if self._full:
            self.rate = rate
            size = self.rate * ROUND_S / max(window, 1)
        elif self._cut:
            size = self.pack_bytes * 2
        else:
            return
        self.pack_bytes = int(min(max(size, MIN_BYTES), MAX_BYTES))
