"""The device's health as ``edge-agent status``, heartbeats (`health`) and the Prometheus
textfile (`metrics`) show it; read from the island's monitoring endpoint and the state files,
so it works while the agent is down.

Imports: `commands`, `outbox`, `island`, `core`, `edge_agent.protocol`.
"""
