"""The packer's pace (`edge_agent.island.pace`): packs sized so that one window of the hub's
mirror crosses in `ROUND_S`, from the rounds the hub acknowledges."""

from __future__ import annotations

from edge_agent.island.pace import MAX_BYTES, MIN_BYTES, ROUND_S, START_BYTES, Pace

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


def test_a_telemetry_made_again_starts_the_count_over() -> None:
    pace = Pace()
    seq = _round(pace, 1, WINDOW, START_BYTES, 1.0, full=True)
    seq = _round(pace, seq, WINDOW, START_BYTES, 3.0, full=True)
    measured = pace.pack_bytes
    _round(pace, 1, WINDOW, START_BYTES, 4.0, full=True)  # sequences from 1 again
    _round(pace, WINDOW + 1, WINDOW, START_BYTES, 5.0, full=True)  # twice as fast now
    assert pace.pack_bytes > measured
