"""Megatron-LM saves as byte-range views: ``dist`` (``torch_dist`` checkpoints, a DCP directory per
iteration) and ``legacy`` (``--ckpt-format torch``: one ``torch.save`` archive per model-parallel
rank, under Hugging Face names). No torch, no MPI.

Nothing is imported here: import the module you need.
"""
