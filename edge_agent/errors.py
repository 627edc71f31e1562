"""Exceptions raised by the edge agent.

    EdgeAgentError
    ├── ConfigError          bad or missing configuration (CLI exit code 2)
    ├── IslandError          the local nats-server could not be rendered, started or reached
    └── StreamError          the island refused a stream configuration

`retriable` says whether the same call may succeed later without anyone changing anything;
tenacity retries key on it.
"""

from __future__ import annotations


class EdgeAgentError(Exception):
    """Base of every error the agent raises on purpose."""

    retriable = False


class ConfigError(EdgeAgentError):
    """The configuration file is missing, unreadable or has a bad value."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}" if key else problem)


class IslandError(EdgeAgentError):
    """The island (local nats-server) is not usable."""


class IslandUnavailable(IslandError):
    """The island is down or restarting; waiting may help."""

    retriable = True


class StreamError(EdgeAgentError):
    """A stream could not be created or updated as configured."""
