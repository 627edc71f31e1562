"""The ``-c/--config`` option of both command lines, taken before or after the subcommand
(``edge-agent status -c agent.toml`` as well as ``edge-agent -c agent.toml status``)."""

from __future__ import annotations

import argparse
from pathlib import Path

_SAME = "the same as -c before the subcommand"


def config_option(parser: argparse.ArgumentParser, default: Path, env: str, what: str) -> None:
    """Add ``-c/--config`` to `parser` and to every subcommand under it, however deep; call it
    once every subcommand is registered. The last one given wins."""
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        default=default,
        help=f"{what} config file (default: ${env} or {default})",
    )
    _add_to_subcommands(parser)


def _add_to_subcommands(parser: argparse.ArgumentParser) -> None:
    # argparse's own (private) attributes: it lists subcommands nowhere else.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                # SUPPRESS: given after the subcommand it overrides, absent it leaves the value.
                if "-c" not in sub._option_string_actions:
                    sub.add_argument(
                        "-c", "--config", type=Path, default=argparse.SUPPRESS, help=_SAME
                    )
                _add_to_subcommands(sub)
