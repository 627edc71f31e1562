"""Who may do what on the hub: one NKey per device, with permissions that name only its own.

The operators and the hub's streams are in the account ``FLEET``; the devices' leaf
connections bind to an account of their aggregate shard (``DEVICES``, then ``DEVICES_2``,
``DEVICES_3``…), which has no stream. ``FLEET`` takes each shard's deliveries to the hub's
mirrors once, renamed under the shard's prefix, the answers to the flow control of its
command consumers (named after the shard), and its islands' APIs, under the shard's prefix
too; a device enrolled before 2026-11-30 brings an import of its island's API of its own
(and, enrolled before 2026-11-29, of its flow-control answers). Adding a device adds none.
Bound to ``FLEET``, or with the fleet's deliveries imported under their own names from every
shard account, a link connecting cost a look at every other link's interest
(docs/scaling.md, "Leaf accounts"). Each device's leaf connection is held to subjects that
carry its own id (docs/security.md has the threat model):

- it may create consumers on, and direct-get from, ``CMD_<id>`` only: not ``COMMANDS``, not
  another device's ``CMD_*``, not ``FLEET_*``;
- it may direct-get its own desired release, the signed release records and the release
  bundles (signed, and the same for every device), nothing else of the rollout;
- it may publish nothing under ``cmd.>`` (nor any plain subject), only deliveries of the
  hub's mirrors of its own streams (``hubin.<id>.>``) and replies to requests it was sent;
- it receives only requests for its own JetStream domain, deliveries of its own mirror
  (``devin.<id>.>``) and replies to its own requests (``_INBOX_<id>.>``).

The hub stores public keys only; a device's seed is written once, mode 0600, for the device.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nkeys
from nats.js import JetStreamContext

from edge_agent.protocol.files import write_durably
from edge_agent.protocol.names import (
    ISLAND_CONSUMER,
    OUTBOUND,
    command_stream,
    inbox_prefix,
    island_consumer,
    js_api,
    to_device_prefix,
    to_hub_prefix,
)
from edge_agent.protocol.release import RELEASES_BUCKET, ROLLOUT_BUCKET, desired_key
from hub_ingest.core.config import HubConfig
from hub_ingest.core.errors import ConfigError
from hub_ingest.fleet.registry import Device, Registry, shard_api, shard_island_api
from hub_ingest.fleet.reload import reload_server
from hub_ingest.fleet.streams import shard_deliveries

ACCOUNT = "FLEET"  # the hub's streams and the operators
DEVICES_ACCOUNT = "DEVICES"  # the leaf connections of the devices of the first shard


def devices_account(shard: int) -> str:
    """The account the leaf connections of a shard's devices bind to, named as its
    aggregates are (`DEVICES`, `DEVICES_2`, …)."""
    return DEVICES_ACCOUNT if shard == 0 else f"{DEVICES_ACCOUNT}_{shard + 1}"


def new_seed() -> str:
    """A fresh NATS user seed (``SU...``)."""
    seed: bytes = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed.decode()


def public_key(seed: str) -> str:
    key: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
    return key.decode()


def write_secret(path: Path, text: str) -> None:
    """Write `text` to `path` readable by its owner only, never briefly wider, and durably
    (the users file lost to a power cut would lock every device out)."""
    write_durably(path, text + "\n", mode=0o600)


def ensure_operator_key(config: HubConfig) -> str:
    """The operators' public key, creating their seed file on first use."""
    seed_file = config.nats.credentials
    if not seed_file.exists():
        write_secret(seed_file, new_seed())
    return public_key(seed_file.read_text(encoding="utf-8").strip())


def derived_keys(config: HubConfig, context: bytes, prefix: int) -> nkeys.KeyPair:
    """A key pair derived from the operators' seed for `context`: every node that holds the
    seed derives the same one, and no new secret is made."""
    ensure_operator_key(config)
    operator = config.nats.credentials.read_text(encoding="utf-8").strip().encode()
    raw = hmac.new(operator, context, hashlib.sha256).digest()
    return nkeys.from_seed(bytearray(nkeys.encode_seed(raw, prefix)))


def system_user(config: HubConfig) -> nkeys.KeyPair:
    """The system account's one user under the callout: the watcher, which has the server
    close a link whose device was removed (`hub_ingest.fleet.cutoff`)."""
    return derived_keys(config, b"hub-ingest system user v1", nkeys.PREFIX_BYTE_USER)


def device_permissions(device: Device, hub_domain: str) -> dict[str, Any]:
    api = js_api(hub_domain)
    commands = command_stream(device.device_id)
    rollout = f"KV_{ROLLOUT_BUCKET}"
    desired = f"$KV.{ROLLOUT_BUCKET}.{desired_key(device.device_id)}"
    records = f"$KV.{ROLLOUT_BUCKET}.release.>"
    releases = f"OBJ_{RELEASES_BUCKET}"
    return {
        "publish": {
            "allow": [
                f"{api}.CONSUMER.CREATE.{commands}",
                f"{api}.CONSUMER.CREATE.{commands}.>",
                # The island's mirror restarts the consumer it is bound to after a cut (one
                # made before its first link is bound to `ISLAND_CONSUMER`).
                *(f"{api}.CONSUMER.RESET.{commands}.{c}" for c in _bound_to(device)),
                f"{api}.DIRECT.GET.{commands}",
                f"{api}.DIRECT.GET.{commands}.>",
                f"{api}.STREAM.INFO.{commands}",
                # Its own desired release, the signed release records, the bundles' chunks.
                f"{api}.DIRECT.GET.{rollout}.{desired}",
                f"{api}.DIRECT.GET.{rollout}.{records}",
                f"{api}.DIRECT.GET.{releases}",
                f"{to_hub_prefix(device.device_id)}.>",
                # Answers to the hub's requests, which reach the island through an import
                # that renames their reply subject to a random `_R_.<id>`, its own to know.
                "_R_.>",
                # Flow control of its command mirror, in both of nats-server's subject forms.
                # No wider: the hub tells a link of every subscription on a subject its
                # device may publish, so `$JS.FC.>` here told every link every flow-control
                # subject of the fleet (its square, docs/scaling.md).
                _hub_flow_control(commands, device.command_consumer),
                f"$JS.FC.{hub_domain}.*.{commands}.{device.command_consumer}.*",
            ]
        },
        "subscribe": {
            "allow": [
                f"{js_api(device.domain)}.>",
                f"{to_device_prefix(device.device_id)}.>",
                f"{inbox_prefix(device.device_id)}.>",
                "$JS.FC.>",
                "$JSC.R.>",
            ]
        },
        "allow_responses": True,
    }


SYSTEM_ACCOUNT = "SYS"


# Flow control, in nats-server's two subject forms (`$JS.FC.<stream>.<consumer>.<id>`, and
# with the domain and account hash first): the hub's mirrors answer the islands' consumers
# (`TELEMETRY`, `EVENTS`), the islands' command mirrors answer the hub's `ISLAND` consumers.
# The first crosses as services from every shard's account, token for token (a service import
# may not overlap one of the other direction: nats-server refuses it as a cycle); the second
# as a stream import a device (`_fleet_account`): a link is told of its account's service
# imports at its handshake only, and each reload takes that back (docs/scaling.md).
_ISLAND_FLOW_CONTROL = tuple(
    subject for s in OUTBOUND for subject in (f"$JS.FC.{s}.*.*", f"$JS.FC.*.*.{s}.*.*")
)


def _bound_to(device: Device) -> tuple[str, ...]:
    """The consumers on its ``CMD_<id>`` a device's island may be bound to."""
    return tuple(dict.fromkeys((ISLAND_CONSUMER, device.command_consumer)))


def _hub_flow_control(stream: str, consumer: str) -> str:
    """Flow control of the hub's consumer `consumer` on `stream`, in the form the hub's
    nats-server uses (its `js_ack_fc_v2` feature flag is off); a device may publish the
    other form too."""
    return f"$JS.FC.{stream}.{consumer}.*"


# What each account exports and the other imports. A service answering a batched direct get
# answers many times (`response_type`).
_FLEET_EXPORTS: tuple[dict[str, str], ...] = (
    # The islands' command mirrors and reads.
    {"service": "$JS.API.>", "response_type": "stream"},
    {"stream": f"{to_device_prefix('*')}.>"},
)
_DEVICES_EXPORTS: tuple[dict[str, str], ...] = (
    *({"service": subject} for subject in _ISLAND_FLOW_CONTROL),
    {"stream": "hubin.>"},
    {"stream": _hub_flow_control("*", ISLAND_CONSUMER)},
)
# The islands' APIs, for the devices enrolled before 2026-11-30, which the hub's account
# imports one by one, named by each domain: a wildcard would overlap the hub's own API, which
# the devices' account imports (nats-server refuses the cycle).
_ISLAND_API_EXPORT = {"service": "$JS.*.API.>", "response_type": "stream"}


def _shard_apis(shard: int) -> dict[str, str]:
    """The islands' APIs of a shard's account, under the shard's prefix
    (`registry.shard_api`), which the hub's account imports once; the account maps it to
    each island's own. An import's cycle check does not follow a mapping, and nothing
    loops: the hub's API is imported under another subject."""
    return {f"{shard_island_api(shard, '*')}.>": f"{js_api('{{wildcard(1)}}')}.>"}


def _imported(exports: Iterable[dict[str, str]], account: str) -> list[dict[str, Any]]:
    """The imports of `exports` from `account`."""
    return [
        {kind: {"account": account, "subject": export[kind]}}
        for export in exports
        for kind in ("service", "stream")
        if kind in export
    ]


def _fleet_account(operator_key: str, devices: list[Device], shards: list[int]) -> dict[str, Any]:
    """The hub's JetStream account: the operators, the streams, and what crosses from each
    shard's account. A device enrolled before 2026-11-30 adds its island's API; one enrolled
    before 2026-11-29 (bound to `ISLAND_CONSUMER`) one stream import more: its island's answers
    to its command consumer's flow control, in the form the hub's nats-server uses
    (`js_ack_fc_v2` is off), imported from its own shard's account so that a link is told of its
    own consumer's only and no service import is told to every link at its handshake. A reload
    that changes an account's stream imports re-examines each of its subscriptions against each
    of them (docs/scaling.md, "Leaf accounts"): the devices enrolled since share their
    shard's."""
    return {
        "jetstream": "enabled",
        "users": [{"nkey": operator_key}],
        "exports": list(_FLEET_EXPORTS),
        "imports": [
            *(
                {"service": {"account": devices_account(d.shard), "subject": f"{d.api_prefix}.>"}}
                for d in devices
                if not d.island_api
            ),
            *(
                {
                    "stream": {
                        "account": devices_account(d.shard),
                        "subject": _hub_flow_control(command_stream(d.device_id), ISLAND_CONSUMER),
                    }
                }
                for d in devices
                if d.command_consumer == ISLAND_CONSUMER
            ),
            *(i for shard in shards for i in _shard_imports(shard)),
            *(
                _legacy_deliveries(d)
                for d in devices
                if any(not i.via_shard for i in d.incarnations)
            ),
        ],
    }


def _shard_imports(shard: int) -> list[dict[str, Any]]:
    """What the hub's account takes of every device of a shard, from the shard's account:
    the islands' APIs, under the shard's prefix; the answers of its mirrors to the islands' flow
    control, named by incarnation, not by device (nats-server hands an answer to each shard's
    account, and only the one its island is linked in has an interest); the islands' deliveries,
    renamed under the shard's prefix, so that a hub mirror's subscription is shadowed in its own
    shard's account alone and told to that shard's links only (each mirror's set-up, retried
    after a restart, subscribes again); the islands' answers to the flow control of the shard's
    command consumers, whose name is the shard's, so that only that shard's are shadowed in its
    account."""
    account = devices_account(shard)
    return [
        {"service": {"account": account, "subject": f"{shard_api(shard)}.>"}},
        *({"service": {"account": account, "subject": s}} for s in _ISLAND_FLOW_CONTROL),
        {"stream": {"account": account, "subject": _shard_flow_control(shard)}},
        {
            "stream": {"account": account, "subject": "hubin.>"},
            "to": f"{shard_deliveries(shard)}.hubin.>",
        },
    ]


def _legacy_deliveries(device: Device) -> dict[str, Any]:
    """A device's deliveries under their own name, for its mirrors made before they were
    renamed by shard (`Incarnation.via_shard`)."""
    subject = f"{to_hub_prefix(device.device_id)}.>"
    return {"stream": {"account": devices_account(device.shard), "subject": subject}}


def _shard_flow_control(shard: int) -> str:
    return _hub_flow_control("*", island_consumer(shard))


def _devices_account(shard: int, devices: list[Device], hub_domain: str) -> dict[str, Any]:
    """The account one shard's leaf connections bind to: no JetStream and no stream of its
    own, so a link connecting costs the hub no look at the fleet's streams, and a mirror's
    set-up in the hub's account is not told to every link. A link connecting is told of
    every subscription of its account before the ones of other links are skipped
    (nats-server's `initLeafNodeSmapAndSendSubs`): one account for 500 devices made each
    restart a storm of the fleet's square, hence one per shard."""
    return {
        "users": [
            {"nkey": d.nkey, "permissions": device_permissions(d, hub_domain)} for d in devices
        ],
        "exports": [
            _ISLAND_API_EXPORT,
            {"service": f"{shard_api(shard)}.>", "response_type": "stream"},
            *_DEVICES_EXPORTS,
            {"stream": _shard_flow_control(shard)},
        ],
        "mappings": {
            # The hub's API under its domain, as the islands address it (nats-server maps it
            # so for a linked account too, but only once a link is up).
            f"{js_api(hub_domain)}.>": "$JS.API.>",
            **_shard_apis(shard),
        },
        "imports": _imported(_FLEET_EXPORTS, ACCOUNT),
    }


def render_auth(
    operator_key: str, devices: Iterable[Device], hub_domain: str, *, system_key: str = ""
) -> str:
    """The users file. With the `system_key` of the callout (`hub_ingest.fleet.admission`) it
    names no device, makes the account of the shard after the last, so that enrolling a device
    changes it only when a shard fills up, and gives the system account that one user."""
    callout = bool(system_key)
    listed = list(devices)
    # The first shard's account always, so that a hub with no device yet has the account its
    # first one links to.
    shards = sorted({0, *(d.shard for d in listed)})
    if callout:
        shards.append(shards[-1] + 1)
    accounts = {
        ACCOUNT: _fleet_account(operator_key, listed, shards),
        **{
            devices_account(shard): _devices_account(
                shard, [d for d in listed if d.shard == shard and not callout], hub_domain
            )
            for shard in shards
        },
    }
    # The system account a hub that is one region of a supercluster names; no users but the
    # callout's watcher's.
    accounts[SYSTEM_ACCOUNT] = {"users": [{"nkey": system_key}]} if callout else {}
    blocks = "\n".join(_account_block(name, body) for name, body in accounts.items())
    return f"""\
# Rendered by hub-ingest from the device registry; every `device add|remove` rewrites it.
accounts {{
{blocks}
}}
"""


def _account_block(name: str, body: dict[str, Any]) -> str:
    """An account in nats-server's config syntax, one user, import or export a line."""
    lines = [f"  {name}: {{"]
    for key, value in body.items():
        if isinstance(value, list):
            items = ",\n      ".join(json.dumps(item) for item in value)
            lines.append(f"    {key}: [\n      {items}\n    ]")
        else:
            lines.append(f"    {key}: {json.dumps(value)}")
    return "\n".join([*lines, "  }"])


@dataclass(frozen=True, slots=True)
class Written:
    changed: bool  # the users file differs from the one it replaced (or there was none)
    new_accounts: bool  # it names an account the one it replaced did not


def write_auth(config: HubConfig, devices: Iterable[Device]) -> Written:
    """Write the users file for `devices`, unless it already says the same."""
    path = config.server.auth_file
    try:
        before: str | None = path.read_text(encoding="utf-8").rstrip("\n")
    except FileNotFoundError:
        before = None  # the server has not read one yet
    devices = list(devices)
    system_key = ""
    if config.server.admission == "callout":
        system_key = system_user(config).public_key.decode()
    if devices:
        check_admission(config)
    text = render_auth(
        ensure_operator_key(config), devices, config.nats.domain, system_key=system_key
    )
    text = text.rstrip("\n")
    if text == before:
        return Written(changed=False, new_accounts=False)
    write_secret(path, text)
    new = before is not None and bool(_account_names(text) - _account_names(before))
    return Written(changed=True, new_accounts=new)


def check_admission(config: HubConfig) -> None:
    """Under the callout the users file names no device: read by a server whose config does
    not ask the callout (`server.admission` changed, `render-nats-config` not run), it would
    lock every device out at its next link. Refused while a server config here lacks it."""
    if config.server.admission != "callout":
        return
    nodes = [config.server] if config.cluster is None else [n.server for n in config.cluster.nodes]
    for server in nodes:
        try:
            rendered = server.config_file.read_text(encoding="utf-8")
        except FileNotFoundError:
            continue  # a node rendered on another machine
        if "auth_callout" not in rendered:
            raise ConfigError(
                f'server.admission = "callout" but {server.config_file} does not ask the '
                "callout: run `hub-ingest render-nats-config` and restart the hub's nats-server "
                "first (a users file without the devices would lock them out); nothing changed"
            )


def _account_names(users_file: str) -> set[str]:
    """The accounts a rendered users file names."""
    return set(re.findall(r"^  (\S+): \{$", users_file, flags=re.MULTILINE))


async def reload_if_changed(config: HubConfig, written: Written) -> bool:
    """Reload the hub's local servers if `written` changed the users file; False if it did
    and no server was there to reload (see `reload_server`)."""
    if not written.changed:
        return True
    return await reload_server(config, new_accounts=written.new_accounts)


async def sync_users(js: JetStreamContext, config: HubConfig) -> bool:
    """Rewrite the users file from the registry and reload if it differs; True if it did."""
    written = write_auth(config, await (await Registry.open(js)).list())
    await reload_if_changed(config, written)
    return written.changed
