"""A fleet on loopback for `make demo`, the tests and the benches: the hub, its watcher and
devices running the product's own commands (`fleet`), each device behind a link that can be
cut or slowed (`link`). Not used by the product itself.

Imports: `fleet`, `core`, `edge_agent.protocol`.
"""
