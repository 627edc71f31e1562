"""One log format: structlog events and the stdlib records of libraries (nats-py, py4j) come
out as the same JSON lines, on the stream chosen (stderr for CLI subcommands)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from edge_agent.protocol.logs import configure_logging


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    out = io.StringIO()
    configure_logging("info", json=True, stream=out)
    try:
        yield out
    finally:
        logging.getLogger().handlers = []
        structlog.reset_defaults()


def test_structlog_and_library_records_share_one_json_format(stream: io.StringIO) -> None:
    structlog.get_logger("edge_agent.app").info("agent_ready", device_id="a")
    logging.getLogger("nats.aio.client").error("nats: encountered error")
    logging.getLogger("py4j.clientserver").info("chatter nobody needs")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert [(e["event"], e["level"]) for e in lines] == [
        ("agent_ready", "info"),
        ("nats: encountered error", "error"),
    ]
    assert lines[0]["device_id"] == "a" and "timestamp" in lines[0]
    assert lines[1]["logger"] == "nats.aio.client" and "timestamp" in lines[1]
