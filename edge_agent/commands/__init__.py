"""Commands from the hub, each run at most once: the envelope checks (`parse`), the executor
on the island's command mirror (`executor`), the at-most-once ledger (`ledger`), the built-in
handlers (`handlers`), the command fence of a re-imaged device (`fence`), the hub's time line
for expiry (`hubclock`) and fast resume while the mirror is stalled (`resume`).

Imports: `outbox`, `island`, `core`, `edge_agent.protocol`.
"""
