"""The safetensors format: ``header`` (the hostile-header parse), ``read`` (ranged region reads),
``write`` (the file planner and the atomic streaming writer), ``io`` (the three together, and the
format itself), and ``rankfiles`` (the destination files of a safetensors output: rank files or
Hugging Face names, the write jobs, the HF index). No MPI; no torch at import.

Nothing is imported here: import the module you need.
"""
