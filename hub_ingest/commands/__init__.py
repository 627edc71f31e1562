"""Commands to devices: sending and status (`send`), the command index that folds the
command history and results a little at a time (`index`), and who sent an event
(`attribution`: the hub's subject, never the payload).

Imports: `fleet`, `core`, `edge_agent.protocol`.
"""
