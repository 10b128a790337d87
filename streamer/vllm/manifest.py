"""The receiver manifest of a live vLLM engine, read from its own layer objects.

``manifest_from_vllm(model)`` runs inside every vLLM worker (all of them: it all-gathers over
vLLM's world group) and describes what each worker holds, with the HF checkpoint names a trainer
publishes, so any trainer manifest matches. No preset, no table of shapes: every region comes from
the attributes vLLM's parallel layers carry (their TP rank and sizes, shard offsets, vocab shard
indices, expert maps), and every shape from the parameters in *model format*: what the weight
loaders write, recorded by vLLM before its kernels repacked them (``reload`` metadata; the CPU build
leaves repacked linear weights with shape ``[0]``).

How each layer is described (vLLM 0.32; a subclass not listed is refused by name):

==============================  ==============================================================
``QKVParallelLinear``           q, k, v of the ``packed_modules_mapping`` names; offsets and
                                sizes from the layer's shard mappings; kv heads replicated when
                                TP exceeds them (shard ``tp_rank // num_kv_head_replicas``)
``MergedColumnParallelLinear``  one sub-block per ``output_sizes`` entry (gate, up)
``ColumnParallelLinear``        rows ``[tp_rank * n, +n)``
``RowParallelLinear``           columns ``[tp_rank * n, +n)``; the bias whole
``ReplicatedLinear``            whole (the MoE router ``GateLinear`` too)
``VocabParallelEmbedding``      vocab rows ``[org_vocab_start, org_vocab_end)`` at local row 0;
/ ``ParallelLMHead``            the padding rows are declared but belong to no array
checkpoint-fused layers         Phi-3's ``qkv_proj`` / ``gate_up_proj`` (``packed_modules_mapping``
                                maps the layer to itself): the same blocks, as regions of the one
                                fused HF array
tied layers                     a tied ``lm_head`` serving ``embed_tokens.weight``: no regions of
                                its own; recorded in ``aliases`` (rebuilt after the owner)
``RoutedExperts`` (FusedMoE)    ``w13`` = [gate; up] and ``w2`` per local expert (its expert map
                                under EP), TP-split along the intermediate size
no quant method, plain loader   whole, under its own name (norms)
==============================  ==============================================================

Routed experts are published two ways; a trainer of either kind matches one of them:
``per_expert`` (hub checkpoints, transformers 4, Megatron: ``mlp.experts.E.gate_proj.weight``;
``w13``/``w2`` are then viewed 2-D, ``[E_local * 2I, H]`` / ``[E_local * H, I]``, as the ``vllm``
preset lays them out) and ``fused`` (transformers 5 state dicts: ``mlp.experts.gate_up_proj``
``[E, 2I, H]`` and ``mlp.experts.down_proj`` ``[E, H, I]``, the parameters 3-D as vLLM holds them).

Block-FP8 linear layers (``Fp8LinearMethod`` with ``weight_block_size``) are described: the FP8
``weight`` as above, its float32 ``weight_scale_inv`` as the block image of each weight region
(the ``vllm`` preset's ``--fp8`` layout); a bf16/fp32 trainer then feeds them by quantize on refit.
Refused by name, never skipped: other quantized layers (per-tensor FP8, UE8M0 scales, FP8 experts
and the rest: not described yet), layers
whose loader this module does not know, array names the model's ``hf_to_vllm_mapper`` loads
elsewhere, partly tied layers, persistent buffers no push writes, experts with biases, LoRA added
vocabulary, EPLB redundant experts, padded MoE intermediate sizes.

Each local tensor also says how the engine reaches the kernels (``VllmTensor.path``):
``inplace`` (the layer keeps the weight as loaded: no quant method, or an unquantized linear or
embedding on CUDA) or ``reprocess`` (the layer transforms it after loading: every other quant
method, e.g. the CPU build's repacking of unquantized linear and embedding weights, and FusedMoE).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from formats.errors import FormatError, ValidationError
from formats.manifest.box import Box
from formats.manifest.dtypes import from_torch
from formats.manifest.wire import ArraySpec, Chunk, Manifest, Source, TensorSpec
from streamer.vllm import internals

__all__ = ["EXPERT_NAMINGS", "VllmLayoutError", "VllmManifests", "VllmTensor", "choose_naming",
           "describe_worker", "manifest_from_vllm", "manifests_from_pieces"]

#: how routed experts are published (see the module docstring)
EXPERT_NAMINGS = ("per_expert", "fused")


class VllmLayoutError(ValidationError):
    """The live model holds a parameter this module cannot describe as regions of HF arrays; each
    problem names the parameter (exit 1)."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One region of one HF array inside one local tensor of this worker."""

    array: str
    shape: tuple[int, ...]
    data_type: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    tensor: str
    local_offsets: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class VllmTensor:
    """A local tensor of this worker: parameter ``param`` of module ``module``, viewed as ``shape``
    (model format), and how an update reaches the kernels (``inplace`` or ``reprocess``)."""

    name: str
    module: str
    param: str
    shape: tuple[int, ...]
    data_type: str
    path: str


@dataclass(frozen=True)
class VllmManifests:
    """The engine's manifest under each expert naming (equal for dense models), this worker's
    rank in it, and its local tensors under each naming."""

    manifests: Mapping[str, Manifest]
    tensors: Mapping[str, tuple[VllmTensor, ...]]
    rank: int
    #: the block of the engine's block-FP8 weights (None: no FP8 layer); the session's ``fp8_block``
    fp8_block: tuple[int, int] | None = None
    #: this worker's tied layers: module -> the module whose parameters it serves (``lm_head`` ->
    #: ``model.embed_tokens``); reprocessed after their owner on every update
    aliases: Mapping[str, str] = field(default_factory=dict)


# ---------------------------------------------------------------- one worker (no communication)


def _model_format(layer: Any, name: str, param: Any) -> Any:
    """The parameter as the loaders write it: vLLM's reload metadata (a meta tensor recorded before
    ``process_weights_after_loading``), else the parameter itself."""
    info = internals.load().LAYERWISE_INFO.get(layer)
    if info is not None:
        meta = info.restore_metadata[0].get(name)
        if meta is not None:
            return meta
    return param


def _path(layer: Any) -> str:
    import torch

    v = internals.load()
    qm = getattr(layer, "quant_method", None)
    if qm is None:
        return "inplace"
    # on CUDA these two keep the weight as loaded (process_weights_after_loading does nothing there)
    if type(qm) in (v.UnquantizedLinearMethod, v.UnquantizedEmbeddingMethod) and torch.cuda.is_available():
        return "inplace"
    return "reprocess"


class _Worker:
    """Collects one worker's pieces and local tensors under both expert namings."""

    def __init__(self, packed: Mapping[str, Sequence[str]]) -> None:
        self.packed = packed
        self.pieces: dict[str, list[Piece]] = {k: [] for k in EXPERT_NAMINGS}
        self.tensors: dict[str, list[VllmTensor]] = {k: [] for k in EXPERT_NAMINGS}
        self.problems: list[str] = []
        self.fp8_blocks: set[tuple[int, int]] = set()
        #: layers that serve another layer's parameters (tied weights): module -> the owner
        self.aliases: dict[str, str] = {}

    def tensor(self, layer: Any, module: str, pname: str, shape: tuple[int, ...], dt: str,
               namings: Iterable[str] = EXPERT_NAMINGS) -> str:
        name = f"{module}.{pname}" if module else pname
        for k in namings:
            self.tensors[k].append(VllmTensor(name, module, pname, shape, dt, _path(layer)))
        return name

    def put(self, array: str, shape: tuple[int, ...], dt: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
            tensor: str, loffs: tuple[int, ...], namings: Iterable[str] = EXPERT_NAMINGS) -> None:
        for k in namings:
            self.pieces[k].append(Piece(array, shape, dt, offsets, sizes, tensor, loffs))

    def rows(self, layer: Any, module: str, pname: str, meta: Any, dt: str,
             blocks: Sequence[tuple[str, int, int, int, int]]) -> None:
        """Column-like: ``blocks`` of (HF module name, global rows, global start, local start, rows)."""
        shape = tuple(int(n) for n in meta.shape)
        t = self.tensor(layer, module, pname, shape, dt)
        rest = shape[1:]
        parent = module.rpartition(".")[0]
        for hf, total, g0, l0, n in blocks:
            array = f"{parent}.{hf}.{pname}" if parent else f"{hf}.{pname}"
            self.put(array, (total, *rest), dt, (g0, *(0,) * len(rest)), (n, *rest), t, (l0, *(0,) * len(rest)))

    def whole(self, layer: Any, module: str, pname: str, meta: Any, dt: str) -> None:
        shape = tuple(int(n) for n in meta.shape)
        t = self.tensor(layer, module, pname, shape, dt)
        self.put(t, shape, dt, (0,) * len(shape), shape, t, (0,) * len(shape))

    def scales(self, layer: Any, module: str, meta: Any, dt: str, block: tuple[int, int]) -> None:
        """A block-FP8 layer's ``weight_scale_inv``: the block image of every ``weight`` piece (one
        float32 per ``block`` of the weight; the last block of a dim may be partial), at the weight's
        local offset in blocks, under the HF name ``...weight_scale_inv``. A piece that does not
        start on the block grid, or ends off it before the array's end, is refused by name."""
        weight = f"{module}.weight"
        shape = tuple(int(n) for n in meta.shape)
        t = self.tensor(layer, module, "weight_scale_inv", shape, dt)
        for k in EXPERT_NAMINGS:
            for p in [p for p in self.pieces[k] if p.tensor == weight]:
                ends = [o + n for o, n in zip(p.offsets, p.sizes)]
                if any(o % b or lo % b or (e % b and e != full) for o, lo, e, b, full
                       in zip(p.offsets, p.local_offsets, ends, block, p.shape)):
                    self.problems.append(f"{p.array}: the region at {list(p.offsets)} of {list(p.sizes)} in {weight} "
                                         f"is not whole FP8 blocks of {list(block)}")
                    return
                self.put(p.array.removesuffix("weight") + "weight_scale_inv",
                         tuple(-(-n // b) for n, b in zip(p.shape, block)), dt,
                         tuple(o // b for o, b in zip(p.offsets, block)),
                         tuple(-(-e // b) - o // b for o, e, b in zip(p.offsets, ends, block)), t,
                         tuple(lo // b for lo, b in zip(p.local_offsets, block)), [k])


def _packed_names(w: _Worker, module: str, n: int) -> list[str] | None:
    leaf = module.rpartition(".")[2]
    names = w.packed.get(leaf)
    if names is None or len(names) != n:
        w.problems.append(f"{module}: a fused layer of {n} parts, but the model's packed_modules_mapping "
                          f"gives {names!r} for {leaf!r}")
        return None
    return list(names)


def _fused_in_checkpoint(w: _Worker, module: str) -> bool:
    """The checkpoint itself holds this layer fused under the layer's own name (Phi-3's
    ``qkv_proj`` and ``gate_up_proj``): the model's ``packed_modules_mapping`` maps it to itself."""
    leaf = module.rpartition(".")[2]
    return list(w.packed.get(leaf) or ()) == [leaf]


def _qkv(w: _Worker, layer: Any, module: str, pname: str, meta: Any, dt: str) -> None:
    fused = _fused_in_checkpoint(w, module)
    names = [module.rpartition(".")[2]] * 3 if fused else _packed_names(w, module, 3)
    if names is None:
        return
    rep = int(layer.num_kv_head_replicas)
    hd = int(layer.head_size)
    vhd = int(getattr(layer, "v_head_size", hd) or hd)
    totals = {"q": int(layer.total_num_heads) * hd, "k": int(layer.total_num_kv_heads) * hd,
              "v": int(layer.total_num_kv_heads) * vhd}
    # a checkpoint-fused array is [q; k; v] whole: each part starts after the ones before it
    base = {"q": 0, "k": totals["q"], "v": totals["q"] + totals["k"]} if fused else {"q": 0, "k": 0, "v": 0}
    total = sum(totals.values())
    blocks = []
    for sid, hf in zip("qkv", names):
        off, n = int(layer._get_shard_offset_mapping(sid)), int(layer._get_shard_size_mapping(sid))
        shard = layer.tp_rank if sid == "q" else layer.tp_rank // rep
        blocks.append((hf, total if fused else totals[sid], base[sid] + int(shard) * n, off, n))
    w.rows(layer, module, pname, meta, dt, blocks)


def _merged(w: _Worker, layer: Any, module: str, pname: str, meta: Any, dt: str) -> None:
    sizes = [int(s) for s in layer.output_sizes]
    fused = _fused_in_checkpoint(w, module)
    names = [module.rpartition(".")[2]] * len(sizes) if fused else _packed_names(w, module, len(sizes))
    if names is None:
        return
    tp, r = int(layer.tp_size), int(layer.tp_rank)
    blocks, l0, g0 = [], 0, 0
    for hf, total in zip(names, sizes):
        n = total // tp
        # a checkpoint-fused array ([gate; up] whole) holds every part, one after the other
        blocks.append((hf, sum(sizes) if fused else total, g0 + r * n, l0, n))
        l0 += n
        g0 += total if fused else 0
    w.rows(layer, module, pname, meta, dt, blocks)


def _column(w: _Worker, layer: Any, module: str, pname: str, meta: Any, dt: str) -> None:
    n = int(meta.shape[0])
    leaf = module.rpartition(".")[2]
    w.rows(layer, module, pname, meta, dt, [(leaf, n * int(layer.tp_size), int(layer.tp_rank) * n, 0, n)])


def _row(w: _Worker, layer: Any, module: str, pname: str, meta: Any, dt: str) -> None:
    if pname != "weight" or len(meta.shape) != 2:
        w.whole(layer, module, pname, meta, dt)  # the bias: whole on every rank
        return
    out, k = (int(n) for n in meta.shape)
    t = w.tensor(layer, module, pname, (out, k), dt)
    w.put(t, (out, k * int(layer.tp_size)), dt, (0, int(layer.tp_rank) * k), (out, k), t, (0, 0))


def _vocab(w: _Worker, layer: Any, module: str, pname: str, meta: Any, dt: str) -> None:
    si = layer.shard_indices
    if si.num_added_elements:
        w.problems.append(f"{module}.{pname}: holds {si.num_added_elements} added (LoRA) vocabulary rows, "
                          f"which no HF array describes")
        return
    shape = tuple(int(n) for n in meta.shape)
    t = w.tensor(layer, module, pname, shape, dt)
    lo, hi = int(si.org_vocab_start_index), int(si.org_vocab_end_index)
    if hi > lo:  # padding rows (up to a multiple of 64 per shard) are in no array
        w.put(t, (int(layer.org_vocab_size), *shape[1:]), dt, (lo, *(0,) * (len(shape) - 1)),
              (hi - lo, *shape[1:]), t, (0,) * len(shape))


def _experts(w: _Worker, layer: Any, module: str, params: Mapping[str, tuple[Any, str]]) -> None:
    """RoutedExperts' ``w13_weight`` [E_local, 2I/tp, H] and ``w2_weight`` [E_local, H, I/tp]."""
    mpc = layer.moe_config.moe_parallel_config
    tp, r = int(mpc.tp_size), int(mpc.tp_rank)
    E = int(layer.global_num_experts)
    local = [int(e) for e in layer.expert_map_manager.get_local_expert_ids()]
    gate, up, down = layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name
    bad = [f"{module}: {why}" for why, cond in (
        ("EPLB redundant experts (one expert in several places) are not described yet",
         getattr(layer.expert_map_manager, "num_redundant_experts", 0)),
        ("a checkpoint with fused gate/up experts (no up_proj name) is not described yet", up is None),
        ("transposed fused expert checkpoints are not described yet", layer.is_fused_checkpoint_transposed),
        (f"expects parameters w13_weight and w2_weight, has {sorted(params)}",
         set(params) != {"w13_weight", "w2_weight"})) if cond]
    if bad:
        w.problems.extend(bad)
        return
    m13, dt = params["w13_weight"]
    m2, dt2 = params["w2_weight"]
    el, i2, H = (int(n) for n in m13.shape)
    n = i2 // 2
    inter = n * tp
    if el != len(local) or tuple(m2.shape) != (el, H, n) or dt2 != dt:
        w.problems.append(f"{module}: w13 {list(m13.shape)} and w2 {list(m2.shape)} do not hold {len(local)} local "
                          f"experts of intermediate size {inter} / tp {tp} (padded intermediate sizes: not described yet)")
        return
    prefix = module.removesuffix(".routed_experts")
    t13 = f"{module}.w13_weight"
    t2 = f"{module}.w2_weight"
    # per expert: the 2-D views [E_local * 2n, H] and [E_local * H, n]
    w.tensor(layer, module, "w13_weight", (el * i2, H), dt, ["per_expert"])
    w.tensor(layer, module, "w2_weight", (el * H, n), dt, ["per_expert"])
    # fused (transformers 5): the 3-D parameters themselves
    w.tensor(layer, module, "w13_weight", (el, i2, H), dt, ["fused"])
    w.tensor(layer, module, "w2_weight", (el, H, n), dt, ["fused"])
    pe, fu = ["per_expert"], ["fused"]
    for le, e in enumerate(local):
        a = f"{prefix}.{e}."
        w.put(a + f"{gate}.weight", (inter, H), dt, (r * n, 0), (n, H), t13, (le * i2, 0), pe)
        w.put(a + f"{up}.weight", (inter, H), dt, (r * n, 0), (n, H), t13, (le * i2 + n, 0), pe)
        w.put(a + f"{down}.weight", (H, inter), dt, (0, r * n), (H, n), t2, (le * H, 0), pe)
        w.put(f"{prefix}.gate_up_proj", (E, 2 * inter, H), dt, (e, r * n, 0), (1, n, H), t13, (le, 0, 0), fu)
        w.put(f"{prefix}.gate_up_proj", (E, 2 * inter, H), dt, (e, inter + r * n, 0), (1, n, H), t13, (le, n, 0), fu)
        w.put(f"{prefix}.down_proj", (E, H, inter), dt, (e, 0, r * n), (1, H, n), t2, (le, 0, 0), fu)


def describe_worker(model: Any) -> _Worker:
    """This worker's pieces and local tensors (both namings) and the problems found."""
    v = internals.load()
    w = _Worker(getattr(model, "packed_modules_mapping", None) or {})
    known: list[tuple[type, Any]] = [(v.QKVParallelLinear, _qkv), (v.MergedColumnParallelLinear, _merged),
                                     (v.RowParallelLinear, _row), (v.ReplicatedLinear, None),
                                     (v.ColumnParallelLinear, _column), (v.VocabParallelEmbedding, _vocab)]
    unquantized = (v.UnquantizedLinearMethod, v.UnquantizedEmbeddingMethod)
    owner: dict[int, str] = {}  # id of a parameter -> the module that describes it
    for module, layer in model.named_modules():
        _buffers(w, module, layer)
        own = {k: p for k, p in layer._parameters.items() if p is not None and id(p) not in owner}
        if _tied(w, module, layer, owner, own) or not own:
            continue
        owner.update((id(p), module) for p in own.values())
        params = {}
        for pname, p in own.items():
            meta = _model_format(layer, pname, p)
            try:
                params[pname] = (meta, from_torch(meta.dtype).name)
            except FormatError:
                w.problems.append(f"{module}.{pname}: dtype {meta.dtype} has no shardstream data_type")
        if len(params) != len(own):
            continue
        qm = getattr(layer, "quant_method", None)
        if isinstance(layer, v.RoutedExperts):
            if type(qm).__name__ != "UnquantizedFusedMoEMethod":
                w.problems.append(f"{module}: quantized experts ({type(qm).__name__}) are not described yet")
            else:
                _experts(w, layer, module, params)
            continue
        kind = next(((cls, fn) for cls, fn in known if isinstance(layer, cls)), None)
        if kind is not None:
            cls, fn = kind
            block = None
            if qm is not None and not isinstance(qm, unquantized):
                block = _fp8_block(w, module, qm, params)
                if block is None:
                    continue
            # subclasses with loaders of their own (fused q/k/v + gate, indexers...) are refused
            if any(getattr(type(layer), f, None) is not getattr(cls, f, None)
                   for f in ("weight_loader", "weight_loader_v2")):
                w.problems.append(f"{module}: {type(layer).__name__} has a weight loader this module does not know")
                continue
            for pname, (meta, dt) in params.items():
                if pname != "weight_scale_inv":
                    (fn or _whole_fn)(w, layer, module, pname, meta, dt)
            if block is not None:
                w.scales(layer, module, *params["weight_scale_inv"], block)
            continue
        for pname, (meta, dt) in params.items():
            loader = getattr(own[pname], "weight_loader", v.default_weight_loader)
            if qm is not None or getattr(loader, "__name__", "") not in ("default_weight_loader",
                                                                         "online_process_loader"):
                w.problems.append(f"{module}.{pname}: {type(layer).__name__} loads it with "
                                  f"{getattr(loader, '__qualname__', loader)!r}, which may transform the bytes "
                                  f"(not described)")
                continue
            w.whole(layer, module, pname, meta, dt)
    _check_mapper(w, model)
    return w


def _tied(w: _Worker, module: str, layer: Any, owner: Mapping[int, str], own: Mapping[str, Any]) -> bool:
    """A layer serving another layer's parameters (tied embeddings: ``lm_head.weight`` is
    ``embed_tokens.weight``) is recorded as an alias of it (True): nothing to receive, but whatever
    its quant method built from them at load (the CPU build's packed copy for the logits) must be
    rebuilt after each update, or it serves the old weights. A partly tied layer is refused."""
    tied = {k: owner[id(p)] for k, p in layer._parameters.items() if p is not None and id(p) in owner}
    if not tied:
        return False
    if own or len(set(tied.values())) != 1:
        w.problems.append(f"{module}: shares {sorted(tied)} with {sorted(set(tied.values()))} and also holds "
                          f"{sorted(own)}: a partly tied layer is not described")
    else:
        w.aliases[module] = next(iter(tied.values()))
    return True


def _check_mapper(w: _Worker, model: Any) -> None:
    """A model whose ``hf_to_vllm_mapper`` renames checkpoint names (the Transformers modeling
    backend standardises prefixes; GPT-OSS renames ``self_attn`` to ``attn``): every array this
    worker publishes must load, through that mapper, into the parameter it describes (or keep its
    name). Names the mapper moves elsewhere are refused by name: publishing them would ask the
    trainer for arrays it does not have."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None or not any(getattr(mapper, f, None) for f in (
            "orig_to_new_renaming", "orig_to_new_regex", "orig_to_new_substr", "orig_to_new_prefix",
            "orig_to_new_suffix")):
        return
    for p in dict.fromkeys(p for k in EXPERT_NAMINGS for p in w.pieces[k]):
        loads_as = mapper.map_name(p.array)
        if loads_as not in (p.array, p.tensor):
            w.problems.append(f"{p.array}: {type(model).__name__}'s hf_to_vllm_mapper loads it as {loads_as!r}, "
                              f"not {p.tensor!r} (renamed checkpoints are not described yet)")
            return


#: persistent buffers of attention layers: KV-cache quantization scales, constants (1.0) unless the
#: KV cache is FP8, where a checkpoint may carry them
_KV_SCALES = frozenset({"_k_scale", "_v_scale", "_q_scale", "_prob_scale"})


def _buffers(w: _Worker, module: str, layer: Any) -> None:
    """Every buffer a layer serves from must be one no weight determines: non-persistent buffers
    are computed from the config (rotary caches, Gemma's embedding normalizer); attention layers'
    KV scales are constants unless the KV cache is FP8. Any other buffer is refused by name: a
    checkpoint could carry it, and no push would write it."""
    for name, b in layer._buffers.items():
        if b is None or name in layer._non_persistent_buffers_set:
            continue
        if name in _KV_SCALES and "fp8" not in str(getattr(layer, "kv_cache_dtype", "auto")):
            continue
        w.problems.append(f"{module}.{name}: a persistent buffer ({type(layer).__name__}) that a checkpoint may carry "
                          f"and no pushed array writes")


def _whole_fn(w: _Worker, layer: Any, module: str, pname: str, meta: Any, dt: str) -> None:
    w.whole(layer, module, pname, meta, dt)


def _fp8_block(w: _Worker, module: str, qm: Any, params: Mapping[str, tuple[Any, str]]) -> tuple[int, int] | None:
    """The block of a block-FP8 linear layer (vLLM's ``Fp8LinearMethod`` with ``weight_block_size``,
    dynamic activation scales, float32 ``weight_scale_inv``), recorded in ``w``; None, with the
    problem recorded, for any other quantized layer (per-tensor FP8, static input scales, UE8M0
    scales, every other method: not described yet)."""
    fp8_method = internals.load().Fp8LinearMethod
    block = getattr(qm, "weight_block_size", None) if type(qm) is fp8_method else None
    why = ("" if block is not None else f"quantized layer ({type(qm).__name__}"
           + (", FP8 without weight_block_size" if type(qm) is fp8_method else "") + ") is not described yet")
    if not why and (qm.act_q_static or getattr(qm, "is_scale_e8m0", False)):
        why = "block-FP8 layer with static input scales or UE8M0 scales is not described yet"
    if not why and (params.get("weight", (None, ""))[1] != "float8_e4m3fn"
                    or params.get("weight_scale_inv", (None, ""))[1] != "float32"
                    or set(params) - {"weight", "weight_scale_inv", "bias"}):
        why = f"block-FP8 layer with parameters {sorted((k, d) for k, (_, d) in params.items())} is not described"
    if why:
        w.problems.append(f"{module}: {why}")
        return None
    assert block is not None
    b = (int(block[0]), int(block[1]))
    w.fp8_blocks.add(b)
    return b


# ---------------------------------------------------------------- every worker


def manifests_from_pieces(per_rank: Sequence[tuple[int, Mapping[str, Sequence[Piece]],
                                                   Mapping[str, Sequence[VllmTensor]]]],
                          world_size: int, name: str | None = None) -> dict[str, Manifest]:
    """Both namings' manifests from every rank's pieces (pure): chunks with the same region in the
    same local tensor at the same offsets are one chunk held by several ranks."""
    out: dict[str, Manifest] = {}
    for naming in EXPERT_NAMINGS:
        arrays: dict[str, tuple[tuple[int, ...], str]] = {}
        chunks: dict[str, dict[tuple[Any, ...], set[int]]] = {}
        tensors: dict[int, dict[str, TensorSpec]] = {}
        problems: list[str] = []
        for rank, pieces, locals_ in per_rank:
            for p in pieces[naming]:
                have = arrays.setdefault(p.array, (p.shape, p.data_type))
                if have != (p.shape, p.data_type):
                    problems.append(f"{p.array}: rank {rank} holds it as {p.data_type} {list(p.shape)}, another rank "
                                    f"as {have[1]} {list(have[0])}")
                key = (p.offsets, p.sizes, p.tensor, p.local_offsets)
                chunks.setdefault(p.array, {}).setdefault(key, set()).add(rank)
            tensors[rank] = {t.name: TensorSpec(t.shape, t.data_type) for t in locals_[naming]}
        if problems:
            raise VllmLayoutError(problems=problems)
        specs = {}
        for a, (shape, dt) in arrays.items():
            cs = tuple(Chunk(Box(k[0], k[1]), tuple(sorted(hs)),
                             Source(tensor=k[2] if k[2] != a else None, offsets=k[3] if any(k[3]) else None))
                       for k, hs in sorted(chunks[a].items()))
            specs[a] = ArraySpec(shape, dt, tuple(c if c.source != Source() else Chunk(c.region, c.holders)
                                                  for c in cs))
        out[naming] = Manifest(world_size=world_size, arrays=specs, name=name, tensors=tensors)
    return out


def choose_naming(manifests: Mapping[str, Manifest], src: Manifest) -> str:
    """The expert naming whose arrays the sender's manifest publishes: ``fused`` when the sender
    names a fused expert array of ours, else ``per_expert``.

    >>> from formats.manifest.wire import Manifest
    >>> choose_naming({"per_expert": Manifest(1, {}), "fused": Manifest(1, {})}, Manifest(1, {}))
    'per_expert'
    """
    fused_only = set(manifests["fused"].arrays) - set(manifests["per_expert"].arrays)
    return "fused" if fused_only & set(src.arrays) else "per_expert"


def manifest_from_vllm(model: Any, *, name: str | None = "vllm", group: Any = None) -> VllmManifests:
    """Describe every worker's parameters; call it in every worker of the engine (a collective over
    ``group``, default vLLM's world group when torch.distributed is initialised). Raises
    :class:`VllmLayoutError` naming every parameter it cannot describe, on every worker."""
    import torch.distributed as dist

    w = describe_worker(model)
    if len(w.fp8_blocks) > 1:
        w.problems.append(f"block-FP8 layers with different blocks {sorted(w.fp8_blocks)}: one session has one block")
    mine = (w.pieces, w.tensors, w.problems)
    if dist.is_available() and dist.is_initialized():
        if group is None:
            from streamer.vllm.replies import world_cpu_group

            group = world_cpu_group()
        rank, size = int(dist.get_rank()), int(dist.get_world_size())
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, (rank, mine), group=group)
    else:
        rank, size = 0, 1
        gathered = [(0, mine)]
    problems = list(dict.fromkeys(p for _r, (_, _, ps) in gathered for p in ps))
    if problems:
        raise VllmLayoutError(problems=problems)
    manifests = manifests_from_pieces([(r, pcs, ts) for r, (pcs, ts, _) in gathered], size, name)
    block = next(iter(w.fp8_blocks), None)
    return VllmManifests(manifests, {k: tuple(v) for k, v in w.tensors.items()}, rank, block, dict(w.aliases))
