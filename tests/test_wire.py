"""The wire reader leans on nats-py internals (hub_ingest/ingest/wire.py): fail loudly, naming what
moved, the day a nats-py release changes them."""

from __future__ import annotations

import inspect
from importlib.metadata import version

from nats.aio.client import Client
from nats.protocol import parser

from hub_ingest.ingest.wire import FrameClient, FrameParser


def test_nats_py_is_the_tested_minor() -> None:
    assert version("nats-py").startswith("2.16."), "re-test hub_ingest/ingest/wire.py, then re-pin"


def test_the_internals_the_wire_reader_uses_are_there() -> None:
    assert isinstance(parser.AWAITING_CONTROL_LINE, int)
    params = list(inspect.signature(Client._process_msg).parameters)
    assert params == ["self", "sid", "subject", "reply", "data", "headers"]
    client = FrameClient()
    assert isinstance(client._ps, FrameParser)
    assert isinstance(client._ps.buf, bytearray)
    assert client._ps.state == parser.AWAITING_CONTROL_LINE
    assert inspect.iscoroutinefunction(parser.Parser.parse)
