"""Exceptions raised by the edge agent, on top of the shared protocol's
(`edge_agent.protocol.errors`: `ConfigError`, `StreamError`, `StoreTrouble`,
`MonitorUnavailable`).

    ProtocolError
    ├── ConfigError          bad or missing configuration (CLI exit code 2)
    ├── StreamError          the island refused a stream configuration
    │   └── StoreTrouble     it could not write it (a full disk; retried)
    ├── MonitorUnavailable   a monitoring endpoint does not answer
    └── EdgeAgentError
    ├── IslandError          the local nats-server could not be rendered, started or reached
    │   └── IslandUnavailable   down or restarting (also a MonitorUnavailable)
    ├── StateDBError         the agent's SQLite file could not be opened, read or written
    │   └── StateDBBusy      another process held its write lock past the busy timeout
    ├── OutboxError          the outbox could not take or hand on a message
    │   ├── TooLarge         larger than the island will ever take (CLI exit code 1)
    │   ├── OutboxFull       its byte budget is used up (CLI exit code 1)
    │   ├── NoSuchDeadLetter `dead-letter retry|drop` named ids that are not dead letters
    │   └── DrainBlocked     the island did not store a batch (down, restarting, full)
    ├── CommandRefused       a command is answered without running (rejected or expired)
    └── CommandFailed        a handler ran and failed (an "error" result, with its output)

`retriable` says whether the same call may succeed later without anyone changing anything;
tenacity retries key on it.
"""

from __future__ import annotations

from typing import Literal

from edge_agent.protocol.errors import ConfigError, MonitorUnavailable, ProtocolError, StreamError

__all__ = [
    "CommandFailed",
    "CommandRefused",
    "ConfigError",
    "DrainBlocked",
    "EdgeAgentError",
    "IslandError",
    "IslandUnavailable",
    "OutboxError",
    "OutboxFull",
    "ProtocolError",
    "StateDBBusy",
    "StateDBError",
    "StreamError",
    "TooLarge",
    "is_retriable",
]


class EdgeAgentError(ProtocolError):
    """Base of every error the agent itself raises on purpose."""


def is_retriable(exc: BaseException) -> bool:
    """The tenacity predicate: retry only what may succeed later unchanged."""
    return isinstance(exc, ProtocolError) and exc.retriable


class IslandError(EdgeAgentError):
    """The island (local nats-server) is not usable."""


class IslandUnavailable(IslandError, MonitorUnavailable):
    """The island is down or restarting; waiting may help."""

    retriable = True


class StoreDamaged(IslandUnavailable):
    """The island cannot recover a stream from its files (a power cut under an interval sync
    policy); the agent sets the stream aside and starts the island again."""

    def __init__(self, account: str, stream: str) -> None:
        super().__init__(f"island cannot recover stream {stream} (account {account})")
        self.account, self.stream = account, stream


class StateDBError(EdgeAgentError):
    """The agent's SQLite file (outbox and command ledger) could not be opened, read or written."""


class StateDBBusy(StateDBError):
    """Another process (``edge-agent publish``, a stalled fsync) held the file's write lock
    past the busy timeout; the same write succeeds once it lets go."""

    retriable = True


class OutboxError(EdgeAgentError):
    """The outbox could not take or hand on a message."""


class OutboxFull(OutboxError):
    """Appending would exceed the outbox's byte budget; draining frees space."""

    retriable = True

    def __init__(self, size: int, used: int, max_bytes: int) -> None:
        self.size, self.used, self.max_bytes = size, used, max_bytes
        if size > max_bytes:
            message = (
                f"a {size}-byte message is larger than the outbox may ever hold for it "
                f"({max_bytes} bytes, from outbox.max_bytes)"
            )
        else:
            message = (
                f"outbox full: {used} of {max_bytes} bytes used, a {size}-byte message does "
                f"not fit (outbox.max_bytes; is the island down?)"
            )
        super().__init__(message)


class TooLarge(OutboxError):
    """A message the island could never store: refused before it enters the outbox."""

    def __init__(self, size: int, max_payload: int) -> None:
        self.size, self.max_payload = size, max_payload
        super().__init__(
            f"message too large: {size} bytes with its headers, the island takes at most "
            f"{max_payload} (island.max_payload); it could never be sent"
        )


class NoSuchDeadLetter(OutboxError):
    """Ids named to `dead-letter retry|drop` that are not dead letters; nothing was changed."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        super().__init__(
            f"no dead letter with id {', '.join(map(str, ids))} (edge-agent dead-letter list); "
            f"nothing changed"
        )


class DrainBlocked(OutboxError):
    """The island did not acknowledge a batch; its rows stay and are sent again later."""

    retriable = True


class CommandRefused(EdgeAgentError):
    """A command is answered without running: `status` is "rejected" or "expired".

    `field` names the envelope field (or argument, ``args.argv``) that is wrong.
    """

    def __init__(
        self, field: str, problem: str, status: Literal["rejected", "expired"] = "rejected"
    ) -> None:
        self.field, self.problem, self.status = field, problem, status
        super().__init__(f"{field}: {problem}")


class CommandFailed(EdgeAgentError):
    """A handler ran and failed; `output` (e.g. what a program printed) goes in the result."""

    def __init__(self, problem: str, output: object = None) -> None:
        self.output = output
        super().__init__(problem)
