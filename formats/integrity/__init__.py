"""Integrity of the bytes: streaming region checksums (``checksum``: ``xxh64`` / ``crc32c`` over
row-major bytes) and the binary sidecar file that holds a compact manifest's chunk checksums
(``sidecar``). No MPI. Nothing is imported here: import the module you need.
"""
