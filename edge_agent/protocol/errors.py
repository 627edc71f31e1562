"""Exceptions of the shared protocol code; each package's own tree builds on them.

ProtocolError
├── ConfigError          bad or missing configuration: names the key (CLI exit code 2)
├── StreamError          a server refused a stream configuration
│   └── StoreTrouble     it could not write it (a full disk, no room under its limits; retriable)
└── MonitorUnavailable   a nats-server's monitoring endpoint does not answer (retriable)
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base of every error raised on purpose by the agent, the hub tools or this package."""

    retriable = False


class ConfigError(ProtocolError):
    """The configuration file is missing, unreadable or has a bad value."""

    def __init__(self, key: str, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"{key}: {problem}" if key else problem)


class StreamError(ProtocolError):
    """A stream could not be created or updated as configured."""

    def __init__(self, message: str, *, err_code: int | None = None) -> None:
        super().__init__(message)
        self.err_code = err_code  # JetStream's, when the server answered with an error


class StoreTrouble(StreamError):
    """The server could not write a stream or consumer (a full disk, no room left under its
    JetStream limits): the same request succeeds once space returns or it is restarted."""

    retriable = True


class MonitorUnavailable(ProtocolError):
    """A nats-server's monitoring endpoint is down or says it is unhealthy; waiting may help."""

    retriable = True
