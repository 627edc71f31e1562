"""The ``hub-ingest`` command line: the entry point (`main`), shared arguments (`args`) and
one module per command group. Errors from every package are turned into messages and exit
codes here, once.

Imports: any hub package except `local`.
"""
