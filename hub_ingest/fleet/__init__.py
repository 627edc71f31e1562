"""The fleet's control plane: the device registry (`registry`), device keys and the
users file (`auth`), enrolment (`enrol`), the hub's streams and device mirrors (their names
and listing `streams`, their creation `provision`, streams of other owners in their way
`clashes`), the hub's nats-server config (`server`),
signed releases and rollouts (`releases`, `rollout`), and the watcher service (`watch`)
with the gap refill it runs (`refill`; its contract and record `gaps`, its reads of the
aggregates `aggregate_rows`, its requests to islands and the hub `requests`).

Imports: `core`, `edge_agent.protocol`.
"""
