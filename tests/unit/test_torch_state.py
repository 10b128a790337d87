"""``manifest_from_state_dict`` in one process.

* The geometry (``local_segments``) against torch's own DTensor splitting (``Shard._split_tensor``
  / ``_StridedShard._split_tensor`` applied left to right, as ``distribute_tensor`` does) and
  ``compute_local_shape_and_global_offset``, exhaustively on small shapes and meshes.
* Whole state dicts on a *fake* process group (``torch.testing._internal.distributed.fake_pg``):
  every rank of a 4- or 8-rank job is simulated in turn in this process. ``distribute_tensor``
  with ``src_data_rank=None`` splits locally, so each simulated rank has its real local tensor:
  every chunk the rank holds must equal the region of the global tensor that it names, the
  chunks must cover the local tensor exactly, the manifest must validate as a full manifest, and
  the JSON must be byte-identical on every rank. ``fully_shard`` and ``parallelize_module`` run
  on the fake group too (shapes and placements; the values are checked in the mpi tier).
* Refusals name the tensor: ``Partial``, non-tensors, non-contiguous, unsupported dtypes,
  rename collisions; the metadata merge used when ranks hold different keys.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402
from torch.distributed.tensor.placement_types import _StridedShard  # noqa: E402

from formats.errors import ShardstreamError, ValidationError  # noqa: E402
from formats.manifest.wire import Manifest, dumps_manifest, loads_manifest  # noqa: E402
from formats.validate.manifest import validate_manifest  # noqa: E402
from streamer.refit.torch_state import (  # noqa: E402
    StateDictError,
    _merge,
    _Record,
    local_segments,
    manifest_from_state_dict,
)


def _enc(p: Any) -> tuple[Any, ...]:
    if isinstance(p, _StridedShard):
        return ("SS", p.dim, p.split_factor)
    if isinstance(p, Shard):
        return ("S", p.dim)
    return ("R",)


def _torch_local_indices(n: int, mesh_shape: Sequence[int], placements: Sequence[Any],
                         coords: Sequence[int]) -> list[int]:
    """Global indices held at ``coords``: torch's own splitting of ``arange(n)``, left to right."""
    t = torch.arange(n)
    for p, k, c in zip(placements, mesh_shape, coords):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(t, k, with_padding=False, contiguous=True)
        t = shards[c]
    return [int(x) for x in t.tolist()]


def _expand(segs: Sequence[tuple[int, int, int]]) -> list[int]:
    out: list[int] = []
    pos = 0
    for ls, gs, n in segs:
        assert ls == pos, segs
        out.extend(range(gs, gs + n))
        pos += n
    return out


_PLACEMENTS_1D = [Replicate(), Shard(0), _StridedShard(0, split_factor=2), _StridedShard(0, split_factor=3)]


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2), (2, 3), (3, 2), (2, 2, 2)])
def test_segments_match_torch_splitting(mesh_shape: tuple[int, ...]) -> None:
    checked = 0
    for pls in itertools.product(_PLACEMENTS_1D, repeat=len(mesh_shape)):
        if len(mesh_shape) == 3 and sum(isinstance(p, _StridedShard) for p in pls) > 1:
            continue  # keep the run short; two strided axes are covered on 2-axis meshes
        enc = [_enc(p) for p in pls]
        for n in range(0, 14):
            for coords in itertools.product(*(range(k) for k in mesh_shape)):
                segs = local_segments((n,), mesh_shape, enc, coords)[0]
                want = _torch_local_indices(n, mesh_shape, pls, coords)
                assert _expand(segs) == want, (n, mesh_shape, pls, coords, segs)
                shape, off = _compute_local_shape_and_global_offset((n,), mesh_shape, list(coords), pls)
                assert shape == (len(want),)
                if want:
                    assert off == (want[0],)
                checked += 1
    assert checked > 100


def test_segments_2d_and_0d() -> None:
    segs = local_segments((5, 7), (2, 2), [("S", 0), ("S", 1)], (1, 1))
    assert segs == [[(0, 3, 2)], [(0, 4, 3)]]
    assert local_segments((), (2,), [("R",)], (1,)) == []
    # trailing empty shards (torch.chunk: 2 rows over 4 ranks)
    assert local_segments((2, 3), (4,), [("S", 0)], (3,)) == [[], [(0, 0, 3)]]


# ---------------------------------------------------------------- fake process group


@contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        dist.destroy_process_group()


def check_rank(m: Manifest, rank: int, locals_: dict[str, Any], globals_: dict[str, Any],
               rename: Callable[[str], str] = lambda k: k) -> int:
    """Every chunk ``rank`` holds equals the region of the global tensor that it names, read
    from the local tensor at ``source.offsets``; the chunks cover each local tensor exactly."""
    covered: dict[str, int] = {}
    n = 0
    for fqn, _spec, c in m.iter_chunks():
        if rank not in c.holders:
            continue
        key = c.tensor(fqn)
        local = locals_[key]
        g = globals_[key]
        assert rename(key) == fqn
        src = local[tuple(slice(o, o + s) for o, s in zip(c.local_offsets, c.region.sizes))]
        want = g[tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))]
        assert src.dtype == want.dtype
        assert torch.equal(src, want), (fqn, c)
        covered[key] = covered.get(key, 0) + c.region.volume
        n += 1
    for key, local in locals_.items():
        if local.numel():
            assert covered.get(key) == local.numel(), (key, covered.get(key), local.shape)
    lt = m.local_tensors(rank)
    for key, local in locals_.items():
        if local.numel():
            assert lt[key].shape == tuple(local.shape), key
    return n


def assert_valid(m: Manifest) -> None:
    assert not m.partial
    assert validate_manifest(m) == []
    assert loads_manifest(dumps_manifest(m)) == m


CASES: list[tuple[str, tuple[int, ...], tuple[str, ...], list[tuple[tuple[int, ...], list[Any], Any]]]] = [
    ("fsdp", (4,), ("dp",), [
        ((7, 5), [Shard(0)], torch.float32),
        ((3, 5, 2), [Shard(0)], torch.float32),
        ((2, 3), [Shard(0)], torch.bfloat16),  # trailing ranks hold nothing
        ((), [Replicate()], torch.int64),
        ((9,), [Shard(0)], torch.float16),
    ]),
    ("fsdp_tp", (2, 2), ("dp", "tp"), [
        ((7, 5), [_StridedShard(0, split_factor=2), Shard(0)], torch.float32),  # colwise
        ((5, 7), [Shard(0), Shard(1)], torch.float32),  # rowwise
        ((5,), [Shard(0), Replicate()], torch.bfloat16),
        ((11, 3), [_StridedShard(0, split_factor=2), Shard(0)], torch.float32),
    ]),
    ("3d", (2, 2, 2), ("pp", "dp", "tp"), [
        ((13, 6), [Replicate(), _StridedShard(0, split_factor=2), Shard(0)], torch.float32),
        ((6, 13), [Shard(1), Shard(1), Shard(1)], torch.float32),
        ((6, 13), [_StridedShard(1, split_factor=3), Replicate(), Shard(0)], torch.float32),
        ((10, 4, 3), [Shard(2), Shard(0), Shard(0)], torch.float32),
    ]),
    ("strided_combos", (2, 3), ("a", "b"), [
        ((17,), [_StridedShard(0, split_factor=3), Shard(0)], torch.float32),
        ((17,), [_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)], torch.float32),
        ((5, 17), [Shard(0), _StridedShard(1, split_factor=4)], torch.float32),
    ]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_distributed_tensors_on_every_rank(case: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    _name, mesh_shape, names, specs = case
    world = 1
    for k in mesh_shape:
        world *= k
    gen = torch.Generator().manual_seed(0)
    globals_ = {f"t{i}": (torch.randn(shape, generator=gen) * 100).to(dt) for i, (shape, _, dt) in enumerate(specs)}
    globals_["plain"] = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    jsons = []
    for rank in range(world):
        with fake_rank(rank, world):
            mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
            sd: dict[str, Any] = {}
            for i, (_shape, pls, _dt) in enumerate(specs):
                sd[f"t{i}"] = distribute_tensor(globals_[f"t{i}"], mesh, pls, src_data_rank=None)
            sd["plain"] = globals_["plain"]
            m = manifest_from_state_dict(sd, name="case")
            locals_ = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in sd.items()}
        assert_valid(m)
        assert m.world_size == world
        assert m.mesh == {"axes": list(names), "shape": list(mesh_shape)}
        for i, (_shape, _pls, dt) in enumerate(specs):
            assert m.arrays[f"t{i}"].data_type == str(dt).removeprefix("torch.")
        check_rank(m, rank, locals_, globals_)
        jsons.append(dumps_manifest(m))
    assert len(set(jsons)) == 1


def test_strided_combination_gives_several_chunks_per_rank() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    g = torch.arange(8.0)
    with fake_rank(1, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
        d = distribute_tensor(g, mesh, [_StridedShard(0, split_factor=2)], src_data_rank=None)
        m = manifest_from_state_dict({"w": d})
    mine = [c for c in m.arrays["w"].chunks if 1 in c.holders]
    assert [(c.region.offsets, c.local_offsets) for c in mine] == [((2,), (0,)), ((6,), (2,))]
    check_rank(m, 1, {"w": d.to_local()}, {"w": g})


def _fsdp_tp_model(mesh: Any) -> Any:
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(5, 7)
            self.down = nn.Linear(7, 5)
            self.norm = nn.LayerNorm(5)
            self.cube = nn.Parameter(torch.randn(3, 5, 2))
            self.register_buffer("steps", torch.tensor(3))

    model = Block()
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    return model


def test_fsdp_tp_module_on_fake_group() -> None:
    """fully_shard over parallelize_module: ``_StridedShard`` on dp, the dp sub-mesh differs per
    rank (norm, cube), every rank computes the same manifest, each local tensor's shape matches."""
    from torch.distributed.device_mesh import init_device_mesh

    jsons = []
    for rank in range(4):
        with fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            sd = _fsdp_tp_model(mesh).state_dict()
            placements = {k: v.placements for k, v in sd.items() if isinstance(v, DTensor)}
            m = manifest_from_state_dict(sd, rename=lambda k: "model." + k)
            lt = m.local_tensors(rank)
            for k, v in sd.items():
                local = v.to_local() if isinstance(v, DTensor) else v
                if local.numel():
                    assert lt[k].shape == tuple(local.shape), k
        assert_valid(m)
        jsons.append(dumps_manifest(m))
    assert placements["up.weight"] == (_StridedShard(0, split_factor=2), Shard(0))
    assert placements["norm.weight"] == (Shard(0),)
    assert len(set(jsons)) == 1
    assert sorted(m.arrays) == sorted("model." + k for k in sd)
    assert m.arrays["model.steps"].chunks[0].holders == (0, 1, 2, 3)
    assert m.arrays["model.steps"].chunks[0].source is not None
    assert m.arrays["model.steps"].chunks[0].source.tensor == "steps"
    # norm: dp sub-mesh [0, 2] on ranks 0/2 and [1, 3] on ranks 1/3; tp ranks are replicas
    norm = m.arrays["model.norm.weight"].chunks
    assert [(c.region.offsets, c.holders) for c in norm] == [((0,), (0, 1)), ((3,), (2, 3))]


def _same_on_every_rank(world: int, build: Callable[[], dict[str, Any]]) -> Manifest:
    """Simulate every rank: the manifests are byte-identical, valid, and agree with each rank's
    local tensor shapes (values need a real group: the mpi tier)."""
    jsons = []
    for rank in range(world):
        with fake_rank(rank, world):
            sd = build()
            m = manifest_from_state_dict(sd)
            lt = m.local_tensors(rank)
            for k, v in sd.items():
                local = v.to_local() if isinstance(v, DTensor) else v
                if local.numel():
                    assert lt[k].shape == tuple(local.shape), (rank, k)
                else:
                    assert k not in lt, (rank, k)
        assert_valid(m)
        jsons.append(dumps_manifest(m))
    assert len(set(jsons)) == 1
    return m


def test_flattened_dp_shard_cp_mesh_with_tp() -> None:
    """TorchTitan style: fully_shard on mesh["dp_shard", "cp"]._flatten("dp_shard_cp") over TP."""
    from torch.distributed.device_mesh import init_device_mesh

    def build() -> dict[str, Any]:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_shard", "cp", "tp"))
        flat = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
        from torch import nn
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        model = nn.Module()
        model.up = nn.Linear(6, 13)
        model.down = nn.Linear(13, 6)
        model.norm = nn.LayerNorm(6)
        parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(model, mesh=flat)
        return dict(model.state_dict())

    m = _same_on_every_rank(8, build)
    assert m.mesh == {"axes": ["dp_shard", "cp", "tp"], "shape": [2, 2, 2]}
    # norm (6 rows) over the 4 dp_shard_cp ranks; tp ranks (neighbours) are replicas
    assert [c.holders for c in m.arrays["norm.weight"].chunks] == [(0, 1), (2, 3), (4, 5)]


def test_hsdp_mesh() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    def build() -> dict[str, Any]:
        from torch import nn
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = nn.Linear(3, 5)
        fully_shard(model, mesh=mesh)
        return dict(model.state_dict())

    m = _same_on_every_rank(4, build)
    assert [c.holders for c in m.arrays["weight"].chunks] == [(0, 2), (1, 3)]


def test_piece_is_shard_ranges() -> None:
    from formats.layouts.mesh import shard_ranges
    from streamer.refit.torch_state import _piece

    for n in range(12):
        for k in range(1, 6):
            assert [_piece(n, k, i) for i in range(k)] == shard_ranges(n, k)


def test_mesh_not_covering_world() -> None:
    """An 8-rank world whose trainer mesh is ranks 4..7: holders are global ranks, world_size is
    the world's, plain tensors are held by the ranks of ``group`` (here: the whole world)."""
    from torch.distributed.device_mesh import DeviceMesh

    g = torch.arange(10.0)
    with fake_rank(5, 8):
        mesh = DeviceMesh("cpu", torch.tensor([4, 5, 6, 7]), mesh_dim_names=("dp",))
        d = distribute_tensor(g, mesh, [Shard(0)], src_data_rank=None)
        m = manifest_from_state_dict({"w": d, "b": torch.zeros(2)}, same_keys=True)
        local = d.to_local()
    assert m.world_size == 8
    assert [c.holders for c in m.arrays["w"].chunks] == [(4,), (5,), (6,), (7,)]
    assert m.arrays["b"].chunks[0].holders == tuple(range(8))
    assert_valid(m)
    check_rank(m, 5, {"w": local, "b": torch.zeros(2)}, {"w": g, "b": torch.zeros(2)})


# ---------------------------------------------------------------- plain tensors, no process group


def test_plain_state_dict_without_distributed() -> None:
    assert not dist.is_initialized()
    w = torch.randn(4, 3, dtype=torch.bfloat16)
    sd = {"model.embed.weight": w, "model.lm_head.weight": w, "model.scale": torch.tensor(2.0),
          "model.empty": torch.zeros(0, 3), "model.master": torch.randn(2, 2, dtype=torch.float32)}
    m = manifest_from_state_dict(sd, name="x", rename=lambda k: k.removeprefix("model."), keep_tied=True)
    assert_valid(m)
    assert m.world_size == 1 and m.name == "x" and m.mesh is None
    assert list(m.arrays) == ["embed.weight", "lm_head.weight", "scale", "empty", "master"]
    assert m.arrays["embed.weight"].data_type == "bfloat16"
    assert m.arrays["master"].data_type == "float32"
    assert m.arrays["scale"].shape == () and m.arrays["scale"].chunks[0].region.sizes == ()
    assert m.arrays["empty"].chunks == ()
    # tied: two arrays, each naming its own state-dict key
    assert m.arrays["embed.weight"].chunks[0].tensor("embed.weight") == "model.embed.weight"
    assert m.arrays["lm_head.weight"].chunks[0].tensor("lm_head.weight") == "model.lm_head.weight"
    check_rank(m, 0, sd, sd, rename=lambda k: k.removeprefix("model."))
    # by default a tied weight is one array under its first key: its bytes move once
    tied = manifest_from_state_dict(sd, rename=lambda k: k.removeprefix("model."))
    assert list(tied.arrays) == ["embed.weight", "scale", "empty", "master"]
    # equal values in separate storage are not tied
    sd["model.lm_head.weight"] = w.clone()
    assert "lm_head.weight" in manifest_from_state_dict(sd, rename=lambda k: k.removeprefix("model.")).arrays


def test_rename_that_raises_is_reported_by_name() -> None:
    def bad(k: str) -> str:
        raise KeyError(k)

    with pytest.raises(StateDictError, match=r"a: rename raised KeyError: 'a'"):
        manifest_from_state_dict({"a": torch.zeros(1)}, rename=bad)


def test_rename_none_drops_and_collision_is_refused() -> None:
    sd = {"a": torch.zeros(2), "b": torch.zeros(2), "skip": torch.zeros(1)}
    m = manifest_from_state_dict(sd, rename=lambda k: None if k == "skip" else k)
    assert list(m.arrays) == ["a", "b"]
    with pytest.raises(StateDictError, match=r"b: renamed to 'x', which 'a' is renamed to too"):
        manifest_from_state_dict(sd, rename=lambda k: "x")


@pytest.mark.parametrize("value, match", [
    (torch.zeros(3, 4).t(), r"bad: local tensor is not contiguous"),
    (torch.zeros(2, dtype=torch.complex64), r"bad: dtype torch.complex64 has no shardstream data_type"),
    (3, r"bad: is a int, not a tensor"),
    (torch.zeros(2, 2).to_sparse(), r"bad: local tensor has layout torch.sparse_coo"),
])
def test_unsupported_values_are_refused_by_name(value: Any, match: str) -> None:
    with pytest.raises(StateDictError, match=match) as ei:
        manifest_from_state_dict({"ok": torch.zeros(1), "bad": value})
    assert isinstance(ei.value, ValidationError) and isinstance(ei.value, ShardstreamError)
    assert ei.value.exit_code == 1


def test_partial_is_refused_by_name() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    with fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        p = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
        ok = DTensor.from_local(torch.ones(3), mesh, [Shard(0)], run_check=False)
        with pytest.raises(StateDictError, match=r"grad_sum: placement Partial\(sum\) is a partial value") as ei:
            manifest_from_state_dict({"ok": ok, "grad_sum": p}, same_keys=True)
    assert len(ei.value.problems) == 1


# ---------------------------------------------------------------- ranks with different keys


def _rec(key: str, shape: tuple[int, ...], **kw: Any) -> _Record:
    return _Record(key, key, shape, "float32", **kw)


def test_merge_pipeline_stages() -> None:
    """pp=2 x dp=2: stage 0 (ranks 0, 1) and stage 1 (ranks 2, 3) hold different layers; each
    layer's mesh is the dp sub-mesh, whose copies are [0, 1] and [2, 3]."""
    copies = ((0, 1), (2, 3))
    l0 = _rec("layers.0.w", (5, 2), placements=(("S", 0),), mesh_shape=(2,), copies=copies)
    l1 = _rec("layers.1.w", (5, 2), placements=(("S", 0),), mesh_shape=(2,), copies=copies)
    emb = _rec("embed", (3,))
    head = _rec("head", (3,))
    gathered = [(0, [emb, l0], []), (1, [emb, l0], []), (2, [l1, head], []), (3, [l1, head], [])]
    arrays, _ = _merge(gathered)
    assert list(arrays) == ["embed", "layers.0.w", "layers.1.w", "head"]
    assert [c.holders for c in arrays["layers.0.w"].chunks] == [(0,), (1,)]
    assert [c.holders for c in arrays["layers.1.w"].chunks] == [(2,), (3,)]
    assert arrays["embed"].chunks[0].holders == (0, 1)
    assert arrays["head"].chunks[0].holders == (2, 3)
    m = Manifest(world_size=4, arrays=arrays)
    assert validate_manifest(m) == []


def test_merge_refuses_disagreement_and_half_held_copies() -> None:
    a = _rec("w", (4,))
    b = _rec("w", (5,))
    with pytest.raises(StateDictError, match=r"w: ranks 0 and 1 disagree about it \(shape \[4\]"):
        _merge([(0, [a], []), (1, [b], [])])
    d = _rec("d", (4,), placements=(("S", 0),), mesh_shape=(2,), copies=((0, 1),))
    with pytest.raises(StateDictError, match=r"d: ranks \[1\] lack it although their mesh copy"):
        _merge([(0, [d], []), (1, [], [])])


def test_import_does_not_load_torch() -> None:
    """``from streamer import manifest_from_state_dict`` must stay cheap: torch loads on call."""
    import subprocess
    import sys

    code = "import sys, streamer.refit.torch_state; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plan_and_execute_from_the_manifest() -> None:
    """The manifest drives a real plan + executor (loopback threads): 4 FSDP2+TP-style ranks
    (strided, uneven, several chunks per rank, bf16 and fp32) gathered into one full rank."""
    from helpers import run_plan_loopback
    from torch.distributed.device_mesh import init_device_mesh

    from formats.layouts import manifest_from_arrays
    from streamer.plan.planner import plan_transfers

    specs = {
        "w": ((11, 3), [_StridedShard(0, split_factor=2), Shard(0)], torch.float32),
        "v": ((17,), [_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)], torch.bfloat16),
        "n": ((5,), [Shard(0), Replicate()], torch.float32),
        "s": ((), [Replicate(), Replicate()], torch.float32),
    }
    gen = torch.Generator().manual_seed(1)
    full = {k: torch.randn(shape, generator=gen).to(dt) for k, (shape, _, dt) in specs.items()}
    src_tensors: dict[int, dict[str, Any]] = {}
    jsons = set()
    for rank in range(4):
        with fake_rank(rank, 4):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
            sd = {k: distribute_tensor(full[k], mesh, pls, src_data_rank=None) for k, (_, pls, _) in specs.items()}
            m = manifest_from_state_dict(sd, rename=lambda k: "model." + k)
            src_tensors[rank] = {k: v.to_local().contiguous() for k, v in sd.items()}
        jsons.add(dumps_manifest(m))
    assert len(jsons) == 1
    dst = manifest_from_arrays({"model." + k: (shape, str(dt).removeprefix("torch."))
                                for k, (shape, _, dt) in specs.items()})
    plan = plan_transfers(m, dst)
    out = {"model." + k: torch.zeros_like(v) for k, v in full.items()}
    res = run_plan_loopback(plan, m, dst, src_tensors, {0: out})
    res.raise_first()
    for k, v in full.items():
        assert torch.equal(out["model." + k], v), k
