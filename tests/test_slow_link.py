"""A backlog over a slow, lossy link that is also cut while it drains: every reading reaches
the hub exactly once, and a command sent meanwhile does not wait for the backlog.

`bench/slow_link.py` measures the speed; this checks correctness on smaller backlogs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.slow_link import LTE, SHAPES, drain
from edge_agent.commands import resume
from edge_agent.island.pace import ROUND_S
from hub_ingest.local.link import Shape


def behind_one_window(shape: Shape) -> float:
    """The longest a command sent while `shape`'s link drains a paced backlog may wait to
    start. It rides the island's command mirror once that is live (0.2 s), but nats-server
    resumes a mirror 10-40 s after its link returns, and until then fast resume reads it from
    the hub: a read that queues behind one window of the backlog, which the island keeps
    to about `ROUND_S` of the link and halves only past twice that
    (`edge_agent.island.pace`), then the answer's way back and fast resume's poll. Fast
    resume asks every poll without waiting for the read before (`resume.catch_up`): one read
    at a time, each giving up after 2 s, a command waited two windows or more (4.7 s in three
    runs of three of this file, 5.8 s in CI; 8.0-8.9 s beside the suite's other worker).
    The tests that assert it run `alone`."""
    return 2 * ROUND_S + shape.rtt + resume.POLL_S


async def test_backlog_crosses_a_lossy_cut_link_once_and_commands_overtake_it(
    tmp_path: Path,
) -> None:
    lossy = Shape(rtt=LTE.rtt, rate=LTE.rate, loss=0.01, seed=3)
    run = await drain(tmp_path, 3000, lossy, "s2_auto", cuts=2)
    assert (run.at_hub, run.lost, run.duplicated) == (3000, 0, 0)
    assert 0 <= run.command_start_s < 5, f"the command waited {run.command_start_s:.1f}s"


async def test_a_poor_rural_link_delivers_its_backlog_once(tmp_path: Path) -> None:
    """300 ms, 256 kbit/s, 5 % of segments lost: slow, yet complete, once, and a command
    still starts within seconds."""
    run = await drain(tmp_path, 600, SHAPES["rural"], "s2_auto")
    assert (run.at_hub, run.lost, run.duplicated) == (600, 0, 0)
    assert 0 <= run.command_start_s < 5, f"the command waited {run.command_start_s:.1f}s"


async def test_packed_backlog_crosses_a_lossy_cut_link_once(tmp_path: Path) -> None:
    """With ``hub.pack`` too: every reading in exactly one pack at the hub's mirror and in the
    aggregate, through two cuts, and a command still starts within seconds."""
    lossy = Shape(rtt=LTE.rtt, rate=LTE.rate, loss=0.01, seed=5)
    run = await drain(tmp_path, 3000, lossy, "s2_auto", cuts=2, packed=True)
    assert (run.at_hub, run.lost, run.duplicated) == (3000, 0, 0)
    assert 0 <= run.command_start_s < 5, f"the command waited {run.command_start_s:.1f}s"


@pytest.mark.alone
async def test_a_packed_backlog_leaves_a_poor_link_room_for_the_devices_requests(
    tmp_path: Path,
) -> None:
    """A new device's agent learns its command fence from the hub, up the link the backlog
    fills. With full packs, the hub's window held 9 s of this uncompressed 256 kbit/s link
    and the fence's requests timed out behind it until the backlog was gone (the command
    started after 4-22 s); paced packs (`edge_agent.island.pace`) keep a round near 2 s."""
    run = await drain(tmp_path, 2400, SHAPES["rural"], "off", packed=True)
    assert (run.at_hub, run.lost, run.duplicated) == (2400, 0, 0)
    waited = f"the command waited {run.command_start_s:.1f}s"
    assert 0 <= run.command_start_s < behind_one_window(SHAPES["rural"]), waited


@pytest.mark.alone
async def test_a_backlog_leaves_a_poor_link_room_for_a_command_sent_while_it_was_cut(
    tmp_path: Path,
) -> None:
    """Unpacked, the hub's mirror window is sized to the link (`edge_agent.island.windows`):
    with the fixed window of 1,000 readings (12 s of this uncompressed 256 kbit/s link) a
    command sent while the link was cut started 16.5 s after it returned, its fast resume
    reads queued behind the backlog."""
    run = await drain(tmp_path, 1200, SHAPES["rural"], "off")
    assert (run.at_hub, run.lost, run.duplicated) == (1200, 0, 0)
    assert 0 <= run.offline_command_s < 5, f"the command waited {run.offline_command_s:.1f}s"
    waited = f"the command waited {run.command_start_s:.1f}s"
    assert 0 <= run.command_start_s < behind_one_window(SHAPES["rural"]), waited
