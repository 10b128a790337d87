"""Validation: every check on a manifest and on the data files it names; each returns all problems.

``manifest`` (``validate_manifest``: the manifest alone, no data file opened), ``data``
(``validate_data``: existence, headers, dtypes and shapes, byte ranges, checksums), and their
helpers: ``overlap`` (overlap and coverage geometry of a set of boxes), ``problems`` (capped
problem lines, design §8), ``paths`` (the rules for ``source.file``). No MPI.

Nothing is imported here: import the module you need.
"""
