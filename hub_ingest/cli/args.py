"""Turning the config parsers into argparse types, so flags and files accept the same values."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from edge_agent.protocol.tomlconf import identifier
from edge_agent.protocol.units import parse_duration

T = TypeVar("T")


def argument(parse: Callable[[str], T]) -> Callable[[str], T]:
    """An argparse ``type=`` from a parser whose ValueError becomes the usage error (exit 2)."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


duration = argument(parse_duration)
device_id = argument(identifier)
