"""Cluster KV tier: blocks in the Ray object store (`store`), catalogued in openGauss / PostgreSQL
(`catalog`), serialized by `codec`; `embedded` starts the default PostgreSQL + pgvector.

Import the submodules directly: `codec` and `catalog` need neither Ray nor a running cluster.
"""
