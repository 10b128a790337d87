"""The zarr v3 format: ``io`` (validated metadata, region reads, the chunk-grid rule and writer of
``convert --format zarr``). zarr itself is imported only when a store is opened or written. No MPI.

Nothing is imported here: import the module you need.
"""
