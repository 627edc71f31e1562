"""The uplink's pace (`edge_agent.island.pace`): packs, or an unpacked stream's window, sized
so that one window of the hub's mirror crosses in `ROUND_S`, from the rounds the hub
acknowledges."""

from __future__ import annotations

import pytest

from edge_agent.island.pace import (
    MAX_BYTES,
    MIN_BYTES,
    MIN_WINDOW,
    ROUND_S,
    START_BYTES,
    Pace,
    Window,
)

WINDOW = 8


def _round(pace: Pace, first: int, packs: int, size: int, at: float, *, full: bool) -> int:
    """Publish `packs` packs of `size` bytes from sequence `first`, see the window full (or
    not) while they cross, and the hub acknowledge them all at `at`; the next sequence."""
    for seq in range(first, first + packs):
        pace.sent(seq, size, cut=True)
    pace.observe(first - 1, WINDOW if full else 1, WINDOW, at - 0.1)
    pace.observe(first + packs - 1, 0, WINDOW, at)
    return first + packs


def test_packs_follow_the_link_when_the_window_is_full() -> None:
    pace = Pace()
    assert pace.pack_bytes == START_BYTES
    seq = _round(pace, 1, WINDOW, START_BYTES, 1.0, full=True)  # starts the clock
    assert pace.pack_bytes == START_BYTES
    # 8 packs of 8 KiB acknowledged 2 s later: 32 KiB/s, so a round of ROUND_S holds
    # 32 KiB/s x ROUND_S, in 8 packs.
    _round(pace, seq, WINDOW, START_BYTES, 3.0, full=True)
    assert pace.rate == WINDOW * START_BYTES / 2.0
    assert pace.pack_bytes == int(WINDOW * START_BYTES / 2.0 * ROUND_S / WINDOW)


def test_a_slow_link_makes_packs_small_and_no_smaller_than_the_least() -> None:
    pace = Pace()
    seq = _round(pace, 1, WINDOW, START_BYTES, 1.0, full=True)
    _round(pace, seq, WINDOW, START_BYTES, 1.0 + 3 * ROUND_S, full=True)
    assert MIN_BYTES < pace.pack_bytes < START_BYTES
    pace = Pace()
    seq = _round(pace, 1, WINDOW, 100, 1.0, full=True)
    _round(pace, seq, WINDOW, 100, 3.0, full=True)
    assert pace.pack_bytes == MIN_BYTES


def test_packs_grow_while_the_window_is_not_full_and_stop_at_the_most() -> None:
    pace, seq, at = Pace(), 1, 1.0
    for _ in range(10):
        seq = _round(pace, seq, 2, pace.pack_bytes, at, full=False)
        at += 0.2
    assert pace.rate is None
    assert pace.pack_bytes == MAX_BYTES


def test_a_trickle_or_a_link_down_changes_nothing() -> None:
    pace = Pace()
    pace.sent(1, 100, cut=False)
    pace.observe(0, 1, WINDOW, 1.0)
    pace.observe(1, 0, WINDOW, 2.0)  # a pack that was not cut: readings were not waiting
    pace.sent(2, 100, cut=True)
    pace.observe(2, 0, WINDOW, 2.0 + 10 * ROUND_S)  # a round as long as a cut link
    assert (pace.pack_bytes, pace.rate) == (START_BYTES, None)


def test_on_a_long_link_packs_fill_rounds_of_several_round_trips() -> None:
    """On a 600 ms link, 8 packs of 8 KiB a round of 2.6 s crossed in 2 s: 32 KiB/s, and a
    round may take five round trips there, 3 s, of which 2.4 s crossing: packs of 9.6 KiB.
    Counting the round trip as the link's slowness, and rounds of `ROUND_S`, they would
    shrink to 6 KiB. On a shorter link a round stays at `ROUND_S`, the reply in it."""
    pace = Pace(rtt=0.6)
    seq = _round(pace, 1, WINDOW, START_BYTES, 1.0, full=True)
    _round(pace, seq, WINDOW, START_BYTES, 3.6, full=True)
    assert pace.rate == WINDOW * START_BYTES / 2.0
    assert pace.pack_bytes == int(WINDOW * START_BYTES / 2.0 * 2.4 / WINDOW)
    pace = Pace(rtt=0.3)
    seq = _round(pace, 1, WINDOW, START_BYTES, 1.0, full=True)
    _round(pace, seq, WINDOW, START_BYTES, 1.0 + 2 * ROUND_S, full=True)
    assert pace.rate is not None
    assert WINDOW * pace.pack_bytes / pace.rate + 0.3 == pytest.approx(ROUND_S, rel=1e-3)
    pace = Pace()
    seq = _round(pace, 1, WINDOW, START_BYTES, 1.0, full=True)
    _round(pace, seq, WINDOW, START_BYTES, 3.6, full=True)
    assert pace.pack_bytes == int(WINDOW * START_BYTES / 2.6 * ROUND_S / WINDOW)


def test_a_telemetry_made_again_starts_the_count_over() -> None:
    pace = Pace()
    seq = _round(pace, 1, WINDOW, START_BYTES, 1.0, full=True)
    seq = _round(pace, seq, WINDOW, START_BYTES, 3.0, full=True)
    measured = pace.pack_bytes
    _round(pace, 1, WINDOW, START_BYTES, 4.0, full=True)  # sequences from 1 again
    _round(pace, WINDOW + 1, WINDOW, START_BYTES, 5.0, full=True)  # twice as fast now
    assert pace.pack_bytes > measured


def _window_round(window: Window, floor: int, at: float, *, full: bool) -> int:
    """One round of `window.size` messages acknowledged at `at`, the window seen full (or
    not) while they crossed; the new floor."""
    size = window.size
    window.observe(floor, size if full else 1, size, at - 0.1)
    window.observe(floor + size, 0, size, at)
    return floor + size


def test_a_window_is_what_the_link_carries_in_a_round() -> None:
    window = Window(size=1_000, most=10_000)
    floor = _window_round(window, 0, 1.0, full=True)  # starts the clock
    assert window.size == 1_000
    floor = _window_round(window, floor, 5.0, full=True)  # 1,000 in 4 s: 250/s
    assert window.size == int(250 * ROUND_S)
    # A fast link: rounds of 0.5 s. The window doubles a round at most; the round after a
    # change started with the old window, and is not a measure.
    sizes = []
    for at in (5.5, 6.0, 6.5, 7.0, 7.5, 8.0):
        floor = _window_round(window, floor, at, full=True)
        sizes.append(window.size)
    assert sizes == [500, 1_000, 1_000, 2_000, 2_000, 4_000]
    # Not full: the window was not what held the link back, so it says nothing.
    _window_round(window, floor, 50.0, full=False)
    assert window.size == 4_000


def test_a_window_shrinks_no_more_than_a_round_allows_nor_below_the_least() -> None:
    window = Window(size=1_000, most=10_000)
    floor = _window_round(window, 0, 1.0, full=True)
    floor = _window_round(window, floor, 1.0 + 3 * ROUND_S, full=True)  # 1,000 in 6 s
    assert window.size == 500  # not 333: halved at most
    window = Window(size=100, most=10_000)
    floor = _window_round(window, 0, 1.0, full=True)
    _window_round(window, floor, 1.0 + 3 * ROUND_S, full=True)
    assert window.size == MIN_WINDOW
    # A round as long as a cut link, or a stream made again (its floor drops), is no measure.
    window = Window(size=1_000, most=10_000)
    floor = _window_round(window, 0, 1.0, full=True)
    floor = _window_round(window, floor, 1.0 + 10 * ROUND_S, full=True)
    assert window.size == 1_000
    window.observe(5, 1_000, 1_000, 30.0)
    window.observe(10, 0, 1_000, 30.5)
    assert window.size == 1_000


def test_a_long_round_trip_is_not_counted_as_the_link_carrying_less() -> None:
    """On a 600 ms link, a window of 1,000 that took 2.6 s a round crossed in 2 s; a request
    may wait five round trips behind it there, 3 s: 1,500."""
    window = Window(size=1_000, most=10_000, rtt=0.6)
    floor = _window_round(window, 0, 1.0, full=True)
    _window_round(window, floor, 3.6, full=True)
    assert window.size == 1_500
    window = Window(size=1_000, most=10_000)  # as if the round trip were the link's slowness
    floor = _window_round(window, 0, 1.0, full=True)
    _window_round(window, floor, 3.6, full=True)
    assert window.size == int(1_000 / 2.6 * ROUND_S)


def test_a_window_follows_what_a_request_waits_behind_it() -> None:
    """Once a request sent as a round began has been timed, the window is sized by what it
    waited: about `ROUND_S` is left alone, more shrinks it, little grows it to the most."""
    window = Window(size=600, most=2_000, queued=2.4)
    floor = _window_round(window, 0, 1.0, full=True)
    floor = _window_round(window, floor, 4.0, full=True)
    assert window.size == 600  # 500 wanted: within the margin
    window.queued = 4.0
    floor = _window_round(window, floor, 7.0, full=True)
    assert window.size == 300
    window.queued = 0.1  # the hub, not the link, holds the window back
    sizes = []
    for at in (8.0, 9.0, 10.0, 11.0, 12.0, 13.0):
        floor = _window_round(window, floor, at, full=True)
        sizes.append(window.size)
    assert sizes == [300, 600, 600, 1_200, 1_200, 2_000]
