"""The fleet view: what `hub-ingest report` collects (`collect`, with
the heartbeats' part in `heartbeats`), as HTML (`html`) and as
Prometheus metrics (`metrics`).

Imports: `commands`, `fleet`, `core`, `edge_agent.protocol`.
"""
