"""The uplink's pace: one window of the hub's mirror crosses the link in about `ROUND_S`.

The hub's mirror takes packs through a consumer on the island that acknowledges by flow
control: it sends up to its window (`max_ack_pending` packs), then waits for the hub's reply
before the next. Everything else the device sends up the link (the fence, fast resume's
reads, status replies) queues behind that window. Full packs over a 256 kbit/s link made it
9 s deep, and a new device's first command waited 22 s for its fence.

So each round (one reply of the hub) is measured: when the window was full in it, the link
set its pace: the link's rate is what crossed while the window did (the round less the
link's round trip `rtt`), and a pack becomes what crosses at that rate in `ROUND_S` less the
round trip, divided by the window. A round (the window's crossing plus the reply's round
trip) then settles at `ROUND_S`, whatever the link, and a request queues behind at most
about that. On a long link the round trip is much of a round, and the link idles through
it: there a round may take up to `_WAIT_RTTS` round trips (twice `ROUND_S` at most), on a
600 ms satellite link 3 s. When the window was not full but packs were cut to size
(readings were left for the next one), the link could take more: packs double, up to
`MAX_BYTES`. Packs start at `START_BYTES`.

An unpacked stream's messages are as large as apps make them, so there the window itself is
sized (`Window`): as large as lets a request to the hub, sent as it goes, wait about
`ROUND_S` behind it (on a long link, as long as packs' rounds).
"""

from __future__ import annotations

from dataclasses import dataclass, field

ROUND_S = 2.0  # what one window of packs may take, reply included
MIN_BYTES = 2 * 1024  # about ten readings: below it, per-message costs come back
# The first packs, before a round is measured: 32 of them at ~3x compression (or 6 without)
# cross the slowest link planned for, 256 kbit/s, in about 2.5 s.
START_BYTES = 8 * 1024
MAX_BYTES = 128 * 1024  # of payload per pack, at most (a larger reading goes alone)
_STALL_S = 4 * ROUND_S  # a round longer than this was a link down, not a measure
MIN_WINDOW = 50  # messages: below it, the link idles a round trip for too little
# A window changes at most this much per round: a round timed between two polls may look
# far shorter or longer than it was.
_GROWTH = 2
_RESIZE = 0.2  # a window is set again only when the pace asks for this much more or less
# On a long link a request's own round trip is much of its wait anyway, and a window of
# `ROUND_S` idles the link for a round trip in every round (a 600 ms satellite link half the
# time): there a window may make a request wait up to this many round trips, twice `ROUND_S`
# at most.
_WAIT_RTTS = 5


def _wait(rtt: float) -> float:
    """How long a round may take on a link of round trip `rtt`: the packs' whole round, or
    what a request may queue behind an unpacked window."""
    return min(max(ROUND_S, _WAIT_RTTS * rtt), 2 * ROUND_S)


def _crossing(took: float, rtt: float) -> float:
    """How long a full window took to cross, of a round that `took` this long (the rest was
    the hub's reply coming back); at least half the round, should `rtt` be off."""
    return max(took - rtt, took / _GROWTH)


@dataclass(slots=True)
class Pace:
    pack_bytes: int = START_BYTES
    rtt: float = 0.0  # the link's round trip, as last measured
    rate: float | None = None  # bytes a second the link carried, in the last full round
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
                self._resize(acked, now - self._since, window)
            self._since, self._full, self._cut = now, False, False
        self._full = self._full or in_flight >= window

    def _resize(self, acked: int, took: float, window: int) -> None:
        if self._full:
            self.rate = acked / _crossing(took, self.rtt)
            size = self.rate * _crossing(_wait(self.rtt), self.rtt) / max(window, 1)
        elif self._cut:
            size = self.pack_bytes * 2
        else:
            return
        self.pack_bytes = int(min(max(size, MIN_BYTES), MAX_BYTES))


@dataclass(slots=True)
class Window:
    """The window (`max_ack_pending`) of an unpacked stream's hub consumer, from `MIN_WINDOW`
    to `most` messages: as large as lets a request to the hub wait at most `ROUND_S` behind it
    (on a long link, `_WAIT_RTTS` of its round trips `rtt`).

    `queued` is what the last request sent as a round began (the window just sent) waited
    more than the link's round trip. A window that made a request wait twice `ROUND_S` is
    halved; one that made it wait half of it or less doubles. When the hub, not the
    link, holds the window back (its fsyncs behind a compressed link), requests do not wait
    behind it and it grows: on a 600 ms satellite link, sizing by the round alone halved the
    drain. Until a request has been timed, the window is what the link carried per second
    while it crossed (the round less the link's round trip, `rtt`), times `ROUND_S`.
    """

    size: int
    most: int
    rtt: float = 0.0
    queued: float | None = None
    _floor: int = 0
    _since: float | None = None
    _full: bool = False

    def observe(self, floor: int, in_flight: int, window: int, now: float) -> bool:
        """As `Pace.observe`, counting messages: the hub acknowledged up to `floor`, with
        `in_flight` delivered and not acknowledged, of `window` at most; whether a round
        ended (a new window is on its way)."""
        if floor < self._floor:  # the stream was made again
            self._floor, self._since = floor, None
        ended = floor > self._floor
        if ended:
            since, self._since = self._since, now
            if self._full and since is not None and 0 < now - since <= _STALL_S:
                self._resize(floor - self._floor, now - since)
            self._floor, self._full = floor, False
        self._full = self._full or in_flight >= window
        return ended

    def _resize(self, acked: int, took: float) -> None:
        wait = _wait(self.rtt)
        if self.queued is None:
            wanted = acked / _crossing(took, self.rtt) * wait
        else:
            wanted = self.size * wait / max(self.queued, wait / _GROWTH)
        wanted = min(max(wanted, self.size / _GROWTH, MIN_WINDOW), self.size * _GROWTH, self.most)
        if abs(wanted - self.size) > _RESIZE * self.size:
            self.size = int(wanted)
            # The round under way started with the old window (a larger one is sent into it
            # at once; a smaller one waits for the flow control already asked for): it
            # measures neither.
            self._since = None
