"""The archive the ingest writes and analysts read: the Iceberg table (`table`), the
decoding of its columns (`columns`), compaction and relocation (`maintenance`) and the audit
of duplicates and gaps (`audit`).

Imports: `commands`, `fleet`, `core`, `edge_agent.protocol`.
"""
