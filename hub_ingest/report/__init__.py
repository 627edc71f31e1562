"""The fleet view: what `hub-ingest report` collects (`collect`), as HTML (`html`) and as
Prometheus metrics (`metrics`).

Imports: `commands`, `fleet`, `core`, `edge_agent.protocol`.
"""
