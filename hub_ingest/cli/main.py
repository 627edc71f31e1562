"""``hub-ingest`` command line. Exit codes: 0 ok, 1 check failed, 2 usage or config error,
3 the hub cannot be reached.

Each subcommand lives beside the code it drives: a module in `COMMAND_MODULES` exposes
``register(subparsers)``, which adds its parser and sets ``handler(config, args) -> int``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import nats.errors

from edge_agent.protocol.cliconfig import config_option
from edge_agent.protocol.logs import LOG_LEVELS, configure_logging
from hub_ingest.cli import commands as commands_cli
from hub_ingest.cli import devices as devices_cli
from hub_ingest.cli import ingest as ingest_cli
from hub_ingest.cli import provision as provision_cli
from hub_ingest.cli import report as report_cli
from hub_ingest.cli import rollout as rollout_cli
from hub_ingest.core.config import DEFAULT_CONFIG_PATH, load_hub_config
from hub_ingest.core.errors import ConfigError, HubIngestError, HubUnreachableError

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
DAEMONS = ("run", "watch")
COMMAND_MODULES = (provision_cli, devices_cli, report_cli, ingest_cli, commands_cli, rollout_cli)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hub-ingest",
        description="The hub's tools: its streams and nats-server config, enrolling devices, "
        "commands, the fleet report, and the archive the Spark ingest writes. Exit codes: 0 ok, "
        "1 a check failed, 2 usage or config error, 3 the hub cannot be reached.",
    )
    parser.add_argument(
        "--log-level", default="warning", choices=LOG_LEVELS, help="default: warning"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(sub)
    default = Path(os.environ.get("HUB_INGEST_CONFIG", DEFAULT_CONFIG_PATH))
    config_option(parser, default, "HUB_INGEST_CONFIG", "hub")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # The daemons log JSON lines for the journal on stdout; other commands keep stdout for
    # their output (`--json` parses) and log to stderr.
    daemon = args.command in DAEMONS
    configure_logging(args.log_level, stream=None if daemon else sys.stderr)
    try:
        config = load_hub_config(args.config)
        code: int = args.handler(config, args)
    except ConfigError as exc:
        print(f"hub-ingest: config error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except HubUnreachableError as exc:
        print(f"hub-ingest: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except HubIngestError as exc:
        print(f"hub-ingest: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        print(f"hub-ingest: cannot reach the hub: {exc or type(exc).__name__}", file=sys.stderr)
        return EXIT_UNREACHABLE
    return code


if __name__ == "__main__":
    sys.exit(main())
