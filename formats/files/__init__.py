"""Filesystem helpers every format shares: ``bounded`` (bounded reads of small metadata files) and
``outdir`` (an output directory one writer owns, under a lock). No MPI.

Nothing is imported here: import the module you need.
"""
