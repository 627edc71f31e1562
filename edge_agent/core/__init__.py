"""What every other agent package builds on: the agent's configuration (`config`), its one
exception tree (`errors`), the SQLite state file shared by the outbox and the ledger
(`statedb`) and systemd's notify protocol (`notify`).

Imports: `edge_agent.protocol` only.
"""
