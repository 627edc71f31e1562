"""Property: any TOML document gives a `Config` or a `ConfigError` naming a key, never a crash."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from edge_agent.core.config import Config, parse_config
from edge_agent.core.errors import ConfigError

KEYS = {
    "": ["device_id", "agent", "island", "hub", "streams", "extra"],
    "agent": ["state_dir", "heartbeat_interval", "link_poll_interval"],
    "island": [
        "domain",
        "server_name",
        "store_dir",
        "max_file_store",
        "max_memory_store",
        "client_listen",
        "monitor_listen",
        "supervise",
        "nats_server",
        "config_path",
    ],
    "hub": ["urls", "domain", "credentials", "tls", "reconnect", "reconnect_spread"],
    "streams": ["telemetry", "events", "commands"],
}

scalars = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["1GiB", "10MB", "30s", "250ms", "child", "external", "127.0.0.1:4222"]),
    st.integers(min_value=-(2**40), max_value=2**40),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for key in draw(st.lists(st.sampled_from(KEYS[""]), unique=True)):
        if key in KEYS and draw(st.booleans()):
            sub = draw(st.lists(st.sampled_from(KEYS[key]), unique=True))
            doc[key] = {k: draw(values) for k in sub}
        else:
            doc[key] = draw(values)
    return doc


@settings(max_examples=400, deadline=None)
@given(documents())
def test_any_document_is_a_config_or_a_named_error(doc: dict[str, Any]) -> None:
    try:
        config = parse_config(doc)
    except ConfigError as exc:
        assert str(exc)
        assert exc.key == "" or exc.key.split(".")[0] in KEYS[""] or exc.key == "streams"
    else:
        assert isinstance(config, Config)
        total = sum(
            b.max_bytes
            for b in (config.streams.telemetry, config.streams.events, config.streams.commands)
        )
        assert total <= config.island.max_file_store


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=20))
def test_any_size_text_parses_or_is_refused(text: str) -> None:
    doc = {
        "device_id": "d",
        "island": {"max_file_store": text},
        "hub": {"urls": ["nats-leaf://127.0.0.1:7422"]},
    }
    try:
        parse_config(doc)
    except ConfigError as exc:
        assert exc.key.startswith(("island.max_file_store", "streams"))
