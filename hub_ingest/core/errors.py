"""Exceptions raised by the hub tools.

    HubIngestError
    ├── ConfigError          bad or missing hub configuration (CLI exit code 2)
    ├── HubUnreachableError  the hub refused the connection or did not answer
    ├── RegistryError        the device registry refused a change (unknown or duplicate device)
    │   └── EnrolmentError   a device asked for cannot be enrolled as asked (names its line)
    ├── ProvisionError       the hub refused a stream configuration
    ├── ReportError          the fleet report could not read what it needs from the hub
    ├── LocalFleetError      a process of the local (demo) fleet did not start
    ├── IngestError          the Spark ingest stopped without archiving what it was asked to
    │   └── DataLossError    retention removed messages before the archive had them
    ├── ArchiveError         the archive table cannot be read or changed as asked
    └── RolloutError         a release or a rollout cannot be published, started or changed

`retriable` says whether the same call may succeed later without anyone changing anything.
"""

from __future__ import annotations


class HubIngestError(Exception):
    """Base of every error the hub tools raise on purpose."""

    retriable = False


class ConfigError(HubIngestError):
    """The hub configuration file is missing, unreadable or has a bad value."""


class HubUnreachableError(HubIngestError):
    """No hub server accepted a connection: it is down, or refused our key."""


class RegistryError(HubIngestError):
    """A registry change cannot be made as asked."""


class EnrolmentError(RegistryError):
    """A device in an enrolment request is malformed or conflicts with the registry."""

    def __init__(self, source: str, line: int, device_id: str, reason: str) -> None:
        self.source, self.line, self.device_id, self.reason = source, line, device_id, reason
        where = source if line == 0 else f"{source} line {line}"
        super().__init__(f"{where}: device {device_id!r}: {reason}; nothing was enrolled")


class ProvisionError(HubIngestError):
    """A hub stream could not be created or updated."""


class ReportError(HubIngestError):
    """The hub did not answer a question the fleet report asked it."""

    def __init__(self, message: str, *, err_code: object = None) -> None:
        super().__init__(message)
        self.err_code = err_code  # JetStream's, when the hub answered with an error


class LocalFleetError(HubIngestError):
    """A process of the local fleet exited or did not get ready in time; its log says why."""


class IngestError(HubIngestError):
    """The ingest query failed; the checkpoint still says what was archived."""


class DataLossError(IngestError):
    """Messages the archive never saw are gone from an aggregate stream."""

    def __init__(self, stream: str, first: int, last: int) -> None:
        self.stream, self.first, self.last = stream, first, last
        super().__init__(
            f"data loss: retention removed {last - first + 1} messages of {stream} "
            f"(seq {first}..{last}) before they were archived; "
            "set ingest.fail_on_data_loss = false to skip them"
        )


class ArchiveError(HubIngestError):
    """The archive table is missing, moved, or refused a change (compaction, relocation)."""


class RolloutError(HubIngestError):
    """A release cannot be published, or a rollout started or changed as asked (says why)."""
