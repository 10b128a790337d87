"""The manifest model (design §3): the arrays of a checkpoint and where their bytes lie.

``box`` (regions, row-major geometry), ``dtypes`` (element types), ``limits`` (the constants every
format shares), ``spec`` (the frozen in-memory model: ``Manifest``, ``ArraySpec``, ``Chunk``,
``Source``, ``TensorSpec``), ``wire`` (the v1 and compact v2 wire forms: parse strictly, serialise
exactly, load and save), and the compact form (v2): ``compact`` (its model and parsing),
``compact_patterns`` (local tensor name patterns), ``compact_fit`` (the layout of each array, for
writing). No MPI; no I/O except ``wire``'s load and save.

Nothing is imported here: import the module you need (:mod:`formats` re-exports the common names).
"""
