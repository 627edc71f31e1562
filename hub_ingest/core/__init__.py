"""What every other hub package builds on: the hub's configuration (`config`), its one
exception tree (`errors`), the NATS connection (`connect`), the key-value buckets' names and
making (`buckets`), bounded concurrent requests (`gather`),
requests answered by several messages (`replies`), the payload-schema check (`ddl`)
and the test failpoints (`failpoints`).

Imports: `edge_agent.protocol` only.
"""
