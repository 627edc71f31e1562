"""An auth callout for `bench/device_shapes.py`'s plain hub: devices admitted without a reload.

nats-server (config mode) sends every connection whose user is not in the callout's
``auth_users`` — leaf connections included — to ``$SYS.REQ.USER.AUTH`` as a JWT; the
service answers with a user JWT naming the account to bind to, signed by the issuer account
key the server was told of. A device admitted here links at once; no users file changes.

Bench-only: the devices' credentials are ``d<i>:d<i>`` as in `bench.fleetscale.bare`, and
the user JWT carries no permissions. The product's (`hub_ingest.fleet.admission`) checks the
device's NKey signature of the server's nonce and carries its permissions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import nats
import nkeys
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from hub_ingest.fleet.admission import AUTH_SUBJECT, claims_of, sign

CALLOUT_USER = "auth"  # the service's own user, in the hub's account, outside the callout


class Issuer:
    """An account key pair that signs the callout's answers (`hub_ingest.fleet.admission.sign`)."""

    def __init__(self) -> None:
        seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT)
        self._keys = nkeys.from_seed(bytearray(seed))
        self.public_key: str = self._keys.public_key.decode()

    def sign(self, claims: dict[str, object]) -> str:
        return sign(self._keys, claims)


async def _quiet(_: Exception) -> None:
    pass


def hub_authorization(issuer: Issuer, operators: list[str]) -> str:
    """The hub's ``authorization`` block: every connection but the `operators`' (and the
    service's own) asks the callout."""
    users = ", ".join([CALLOUT_USER, *operators])
    callout = f"issuer: {issuer.public_key}, account: FLEET, auth_users: [{users}]"
    return f"authorization {{ auth_callout {{ {callout} }} }}\n"


class Callout:
    """Answers the hub's authorization requests: user ``d<i>`` with password ``d<i>`` binds
    to the account `account_of(i)`; anyone else is refused."""

    def __init__(self, account_of: Callable[[int], str | None]) -> None:
        self.issuer, self.account_of = Issuer(), account_of
        self.answered = self.refused = 0
        self.busy_s = 0.0  # time spent answering
        self._nc: NATS | None = None

    def __str__(self) -> str:
        return f"{self.answered} answered, {self.refused} refused, {self.busy_s:.2f} s busy"

    async def start(self, client_port: int) -> None:
        """Connect to the hub as `CALLOUT_USER`, once: it reconnects itself after a restart."""
        if self._nc is not None:
            return
        self._nc = await nats.connect(
            f"nats://{CALLOUT_USER}:{CALLOUT_USER}@127.0.0.1:{client_port}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.1,
            error_cb=_quiet,  # the hub away while the bench restarts it
        )
        await self._nc.subscribe(AUTH_SUBJECT, cb=self._answer)

    async def close(self) -> None:
        if self._nc is not None:
            await self._nc.close()

    async def _answer(self, msg: Msg) -> None:
        start = time.monotonic()
        request = claims_of(msg.data.decode())["nats"]
        assert isinstance(request, dict)
        user_key, server = request["user_nkey"], request["server_id"]["id"]
        opts = request.get("connect_opts") or {}
        name = str(opts.get("user", ""))
        i = int(name[1:]) if name[:1] == "d" and name[1:].isdigit() else -1
        response: dict[str, object] = {"type": "authorization_response", "version": 2}
        account = self.account_of(i) if i >= 0 else None
        if account is not None and opts.get("pass") == name:
            user = {"name": name, "sub": user_key, "aud": account}
            limits = {"subs": -1, "data": -1, "payload": -1}
            response["jwt"] = self.issuer.sign(
                {**user, "nats": {"type": "user", "version": 2, **limits}}
            )
            self.answered += 1
        else:
            response["error"] = f"not admitted: {name!r}"
            self.refused += 1
        answer = self.issuer.sign({"sub": user_key, "aud": server, "nats": response})
        self.busy_s += time.monotonic() - start
        await msg.respond(answer.encode())
