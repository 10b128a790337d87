"""Presets: (HF config, framework, mesh) -> the manifest the framework really holds (design §4).

No I/O beyond reading a config file you name, no MPI, no torch.

Arrays are always the *logical* Hugging Face arrays (``model.layers.3.self_attn.q_proj.weight``);
each chunk's ``source`` names the framework's own *local* tensor and where the region sits in it.
Fused tensors (``linear_qkv``, ``qkv_proj``, ``gate_up_proj``, ``w13_weight``) therefore hold
regions of several arrays, and one array's region on a rank may be split into several chunks at
different offsets (Megatron's per-group QKV interleave). Vocabulary padding rows exist only in
the local tensors: they are declared in the manifest's ``tensors`` section and no chunk covers
them (a receiver leaves them as they are, a converted file has zeros there).

>>> cfg = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
...        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000}
>>> m = preset_manifest(cfg, "vllm", Mesh(("tp",), (2,)))
>>> sorted(m.local_tensors(0))[:3]
['lm_head.weight', 'model.embed_tokens.weight', 'model.layers.0.input_layernorm.weight']
>>> m.local_tensors(1)["model.layers.0.self_attn.qkv_proj.weight"].shape
(64, 64)

Presets
-------
``megatron`` -- Megatron-core with the Transformer Engine layer specs. Mesh axes, in Megatron's
    rank order (tp fastest): a subsequence of ``pp, dp, ep, cp, tp``.

    * ``embedding.word_embeddings.weight`` / ``output_layer.weight``: vocab-parallel (``S(0)``),
      the vocab padded to a multiple of ``make_vocab_size_divisible_by`` (128) × tp
      (``_vocab_size_with_padding``) and split evenly; embedding on the first stage, output layer
      on the last. Tied embeddings: no ``output_layer`` (pp = 1 only: with pp > 1 Megatron keeps
      a second copy of the embedding as the last stage's ``output_layer.weight``, which a manifest
      cannot name next to the first, so it is refused).
    * ``decoder.layers.{l}.self_attention.linear_qkv.weight`` (and ``.bias``): for each local
      query group ``[q rows of the group's heads; k rows; v rows]``; groups split evenly over tp
      (``num_query_groups % tp == 0`` and ``num_attention_heads % tp == 0`` are required, as in
      Megatron). ``linear_qkv.layer_norm_weight`` = ``input_layernorm``; ``q_layernorm`` /
      ``k_layernorm`` = ``q_norm`` / ``k_norm`` (replicated).
    * ``linear_proj.weight`` = ``o_proj`` ``S(1)`` (its bias replicated);
      ``mlp.linear_fc1.weight`` = ``[gate_shard; up_shard]``, ``mlp.linear_fc2.weight`` = ``down``
      ``S(1)``; ``mlp.linear_fc1.layer_norm_weight`` = ``post_attention_layernorm`` in dense layers,
      ``pre_mlp_layernorm.weight`` in MoE layers; ``decoder.final_layernorm.weight``.
    * pp: ``num_hidden_layers % pp == 0``; layer ``i`` lives on stage ``i // (L/pp)`` as local layer
      ``i % (L/pp)`` (Megatron numbers the layers of a stage from 0).
    * MoE (qwen3_moe): ``mlp.router.weight`` (replicated); experts
      ``mlp.experts.local_experts.{e}.linear_fc1.weight`` / ``linear_fc2.weight`` numbered within
      the EP rank (``moe_grouped_gemm=True``: TE ``GroupedLinear`` names ``mlp.experts.linear_fc1.weight{e}``);
      ``num_experts % ep == 0``. Expert tensor parallelism defaults to tp (Megatron's default,
      experts TP-split like the dense MLP); ``expert_tensor_parallel=1`` spreads whole experts over
      the flattened ``ep × tp`` ranks (parallel folding, EP = ep·tp), as NeMo RL's refit assumes.
    * ``dp``, ``cp`` (and ``ep`` for non-expert arrays) replicate.
    * MLA (deepseek_v3 / v2), Megatron-core's ``MLASelfAttention`` TE spec with
      ``qk_layernorm=True``: ``self_attention.linear_q_down_proj.weight`` = ``q_a_proj`` and
      ``linear_kv_down_proj.weight`` = ``kv_a_proj_with_mqa`` (TELinear "duplicated": replicated
      over tp), ``linear_q_up_proj.weight`` = ``q_b_proj`` and ``linear_kv_up_proj.weight`` =
      ``kv_b_proj`` column-parallel (whole heads, ``S(0)``) with ``q_a_layernorm`` /
      ``kv_a_layernorm`` as their ``layer_norm_weight``; without ``q_lora_rank``
      ``linear_q_proj.weight`` = ``q_proj`` ``S(0)``; ``linear_proj.weight`` = ``o_proj`` ``S(1)``.
      The input layernorm is a separate TENorm, ``input_layernorm.weight``. MoE layers add
      ``mlp.router.expert_bias`` (= ``e_score_correction_bias``, float32) and
      ``mlp.shared_experts.linear_fc1.weight`` (``[gate_shard; up_shard]``) / ``linear_fc2.weight``
      (``S(1)``, TP like the dense MLP); routed experts and dense layers as above.

``vllm`` / ``sglang`` -- vLLM's (and SGLang's) parallel layers. Mesh axes, slowest first: a
    subsequence of ``dp, ep, pp, tp``; ``dp`` are independent replicas (separate engines),
    ``ep`` is data-parallel attention with expert parallelism (``--data-parallel-size`` with
    ``--enable-expert-parallel``). Layer names keep their global index.

    * ``model.embed_tokens.weight`` / ``lm_head.weight``: ``VocabParallelEmbedding`` /
      ``ParallelLMHead``: the vocab padded to a multiple of 64, then split evenly over tp (vLLM
      requires the padded vocab to be divisible by tp). Tied embeddings: no ``lm_head``; with
      pp > 1 the last stage holds ``model.embed_tokens.weight`` too.
    * ``self_attn.qkv_proj.weight`` (and ``.bias``) = ``[q_shard; k_shard; v_shard]``
      (``QKVParallelLinear``); with tp >= num_kv_heads the kv heads are replicated: rank ``t``
      holds kv head ``t * num_kv_heads // tp`` (``tp % num_kv_heads == 0`` required), else
      ``num_kv_heads % tp == 0``. ``o_proj`` ``S(1)``; ``mlp.gate_up_proj.weight`` =
      ``[gate_shard; up_shard]`` (``MergedColumnParallelLinear``), ``down_proj`` ``S(1)``; norms
      replicated.
    * pp: vLLM's ``get_pp_indices`` (the remainder goes to the stages before the last, from the
      second-to-last backwards); SGLang's gives it to the last stages.
    * MoE: router ``mlp.gate.weight`` replicated; ``mlp.experts.w13_weight`` ``[E_local, 2·I_shard,
      H]`` (``[gate; up]`` per expert) and ``mlp.experts.w2_weight`` ``[E_local, H, I_shard]``,
      described as their row-major 2-D views ``[E_local·2·I_shard, H]`` and ``[E_local·H, I_shard]``
      (same bytes; a live refit passes ``w13_weight.view(-1, H)``). Without expert parallelism all
      experts are on every rank, TP-split on dim 1 of w13 / dim 2 of w2. With an ``ep`` axis (or
      ``expert_parallel=True``) experts are whole and spread over the flattened ``ep × tp`` ranks
      of a stage (EP rank ``ep·tp_size + tp``), vLLM's "linear" placement: the first
      ``E % EP`` ranks get one more expert (SGLang requires ``E % EP == 0``).
    * MLA (vLLM's ``DeepseekV2MLAAttention``): ``self_attn.fused_qkv_a_proj.weight`` =
      ``[q_a_proj; kv_a_proj_with_mqa]`` replicated (``MergedColumnParallelLinear`` with
      ``disable_tp``; current vLLM -- older releases kept ``q_a_proj`` and ``kv_a_proj_with_mqa``
      apart), ``q_a_layernorm`` / ``kv_a_layernorm`` replicated, ``q_b_proj`` / ``kv_b_proj``
      column-parallel by heads, ``o_proj`` ``S(1)``; without ``q_lora_rank``: ``q_proj``
      ``S(0)`` and ``kv_a_proj_with_mqa`` replicated. SGLang names the fused tensor
      ``fused_qkv_a_proj_with_mqa``. MoE layers: ``mlp.gate.e_score_correction_bias``
      replicated, ``mlp.shared_experts.gate_up_proj`` / ``down_proj`` TP-split like the dense MLP
      (shared experts not fused into the routed ones: SGLang's ``--disable-shared-experts-fusion``).

Block FP8 (``fp8=True``, megatron / vllm / sglang): each ``weight_scale_inv`` is laid out like its
weight, in block units: a chunk of rows ``[r0, r1)`` at local row ``l0`` brings scale rows
``[r0/b, ceil(r1/b))`` at local row ``l0/b`` of the local scale tensor, named after the local
weight (``…q_b_proj.weight_scale_inv``, ``w13_weight_scale_inv``, Megatron
``linear_fc1.weight_scale_inv``); vLLM's stacked ``w2_weight_scale_inv`` holds
``ceil(H/b)`` rows per expert. A piece that does not start and end on block boundaries (or a fused
part that does not start on one) is refused, naming the array, as vLLM's block-FP8 loader
refuses such shards. Replicated weights have replicated scales. ``fsdp2`` / ``hf`` treat scales as
arrays of their own.

``fsdp2`` -- HF names; every array ``S(0)`` over ``fsdp`` (uneven, torch.chunk), optionally × ``tp``
    with the generic tensor-parallel rules (:func:`~.models.generic_rules`; FSDP2 then shards the
    TP-local tensor, the ``_StridedShard`` order); ``dp`` replicates (HSDP), ``pp`` pins by stage.

``hf`` -- one rank, HF names (``convert`` names the files and writes the index).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from itertools import product
from pathlib import Path
from typing import Any

from ..box import Box
from ..dtypes import by_name
from ..manifest import ArraySpec, Chunk, Manifest, Source, TensorSpec
from .mesh import LayoutError, Mesh, Placement, Shard
from .rules import check_file_pattern, parse_rule, pp_stage

__all__ = [
    "MEGATRON_VOCAB_DIVISOR",
    "PRESETS",
    "VLLM_VOCAB_PADDING",
    "ModelInfo",
    "megatron_padded_vocab",
    "model_info",
    "pp_partition",
    "preset_manifest",
    "vllm_expert_range",
    "vllm_padded_vocab",
]

PRESETS = ("megatron", "vllm", "sglang", "fsdp2", "hf")

#: Megatron's ``make_vocab_size_divisible_by`` default
MEGATRON_VOCAB_DIVISOR = 128
#: vLLM's ``DEFAULT_VOCAB_PADDING_SIZE`` (SGLang uses the same)
VLLM_VOCAB_PADDING = 64

_MEGATRON_AXES = ("pp", "dp", "ep", "cp", "tp")
_VLLM_AXES = ("dp", "ep", "pp", "tp")
_FSDP_AXES = ("pp", "dp", "fsdp", "cp", "tp")
_DENSE_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
_MLA_TYPES = ("deepseek_v3", "deepseek_v2")

Arrays = dict[str, tuple[tuple[int, ...], str]]


class _PresetError(LayoutError):
    pass


# ---------------------------------------------------------------- model description


@dataclass(frozen=True)
class ModelInfo:
    """What a preset needs to know about the model, and its HF arrays."""

    model_type: str
    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tie: bool
    arrays: Arrays
    #: multi-head latent attention (deepseek_v2 / deepseek_v3): no q/k/v heads to fuse
    mla: bool = False
    #: block ``(rows, cols)`` of the FP8 weights' ``weight_scale_inv`` siblings (None: no FP8)
    fp8_block: tuple[int, int] | None = None

    def is_moe_layer(self, i: int) -> bool:
        return f"model.layers.{i}.mlp.gate.weight" in self.arrays

    def num_experts(self, i: int) -> int:
        return self.arrays[f"model.layers.{i}.mlp.gate.weight"][0][0]


def _load_cfg(cfg: Mapping[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return dict(cfg)
    p = Path(cfg)
    if p.is_dir():
        p = p / "config.json"
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LayoutError(f"{p}: no such config.json") from None
    except json.JSONDecodeError as e:
        raise LayoutError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(obj, dict):
        raise LayoutError(f"{p}: expected a JSON object at top level")
    return obj


def _arrays_from_config(c: Mapping[str, Any], fp8: bool) -> tuple[Arrays, tuple[int, int] | None]:
    from .models import _fp8_block, arrays_from_config

    return arrays_from_config(c, fp8=fp8), _fp8_block(c, "config.json", fp8)


def model_info(cfg: Mapping[str, Any] | str | os.PathLike[str], *, dtype: str | None = "bfloat16",
               fp8: bool = False) -> ModelInfo:
    """The HF arrays of ``cfg`` (``dtype`` replaces ``torch_dtype`` unless None; ``fp8``: block-FP8
    linear weights with ``weight_scale_inv`` siblings, as :func:`~.models.arrays_from_config`) and
    the attention geometry the fused layouts need."""
    c = _load_cfg(cfg)
    if dtype is not None:
        by_name(dtype)
        c["torch_dtype"] = dtype
    arrays, block = _arrays_from_config(c, fp8)

    def num(key: str, default: int | None = None) -> int:
        v = c.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise LayoutError(f"config.json: {key} must be an integer >= 1, got {v!r}")
        return v

    mt = str(c.get("model_type"))
    h = num("hidden_size")
    nh = num("num_attention_heads")
    nkv = num("num_key_value_heads", nh)
    hd = c.get("head_dim") or h // nh
    return ModelInfo(mt, h, num("num_hidden_layers"), num("vocab_size"), nh, nkv, int(hd),
                     bool(c.get("tie_word_embeddings", False)), arrays, mt in _MLA_TYPES, block)


# ---------------------------------------------------------------- geometry helpers


def _ceil_to(n: int, m: int) -> int:
    return -(-n // m) * m


def megatron_padded_vocab(vocab: int, tp: int, divisor: int = MEGATRON_VOCAB_DIVISOR) -> int:
    """Megatron's ``_vocab_size_with_padding``: a multiple of ``divisor × tp``.

    >>> megatron_padded_vocab(1000, 3)
    1152
    """
    return _ceil_to(vocab, divisor * tp)


def vllm_padded_vocab(vocab: int, padding: int = VLLM_VOCAB_PADDING) -> int:
    """vLLM's ``pad_vocab_size``: a multiple of 64.

    >>> vllm_padded_vocab(1000)
    1024
    """
    return _ceil_to(vocab, padding)


def pp_partition(num_layers: int, pp: int, style: str, *, first: int | None = None,
                 last: int | None = None) -> list[int]:
    """Layers per pipeline stage. ``megatron``: even (``num_layers % pp == 0``), or with
    ``first`` / ``last`` (Megatron-core's ``decoder_first_pipeline_num_layers`` /
    ``decoder_last_pipeline_num_layers``) those on the first / last stage and the rest even over
    the others; ``vllm``: ``get_pp_indices`` (remainder to the stages before the last, from the
    second-to-last backwards); ``sglang``: remainder to the last stages.

    >>> pp_partition(6, 4, "vllm"), pp_partition(6, 4, "sglang"), pp_partition(61, 16, "megatron", first=3, last=2)
    ([1, 2, 2, 1], [1, 1, 2, 2], [3, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2])
    """
    if num_layers < pp:
        raise _PresetError(f"{num_layers} layers cannot fill {pp} pipeline stages (every stage needs a layer)")
    if (first is not None or last is not None) and style != "megatron":
        raise _PresetError(f"{style}: first/last pipeline stage layer counts are a megatron option")
    base, rem = divmod(num_layers, pp)
    parts = [base] * pp
    if style == "megatron" and (first is not None or last is not None):
        for what, v in (("first", first), ("last", last)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise _PresetError(f"megatron: {what}-stage layers must be an integer >= 1, got {v!r}")
        ends = [x for x in (first, last) if x is not None]
        if pp <= len(ends):
            raise _PresetError(f"megatron: first/last-stage layer counts need pp > {len(ends)} (got pp = {pp})")
        rest, inner = num_layers - sum(ends), pp - len(ends)
        if rest < inner or rest % inner:
            raise _PresetError(f"megatron: {num_layers} layers minus first/last-stage layers ({sum(ends)}) leave "
                               f"{rest} for {inner} middle stages: Megatron needs a whole number >= 1 per stage")
        parts = [rest // inner] * pp
        if first is not None:
            parts[0] = first
        if last is not None:
            parts[-1] = last
    elif style == "megatron":
        if rem:
            raise _PresetError(f"megatron: num_hidden_layers ({num_layers}) must be divisible by pp ({pp}) "
                               f"(Megatron's even pipeline split; or give the first/last stages their own layer "
                               f"counts, as decoder_first/last_pipeline_num_layers do)")
    elif style == "vllm":
        for i in range(2, rem + 2):
            parts[-i] += 1
    elif style == "sglang":
        for i in range(pp - rem, pp):
            parts[i] += 1
    else:
        raise ValueError(style)
    return parts


def vllm_expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the experts of one EP rank in vLLM's "linear" placement
    (``determine_expert_map``): the first ``E % ep`` ranks get one expert more.

    >>> [vllm_expert_range(10, 4, r) for r in range(4)]
    [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    base, rem = divmod(num_experts, ep_size)
    n = base + 1 if ep_rank < rem else base
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + n


def _piece(n: int, k: int, i: int) -> tuple[int, int]:
    c = -(-n // k)
    return min(i * c, n), min((i + 1) * c, n)


def _divide(n: int, k: int, what: str) -> int:
    if n % k:
        raise _PresetError(f"{what}")
    return n // k


# ---------------------------------------------------------------- manifest builder


class _Builder:
    """Collects chunks ``(array, region, local tensor, local offsets) -> holders`` and declared
    local tensors, over the ranks of ``mesh`` selected by fixed coordinates."""

    def __init__(self, mesh: Mesh, arrays: Arrays, file_pattern: str | None, *, label: str = "layout",
                 fp8_block: tuple[int, int] | None = None) -> None:
        self.mesh = mesh
        self.arrays = arrays
        self.file = file_pattern
        self.label = label
        self.block = fp8_block
        #: FP8 weight -> its ``weight_scale_inv`` sibling, placed together with the weight by :meth:`put`
        #: (only with ``fp8_block``: fsdp2 / hf shard the scales as arrays of their own)
        self.scale_of = {n.removesuffix("_scale_inv"): n for n in arrays if fp8_block is not None
                         and n.endswith(".weight_scale_inv") and n.removesuffix("_scale_inv") in arrays}
        self.scales = frozenset(self.scale_of.values())
        self.strides = dict(zip(mesh.axes, mesh.strides))
        self.sizes = dict(zip(mesh.axes, mesh.shape))
        self.chunks: dict[str, dict[tuple[Any, ...], set[int]]] = {n: {} for n in arrays}
        self.tensors: dict[int, dict[str, TensorSpec]] = {}
        self._rank_cache: dict[tuple[tuple[str, int], ...], tuple[int, ...]] = {}

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    def ranks(self, **fixed: int) -> tuple[int, ...]:
        """Sorted ranks whose coordinates equal ``fixed`` (absent axes must be 0)."""
        key = tuple(fixed.items())  # call sites pass the same axes in the same order
        got = self._rank_cache.get(key)
        if got is not None:
            return got
        base = 0
        for a, c in fixed.items():
            if a not in self.sizes:
                if c != 0:
                    raise AssertionError(f"coordinate {c} on absent axis {a}")
                continue
            base += c * self.strides[a]
        offs = [0]
        for a in self.mesh.axes:
            if a in fixed:
                continue
            offs = [o + c * self.strides[a] for o in offs for c in range(self.sizes[a])]
        out = tuple(sorted(base + o for o in offs))
        self._rank_cache[key] = out
        return out

    def put(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int], tensor: str,
            local: Sequence[int], holders: Iterable[int], *, scale_row: int | None = None) -> None:
        """One chunk. An FP8 weight's ``weight_scale_inv`` goes along, in block units (``scale_row``:
        its row in the local scale tensor when that is not ``local[0] / block``, e.g. stacked experts
        whose row count is not a multiple of the block)."""
        if any(s == 0 for s in sizes):
            return
        holders = tuple(holders)
        key = (tuple(offsets), tuple(sizes), tensor, tuple(local))
        self.chunks[fqn].setdefault(key, set()).update(holders)
        if fqn in self.scale_of:
            self._put_scale(fqn, offsets, sizes, tensor, local, holders, scale_row)

    def _put_scale(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int], tensor: str,
                   local: Sequence[int], holders: tuple[int, ...], scale_row: int | None) -> None:
        """The scale blocks of a weight chunk: a piece must start on a block boundary and end on
        one (or at the end of the array), and sit on one in its local tensor -- else the shard's
        scales would not be whole blocks of the scale grid (vLLM's block-FP8 loader refuses
        such shards too)."""
        sfqn = self.scale_of[fqn]
        if self.block is None:
            raise AssertionError(f"{sfqn}: FP8 scales without a block size")
        shape = self.arrays[fqn][0]
        so: list[int] = []
        ss: list[int] = []
        sl: list[int] = []
        for d, (o, n, lo, b, full) in enumerate(zip(offsets, sizes, local, self.block, shape)):
            end = o + n
            if o % b or (end % b and end != full):
                raise _PresetError(f"{self.label}: {fqn}: its shard [{o}, {end}) of dim {d} (size {full}) does not "
                                   f"start and end on FP8 block boundaries (multiples of {b}), so {sfqn} cannot be "
                                   f"split with it; pick parallel sizes that split dim {d} into multiples of {b}")
            if d == 0 and scale_row is not None:
                sl.append(scale_row)
            elif lo % b:
                raise _PresetError(f"{self.label}: {fqn}: it sits at offset {lo} of dim {d} of the fused local tensor "
                                   f"{tensor}, not on an FP8 block boundary (a multiple of {b}), so {sfqn} cannot "
                                   f"be fused the same way; pick parallel sizes that keep the fused parts "
                                   f"multiples of {b}")
            else:
                sl.append(lo // b)
            so.append(o // b)
            ss.append(-(-end // b) - o // b)
        self.put(sfqn, so, ss, _scale_tensor(tensor), sl, holders)

    def rows(self, fqn: str, r0: int, n: int, tensor: str, l0: int, holders: Iterable[int], *,
             scale_row: int | None = None) -> None:
        """Rows ``[r0, r0+n)`` (all of the other dims) at row ``l0`` of ``tensor``."""
        shape = self.arrays[fqn][0]
        z = (0,) * (len(shape) - 1)
        self.put(fqn, (r0, *z), (n, *shape[1:]), tensor, (l0, *z), holders, scale_row=scale_row)

    def cols(self, fqn: str, c0: int, n: int, tensor: str, l0: int, holders: Iterable[int], *,
             scale_row: int | None = None) -> None:
        """Columns ``[c0, c0+n)`` of a 2-D array at ``(l0, 0)`` of ``tensor``."""
        shape = self.arrays[fqn][0]
        self.put(fqn, (0, c0), (shape[0], n), tensor, (l0, 0), holders, scale_row=scale_row)

    def column(self, fqn: str, T: int, stage: int, tensor: str, l0: int, msg: str) -> None:
        """Column-parallel: dim 0 split evenly over TP, at row ``l0`` of each TP rank's ``tensor``
        (``msg``: the error when tp does not divide it)."""
        n = _divide(self.arrays[fqn][0][0], T, msg)
        for t in range(T):
            self.rows(fqn, t * n, n, tensor, l0, self.ranks(pp=stage, tp=t))

    def row_parallel(self, fqn: str, T: int, stage: int, tensor: str, msg: str) -> None:
        """Row-parallel: the input dim (1) split evenly over TP."""
        n = _divide(self.arrays[fqn][0][1], T, msg)
        for t in range(T):
            self.cols(fqn, t * n, n, tensor, 0, self.ranks(pp=stage, tp=t))

    def gate_up(self, fqn: str, T: int, stage: int, tensor: str, label: str) -> None:
        """A column-parallel gate or up array into the fused ``[gate_shard; up_shard]`` local
        tensor of each TP rank (Megatron ``linear_fc1``, vLLM ``gate_up_proj``)."""
        shape = self.arrays[fqn][0]
        msg = f"{label}: intermediate_size ({shape[0]}) must be divisible by tp ({T})"
        n = _divide(shape[0], T, msg)
        self.column(fqn, T, stage, tensor, n if ".up_proj." in fqn else 0, msg)

    def down(self, fqn: str, T: int, stage: int, tensor: str, label: str) -> None:
        """The row-parallel down projection: its input dim split over TP."""
        shape = self.arrays[fqn][0]
        self.row_parallel(fqn, T, stage, tensor, f"{label}: intermediate_size ({shape[1]}) must be divisible by "
                                                 f"tp ({T})")

    def vocab_parallel(self, fqn: str, tensor: str, stages: Sequence[int], per: int) -> None:
        """Vocab-parallel embedding / output layer: TP rank ``t`` holds padded-vocab rows
        ``[t·per, (t+1)·per)`` (rows past the real vocab are padding no chunk covers), on every
        stage of ``stages``."""
        shape, dt = self.arrays[fqn]
        for t in range(self.size("tp")):
            hs = sorted({r for s in stages for r in self.ranks(pp=s, tp=t)})
            lo, hi = t * per, min((t + 1) * per, shape[0])
            if hi > lo:
                self.rows(fqn, lo, hi - lo, tensor, 0, hs)
            self.declare(hs, tensor, (per, *shape[1:]), dt)

    def whole(self, fqn: str, tensor: str, holders: Iterable[int]) -> None:
        shape = self.arrays[fqn][0]
        z = (0,) * len(shape)
        self.put(fqn, z, shape, tensor, z, holders)

    def declare(self, holders: Iterable[int], tensor: str, shape: Sequence[int], data_type: str) -> None:
        for r in holders:
            self.tensors.setdefault(r, {})[tensor] = TensorSpec(tuple(shape), data_type)

    def build(self, *, name: str | None, domain_size: int | None) -> Manifest:
        if domain_size is not None and (not isinstance(domain_size, int) or domain_size < 1):
            raise LayoutError(f"domain_size must be an integer >= 1, got {domain_size!r}")
        out: dict[str, ArraySpec] = {}
        for fqn, (shape, dt) in self.arrays.items():
            chunks = []
            for (offs, sizes, tensor, local), hs in self.chunks[fqn].items():
                offsets = tuple(local) if any(local) else None
                src = None
                if tensor != fqn or offsets is not None or self.file is not None:
                    src = Source(tensor=tensor if tensor != fqn else None, offsets=offsets, file=self.file)
                chunks.append(Chunk(Box(offs, sizes), tuple(sorted(hs)), src))
            chunks.sort(key=lambda c: (c.region.offsets, c.holders))
            out[fqn] = ArraySpec(tuple(shape), dt, tuple(chunks))
        return Manifest(world_size=self.mesh.size, arrays=out, name=name, mesh=self.mesh.to_dict(),
                        topology={"domain_size": domain_size} if domain_size is not None else None,
                        tensors={r: dict(sorted(ts.items())) for r, ts in sorted(self.tensors.items())})


def _check_axes(mesh: Mesh, allowed: Sequence[str], preset: str, *, ordered: bool) -> None:
    bad = [a for a in mesh.axes if a not in allowed]
    if bad:
        raise _PresetError(f"preset {preset}: mesh axis {bad[0]!r} is not one of {', '.join(allowed)}")
    if ordered:
        idx = [allowed.index(a) for a in mesh.axes]
        if idx != sorted(idx):
            want = ",".join(f"{a}={mesh.size_of(a)}" for a in allowed if a in mesh.axes)
            raise _PresetError(f"preset {preset}: mesh axes {','.join(mesh.axes)} are not in the framework's rank "
                               f"order (slowest first: {', '.join(allowed)}); write the mesh as {want}")


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\Z")
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight\Z")
#: a dense MLP or the shared experts of a MoE layer: (module prefix, gate/up/down, weight/bias)
_MLP = re.compile(r"(mlp\.(?:shared_experts\.)?)(gate|up|down)_proj\.(weight|bias)\Z")


def _scale_tensor(tensor: str) -> str:
    """The local tensor holding the FP8 scales of the local weight ``tensor``: its last ``weight``
    becomes ``weight_scale_inv`` (``q_b_proj.weight_scale_inv``, vLLM's ``w13_weight_scale_inv``,
    Megatron grouped-GEMM ``linear_fc1.weight_scale_inv3``).

    >>> _scale_tensor("model.layers.0.mlp.experts.w13_weight"), _scale_tensor("x.linear_fc1.weight3")
    ('model.layers.0.mlp.experts.w13_weight_scale_inv', 'x.linear_fc1.weight_scale_inv3')
    """
    head, sep, tail = tensor.rpartition("weight")
    return head + "weight_scale_inv" + tail if sep else tensor + "_scale_inv"


#: MLA attention (deepseek_v2 / v3), HF ``self_attn.<name>`` -> (local name under the framework's
#: attention module, TP split, the HF array fused in front of it in the same local tensor).
#: Splits: ``R`` replicated over TP, ``S0`` column-parallel (dim 0, whole heads), ``S1``
#: row-parallel (dim 1, whole heads).
_MLA_MEGATRON: dict[str, tuple[str, str, str | None]] = {
    "q_proj.weight": ("linear_q_proj.weight", "S0", None),  # q_lora_rank None
    "q_a_proj.weight": ("linear_q_down_proj.weight", "R", None),  # TELinear, parallel_mode "duplicated"
    "q_a_layernorm.weight": ("linear_q_up_proj.layer_norm_weight", "R", None),  # qk_layernorm=True
    "q_b_proj.weight": ("linear_q_up_proj.weight", "S0", None),
    "kv_a_proj_with_mqa.weight": ("linear_kv_down_proj.weight", "R", None),
    "kv_a_layernorm.weight": ("linear_kv_up_proj.layer_norm_weight", "R", None),
    "kv_b_proj.weight": ("linear_kv_up_proj.weight", "S0", None),
    "o_proj.weight": ("linear_proj.weight", "S1", None),
}
_MLA_VLLM: dict[str, tuple[str, str, str | None]] = {
    "q_proj.weight": ("q_proj.weight", "S0", None),
    "q_a_proj.weight": ("fused_qkv_a_proj.weight", "R", None),  # [q_a; kv_a], replicated
    "q_a_layernorm.weight": ("q_a_layernorm.weight", "R", None),
    "q_b_proj.weight": ("q_b_proj.weight", "S0", None),
    # without q_lora_rank there is no fused_qkv_a_proj: kv_a_proj_with_mqa stays (ReplicatedLinear)
    "kv_a_proj_with_mqa.weight": ("fused_qkv_a_proj.weight", "R", "q_a_proj.weight"),
    "kv_a_layernorm.weight": ("kv_a_layernorm.weight", "R", None),
    "kv_b_proj.weight": ("kv_b_proj.weight", "S0", None),
    "o_proj.weight": ("o_proj.weight", "S1", None),
}
_MLA_SGLANG = {k: (v[0].replace("fused_qkv_a_proj.", "fused_qkv_a_proj_with_mqa."), *v[1:])
               for k, v in _MLA_VLLM.items()}


def _mla(b: _Builder, fqn: str, rest: str, stage: int, attn: str, table: Mapping[str, tuple[str, str, str | None]],
         label: str) -> bool:
    """Place one MLA attention array (``rest``: its name after ``model.layers.{i}.``) into the local
    tensors under ``attn`` (the local attention module prefix); False if ``table`` has no entry."""
    entry = table.get(rest.removeprefix("self_attn."))
    if entry is None or not rest.startswith("self_attn."):
        return False
    local, split, after = entry
    T = b.size("tp")
    heads = f"{label}: {fqn}: {{}} ({{}}) must be divisible by tp ({T}) (whole attention heads per rank)"
    if split == "R":
        l0 = 0
        if after is not None:
            front = fqn[: -len(rest)] + "self_attn." + after
            if front in b.arrays:
                l0 = b.arrays[front][0][0]
            else:
                local = rest.removeprefix("self_attn.")  # nothing to fuse with: the HF module stays
        shape = b.arrays[fqn][0]
        b.rows(fqn, 0, shape[0], attn + local, l0, b.ranks(pp=stage))
    elif split == "S0":
        b.column(fqn, T, stage, attn + local, 0, heads.format("its output dim", b.arrays[fqn][0][0]))
    else:
        b.row_parallel(fqn, T, stage, attn + local, heads.format("its input dim", b.arrays[fqn][0][1]))
    return True


def _unmapped(preset: str, info: ModelInfo, names: list[str]) -> _PresetError:
    more = f" ... ({len(names)} in all)" if len(names) > 8 else ""
    hint = (" (DeepSeek MTP layers: use fsdp2 / hf, or a rule-based layout)"
            if info.mla and any(".embed_tokens." in n or ".eh_proj." in n for n in names) else "")
    return _PresetError(f"preset {preset}: model_type {info.model_type!r}: no mapping for array(s) "
                        f"{', '.join(names[:8])}{more}{hint}")


def _attention_checks(preset: str, info: ModelInfo, tp: int) -> None:
    if info.model_type not in _DENSE_TYPES + _MLA_TYPES:
        raise _PresetError(f"preset {preset}: model_type {info.model_type!r} is not supported (supported: "
                           f"{', '.join(_DENSE_TYPES + _MLA_TYPES)})")
    if info.heads % tp:
        raise _PresetError(f"preset {preset}: num_attention_heads ({info.heads}) must be divisible by tp ({tp})")
    if info.mla:
        return
    if info.heads % info.kv_heads:
        raise _PresetError(f"preset {preset}: num_attention_heads ({info.heads}) must be a multiple of "
                           f"num_key_value_heads ({info.kv_heads})")


# ---------------------------------------------------------------- megatron


def _megatron(b: _Builder, info: ModelInfo, *, etp: int | None, grouped_gemm: bool,
              first: int | None = None, last: int | None = None) -> None:
    T, P, EP, CP = b.size("tp"), b.size("pp"), b.size("ep"), b.size("cp")
    _attention_checks("megatron", info, T)
    if not info.mla and info.kv_heads % T:
        raise _PresetError(f"megatron: num_query_groups (num_key_value_heads = {info.kv_heads}) must be divisible "
                           f"by tp ({T}); Megatron-core splits whole query groups over tensor-parallel ranks "
                           f"(use tp <= {info.kv_heads} dividing it, or the vllm preset, which replicates kv heads)")
    if info.tie and P > 1:
        raise _PresetError("megatron: tie_word_embeddings with pp > 1 is not supported: Megatron keeps a copy of "
                           "the embedding as output_layer.weight on the last stage, a second local tensor for "
                           "the same array, which a manifest cannot describe; use pp = 1")
    etp = T if etp is None else etp
    if etp not in (1, T):
        raise _PresetError(f"megatron: expert_tensor_parallel must be 1 or tp ({T}), got {etp}")
    parts = pp_partition(info.layers, P, "megatron", first=first, last=last)
    starts = [sum(parts[:k]) for k in range(P)]
    stage_of = [k for k, n in enumerate(parts) for _ in range(n)]
    V, nh, nkv, hd = info.vocab, info.heads, info.kv_heads, info.head_dim
    hpg = nh // nkv
    G = nkv // T  # local query groups
    blk = (hpg + 2) * hd
    vper = megatron_padded_vocab(V, T) // T
    unmapped: list[str] = []

    for fqn, (shape, dt) in info.arrays.items():
        if fqn in b.scales:
            continue  # placed with its FP8 weight
        if fqn == "model.embed_tokens.weight":
            b.vocab_parallel(fqn, "embedding.word_embeddings.weight", [0], vper)
            continue
        if fqn == "lm_head.weight":
            b.vocab_parallel(fqn, "output_layer.weight", [P - 1], vper)
            continue
        if fqn == "model.norm.weight":
            b.whole(fqn, "decoder.final_layernorm.weight", b.ranks(pp=P - 1))
            continue
        m = _LAYER.match(fqn)
        if not m:
            unmapped.append(fqn)
            continue
        i, rest = int(m.group(1)), m.group(2)
        stage = stage_of[i]
        li = i - starts[stage]  # Megatron numbers layers within the stage
        p = f"decoder.layers.{li}."
        rep = b.ranks(pp=stage)
        kind = rest.rsplit(".", 1)[-1]  # weight / bias
        if rest == "input_layernorm.weight":  # MLA: a separate TENorm (not fused into a linear)
            b.whole(fqn, p + ("input_layernorm.weight" if info.mla
                              else "self_attention.linear_qkv.layer_norm_weight"), rep)
        elif info.mla and _mla(b, fqn, rest, stage, p + "self_attention.", _MLA_MEGATRON, "megatron"):
            pass
        elif rest == "post_attention_layernorm.weight":
            b.whole(fqn, p + ("pre_mlp_layernorm.weight" if info.is_moe_layer(i)
                              else "mlp.linear_fc1.layer_norm_weight"), rep)
        elif rest in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            b.whole(fqn, p + f"self_attention.{rest[10]}_layernorm.weight", rep)
        elif rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                      "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias"):
            which = rest[10]
            tensor = p + "self_attention.linear_qkv." + kind
            for t in range(T):
                hs = b.ranks(pp=stage, tp=t)
                for j in range(G):
                    g = t * G + j
                    base = j * blk
                    if which == "q":
                        b.rows(fqn, g * hpg * hd, hpg * hd, tensor, base, hs)
                    elif which == "k":
                        b.rows(fqn, g * hd, hd, tensor, base + hpg * hd, hs)
                    else:
                        b.rows(fqn, g * hd, hd, tensor, base + (hpg + 1) * hd, hs)
        elif rest == "self_attn.o_proj.weight":
            b.row_parallel(fqn, T, stage, p + "self_attention.linear_proj.weight",
                           f"megatron: o_proj input dim {shape[1]} must be divisible by tp ({T})")
        elif rest == "self_attn.o_proj.bias":
            b.whole(fqn, p + "self_attention.linear_proj.bias", rep)
        elif (mm := _MLP.match(rest)) is not None:  # dense MLP, or the MoE layer's shared experts
            mod, proj = p + mm.group(1), mm.group(2)
            if proj != "down":
                b.gate_up(fqn, T, stage, mod + "linear_fc1." + kind, "megatron")
            elif kind == "weight":
                b.down(fqn, T, stage, mod + "linear_fc2.weight", "megatron")
            else:
                b.whole(fqn, mod + "linear_fc2.bias", rep)
        elif rest == "mlp.gate.weight":
            b.whole(fqn, p + "mlp.router.weight", rep)
        elif rest == "mlp.gate.e_score_correction_bias":
            b.whole(fqn, p + "mlp.router.expert_bias", rep)  # float32 in Megatron too
        elif (em := _EXPERT.match(rest)) is not None:
            e, proj = int(em.group(1)), em.group(2)
            E = info.num_experts(i)
            group = EP * (T if etp == 1 else 1)  # expert-parallel ranks
            if CP > 1 and group > 1:
                raise _PresetError("megatron: expert parallelism with cp > 1 is not supported (Megatron folds the "
                                   "expert-parallel group over context-parallel ranks)")
            nloc = _divide(E, group, f"megatron: num_experts ({E}) must be divisible by the expert-parallel size "
                                     f"({group})")
            r, le = divmod(e, nloc)
            fc = "linear_fc2" if proj == "down_proj" else "linear_fc1"
            tensor = (p + f"mlp.experts.{fc}.weight{le}" if grouped_gemm
                      else p + f"mlp.experts.local_experts.{le}.{fc}.weight")
            if etp == 1:
                ep_c, t0 = divmod(r, T)
                hs = b.ranks(pp=stage, ep=ep_c, tp=t0)
                if proj == "down_proj":
                    b.whole(fqn, tensor, hs)
                else:
                    b.rows(fqn, 0, shape[0], tensor, 0 if proj == "gate_proj" else shape[0], hs)
                continue
            dim = 1 if proj == "down_proj" else 0
            n = _divide(shape[dim], T, f"megatron: moe_intermediate_size ({shape[dim]}) must be divisible by the "
                                       f"expert tensor-parallel size ({T})")
            for t in range(T):
                hs = b.ranks(pp=stage, ep=r, tp=t)
                if proj == "down_proj":
                    b.cols(fqn, t * n, n, tensor, 0, hs)
                else:
                    b.rows(fqn, t * n, n, tensor, 0 if proj == "gate_proj" else n, hs)
        else:
            unmapped.append(fqn)
    if unmapped:
        raise _unmapped("megatron", info, unmapped)


# ---------------------------------------------------------------- vllm / sglang


def _vllm(b: _Builder, info: ModelInfo, preset: str, *, expert_parallel: bool | None) -> None:
    T, P, EPX = b.size("tp"), b.size("pp"), b.size("ep")
    _attention_checks(preset, info, T)
    H, V, nh, nkv, hd = info.hidden, info.vocab, info.heads, info.kv_heads, info.head_dim
    if info.mla:
        replicas, kv_loc = 1, 0  # no q/k/v heads (MLA)
    elif T >= nkv:
        replicas = _divide(T, nkv, f"{preset}: tp ({T}) must be a multiple of num_key_value_heads ({nkv}) when "
                                   f"tp >= num_key_value_heads (kv heads are replicated tp/num_kv_heads times)")
        kv_loc = hd
    else:
        replicas = 1
        kv_loc = _divide(nkv, T, f"{preset}: num_key_value_heads ({nkv}) must be divisible by tp ({T})") * hd
    q_loc = nh // T * hd
    vpad = vllm_padded_vocab(V)
    vper = _divide(vpad, T, f"{preset}: the padded vocab ({V} -> {vpad}, a multiple of {VLLM_VOCAB_PADDING}) must be "
                            f"divisible by tp ({T}), as VocabParallelEmbedding requires")
    ep_on = ("ep" in b.sizes) if expert_parallel is None else expert_parallel
    if not ep_on and "ep" in b.sizes:
        raise _PresetError(f"{preset}: an 'ep' mesh axis means expert parallelism; drop it or use "
                           f"expert_parallel=None/True")
    ep_size = EPX * T
    parts = pp_partition(info.layers, P, "sglang" if preset == "sglang" else "vllm")
    stage_of = [s for s, n in enumerate(parts) for _ in range(n)]
    unmapped: list[str] = []
    mla_table = _MLA_SGLANG if preset == "sglang" else _MLA_VLLM
    # w2 stacks whole [H, I] experts: its scale stacks [ceil(H/b), ...] blocks per expert
    h_blocks = -(-H // b.block[0]) if b.block is not None else 0

    moe_layers: dict[int, int] = {}
    owner: dict[int, list[tuple[int, int]]] = {}  # experts -> (EP rank, its first expert) per expert
    for fqn, (shape, dt) in info.arrays.items():
        if fqn in b.scales:
            continue  # placed with its FP8 weight
        if fqn == "model.embed_tokens.weight":
            b.vocab_parallel(fqn, fqn, sorted({0, P - 1}) if info.tie else [0], vper)
            continue
        if fqn == "lm_head.weight":
            b.vocab_parallel(fqn, fqn, [P - 1], vper)
            continue
        if fqn == "model.norm.weight":
            b.whole(fqn, fqn, b.ranks(pp=P - 1))
            continue
        m = _LAYER.match(fqn)
        if not m:
            unmapped.append(fqn)
            continue
        i, rest = int(m.group(1)), m.group(2)
        stage = stage_of[i]
        p = f"model.layers.{i}."
        rep = b.ranks(pp=stage)
        kind = rest.rsplit(".", 1)[-1]
        if rest in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                    "self_attn.k_norm.weight", "self_attn.o_proj.bias", "mlp.down_proj.bias", "mlp.gate.weight",
                    "mlp.gate.e_score_correction_bias"):
            b.whole(fqn, fqn, rep)  # replicated, same name (o_proj / down_proj biases are full on every rank)
        elif info.mla and _mla(b, fqn, rest, stage, p + "self_attn.", mla_table, preset):
            pass
        elif rest in ("self_attn.q_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.weight",
                      "self_attn.k_proj.bias", "self_attn.v_proj.weight", "self_attn.v_proj.bias"):
            which = rest[10]
            tensor = p + "self_attn.qkv_proj." + kind
            for t in range(T):
                hs = b.ranks(pp=stage, tp=t)
                if which == "q":
                    b.rows(fqn, t * q_loc, q_loc, tensor, 0, hs)
                else:
                    shard = t // replicas  # vLLM's shard_id for k / v
                    b.rows(fqn, shard * kv_loc, kv_loc, tensor, q_loc + (0 if which == "k" else kv_loc), hs)
        elif rest == "self_attn.o_proj.weight":
            b.row_parallel(fqn, T, stage, fqn, f"{preset}: o_proj input dim {shape[1]} must be divisible by tp ({T})")
        elif (mm := _MLP.match(rest)) is not None and mm.group(2) != "down":  # dense MLP or shared experts
            b.gate_up(fqn, T, stage, p + mm.group(1) + "gate_up_proj." + kind, preset)
        elif mm is not None and kind == "weight":
            b.down(fqn, T, stage, fqn, preset)
        elif (em := _EXPERT.match(rest)) is not None:
            e, proj = int(em.group(1)), em.group(2)
            E = info.num_experts(i)
            moe_layers[i] = E
            w13, w2 = p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"
            inter = shape[1] if proj == "down_proj" else shape[0]
            if ep_on:
                if preset == "sglang" and E % ep_size:
                    raise _PresetError(f"sglang: num_experts ({E}) must be divisible by the expert-parallel size "
                                       f"({ep_size}) (SGLang's FusedMoE splits experts evenly)")
                if E not in owner:
                    owner[E] = [(r, e0) for r in range(ep_size)
                                for e0 in [vllm_expert_range(E, ep_size, r)[0]]
                                for _ in range(*vllm_expert_range(E, ep_size, r))]
                r, start = owner[E][e]
                le = e - start
                ep_c, t = divmod(r, T)
                hs = b.ranks(pp=stage, ep=ep_c, tp=t)
                if proj == "down_proj":
                    b.rows(fqn, 0, H, w2, le * H, hs, scale_row=le * h_blocks)
                else:
                    b.rows(fqn, 0, inter, w13, le * 2 * inter + (0 if proj == "gate_proj" else inter), hs)
                continue
            n = _divide(inter, T, f"{preset}: moe_intermediate_size ({inter}) must be divisible by tp ({T}) "
                                  f"(or enable expert parallelism)")
            for t in range(T):
                hs = b.ranks(pp=stage, tp=t)
                if proj == "down_proj":
                    b.cols(fqn, t * n, n, w2, e * H, hs, scale_row=e * h_blocks)
                else:
                    b.rows(fqn, t * n, n, w13, e * 2 * n + (0 if proj == "gate_proj" else n), hs)
        else:
            unmapped.append(fqn)
    if unmapped:
        raise _unmapped(preset, info, unmapped)
    # ranks with no expert (EP group larger than the experts) still hold empty w13 / w2
    for i, E in moe_layers.items():
        if not ep_on:
            continue
        p = f"model.layers.{i}."
        down = p + "mlp.experts.0.down_proj.weight"
        inter = info.arrays[down][0][1]
        dt = info.arrays[down][1]
        for r in range(ep_size):
            lo, hi = vllm_expert_range(E, ep_size, r)
            ep_c, t = divmod(r, T)
            hs = b.ranks(pp=stage_of[i], ep=ep_c, tp=t)
            b.declare(hs, p + "mlp.experts.w13_weight", ((hi - lo) * 2 * inter, H), dt)
            b.declare(hs, p + "mlp.experts.w2_weight", ((hi - lo) * H, inter), dt)
            if b.block is not None and down in b.scale_of:  # [E_local, 2·ceil(I/b0), ceil(H/b1)], [E_local, ...]
                b0, b1 = b.block
                b.declare(hs, p + "mlp.experts.w13_weight_scale_inv",
                          ((hi - lo) * 2 * -(-inter // b0), -(-H // b1)), "float32")
                b.declare(hs, p + "mlp.experts.w2_weight_scale_inv", ((hi - lo) * h_blocks, -(-inter // b1)),
                          "float32")


# ---------------------------------------------------------------- fsdp2 / hf


def _tp_placements(info: ModelInfo) -> dict[str, Placement]:
    from .models import generic_rules

    one = Mesh(("tp",), (1,))
    rules = [parse_rule(r, one) for r in generic_rules(("tp",))]
    out: dict[str, Placement] = {}
    for fqn in info.arrays:
        for r in rules:
            if fnmatchcase(fqn, r.pattern):
                out[fqn] = r.placements[0]
                break
    return out


def _fsdp2(b: _Builder, info: ModelInfo) -> None:
    T, P, F = b.size("tp"), b.size("pp"), b.size("fsdp")
    tp_pl = _tp_placements(info) if T > 1 else {}
    for fqn, (shape, _dt) in info.arrays.items():
        stage = pp_stage(fqn, num_layers=info.layers, pp=P) if P > 1 else 0
        # TP first, then FSDP2 chunks dim 0 of the TP-local tensor (the _StridedShard order)
        splits: list[tuple[str, int, int]] = []
        pl = tp_pl.get(fqn)
        if isinstance(pl, Shard) and pl.dim < len(shape):
            splits.append(("tp", pl.dim, T))
        if len(shape) >= 1:
            splits.append(("fsdp", 0, F))
        for coords in product(*(range(n) for _, _, n in splits)):
            offs = [0] * len(shape)
            sizes = list(shape)
            for (_axis, d, n), c in zip(splits, coords):
                lo, hi = _piece(sizes[d], n, c)
                offs[d] += lo
                sizes[d] = hi - lo
            fixed = {axis: c for (axis, _, _), c in zip(splits, coords)}
            b.put(fqn, offs, sizes, fqn, (0,) * len(shape), b.ranks(pp=stage, **fixed))


def _hf(b: _Builder, info: ModelInfo) -> None:
    if b.mesh.size != 1:
        raise _PresetError(f"preset hf: one rank, got mesh {b.mesh} ({b.mesh.size} ranks); use fsdp2 or a rule "
                           f"layout for several ranks")
    for fqn in info.arrays:
        b.whole(fqn, fqn, (0,))


# ---------------------------------------------------------------- entry point


def preset_manifest(cfg: Mapping[str, Any] | str | os.PathLike[str], preset: str, mesh: Mesh, *,
                    file_pattern: str | None = None, domain_size: int | None = None, name: str | None = None,
                    dtype: str | None = "bfloat16", expert_parallel: bool | None = None,
                    expert_tensor_parallel: int | None = None, moe_grouped_gemm: bool = False,
                    fp8: bool = False, first_stage_layers: int | None = None,
                    last_stage_layers: int | None = None) -> Manifest:
    """The manifest a ``preset`` framework holds for the HF model ``cfg`` on ``mesh`` (see the
    module docstring for each preset's names, layouts and mesh axes).

    ``cfg``: a parsed ``config.json``, its path, or a directory holding it (llama, qwen2, qwen3,
    qwen3_moe, deepseek_v2 / deepseek_v3; any model :func:`~.models.arrays_from_config` knows for
    ``fsdp2`` / ``hf``). ``fp8``: block-FP8 linear weights with ``weight_scale_inv`` siblings
    (:func:`~.models.arrays_from_config` ``fp8=True``); each scale is laid out like its weight, in
    block units.
    ``file_pattern``: ``source.file`` of every chunk (``{rank}`` for per-rank files); None gives a
    live, in-memory manifest (and for ``hf`` leaves file naming to ``convert``). ``dtype``
    replaces the config's ``torch_dtype`` (None keeps it). ``expert_parallel`` (vllm / sglang):
    experts whole over the EP ranks (default: when the mesh has an ``ep`` axis);
    ``expert_tensor_parallel`` (megatron): 1 or tp (default tp); ``moe_grouped_gemm`` (megatron):
    TE grouped-GEMM expert names. ``first_stage_layers`` / ``last_stage_layers`` (megatron):
    Megatron-core's ``decoder_first/last_pipeline_num_layers`` (uneven pipelines, e.g. DeepSeek-V3's
    61 layers on pp = 16 as 3 + 14 × 4 + 2).
    """
    if preset not in PRESETS:
        raise LayoutError(f"unknown preset {preset!r} (expected one of {', '.join(PRESETS)})")
    if file_pattern is not None:
        check_file_pattern(file_pattern)
    info = model_info(cfg, dtype=dtype, fp8=fp8)
    fused = preset in ("megatron", "vllm", "sglang")  # FP8 scales laid out like their weights
    b = _Builder(mesh, info.arrays, file_pattern, label=preset, fp8_block=info.fp8_block if fused else None)
    if preset == "megatron":
        _check_axes(mesh, _MEGATRON_AXES, preset, ordered=True)
        _megatron(b, info, etp=expert_tensor_parallel, grouped_gemm=moe_grouped_gemm,
                  first=first_stage_layers, last=last_stage_layers)
    elif first_stage_layers is not None or last_stage_layers is not None:
        raise LayoutError(f"{preset}: first_stage_layers / last_stage_layers are megatron options")
    elif preset in ("vllm", "sglang"):
        _check_axes(mesh, _VLLM_AXES, preset, ordered=True)
        _vllm(b, info, preset, expert_parallel=expert_parallel)
    elif preset == "fsdp2":
        _check_axes(mesh, _FSDP_AXES, preset, ordered=False)
        _fsdp2(b, info)
    else:
        _hf(b, info)
    if name is None:
        name = f"{info.model_type}-{preset}-{str(mesh).replace(',', '-').replace('=', '')}"
    return b.build(name=name, domain_size=domain_size)
