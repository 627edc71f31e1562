"""Property: any command message yields a `Command` or a `CommandRefused` naming the field,
never another exception; the executor's loop relies on it to answer every message."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from edge_agent.commands.parse import Command, Incoming, command_id, parse_command
from edge_agent.core.errors import CommandRefused

DEVICE = "a"
MAX_PAYLOAD = 4096
KNOWN = {"ping": object(), "exec": object()}
NOW = datetime(2030, 1, 1, tzinfo=UTC)
FIELDS = {"payload", "id", "type", "subject", "device_id", "args", "issued_at", "expires_at"}

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(["2029-12-31T00:00:00Z", "2031-01-01T00:00:00+02:00", "yesterday"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner),
    max_leaves=8,
)


@st.composite
def envelopes(draw: st.DrawFn) -> dict[str, Any]:
    """Mostly well-formed envelopes with some fields missing or replaced by any JSON value."""
    good: dict[str, Any] = {
        "id": draw(st.text(min_size=1, max_size=12) | st.just("c-1")),
        "type": draw(st.sampled_from(["ping", "exec", "nope", ""])),
        "device_id": draw(st.sampled_from([DEVICE, "all", "b"])),
        "args": {},
        "issued_at": "2029-12-31T00:00:00Z",
        "expires_at": draw(st.sampled_from([None, "2031-01-01T00:00:00Z", "2029-01-01"])),
    }
    for key in draw(st.lists(st.sampled_from(sorted(good)), unique=True)):
        if draw(st.booleans()):
            del good[key]
        else:
            good[key] = draw(json_values)
    return good


subjects = st.sampled_from(
    ["cmd.a.ping", "cmd.all.exec", "cmd.b.ping", "cmd.a", "cmd", "", "cmd.a.ping.x"]
) | st.text(max_size=20)


def _check(item: Incoming) -> None:
    try:
        command = parse_command(item, DEVICE, MAX_PAYLOAD, KNOWN, NOW)
    except CommandRefused as exc:
        assert exc.field in FIELDS, exc.field
        assert exc.status in ("rejected", "expired")
        assert str(exc).startswith(f"{exc.field}: ") and exc.problem
    else:
        assert isinstance(command, Command)
        assert command.type in KNOWN and command.device_id in (DEVICE, "all")
        assert command.expires_at is None or command.expires_at > NOW
    found = command_id(item, MAX_PAYLOAD)
    assert found is None or (isinstance(found, str) and 0 < len(found) <= 128)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200), subjects, st.dictionaries(st.text(max_size=12), st.text()))
@example(b"[" * 4000, "cmd.a.ping", {})  # deeper than Python's recursion limit
@example(b"\xff\xfe", "cmd.a.ping", {"Nats-Msg-Id": "m-1"})
@example(b'{"id": 1e999}', "cmd.a.ping", {})
@example(b"9" * 4090, "cmd.a.ping", {})  # more digits than int() takes
def test_any_bytes_are_a_command_or_a_named_refusal(
    data: bytes, subject: str, headers: dict[str, str]
) -> None:
    _check(Incoming(1, subject, data, headers, "mirror"))


@settings(max_examples=500, deadline=None)
@given(envelopes(), subjects)
def test_any_envelope_is_a_command_or_a_named_refusal(body: dict[str, Any], subject: str) -> None:
    data = json.dumps(body).encode()
    _check(Incoming(7, subject, data, {}, "hub"))


@settings(max_examples=200, deadline=None)
@given(json_values)
def test_any_json_document_is_a_command_or_a_named_refusal(value: object) -> None:
    _check(Incoming(3, "cmd.a.ping", json.dumps(value).encode(), {}, "mirror"))


def test_a_good_envelope_parses() -> None:
    """The strategies above must reach the success path too, or they test only refusals."""
    body = {"id": "c-1", "type": "ping", "args": {}, "issued_at": "2029-12-31T00:00:00Z"}
    command = parse_command(
        Incoming(1, "cmd.a.ping", json.dumps(body).encode(), {}, "mirror"),
        DEVICE,
        MAX_PAYLOAD,
        KNOWN,
        NOW,
    )
    assert (command.id, command.type, command.device_id) == ("c-1", "ping", "a")
