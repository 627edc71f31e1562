"""Updates pulled from the hub: the agent's side of ``hub-ingest release|rollout``.

- `paths`: where an update lives on the device while it travels (``<state_dir>/updates``);
- `download`: the bundle, chunk by chunk through the leaf link, resumable and throttled;
- `updater`: the agent's loop: read the desired release, fetch, verify, stage, report;
- `install`: the installer (``edge-agent update install``, root under systemd): a new release
  directory, ``current`` switched once it is complete and on disk, the restart, the health
  gate, and the switch back when the gate fails.

Imports: `outbox` (reports as events), `island` (the link's state), `core`,
`edge_agent.protocol`.
"""
