"""The plain hub of `bench/device_shapes.py`: its config, split into accounts as the product's
is (`hub_ingest/fleet/auth.py`), its devices users or admitted by an auth callout."""

from __future__ import annotations

import json
from pathlib import Path

from bench.fleetscale.callout import CALLOUT_USER, Callout, hub_authorization

# The product's split of accounts, for these names: the hub's account imports each island's
# API and the flow control of the islands' consumers; the devices' imports the hub's API and
# the deliveries to the islands' command mirrors. No import of one direction overlaps one of
# the other. With --per-account the devices are split over accounts of that many (`Dk`),
# each island's consumer named after its account (`HUBk`) so that flow control, a service,
# is imported from the one account it comes from.
FLEET_ACCOUNT = """
  FLEET: {
    jetstream: enabled
    users: [ {user: op, password: op}, {user: CALLOUT, password: CALLOUT} ]
    exports: [
      {service: "$JS.API.>", response_type: stream}
      {stream: "devin.>"}
    ]
    imports: [ IMPORTS ]
  }
"""
DEVICE_ACCOUNT = """
  NAME: {
    users: [ USERS ]
    mappings: { "$JS.hub.API.>": "$JS.API.>" }
    exports: [
      {service: "$JS.*.API.>", response_type: stream}
      {service: "$JS.FC.T.HUBK.>"}
      {service: "$JS.FC.E.HUBK.>"}
      {service: "$JS.FC.*.*.T.HUBK.>"}
      {service: "$JS.FC.*.*.E.HUBK.>"}
      {stream: "hubin.>"}
      {stream: "$JS.FC.*.ISLAND.*"}
      {stream: "$JS.FC.*.*.*.ISLAND.*"}
      {stream: "$JS.FC.COMMANDS.>"}
      {stream: "$JS.FC.*.*.COMMANDS.>"}
    ]
    imports: [
      {service: {account: FLEET, subject: "$JS.API.>"}}
      {stream: {account: FLEET, subject: "devin.>"}}
    ]
  }
"""
FROM_DEVICES = (
    '{service: {account: NAME, subject: "$JS.FC.T.HUBK.>"}}',
    '{service: {account: NAME, subject: "$JS.FC.E.HUBK.>"}}',
    '{service: {account: NAME, subject: "$JS.FC.*.*.T.HUBK.>"}}',
    '{service: {account: NAME, subject: "$JS.FC.*.*.E.HUBK.>"}}',
    '{stream: {account: NAME, subject: "hubin.>"}}',
    '{stream: {account: NAME, subject: "$JS.FC.*.ISLAND.*"}}',
    '{stream: {account: NAME, subject: "$JS.FC.*.*.*.ISLAND.*"}}',
    '{stream: {account: NAME, subject: "$JS.FC.COMMANDS.>"}}',
    '{stream: {account: NAME, subject: "$JS.FC.*.*.COMMANDS.>"}}',
)


def _user(name: str) -> str:
    return json.dumps({"user": name, "password": name})


def _accounts(n: int, per_account: int, callout: bool) -> str:
    imports, blocks = [], [FLEET_ACCOUNT.replace("CALLOUT", CALLOUT_USER)]
    for k in range((n + per_account - 1) // per_account):
        members = range(k * per_account, min((k + 1) * per_account, n))
        # With the callout no device is a user: it binds each to its account.
        users = "" if callout else ", ".join(_user(f"d{i}") for i in members)
        name = f"D{k}"
        block = DEVICE_ACCOUNT.replace("NAME", name).replace("USERS", users)
        blocks.append(block.replace("HUBK", f"HUB{k}"))
        imports += [i.replace("NAME", name).replace("HUBK", f"HUB{k}") for i in FROM_DEVICES]
        imports += [f'{{service: {{account: {name}, subject: "$JS.d{i}.API.>"}}}}' for i in members]
    return "".join(blocks).replace("IMPORTS", "\n      ".join(imports))


def hub_config(
    n: int, per_account: int, ports: dict[str, int], store: Path, callout: Callout | None
) -> str:
    accounts = _accounts(n, per_account, callout is not None)
    authorization = hub_authorization(callout.issuer, ["op"]) if callout else ""
    return f"""{authorization}server_name: hub
listen: "127.0.0.1:{ports["client"]}"
http: "127.0.0.1:{ports["monitor"]}"
jetstream {{ domain: hub, store_dir: {json.dumps(str(store))} }}
accounts {{ {accounts} }}
leafnodes {{
  listen: "127.0.0.1:{ports["leaf"]}"
  compression: off
  isolate_leafnode_interest: true
}}
"""
