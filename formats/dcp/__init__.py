"""torch checkpoints read without executing a pickle: ``io`` (a ``torch.distributed.checkpoint``
directory as a manifest), ``torch_archive`` (a ``torch.save`` zip read by byte range, payloads only
located) and ``unpickle`` (the restricted unpicklers: DCP ``.metadata``, a tensor's ``data.pkl``,
Megatron's legacy ``.pt``). No torch, no MPI.

Nothing is imported here: import the module you need.
"""
