"""``manifest_from_state_dict`` on a real 4-rank gloo job (CPU).

Run under ``mpiexec -n 4 python torch_state_worker.py PORT`` (RANK / WORLD_SIZE come from MPICH's
``PMI_RANK`` / ``PMI_SIZE``, the rendezvous is 127.0.0.1:PORT) or under ``torchrun --standalone
--nproc-per-node 4 torch_state_worker.py`` (torchrun sets the environment). One launch runs
every case, so torch is imported once per rank:

* ``fsdp``: ``fully_shard`` on a 1-D mesh of 4: uneven 7x5 and 7, a 3-D parameter, a 0-D buffer,
  an fp32 master, a bf16 submodule (6x3: the last rank holds nothing of it), and a submodule
  sharded on dim 1 (``shard_placement_fn``);
* ``fsdp_tp`` / ``fsdp_tp_bf16``: ``parallelize_module`` (colwise / rowwise) on the ``tp`` axis of a
  dp x tp = 2 x 2 mesh, then ``fully_shard`` on ``mesh["dp"]``: ``_StridedShard(0, sf=2)`` on dp;
* ``pipeline``: pp x dp = 2 x 2; each stage holds other keys (FSDP on its dp sub-mesh, and a
  plain buffer): the metadata all-gather path;
* ``refusals``: a ``Partial`` DTensor on every rank, and a non-contiguous tensor on rank 2 only:
  every rank raises a ``StateDictError`` that names the tensor (nobody hangs).

Every rank checks, for every chunk it holds, that the bytes at ``source.offsets`` of its local
tensor equal the chunk's region of ``full_tensor()``; that the chunks cover each of its local
tensors; that the manifest validates as a full manifest; and (all-gathered digests) that every
rank's JSON is byte-identical. Prints ``OK <rank> <json summary>`` and exits 0, or exits 1.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

if "RANK" not in os.environ:  # mpiexec (MPICH hydra)
    os.environ["RANK"] = os.environ["PMI_RANK"]
    os.environ["WORLD_SIZE"] = os.environ["PMI_SIZE"]
    os.environ["LOCAL_RANK"] = os.environ["PMI_RANK"]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = sys.argv[1]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor, Partial, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from formats.manifest.wire import Manifest, dumps_manifest, loads_manifest  # noqa: E402
from formats.validate.manifest import validate_manifest  # noqa: E402
from streamer.refit.torch_state import StateDictError, manifest_from_state_dict  # noqa: E402


def check(m: Manifest, sd: dict[str, Any], rank: int, name: str) -> dict[str, Any]:
    """The correctness property on this rank; returns a summary."""
    assert not m.partial, name
    problems = validate_manifest(m)
    assert problems == [], (name, problems)
    assert loads_manifest(dumps_manifest(m)) == m
    fulls = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in sd.items()}  # collective
    locals_ = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in sd.items()}
    covered = dict.fromkeys(sd, 0)
    held = 0
    for fqn, spec, c in m.iter_chunks():
        if rank not in c.holders:
            continue
        key = c.tensor(fqn)
        local, full = locals_[key], fulls[key]
        assert spec.data_type == str(full.dtype).removeprefix("torch."), (name, fqn, spec.data_type, full.dtype)
        assert tuple(full.shape) == spec.shape, (name, fqn)
        src = local[tuple(slice(o, o + s) for o, s in zip(c.local_offsets, c.region.sizes))]
        want = full[tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))]
        assert torch.equal(src, want), (name, rank, fqn, c)
        covered[key] += c.region.volume
        held += 1
    for k, local in locals_.items():
        assert covered[k] == local.numel(), (name, rank, k, covered[k], tuple(local.shape))
    digest = hashlib.sha256(dumps_manifest(m).encode()).hexdigest()
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, digest)
    assert len(set(digests)) == 1, (name, digests)
    return {"chunks_held": held, "arrays": len(m.arrays), "digest": digest[:12]}


class Block(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.up = nn.Linear(5, 7, dtype=dtype)
        self.down = nn.Linear(7, 5, dtype=dtype)
        self.norm = nn.LayerNorm(5, dtype=dtype)
        self.cube = nn.Parameter(torch.randn(3, 5, 2, dtype=dtype))
        self.register_buffer("steps", torch.tensor(3))


def case_fsdp(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    model = Block()
    model.half_sub = nn.Linear(3, 6, dtype=torch.bfloat16)
    fully_shard(model.half_sub, mesh=mesh)
    model.wide = nn.Linear(8, 3)  # FSDP2 on dim 1 (shard_placement_fn): weight 3 x 8 -> 3 x 2 per rank
    fully_shard(model.wide, mesh=mesh, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    fully_shard(model, mesh=mesh)
    sd = model.state_dict()
    m = manifest_from_state_dict(sd, name="fsdp")
    assert m.arrays["half_sub.weight"].data_type == "bfloat16"
    assert m.arrays["up.weight"].data_type == "float32"
    assert m.arrays["steps"].shape == ()
    assert [c.holders for c in m.arrays["up.weight"].chunks] == [(0,), (1,), (2,), (3,)]
    assert [c.region.sizes[0] for c in m.arrays["half_sub.weight"].chunks] == [2, 2, 2]
    assert sd["wide.weight"].placements == (Shard(1),)
    # the gather path and the no-communication path give the same manifest
    for same_keys in (False, True):
        other = manifest_from_state_dict(sd, name="fsdp", same_keys=same_keys)
        assert dumps_manifest(other) == dumps_manifest(m), same_keys
    assert [c.region.offsets for c in m.arrays["wide.weight"].chunks] == [(0, 0), (0, 2), (0, 4), (0, 6)]
    return check(m, sd, rank, "fsdp")


def case_fsdp_tp(rank: int, dtype: torch.dtype) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Block(dtype)
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    sd = model.state_dict()
    assert sd["up.weight"].placements == (_StridedShard(0, split_factor=2), Shard(0)), sd["up.weight"].placements
    m = manifest_from_state_dict(sd, name="fsdp_tp", rename=lambda k: "model.layers.0." + k)
    assert m.mesh == {"axes": ["dp", "tp"], "shape": [2, 2]}
    # colwise 7 rows: tp pieces [0,4) [4,7), each split over dp: rank (dp, tp)
    up = {c.region.offsets[0]: c.holders for c in m.arrays["model.layers.0.up.weight"].chunks}
    assert up == {0: (0,), 2: (2,), 4: (1,), 6: (3,)}, up
    return check(m, sd, rank, f"fsdp_tp_{dtype}")


def case_pipeline(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    model = nn.Module()
    if stage == 0:
        model.embed = nn.Embedding(11, 4)
        model.layer0 = nn.Linear(4, 5)
    else:
        model.layer1 = nn.Linear(5, 4)
        model.head = nn.Linear(4, 11, bias=False)
        model.register_buffer("inv_freq", torch.arange(3.0))
    fully_shard(model, mesh=mesh["dp"])
    sd = model.state_dict()
    m = manifest_from_state_dict(sd, name="pp", rename=lambda k: "model." + k)
    # first appearance by rank; a module's own buffers come before its children's parameters
    assert list(m.arrays) == ["model.embed.weight", "model.layer0.weight", "model.layer0.bias",
                              "model.inv_freq", "model.layer1.weight", "model.layer1.bias",
                              "model.head.weight"], list(m.arrays)
    assert [c.holders for c in m.arrays["model.embed.weight"].chunks] == [(0,), (1,)]
    assert [c.holders for c in m.arrays["model.head.weight"].chunks] == [(2,), (3,)]
    assert m.arrays["model.inv_freq"].chunks[0].holders == (2, 3)
    return check(m, sd, rank, "pipeline")


def case_refusals(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    ok = DTensor.from_local(torch.ones(2), mesh, [Shard(0)], run_check=False)
    partial = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
    try:
        manifest_from_state_dict({"ok": ok, "loss_sum": partial})
    except StateDictError as e:
        # every rank refused it: one line, no rank list
        assert len(e.problems) == 1 and e.problems[0].startswith("loss_sum: placement Partial(sum)"), e.problems
    else:
        raise AssertionError("Partial was not refused")
    odd = torch.zeros(3, 4).t() if rank == 2 else torch.zeros(4, 3)
    try:
        manifest_from_state_dict({"ok": ok, "odd": odd})
    except StateDictError as e:
        assert e.problems == ["rank 2: odd: local tensor is not contiguous (shape [4, 3], stride [1, 4]); "
                              "make it contiguous before describing or pushing it"], e.problems
    else:
        raise AssertionError("a non-contiguous tensor on rank 2 was not refused on every rank")
    return {"refused": 2}


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different init per rank: full_tensor() must still agree
    out: dict[str, Any] = {}
    try:
        out["fsdp"] = case_fsdp(rank)
        out["fsdp_tp"] = case_fsdp_tp(rank, torch.float32)
        out["fsdp_tp_bf16"] = case_fsdp_tp(rank, torch.bfloat16)
        out["pipeline"] = case_pipeline(rank)
        out["refusals"] = case_refusals(rank)
    except BaseException:  # noqa: BLE001 - any failure: report it and leave at once
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # do not wait in a collective that the others never reach
    dist.barrier()
    # one write per line: the launcher forwards every rank's stdout through one pipe
    sys.stdout.flush()
    os.write(1, f"OK {rank} {json.dumps(out, sort_keys=True)}\n".encode())
    # every rank has passed the barrier and reported: leave without torch's gloo teardown, which
    # once aborted rank 0 in CI after all four had printed OK ("terminate called without an
    # active exception" in destroy_process_group, with the DeviceMesh subgroups still alive)
    os._exit(0)


if __name__ == "__main__":
    rc = main()
    gc.freeze()  # exit without a last collection over the heap (torch's: 0.3 CPU-s a rank)
    sys.exit(rc)
