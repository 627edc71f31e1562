"""The device's own JetStream island: its nats-server config, process and quarantine of
damaged streams (`server`), its streams and the hub's consumers on them (`streams`), and its
leaf link to the hub as the agent sees it (`link`).

Imports: `core`, `edge_agent.protocol`.
"""
