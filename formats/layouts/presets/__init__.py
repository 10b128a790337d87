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

Tied embeddings (``tie_word_embeddings: true``): every preset names the shared weight
``model.embed_tokens.weight`` and has no ``lm_head.weight`` array, as Hugging Face does:
``lm_head.weight`` is the same tensor as ``model.embed_tokens.weight`` and ``save_pretrained``
stores only the latter, so an HF checkpoint, an ``hf`` / ``fsdp2`` layout and the fused presets
agree with no flag. Megatron holds it as ``embedding.word_embeddings.weight`` and has no
``output_layer`` (pp = 1; pp > 1 is refused, see below); vLLM / SGLang hold it as
``model.embed_tokens.weight``, on the last pipeline stage too (their ``lm_head`` shares it).

>>> tied = dict(cfg, tie_word_embeddings=True)
>>> sorted({p: [n for n in preset_manifest(tied, p, Mesh(("tp",), (1,))).arrays if "embed" in n or "lm_head" in n]
...         for p in PRESETS}.items())[:2]
[('fsdp2', ['model.embed_tokens.weight']), ('hf', ['model.embed_tokens.weight'])]
>>> sorted(n for n in preset_manifest(tied, "megatron", Mesh(("tp",), (1,))).local_tensors(0) if "embed" in n or "output" in n)
['embedding.word_embeddings.weight']

Dtypes: the weights take ``dtype`` when given, else the config's ``torch_dtype`` / ``dtype``, else
bfloat16 (:func:`preset_dtype`); fp32 master weights are ``dtype="float32"``.

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

Modules
-------
``engine`` (:class:`~.engine.ModelInfo`, the table walk, shared checks), ``builder`` (the manifest
builder), ``geometry`` (splits, pipeline partitions); one module per framework: ``megatron``,
``vllm`` (with ``sglang``), ``fsdp2``, ``hf``. A new framework is one module exporting a
:class:`~.engine.Framework`, listed in :data:`FRAMEWORKS`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from ...manifest.spec import Manifest
from ..mesh import LayoutError, Mesh
from ..rules import check_file_pattern
from . import fsdp2, hf, megatron, vllm
from .builder import Builder
from .engine import PRESET_DTYPES, Framework, ModelInfo, Options, check_axes, model_info, preset_dtype
from .geometry import PresetError, pp_partition
from .megatron import MEGATRON_VOCAB_DIVISOR, megatron_padded_vocab
from .vllm import VLLM_VOCAB_PADDING, vllm_expert_range, vllm_padded_vocab

__all__ = [
    "FRAMEWORKS",
    "MEGATRON_VOCAB_DIVISOR",
    "PRESETS",
    "PRESET_DTYPES",
    "PresetError",
    "TIED_EMBEDDING",
    "VLLM_VOCAB_PADDING",
    "Framework",
    "ModelInfo",
    "megatron_padded_vocab",
    "model_info",
    "pp_partition",
    "preset_dtype",
    "preset_manifest",
    "vllm_expert_range",
    "vllm_padded_vocab",
]

#: every preset by name, in the order the CLI lists them
FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (megatron.FRAMEWORK, vllm.VLLM, vllm.SGLANG, fsdp2.FRAMEWORK,
                                                         hf.FRAMEWORK)}
PRESETS = tuple(FRAMEWORKS)
#: with ``tie_word_embeddings``, the one array that holds the shared embedding / output weight
TIED_EMBEDDING = "model.embed_tokens.weight"


def preset_manifest(cfg: Mapping[str, Any] | str | os.PathLike[str], preset: str, mesh: Mesh, *,
                    file_pattern: str | None = None, domain_size: int | None = None, name: str | None = None,
                    dtype: str | None = None, expert_parallel: bool | None = None,
                    expert_tensor_parallel: int | None = None, moe_grouped_gemm: bool = False,
                    fp8: bool = False, first_stage_layers: int | None = None,
                    last_stage_layers: int | None = None, megatron_spec: str = "te",
                    megatron_padded_vocab: int | None = None, compact: bool = True) -> Manifest:
    """The manifest a ``preset`` framework holds for the HF model ``cfg`` on ``mesh`` (see the
    module docstring for each preset's names, layouts and mesh axes).

    ``cfg``: a parsed ``config.json``, its path, or a directory holding it (llama, qwen2, qwen3,
    qwen3_moe, deepseek_v2 / deepseek_v3; any model :func:`~.models.arrays_from_config` knows for
    ``fsdp2`` / ``hf``). ``fp8``: block-FP8 linear weights with ``weight_scale_inv`` siblings
    (:func:`~.models.arrays_from_config` ``fp8=True``); each scale is laid out like its weight, in
    block units.
    ``file_pattern``: ``source.file`` of every chunk (``{rank}`` for per-rank files); None gives a
    live, in-memory manifest (and for ``hf`` leaves file naming to ``convert``). ``dtype``: the
    weights' data_type (bfloat16, float16 or float32, e.g. fp32 master weights); None: the
    config's ``torch_dtype`` / ``dtype``, else bfloat16 (:func:`preset_dtype` says which). ``expert_parallel`` (vllm / sglang):
    experts whole over the EP ranks (default: when the mesh has an ``ep`` axis);
    ``expert_tensor_parallel`` (megatron): 1 or tp (default tp); ``moe_grouped_gemm`` (megatron):
    TE grouped-GEMM expert names. ``first_stage_layers`` / ``last_stage_layers`` (megatron):
    Megatron-core's ``decoder_first/last_pipeline_num_layers`` (uneven pipelines, e.g. DeepSeek-V3's
    61 layers on pp = 16 as 3 + 14 × 4 + 2). ``megatron_spec`` (megatron): ``te`` (default) or
    ``local``, Megatron-core's local module spec (separate ``input_layernorm`` / ``pre_mlp_layernorm``).
    ``megatron_padded_vocab`` (megatron): the padded vocabulary a save holds (``args.padded_vocab_size``,
    a multiple of tp); None: Megatron's default padding to a multiple of 128 × tp.
    ``compact``: arrays a mesh layout describes exactly are layout references whose chunks expand
    on first use (:mod:`formats.manifest.compact`), written directly for the regular placements (no chunk
    is listed: :meth:`~.builder.Builder.spread`); False lists every chunk (the v1 writer; both
    give equal chunks).
    """
    fw = FRAMEWORKS.get(preset)
    if fw is None:
        raise LayoutError(f"unknown preset {preset!r} (expected one of {', '.join(PRESETS)})")
    if file_pattern is not None:
        check_file_pattern(file_pattern)
    info = model_info(cfg, dtype=dtype, fp8=fp8)
    b = Builder(mesh, info.arrays, file_pattern, label=preset, fp8_block=info.fp8_block if fw.fused_scales else None,
                compact=compact)
    if preset != "megatron" and (megatron_spec != "te" or megatron_padded_vocab is not None):
        raise LayoutError(f"{preset}: megatron_spec / megatron_padded_vocab are megatron options")
    if not fw.stage_layers and (first_stage_layers is not None or last_stage_layers is not None):
        raise LayoutError(f"{preset}: first_stage_layers / last_stage_layers are megatron options")
    if fw.axes is not None:
        check_axes(mesh, fw.axes, preset, ordered=fw.ordered)
    fw.place(b, info, Options(expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel,
                              moe_grouped_gemm=moe_grouped_gemm, first_stage_layers=first_stage_layers,
                              last_stage_layers=last_stage_layers, megatron_spec=megatron_spec,
                              megatron_padded_vocab=megatron_padded_vocab))
    if name is None:
        name = f"{info.model_type}-{preset}-{str(mesh).replace(',', '-').replace('=', '')}"
    return b.build(name=name, domain_size=domain_size)
