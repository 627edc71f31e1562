"""What the agent itself must send (results, events, heartbeats, ``edge-agent publish``) is
committed to SQLite first (`store`, with its budget and dead letters) and published to the
island by the drainer (`drain`), deleted only after its PubAck.

Imports: `core`, `edge_agent.protocol`.
"""
