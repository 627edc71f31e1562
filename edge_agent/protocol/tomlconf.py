"""Reading TOML tables into typed values, naming the key of anything that is wrong.

Shared by the agent's and the hub's configuration loaders. Errors are `ConfigError`; the hub
package translates them into its own tree at its boundary.
"""

from __future__ import annotations

import difflib
import ipaddress
import re
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from edge_agent.protocol.errors import ConfigError
from edge_agent.protocol.units import parse_duration

T = TypeVar("T")

# Ids become subject tokens (cmd.<id>.>) and JetStream domains (edge-<id>): keep them plain.
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
_MISSING = object()


class Section:
    """One TOML table; remembers which keys were read so that leftovers can be refused."""

    def __init__(self, data: object, prefix: str = "") -> None:
        if not isinstance(data, dict):
            raise ConfigError(prefix, f"expected a table, got {data!r}")
        self._data: dict[str, Any] = data
        self._prefix = prefix
        self._used: set[str] = set()

    def key(self, name: str) -> str:
        return f"{self._prefix}.{name}" if self._prefix else name

    def has(self, name: str) -> bool:
        return name in self._data

    def get(self, name: str, parse: Callable[[object], T], default: Any = _MISSING) -> T:
        """The parsed value of `name`; without a `default` the key is required."""
        self._used.add(name)
        if name not in self._data:
            if default is _MISSING:
                # A misspelt required key is the likely cause: name the key that was written.
                for typo in difflib.get_close_matches(name, [str(k) for k in self._data]):
                    raise ConfigError(self.key(typo), f"unknown key (did you mean {name!r}?)")
                raise ConfigError(self.key(name), "missing (required)")
            return default  # type: ignore[no-any-return]
        try:
            return parse(self._data[name])
        except (TypeError, ValueError) as exc:
            raise ConfigError(self.key(name), str(exc)) from None

    def table(self, name: str) -> Section:
        self._used.add(name)
        return Section(self._data.get(name, {}), self.key(name))

    def finish(self) -> None:
        unknown = sorted(set(self._data) - self._used)
        if unknown:
            known = ", ".join(sorted(self._used))
            raise ConfigError(self.key(unknown[0]), f"unknown key (known here: {known})")


def read_toml(path: Path) -> dict[str, Any]:
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("", f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError("", f"{path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("", f"{path}: not valid TOML: {exc}") from None


def string(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def identifier(value: object) -> str:
    text = string(value)
    if not _ID_RE.match(text):
        raise ValueError(f"expected letters, digits, '-' or '_' (at most 64), got {text!r}")
    return text


# nats-server's leaf-link compression modes. s2_auto compresses once the round trip passes
# 10 ms, and harder past 50 and 100 ms; below 10 ms it still frames the link as s2, with
# the buffers that costs each side (about 1.3 MiB of the hub's memory per link).
COMPRESSION_MODES = ("off", "accept", "s2_fast", "s2_better", "s2_best", "s2_auto")
# The agent's own choice: "off" or "s2_auto" by the link's measured round trip
# (`edge_agent.island.compression`).
BY_RTT = "by_rtt"


def compression(value: object) -> str:
    if value not in COMPRESSION_MODES:
        raise ValueError(f"expected one of {', '.join(COMPRESSION_MODES)}, got {value!r}")
    return str(value)


def link_compression(value: object) -> str:
    """A device's `hub.compression`: a nats-server mode, or "by_rtt"."""
    if value == BY_RTT:
        return BY_RTT
    try:
        return compression(value)
    except ValueError:
        raise ValueError(
            f"expected {BY_RTT} or one of {', '.join(COMPRESSION_MODES)}, got {value!r}"
        ) from None


def sync_policy(value: object) -> float | None:
    """JetStream's ``sync_interval``: "always" (None: fsync before every PubAck) or a
    duration (fsync that often: a power cut loses up to that much acknowledged data)."""
    if value == "always":
        return None
    try:
        seconds = parse_duration(value)
    except ValueError:
        seconds = 0.0
    if seconds <= 0:
        raise ValueError(f'expected "always" or a duration like "1s", got {value!r}')
    return seconds


def format_sync(policy: float | None) -> str:
    """`sync_policy`'s value as the config file writes it (the inverse of `sync_policy`)."""
    return "always" if policy is None else f"{policy:g}s"


def render_sync(policy: float | None) -> str:
    """The nats-server ``sync_interval`` line for `sync_policy`'s value."""
    return (
        "sync_interval: always" if policy is None else f'sync_interval: "{round(policy * 1000)}ms"'
    )


def path(value: object) -> Path:
    return Path(string(value))


def positive_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"expected a whole number > 0, got {value!r}")
    return value


def url_list(value: object) -> tuple[str, ...]:
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list) or not urls:
        raise ValueError(f"expected a list of URLs, got {value!r}")
    for url in urls:
        if not isinstance(url, str) or "://" not in url:
            raise ValueError(f'expected URLs like "nats://host:4222", got {url!r}')
    return tuple(urls)


def host_port(value: object, *, loopback: bool) -> tuple[str, int]:
    text = string(value)
    host, sep, port_text = text.rpartition(":")
    if not sep or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f'expected "HOST:PORT", got {text!r}')
    host = host.strip("[]")
    if loopback:
        try:
            ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"must listen on loopback only (127.0.0.1, ::1 or localhost), got {host!r}"
            )
    return host, int(port_text)
