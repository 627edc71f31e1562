"""sd_notify without a dependency: one datagram per message to ``$NOTIFY_SOCKET``.

systemd (``Type=notify``, ``WatchdogSec=``) reads ``READY=1``, ``WATCHDOG=1`` and
``STOPPING=1`` from this socket. Outside systemd the variable is unset and every call is a
no-op, so the agent runs the same under a terminal, in tests and in containers.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        # "@name" is a socket in the abstract namespace, spelled with a leading NUL byte.
        self.address = "\0" + address[1:] if address.startswith("@") else address
        self.watchdog_interval: float | None = None
        usec, pid = env.get("WATCHDOG_USEC", ""), env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            # Half the deadline, as sd_watchdog_enabled(3) recommends.
            self.watchdog_interval = int(usec) / 2e6

    def notify(self, *states: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False (and a log line) if it failed."""
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto("\n".join(states).encode(), self.address)
        except OSError as exc:
            log.warning("sd_notify_failed", states=list(states), error=str(exc))
            return False
        return True

    def ready(self) -> bool:
        return self.notify("READY=1", "STATUS=serving")

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", "STATUS=stopping")
