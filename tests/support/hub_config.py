"""The test hub's configuration as a TOML file, for tests that drive the ``hub-ingest`` CLI."""

from __future__ import annotations

import json
from pathlib import Path

from hub_ingest.config import HubConfig


def write_hub_config(config: HubConfig, path: Path) -> Path:
    srv, ing = config.server, config.ingest
    path.write_text(
        f"""state_dir = {json.dumps(str(config.state_dir))}
[nats]
servers = {json.dumps(list(config.nats.servers))}
domain = {json.dumps(config.nats.domain)}
credentials = {json.dumps(str(config.nats.credentials))}
[server]
server_name = {json.dumps(srv.server_name)}
listen = {json.dumps(srv.listen)}
monitor_listen = {json.dumps(srv.monitor_listen)}
leaf_listen = {json.dumps(srv.leaf_listen)}
store_dir = {json.dumps(str(srv.store_dir))}
max_file_store = {srv.max_file_store}
max_memory_store = {srv.max_memory_store}
[commands]
max_bytes = {config.commands.max_bytes}
max_age = {config.commands.max_age}
[aggregates]
max_sources_per_stream = {config.aggregates.max_sources_per_stream}
[ingest]
archive = {json.dumps(str(ing.archive))}
checkpoint = {json.dumps(str(ing.checkpoint))}
max_messages_per_trigger = {ing.max_messages_per_trigger}
messages_per_partition = {ing.messages_per_partition}
fail_on_data_loss = {json.dumps(ing.fail_on_data_loss)}
""",
        encoding="utf-8",
    )
    return path
