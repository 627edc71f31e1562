"""Exceptions raised by the hub tools.

    HubIngestError
    ├── ConfigError          bad or missing hub configuration (CLI exit code 2)
    ├── RegistryError        the device registry refused a change (unknown or duplicate device)
    └── ProvisionError       the hub refused a stream configuration

`retriable` says whether the same call may succeed later without anyone changing anything.
"""

from __future__ import annotations


class HubIngestError(Exception):
    """Base of every error the hub tools raise on purpose."""

    retriable = False


class ConfigError(HubIngestError):
    """The hub configuration file is missing, unreadable or has a bad value."""


class RegistryError(HubIngestError):
    """A registry change cannot be made as asked."""


class ProvisionError(HubIngestError):
    """A hub stream could not be created or updated."""
