"""A device key in use on two machines at once: a disk copied after enrolment.

A device's island links with its key and its server name, and nats-server keeps one link
per name and account on a node, closing the older one when a newer one comes ("Replacing
connection from same server"). A device whose link dropped dials again and is let in once.
Two machines holding one device's key (a disk image taken from an enrolled device and
written to others) push each other off for as long as both run, each let in a second or so
after the other. Their islands hold different messages under the same sequences; the hub
mirrors from whichever is linked, and a mirror takes only sequences above its last:
readings of one or the other are lost with no gap to see, and both run the device's
commands.

The watcher that lets the links in (`hub_ingest.fleet.admission`) counts, per device, the
links let in within `QUICK_S` of the one before; `SHARED_AT` of them within `WINDOW_S` make
it a suspect, as a device whose power fails every few seconds is too. So for `CONFIRM_S` the
watcher then reads the system account's disconnect events, and `REPLACED_AT` of the
suspect's links closed as replaced by a newer one of its name (a link whose machine lost
power is closed, not replaced) mark the device shared in the figures, where `report` flags
and names it; its links are cut and every machine with its key is refused for
``server.shared_key_hold``: their readings wait on their islands instead of being lost in
the mix, until an operator gives the copy an identity of its own (or the hold ends, and the
count begins again). A restart's storm lets a device in a few times at most. (Reading those
events all the time made a restart of 500 devices 20 s slower: docs/scaling.md.)

On a cluster nats-server closes the older link of a name on its own node only: two
machines linked to different nodes both stay up, and both answer the hub. So every
`LOOK_S` the watchers look at every node's links (``/leafz``, asked of the system account)
and mark shared a device linked on two nodes whose links both carried messages since the
look before; a link whose machine went away, which its node has not noticed yet, carries
none.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

QUICK_S = 5.0
SHARED_AT = 20
WINDOW_S = 60.0
CONFIRM_S = 10.0
REPLACED_AT = 3
LOOK_S = 15.0
DISCONNECTS = "$SYS.ACCOUNT.*.DISCONNECT"  # the system account's events, any account's
REPLACED = "Duplicate Remote LeafNode Connection"  # nats-server's reason

# By leaf name: each of its links, (server name, connection id), and the messages it carried in.
Look = dict[str, dict[tuple[str, int], int]]


def replaced_leaf(event: Mapping[str, Any]) -> str | None:
    """The name of the leaf whose link a disconnect event says a newer one replaced."""
    client = event.get("client") or {}
    if event.get("reason") != REPLACED or client.get("kind") != "Leafnode":
        return None
    return str(client.get("name") or "") or None


class SharedKeys:
    """The devices whose links keep replacing each other, as one watcher sees them."""

    def __init__(self, hold: float) -> None:
        self._hold = hold
        self._last: dict[str, float] = {}  # by device: when its last link was let in
        self._quick: dict[str, deque[float]] = {}  # by device: its latest quick links
        self._held: dict[str, float] = {}  # by device: until when its links are refused

    def admitted(self, device_id: str, now: float) -> bool:
        """Note a link of `device_id` let in at `now` (monotonic seconds); whether the device
        is now a suspect (`CONFIRM_S` of disconnect events decide)."""
        last, self._last[device_id] = self._last.get(device_id), now
        if last is None or now - last > QUICK_S:
            return False
        quick = self._quick.setdefault(device_id, deque(maxlen=SHARED_AT))
        quick.append(now)
        return len(quick) == SHARED_AT and now - quick[0] <= WINDOW_S

    def hold(self, device_id: str, now: float) -> bool:
        """Refuse `device_id`'s links from `now` for the hold; whether they are (not with a
        hold of 0)."""
        if self._hold <= 0:
            return False
        self._held[device_id] = now + self._hold
        self._quick.pop(device_id, None)  # counted again from the hold's end
        return True

    def held(self, device_id: str, now: float) -> bool:
        """Whether `device_id`'s links are refused at `now`."""
        until = self._held.get(device_id)
        if until is not None and now >= until:
            del self._held[device_id]
            return False
        return until is not None


def look_of(answers: Iterable[Mapping[str, Any]]) -> Look:
    """Every link in the servers' answers to ``$SYS.REQ.SERVER.PING.LEAFZ``."""
    look: Look = {}
    for answer in answers:
        server = str((answer.get("server") or {}).get("name", ""))
        for leaf in (answer.get("data") or {}).get("leafs") or []:
            links = look.setdefault(str(leaf.get("name")), {})
            links[(server, int(leaf.get("id", 0)))] = int(leaf.get("in_msgs", 0))
    return look


def linked_twice(before: Look, now: Look) -> set[str]:
    """Leaf names linked on two servers or more by links that carried messages since
    `before`."""
    twice = set()
    for name, links in now.items():
        was = before.get(name, {})
        live = {server for (server, cid), n in links.items() if n > was.get((server, cid), n)}
        if len(live) > 1:
            twice.add(name)
    return twice
