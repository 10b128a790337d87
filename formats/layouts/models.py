"""Model descriptions -> arrays, and the parallel layouts of training / inference jobs.

No I/O beyond reading the JSON file you name, no MPI, no torch.

Three kinds of model description become the same thing, ``{hf_name: (shape, data_type)}``
(the input of :func:`~formats.layouts.manifest_from_arrays` / :func:`~.rules.build_manifest`):

* a Hugging Face ``config.json`` (:func:`arrays_from_config`): ``model_type`` llama, qwen2,
  qwen3 (dense), qwen3_moe and deepseek_v3 (MLA attention, dense-then-MoE layers, shared
  experts, optional block-FP8 weights with ``weight_scale_inv`` siblings, optional MTP layers);
* an NCCL M2N model JSON (:func:`arrays_from_m2n_model`): ``{name: {"shape", "dtype", "shard"}}``;
* an existing manifest (``layout --like``, not here).

An NCCL M2N *system* JSON (:func:`parse_m2n_system`) gives the parallel sizes of both sides of
a refit; :func:`manifest_from_parallel` lays a model out the way Megatron-core (trainer) or vLLM
(generator) holds it, using :func:`generic_rules` (Megatron column/row parallelism, in HF names).

Parallel layout (:func:`manifest_from_parallel`)
------------------------------------------------
Ranks follow the Megatron order: ``tp`` fastest, then ``cp``, ``fsdp``, ``dp``, ``pp`` slowest.
Non-expert arrays live on the mesh ``pp × dp × fsdp × cp × tp`` (axes of size 1 dropped, ``tp``
always kept): ``tp`` shards by :func:`generic_rules`, ``fsdp`` shards dim 0 of every array,
``dp`` and ``cp`` replicate (context parallelism splits activations, not weights), ``pp`` pins
each array to its stage. With ``ep > 1``, expert arrays (``…experts.{E}.…``) use a second mesh
over the *same* ranks, ``pp × edp × ep`` with ``edp = ranks_per_stage / ep`` (Megatron "parallel
folding" with expert tensor parallelism ETP = 1, as NCCL M2N's model bench and NeMo RL's
``nccl_reshard`` assume): each expert lives whole on the ranks of its contiguous expert block,
replicated over ``edp``. With ``ep == 1`` experts are ordinary arrays, TP-sharded like the dense
MLP (vLLM TP, or Megatron ETP = TP).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from math import ceil, prod
from pathlib import Path
from typing import Any

from ..errors import FormatError
from ..manifest.dtypes import by_safetensors
from ..manifest.spec import ArraySpec, Manifest
from .mesh import LayoutError, Mesh
from .rules import EP_AXIS, PP_AXIS, build_manifest, expert_index, layer_index, parse_rule, resolve_placements

__all__ = [
    "FP8_BLOCK",
    "PARALLEL_KEYS",
    "ModelConfigError",
    "arrays_from_config",
    "arrays_from_m2n_model",
    "arrays_from_model",
    "config_dtype",
    "count_parameters",
    "fp8_block_size",
    "generic_rules",
    "is_hf_config",
    "manifest_from_parallel",
    "parallel_from_dict",
    "parallel_meshes",
    "parse_m2n_system",
]

Arrays = dict[str, tuple[tuple[int, ...], str]]

#: default block of block-wise FP8 weights (DeepSeek-V3, Qwen3-*-FP8): one float32 scale per 128×128
FP8_BLOCK = (128, 128)

#: sizes of one side of an NCCL M2N system JSON (``<key>_size``); missing ones default to 1
PARALLEL_KEYS = ("tp", "cp", "ep", "pp", "fsdp", "dp")

_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16",
           "half": "float16", "float32": "float32", "fp32": "float32", "float": "float32"}


class ModelConfigError(LayoutError):
    """A model description or system JSON is missing a field or is inconsistent (CLI exit 1)."""


# ---------------------------------------------------------------- loading


def _load_json(src: Mapping[str, Any] | str | os.PathLike[str], what: str) -> tuple[dict[str, Any], str]:
    if isinstance(src, Mapping):
        return dict(src), f"<{what}>"
    p = Path(src)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelConfigError(f"{p}: no such {what} file") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise FormatError(f"{p}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ModelConfigError(f"{p}: expected a JSON object at top level, got {type(obj).__name__}")
    return obj, str(p)


def _int(cfg: Mapping[str, Any], key: str, where: str, default: int | None = None, *, minimum: int = 1) -> int:
    v = cfg.get(key, default)
    if v is None:
        raise ModelConfigError(f"{where}: model_type {cfg.get('model_type')!r} needs {key!r} (an integer)")
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ModelConfigError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def config_dtype(cfg: Mapping[str, Any], where: str) -> str:
    """The weights' data_type a config states: ``torch_dtype``, else ``dtype`` (newer transformers),
    else bfloat16."""
    raw = cfg.get("torch_dtype", cfg.get("dtype", "bfloat16")) or "bfloat16"
    dt = _DTYPES.get(str(raw).removeprefix("torch."))
    if dt is None:
        raise ModelConfigError(f"{where}: torch_dtype {raw!r} is not supported "
                               f"(expected one of bfloat16, float16, float32)")
    return dt


# ---------------------------------------------------------------- HF config.json


class _Builder:
    """Accumulates arrays; linear weights inside decoder layers become FP8 + scales when asked."""

    def __init__(self, dtype: str, fp8_block: tuple[int, int] | None) -> None:
        self.dtype = dtype
        self.fp8_block = fp8_block
        self.out: Arrays = {}

    def add(self, name: str, shape: Sequence[int], dtype: str | None = None) -> None:
        self.out[name] = (tuple(int(s) for s in shape), dtype or self.dtype)

    def linear(self, name: str, out_f: int, in_f: int, *, bias: bool = False, quantize: bool = True) -> None:
        """``name`` is the module path (``….q_proj``); adds ``.weight`` (and ``.bias``)."""
        if self.fp8_block is not None and quantize:
            bo, bi = self.fp8_block
            self.add(f"{name}.weight", (out_f, in_f), "float8_e4m3fn")
            self.add(f"{name}.weight_scale_inv", (ceil(out_f / bo), ceil(in_f / bi)), "float32")
        else:
            self.add(f"{name}.weight", (out_f, in_f))
        if bias:
            self.add(f"{name}.bias", (out_f,))


def fp8_block_size(cfg: Mapping[str, Any], where: str, fp8: bool) -> tuple[int, int] | None:
    """The FP8 block of ``cfg`` (``quantization_config.weight_block_size``) when ``fp8``, else None."""
    if not fp8:
        return None
    q = cfg.get("quantization_config")
    if q is None:  # a BF16 config asked for FP8: the block-wise scheme of the published FP8 checkpoints
        return FP8_BLOCK
    if not isinstance(q, Mapping):
        raise ModelConfigError(f"{where}: quantization_config must be an object, got {type(q).__name__}")
    fmt = q.get("fmt", "e4m3")
    method = q.get("quant_method", "fp8")
    block = q.get("weight_block_size", list(FP8_BLOCK))
    if method != "fp8" or fmt != "e4m3":
        raise ModelConfigError(f"{where}: fp8=True supports quantization_config quant_method 'fp8' with fmt "
                               f"'e4m3', got quant_method {method!r} fmt {fmt!r}")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ModelConfigError(f"{where}: quantization_config.weight_block_size must be two integers >= 1 "
                               f"(e.g. [128, 128]), got {block!r}")
    return (block[0], block[1])


def _dense_attention(b: _Builder, p: str, cfg: Mapping[str, Any], where: str, *, qkv_bias: bool,
                     o_bias: bool, qk_norm: bool) -> None:
    h = _int(cfg, "hidden_size", where)
    nh = _int(cfg, "num_attention_heads", where)
    nkv = _int(cfg, "num_key_value_heads", where, nh)
    hd = cfg.get("head_dim") or h // nh
    hd = _int({"head_dim": hd}, "head_dim", where)
    b.linear(p + "self_attn.q_proj", nh * hd, h, bias=qkv_bias)
    b.linear(p + "self_attn.k_proj", nkv * hd, h, bias=qkv_bias)
    b.linear(p + "self_attn.v_proj", nkv * hd, h, bias=qkv_bias)
    b.linear(p + "self_attn.o_proj", h, nh * hd, bias=o_bias)
    if qk_norm:
        b.add(p + "self_attn.q_norm.weight", (hd,))
        b.add(p + "self_attn.k_norm.weight", (hd,))


def _mlp(b: _Builder, p: str, h: int, inter: int, *, bias: bool = False) -> None:
    b.linear(p + "gate_proj", inter, h, bias=bias)
    b.linear(p + "up_proj", inter, h, bias=bias)
    b.linear(p + "down_proj", h, inter, bias=bias)


def _mla_attention(b: _Builder, p: str, cfg: Mapping[str, Any], where: str) -> None:
    h = _int(cfg, "hidden_size", where)
    nh = _int(cfg, "num_attention_heads", where)
    nope = _int(cfg, "qk_nope_head_dim", where)
    rope = _int(cfg, "qk_rope_head_dim", where)
    vhd = _int(cfg, "v_head_dim", where)
    kv_lora = _int(cfg, "kv_lora_rank", where)
    q_lora = cfg.get("q_lora_rank")
    a = p + "self_attn."
    if q_lora is None:
        b.linear(a + "q_proj", nh * (nope + rope), h)
    else:
        q_lora = _int(cfg, "q_lora_rank", where)
        b.linear(a + "q_a_proj", q_lora, h)
        b.add(a + "q_a_layernorm.weight", (q_lora,))
        b.linear(a + "q_b_proj", nh * (nope + rope), q_lora)
    b.linear(a + "kv_a_proj_with_mqa", kv_lora + rope, h)
    b.add(a + "kv_a_layernorm.weight", (kv_lora,))
    b.linear(a + "kv_b_proj", nh * (nope + vhd), kv_lora)
    b.linear(a + "o_proj", h, nh * vhd)


def _dsv3_layer(b: _Builder, i: int, cfg: Mapping[str, Any], where: str) -> None:
    h = _int(cfg, "hidden_size", where)
    p = f"model.layers.{i}."
    b.add(p + "input_layernorm.weight", (h,))
    _mla_attention(b, p, cfg, where)
    b.add(p + "post_attention_layernorm.weight", (h,))
    n_routed = cfg.get("n_routed_experts")
    first_dense = _int(cfg, "first_k_dense_replace", where, 0, minimum=0)
    freq = _int(cfg, "moe_layer_freq", where, 1)
    if n_routed is not None and i >= first_dense and i % freq == 0:
        e = _int(cfg, "n_routed_experts", where)
        mi = _int(cfg, "moe_intermediate_size", where)
        b.add(p + "mlp.gate.weight", (e, h))
        if cfg.get("model_type") == "deepseek_v3" or cfg.get("topk_method") == "noaux_tc":
            b.add(p + "mlp.gate.e_score_correction_bias", (e,), "float32")  # float32 in the checkpoint
        for k in range(e):
            _mlp(b, f"{p}mlp.experts.{k}.", h, mi)
        ns = _int(cfg, "n_shared_experts", where, 0, minimum=0)
        if ns:
            _mlp(b, p + "mlp.shared_experts.", h, mi * ns)
    else:
        _mlp(b, p + "mlp.", h, _int(cfg, "intermediate_size", where))


def arrays_from_config(cfg: Mapping[str, Any] | str | os.PathLike[str], *, fp8: bool = False,
                       include_mtp: bool = False) -> Arrays:
    """HF parameter names -> ``(shape, data_type)`` for a Hugging Face ``config.json``.

    ``cfg`` is the parsed object, a path to the file, or a directory holding ``config.json``.
    Supported ``model_type``: ``llama``, ``qwen2``, ``qwen3``, ``qwen3_moe``, ``deepseek_v3``
    (``deepseek_v2`` too: the same MLA/MoE shapes without ``e_score_correction_bias``).

    ``fp8=True``: linear weights inside the decoder layers (attention projections, MLP, routed
    and shared experts) are ``float8_e4m3fn`` with a float32 ``<name>_scale_inv`` sibling of shape
    ``ceil(out/b0) × ceil(in/b1)``, the block ``[b0, b1]`` taken from
    ``quantization_config.weight_block_size`` (default ``[128, 128]``). Embeddings, ``lm_head``,
    norms and the MoE router stay in ``torch_dtype``. Default: every weight in ``torch_dtype``.

    ``include_mtp``: DeepSeek-V3's ``num_nextn_predict_layers`` multi-token-prediction layers
    (indices ``num_hidden_layers …``: a full MoE decoder layer plus ``embed_tokens``, ``enorm``,
    ``hnorm``, ``eh_proj`` and ``shared_head``); excluded by default, like inference engines.

    ``tie_word_embeddings`` true -> no ``lm_head.weight``.

    >>> a = arrays_from_config({"model_type": "llama", "hidden_size": 8, "intermediate_size": 16,
    ...     "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 10})
    >>> a["model.layers.0.self_attn.k_proj.weight"], len(a)
    (((8, 8), 'bfloat16'), 12)
    """
    c, where = _load_json(cfg, "config.json")
    mt = c.get("model_type")
    if mt not in ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "deepseek_v2"):
        raise ModelConfigError(f"{where}: model_type {mt!r} is not supported (supported: llama, qwen2, qwen3, "
                               f"qwen3_moe, deepseek_v3); describe it as an NCCL M2N model JSON or a manifest instead")
    b = _Builder(config_dtype(c, where), fp8_block_size(c, where, fp8))
    h = _int(c, "hidden_size", where)
    layers = _int(c, "num_hidden_layers", where)
    vocab = _int(c, "vocab_size", where)
    b.add("model.embed_tokens.weight", (vocab, h))
    if mt in ("deepseek_v3", "deepseek_v2"):
        for i in range(layers):
            _dsv3_layer(b, i, c, where)
        if include_mtp:
            for k in range(_int(c, "num_nextn_predict_layers", where, 0, minimum=0)):
                i = layers + k
                _dsv3_layer(b, i, c, where)
                p = f"model.layers.{i}."
                b.add(p + "embed_tokens.weight", (vocab, h))
                b.add(p + "enorm.weight", (h,))
                b.add(p + "hnorm.weight", (h,))
                b.linear(p + "eh_proj", h, 2 * h, quantize=False)
                b.add(p + "shared_head.norm.weight", (h,))
                b.add(p + "shared_head.head.weight", (vocab, h))
    else:
        qkv_bias = mt == "qwen2" or bool(c.get("attention_bias", False))
        o_bias = mt == "llama" and bool(c.get("attention_bias", False))
        mlp_bias = mt == "llama" and bool(c.get("mlp_bias", False))
        qk_norm = mt in ("qwen3", "qwen3_moe")
        sparse_step = _int(c, "decoder_sparse_step", where, 1)
        dense_only = c.get("mlp_only_layers") or []
        if not isinstance(dense_only, list) or not all(isinstance(x, int) for x in dense_only):
            raise ModelConfigError(f"{where}: mlp_only_layers must be a list of layer indices, got {dense_only!r}")
        for i in range(layers):
            p = f"model.layers.{i}."
            b.add(p + "input_layernorm.weight", (h,))
            _dense_attention(b, p, c, where, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm)
            b.add(p + "post_attention_layernorm.weight", (h,))
            moe = mt == "qwen3_moe" and i not in dense_only and (i + 1) % sparse_step == 0
            if moe:
                # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
                e = _int(c, "num_experts" if "num_experts" in c or "num_local_experts" not in c
                         else "num_local_experts", where)
                mi = _int(c, "moe_intermediate_size", where)
                b.add(p + "mlp.gate.weight", (e, h))
                for k in range(e):
                    _mlp(b, f"{p}mlp.experts.{k}.", h, mi)
            else:
                _mlp(b, p + "mlp.", h, _int(c, "intermediate_size", where), bias=mlp_bias)
    b.add("model.norm.weight", (h,))
    if not c.get("tie_word_embeddings", False):
        b.add("lm_head.weight", (vocab, h))
    return b.out


# ---------------------------------------------------------------- NCCL M2N JSONs


def arrays_from_m2n_model(path: Mapping[str, Any] | str | os.PathLike[str]) -> Arrays:
    """An NCCL M2N model JSON (``{hf_name: {"shape": [...], "dtype": "BF16", "shard": file}}``)
    -> ``{hf_name: (shape, data_type)}``. ``dtype`` is a safetensors name (default ``BF16``, as
    in M2N's model bench); ``shard`` (the source safetensors file) is accepted and not used here."""
    obj, where = _load_json(path, "NCCL M2N model JSON")
    out: Arrays = {}
    for name, spec in obj.items():
        if not isinstance(spec, Mapping):
            raise ModelConfigError(f"{where}: {name}: expected an object with 'shape' and 'dtype', "
                                   f"got {type(spec).__name__}")
        extra = set(spec) - {"shape", "dtype", "shard"}
        if extra:
            raise ModelConfigError(f"{where}: {name}: unknown key(s) {sorted(extra)} (expected shape, dtype, shard)")
        shape = spec.get("shape")
        if (not isinstance(shape, list)
                or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape)):
            raise ModelConfigError(f"{where}: {name}: shape must be a list of integers >= 0, got {shape!r}")
        try:
            dt = by_safetensors(spec.get("dtype", "BF16"))
        except FormatError as e:
            raise ModelConfigError(f"{where}: {name}: {e}") from None
        out[name] = (tuple(shape), dt.name)
    if not out:
        raise ModelConfigError(f"{where}: no arrays in the model JSON")
    return out


def is_hf_config(obj: Mapping[str, Any]) -> bool:
    """A Hugging Face ``config.json`` (has ``model_type``) rather than an M2N model JSON."""
    return "model_type" in obj and not isinstance(obj.get("model_type"), Mapping)


def arrays_from_model(src: Mapping[str, Any] | str | os.PathLike[str], *, fp8: bool = False,
                      include_mtp: bool = False) -> Arrays:
    """Either description: an HF ``config.json`` (with ``model_type``) or an NCCL M2N model JSON.
    ``fp8`` / ``include_mtp`` apply to HF configs only (an M2N JSON states its dtypes)."""
    obj, where = _load_json(src, "model description")
    if is_hf_config(obj):
        return arrays_from_config(obj if isinstance(src, Mapping) else src, fp8=fp8, include_mtp=include_mtp)
    if fp8:
        raise ModelConfigError(f"{where}: fp8 applies to HF config.json models; an NCCL M2N model JSON "
                               f"gives each array's dtype itself")
    return arrays_from_m2n_model(obj if isinstance(src, Mapping) else src)


def count_parameters(arrays: Mapping[str, tuple[Sequence[int], str]], *, scales: bool = False) -> int:
    """Elements over all arrays; FP8 ``*_scale_inv`` arrays are not parameters unless ``scales``."""
    return sum(prod(s) for n, (s, _) in arrays.items() if scales or not n.endswith("_scale_inv"))


def parallel_from_dict(d: Mapping[str, Any], *, where: str = "<system>") -> dict[str, Any]:
    """One side of an NCCL M2N system JSON -> ``{"num_gpus", "tp", "cp", "ep", "pp", "fsdp", "dp",
    "edp", "ranks_per_stage", "dp_derived"}``, checked.

    Sizes default to 1; ``num_gpus`` is required. Two ways to count the world are accepted:

    * ``pp × dp × fsdp × cp × tp == num_gpus`` (``dp`` is the data parallelism of the dense
      arrays). Experts, with ``ep > 1``, are replicated ``edp = ranks_per_stage / ep`` times.
    * ``ep > 1`` and ``pp × dp × ep == num_gpus``: Megatron "parallel folding" with ETP = 1, as NCCL
      M2N's model bench reads its system files (``dsv3-256gpus-gb200.json``: EP16 × PP8 on 128 GPUs
      with ``dp_size`` 1). ``dp`` is then the *expert* data parallelism (``edp``), and the dense
      arrays' ``dp`` is derived: ``ranks_per_stage / (fsdp·cp·tp)`` (``dp_derived`` is true).

    In both, ``ranks_per_stage = num_gpus / pp`` must be a multiple of ``ep`` and of ``fsdp·cp·tp``.
    """
    if not isinstance(d, Mapping):
        raise ModelConfigError(f"{where}: expected an object with num_gpus and *_size keys, got {type(d).__name__}")
    allowed = {"num_gpus"} | {f"{k}_size" for k in PARALLEL_KEYS}
    extra = sorted(k for k in d if k not in allowed and not k.startswith("_"))
    if extra:
        raise ModelConfigError(f"{where}: unknown key(s) {extra} (expected num_gpus, "
                               f"{', '.join(f'{k}_size' for k in PARALLEL_KEYS)})")
    if "num_gpus" not in d:
        raise ModelConfigError(f"{where}: num_gpus is required")
    out: dict[str, Any] = {"num_gpus": _int(d, "num_gpus", where)}
    for k in PARALLEL_KEYS:
        out[k] = _int(d, f"{k}_size", where, 1)
    n, tp, cp, ep, pp, fsdp, dp = (out[k] for k in ("num_gpus", *PARALLEL_KEYS))
    dense = pp * dp * fsdp * cp * tp
    out["dp_derived"] = False
    if dense != n:
        if ep > 1 and pp * dp * ep == n and (n // pp) % (fsdp * cp * tp) == 0:
            out["dp"] = (n // pp) // (fsdp * cp * tp)
            out["dp_derived"] = True
        else:
            folded = (f"; nor does pp({pp})*dp({dp})*ep({ep}) = {pp * dp * ep} (dp_size read as expert data "
                      f"parallelism, Megatron parallel folding)") if ep > 1 else ""
            raise ModelConfigError(f"{where}: pp({pp})*dp({dp})*fsdp({fsdp})*cp({cp})*tp({tp}) = {dense} "
                                   f"!= num_gpus({n}){folded}")
    per_stage = n // pp
    if per_stage % ep:
        raise ModelConfigError(f"{where}: ep({ep}) must divide the ranks of one pipeline stage "
                               f"num_gpus({n}) / pp({pp}) = {per_stage}")
    out["ranks_per_stage"] = per_stage
    out["edp"] = per_stage // ep
    return out


def parse_m2n_system(path: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An NCCL M2N system JSON (``{"train": {...}, "generation": {...}}``) -> ``(train, generation)``
    as :func:`parallel_from_dict` returns them. Trainers are global ranks ``0..train.num_gpus-1``."""
    obj, where = _load_json(path, "NCCL M2N system JSON")
    extra = sorted(k for k in obj if k not in ("train", "generation") and not k.startswith("_"))
    if extra:
        raise ModelConfigError(f"{where}: unknown key(s) {extra} (expected train, generation)")
    for k in ("train", "generation"):
        if k not in obj:
            raise ModelConfigError(f"{where}: missing {k!r} (an object with num_gpus, tp_size, ...)")
    return (parallel_from_dict(obj["train"], where=f"{where}: train"),
            parallel_from_dict(obj["generation"], where=f"{where}: generation"))


# ---------------------------------------------------------------- rules and layouts

#: (glob, tp placement) in HF names; first match wins. ``*_proj.weight*`` also matches the FP8
#: ``weight_scale_inv`` sibling, which is split along the same dim as its weight.
_TP_RULES: tuple[tuple[str, str], ...] = (
    ("*embed_tokens.weight", "S(0)"),          # vocab-parallel (MTP's layers.N.embed_tokens too)
    ("*lm_head.weight", "S(0)"),
    ("*shared_head.head.weight", "S(0)"),
    ("*.mlp.gate.weight", "R"),                # MoE router
    ("*.e_score_correction_bias", "R"),
    ("*.q_a_proj.weight*", "R"),               # MLA down-projections: small, replicated
    ("*.kv_a_proj_with_mqa.weight*", "R"),
    ("*.eh_proj.weight*", "R"),
    ("*.q_proj.weight*", "S(0)"),              # column-parallel
    ("*.k_proj.weight*", "S(0)"),
    ("*.v_proj.weight*", "S(0)"),
    ("*.q_proj.bias", "S(0)"),
    ("*.k_proj.bias", "S(0)"),
    ("*.v_proj.bias", "S(0)"),
    ("*.q_b_proj.weight*", "S(0)"),
    ("*.kv_b_proj.weight*", "S(0)"),
    ("*.gate_proj.weight*", "S(0)"),           # dense MLP, shared experts and routed experts
    ("*.up_proj.weight*", "S(0)"),
    ("*.gate_proj.bias", "S(0)"),
    ("*.up_proj.bias", "S(0)"),
    ("*.o_proj.weight*", "S(1)"),              # row-parallel (their biases stay replicated)
    ("*.down_proj.weight*", "S(1)"),
)


def generic_rules(mesh_axes: Sequence[str], *, tp_axis: str = "tp", fsdp_axis: str = "fsdp") -> list[str]:
    """Megatron-like rules in HF names for llama / qwen2 / qwen3 / qwen3_moe / deepseek_v3, one
    placement per mesh axis, as ``--rule`` strings (first match wins).

    On ``tp``: column-parallel ``q/k/v_proj``, ``q_b_proj``, ``kv_b_proj``, ``gate/up_proj``
    (dense, shared and routed experts) ``S(0)``; row-parallel ``o_proj``, ``down_proj`` ``S(1)``;
    ``embed_tokens`` / ``lm_head`` ``S(0)`` (vocab-parallel); MLA ``q_a_proj`` and
    ``kv_a_proj_with_mqa``, norms, the router and its bias ``R``. On ``fsdp``: ``S(0)`` for every
    array (FSDP2). Every other axis ``R`` (``pp`` and ``ep`` place arrays by name in
    :func:`~.rules.apply_layout`).

    >>> generic_rules(["dp", "tp"])[:2]
    ['*embed_tokens.weight=R,S(0)', '*lm_head.weight=R,S(0)']
    """
    axes = list(mesh_axes)
    if not axes:
        raise LayoutError("generic_rules needs at least one mesh axis")

    def pl(tp_pl: str) -> str:
        return ",".join(tp_pl if a == tp_axis else "S(0)" if a == fsdp_axis else "R" for a in axes)

    rules = [f"{glob}={pl(p)}" for glob, p in _TP_RULES]
    if fsdp_axis in axes:
        rules.append(f"*={pl('R')}")  # FSDP shards the arrays no tp rule names too
    return rules


def _mesh(axes_sizes: Sequence[tuple[str, int]]) -> Mesh:
    kept = [(a, n) for a, n in axes_sizes if n > 1 or a == "tp"]
    return Mesh(tuple(a for a, _ in kept), tuple(n for _, n in kept))


def parallel_meshes(par: Mapping[str, Any]) -> tuple[Mesh, Mesh | None]:
    """The non-expert mesh and (with ``ep > 1``) the expert mesh of one side, over the same ranks
    (see the module docstring)."""
    ne = _mesh([(PP_AXIS, par["pp"]), ("dp", par["dp"]), ("fsdp", par.get("fsdp", 1)),
                ("cp", par.get("cp", 1)), ("tp", par["tp"])])
    if ne.size != par["num_gpus"]:
        raise ModelConfigError(f"mesh {ne} has {ne.size} ranks, expected num_gpus {par['num_gpus']}")
    if par.get("ep", 1) <= 1:
        return ne, None
    per_stage = par["num_gpus"] // par["pp"]
    ex = Mesh(tuple(a for a, n in ((PP_AXIS, par["pp"]), ("edp", per_stage // par["ep"])) if n > 1) + (EP_AXIS,),
              tuple(n for n in (par["pp"], per_stage // par["ep"]) if n > 1) + (par["ep"],))
    return ne, ex


def manifest_from_parallel(arrays: Mapping[str, tuple[Sequence[int], str]], par: Mapping[str, Any], *,
                           rules: Sequence[str] | None = None, file_pattern: str | None = None,
                           domain_size: int | None = None, name: str | None = None,
                           num_layers: int | None = None) -> Manifest:
    """The manifest of ``arrays`` laid out like a Megatron (or vLLM) job with the sizes ``par``
    (:func:`parallel_from_dict`): non-expert arrays on ``pp × dp × fsdp × cp × tp`` by ``rules``
    (default :func:`generic_rules`), experts on ``pp × edp × ep`` when ``ep > 1``. HF names are
    kept as local tensor names; ``file_pattern=None`` makes a live (in-memory) manifest.
    ``num_layers`` (for ``pp``) defaults to the largest ``layers.{i}`` index + 1 over all arrays.
    """
    ne, ex = parallel_meshes(par)
    if num_layers is None:
        idx = [li for li in (layer_index(n) for n in arrays) if li is not None]
        num_layers = max(idx) + 1 if idx else 1
    expert_names = {n for n in arrays if ex is not None and expert_index(n) is not None}
    dense = {n: v for n, v in arrays.items() if n not in expert_names}
    experts = {n: v for n, v in arrays.items() if n in expert_names}
    ne_rules = [parse_rule(r, ne) for r in (rules if rules is not None else generic_rules(ne.axes))]
    out: dict[str, ArraySpec] = {}
    if dense:
        pl = resolve_placements({n: s for n, (s, _) in dense.items()}, ne, ne_rules, num_layers=num_layers)
        out.update(build_manifest(dense, ne, pl, file_pattern=file_pattern).arrays)
    if experts:
        assert ex is not None
        pl = resolve_placements({n: s for n, (s, _) in experts.items()}, ex, [], num_layers=num_layers)
        out.update(build_manifest(experts, ex, pl, file_pattern=file_pattern).arrays)
    ordered = {n: out[n] for n in arrays}
    return Manifest(world_size=ne.size, arrays=ordered, name=name, mesh=ne.to_dict(),
                    topology={"domain_size": domain_size} if domain_size is not None else None)

