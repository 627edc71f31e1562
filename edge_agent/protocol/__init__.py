"""The device-hub contract: what both sides of the leaf link must agree on, in one place.

`hub_ingest` imports the agent only through this package, and this package imports nothing
else of the agent (`tests/test_protocol.py` walks the imports to keep it so):

- `names`: subjects, stream and consumer names, JetStream domains and API prefixes;
- `envelope`: the command envelope and the result schema;
- `units`: sizes, durations and timestamps as both sides write them;
- `tomlconf`: reading TOML sections that name the key of anything wrong;
- `reconcile`: idempotent stream reconciliation;
- `monitor`: the client of a nats-server's monitoring endpoint;
- `logs`: the logging set-up of every daemon and CLI;
- `errors`: the exceptions raised here, which each package translates at its boundary.
"""
