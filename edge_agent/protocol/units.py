"""Parsing of the sizes and durations in configuration files; the one timestamp format."""

from __future__ import annotations

import re
from datetime import UTC, datetime

# nats-server's own spellings, with its meanings: "2G" is 2 * 1000**3 and "2GB", "2Gi" and
# "2GiB" are 2 * 1024**3 (conf/parse.go), so a size means the same here and in its config.
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])(I?B|I)?|B)?\s*$", re.IGNORECASE)
_SIZE_POWERS = {"k": 1, "m": 2, "g": 3, "t": 4, "p": 5}
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_FACTORS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_size(value: object) -> int:
    """Bytes from an int or a string like ``"2GiB"``, ``"512MB"`` (MiB, as nats-server reads
    it), ``"2G"`` (10**9) or ``"1024"``."""
    if isinstance(value, bool):
        raise ValueError(f'expected size like "2GiB", got {value!r}')
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"expected a size >= 0, got {value}")
        return value
    if isinstance(value, str) and (match := _SIZE_RE.match(value)):
        number, prefix, binary = match.groups()
        power = _SIZE_POWERS[prefix.lower()] if prefix else 0
        return int(float(number) * (1024 if binary else 1000) ** power)
    raise ValueError(f'expected size like "2GiB", "2G" or "512MB", got {value!r}')


def parse_duration(value: object) -> float:
    """Seconds from a number or a string like ``"250ms"``, ``"30s"``, ``"1h30m"`` or ``"7d"``."""
    if isinstance(value, bool):
        raise ValueError(f'expected duration like "30s", got {value!r}')
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"expected a duration >= 0, got {value}")
        return float(value)
    if isinstance(value, str):
        text = value.strip().lower()
        parts = _DURATION_RE.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sum(float(n) * _DURATION_FACTORS[u] for n, u in parts)
    raise ValueError(f'expected duration like "30s" or "2h", got {value!r}')


def utc_now_iso() -> str:
    return format_time(datetime.now(UTC))


def format_time(moment: datetime) -> str:
    """RFC 3339 in UTC with milliseconds and a ``Z``, as every timestamp we write looks."""
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def parse_time(value: object) -> datetime | None:
    """A timestamp from JetStream (RFC 3339, nanoseconds) or an envelope (ISO or epoch)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if not isinstance(value, str) or not value:
        return None
    text = value.strip().replace("Z", "+00:00")
    # Python takes at most microseconds; JetStream writes nanoseconds.
    head, dot, rest = text.partition(".")
    if dot:
        digits = len(rest) - len(rest.lstrip("0123456789"))
        text = f"{head}.{rest[: min(digits, 6)]}{rest[digits:]}"
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


def format_size(n: int) -> str:
    """Bytes for a reader: ``512 B``, ``1.5 MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"
