"""The Spark data path from the hub's aggregate streams into the archive: the wire reader
(`wire`), the ``jetstream`` PySpark data source (`source`), the streaming job and the order of
a micro-batch (`job`), each batch's write and commit (`sink`) and the checkpoint's durability
(`durability`).

Imports: `archive`, `fleet`, `core`, `edge_agent.protocol`.
"""
