"""The engine every framework preset runs on: the model description (:class:`ModelInfo`), the
walk over the HF arrays that dispatches each one to the first matching row of a framework's table
(:func:`walk`), and the checks the fused presets share.

A framework module (``megatron``, ``vllm``, ``fsdp2``, ``hf``) is a :class:`Framework`: its mesh
axes, and a ``place`` function. The fused ones describe themselves as data: a table of the arrays
outside the decoder layers (``{hf name: handler}``) and a list of :class:`Rule` rows for the arrays
inside a layer (``model.layers.{i}.<rest>``: a regex over ``rest``, a handler that places the
array in the framework's local tensors). Adding a framework means one such module and one line in
:data:`~formats.layouts.presets.FRAMEWORKS`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ...manifest.dtypes import by_name
from ..mesh import LayoutError, Mesh
from .builder import Arrays, Builder
from .geometry import PresetError

__all__ = [
    "DENSE_TYPES",
    "MLA_TYPES",
    "PRESET_DTYPES",
    "Framework",
    "LayerContext",
    "ModelInfo",
    "Options",
    "Rule",
    "Site",
    "attention_checks",
    "check_axes",
    "model_info",
    "preset_dtype",
    "mla_rule",
    "replicated",
    "walk",
]

DENSE_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MLA_TYPES = ("deepseek_v3", "deepseek_v2")

#: the weight dtypes a preset writes (``--dtype``); fp32 master weights included
PRESET_DTYPES = ("bfloat16", "float16", "float32")

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\Z")


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
    #: the weights' data_type (:func:`preset_dtype`)
    dtype: str = "bfloat16"

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
    from ..models import arrays_from_config, fp8_block_size

    return arrays_from_config(c, fp8=fp8), fp8_block_size(c, "config.json", fp8)


def _with_dtype(c: dict[str, Any], dtype: str | None) -> str:
    """Set ``c``'s ``torch_dtype`` to the weights' data_type: ``dtype`` when given, else the
    config's ``torch_dtype`` / ``dtype``, else bfloat16 (HF's own precedence); returns it."""
    from ..models import config_dtype

    if dtype is not None:
        if dtype not in PRESET_DTYPES:
            by_name(dtype)  # an unknown name: its own message
            raise PresetError(f"dtype {dtype!r} is not a weight dtype a preset writes "
                              f"(expected one of {', '.join(PRESET_DTYPES)})")
        c["torch_dtype"] = dtype
        return dtype
    return config_dtype(c, "config.json")


def preset_dtype(cfg: Mapping[str, Any] | str | os.PathLike[str], dtype: str | None = None) -> str:
    """The data_type a preset gives the weights of ``cfg``: ``dtype`` when given, else the config's
    ``torch_dtype`` / ``dtype``, else bfloat16 (FP8 weights and float32 routing biases aside).

    >>> preset_dtype({"torch_dtype": "float32"}), preset_dtype({"dtype": "float16"}), preset_dtype({})
    ('float32', 'float16', 'bfloat16')
    >>> preset_dtype({"torch_dtype": "float32"}, "bfloat16")
    'bfloat16'
    """
    return _with_dtype(_load_cfg(cfg), dtype)


def model_info(cfg: Mapping[str, Any] | str | os.PathLike[str], *, dtype: str | None = None,
               fp8: bool = False) -> ModelInfo:
    """The HF arrays of ``cfg`` (in :func:`preset_dtype` ``(cfg, dtype)``; ``fp8``: block-FP8
    linear weights with ``weight_scale_inv`` siblings, as :func:`~.models.arrays_from_config`) and
    the attention geometry the fused layouts need."""
    c = _load_cfg(cfg)
    wdt = _with_dtype(c, dtype)
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
                     bool(c.get("tie_word_embeddings", False)), arrays, mt in MLA_TYPES, block, wdt)



# ---------------------------------------------------------------- what a framework is


@dataclass(frozen=True)
class Options:
    """The options of :func:`~formats.layouts.presets.preset_manifest` that belong to one framework."""

    expert_parallel: bool | None = None
    expert_tensor_parallel: int | None = None
    moe_grouped_gemm: bool = False
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    #: megatron: "te" (Transformer Engine: norms fused into linear_qkv / linear_fc1) or "local"
    megatron_spec: str = "te"
    #: megatron: the saved padded vocabulary (``args.padded_vocab_size``); None: 128 × tp padding
    megatron_padded_vocab: int | None = None


@dataclass(frozen=True)
class Framework:
    """One preset: its name, its mesh axes (slowest first when ``ordered``: the framework's rank
    order; None: no axis check) and ``place``, which puts every HF array into the builder.
    ``fused_scales``: FP8 ``weight_scale_inv`` arrays follow their weights into the fused local
    tensors (else they are arrays of their own). ``stage_layers``: takes first/last stage layer
    counts."""

    name: str
    axes: tuple[str, ...] | None
    ordered: bool
    place: Callable[[Builder, ModelInfo, Options], None]
    fused_scales: bool = False
    stage_layers: bool = False


@dataclass(frozen=True)
class Site:
    """One HF array inside decoder layer ``layer``: ``rest`` is its name after ``model.layers.{i}.``,
    ``prefix`` the framework's name of that layer's module (``decoder.layers.{local}.``)."""

    fqn: str
    rest: str
    layer: int
    stage: int
    prefix: str
    shape: tuple[int, ...]

    @property
    def kind(self) -> str:
        """``weight`` or ``bias`` (the last part of the name)."""
        return self.rest.rsplit(".", 1)[-1]


@dataclass
class LayerContext:
    """What a framework's handlers share during one :func:`walk`: the builder, the model, the
    stage of every layer; framework modules subclass it with their derived sizes."""

    preset: str
    b: Builder
    info: ModelInfo
    stage_of: list[int]

    @property
    def tp(self) -> int:
        return self.b.size("tp")

    def prefix(self, layer: int, stage: int) -> str:
        """The framework's module prefix of decoder layer ``layer`` (HF numbering by default)."""
        return f"model.layers.{layer}."


C = TypeVar("C", bound=LayerContext)


@dataclass(frozen=True)
class Rule(Generic[C]):
    """One row of a framework's layer table: arrays whose ``rest`` matches ``pattern`` (anchored at
    both ends) are placed by ``place``; ``when`` restricts the row to some models."""

    pattern: str
    place: Callable[[C, Site, re.Match[str]], None]
    when: Callable[[ModelInfo], bool] | None = None
    regex: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "regex", re.compile(f"(?:{self.pattern})\\Z"))


def walk(ctx: C, top: Mapping[str, Callable[[C, str], None]], rules: Sequence[Rule[C]]) -> None:
    """Place every HF array of ``ctx.info``: the arrays outside the layers by ``top`` (by name),
    those of a layer by the first row of ``rules`` that matches; FP8 scales that follow their
    weights are skipped (the builder places them). Arrays nothing matches are refused together."""
    b, info = ctx.b, ctx.info
    active = [r for r in rules if r.when is None or r.when(info)]
    unmapped: list[str] = []
    for fqn, (shape, _dt) in info.arrays.items():
        if fqn in b.scales:
            continue  # placed with its FP8 weight
        outer = top.get(fqn)
        if outer is not None:
            outer(ctx, fqn)
            continue
        m = _LAYER.match(fqn)
        if not m:
            unmapped.append(fqn)
            continue
        i, rest = int(m.group(1)), m.group(2)
        stage = ctx.stage_of[i]
        site = Site(fqn, rest, i, stage, ctx.prefix(i, stage), shape)
        for rule in active:
            mm = rule.regex.match(rest)
            if mm is not None:
                rule.place(ctx, site, mm)
                break
        else:
            unmapped.append(fqn)
    if unmapped:
        raise _unmapped(ctx.preset, info, unmapped)


def replicated(local: str = "{fqn}") -> Callable[[LayerContext, Site, re.Match[str]], None]:
    """A layer-table handler: the array whole on every rank of its stage, as the local tensor
    ``local`` under the layer's module prefix (formatted with the pattern's groups; ``{fqn}``
    alone: the HF name itself)."""

    def place(c: LayerContext, s: Site, m: re.Match[str]) -> None:
        name = s.fqn if local == "{fqn}" else s.prefix + local.format(*m.groups())
        c.b.whole(s.fqn, name, pp=s.stage)

    return place


# ---------------------------------------------------------------- shared pieces of the fused presets


def check_axes(mesh: Mesh, allowed: Sequence[str], preset: str, *, ordered: bool) -> None:
    bad = [a for a in mesh.axes if a not in allowed]
    if bad:
        raise PresetError(f"preset {preset}: mesh axis {bad[0]!r} is not one of {', '.join(allowed)}")
    if ordered:
        idx = [allowed.index(a) for a in mesh.axes]
        if idx != sorted(idx):
            want = ",".join(f"{a}={mesh.size_of(a)}" for a in allowed if a in mesh.axes)
            raise PresetError(f"preset {preset}: mesh axes {','.join(mesh.axes)} are not in the framework's rank "
                               f"order (slowest first: {', '.join(allowed)}); write the mesh as {want}")


def attention_checks(preset: str, info: ModelInfo, tp: int) -> None:
    if info.model_type not in DENSE_TYPES + MLA_TYPES:
        raise PresetError(f"preset {preset}: model_type {info.model_type!r} is not supported (supported: "
                           f"{', '.join(DENSE_TYPES + MLA_TYPES)})")
    if info.heads % tp:
        raise PresetError(f"preset {preset}: num_attention_heads ({info.heads}) must be divisible by tp ({tp})")
    if info.mla:
        return
    if info.heads % info.kv_heads:
        raise PresetError(f"preset {preset}: num_attention_heads ({info.heads}) must be a multiple of "
                           f"num_key_value_heads ({info.kv_heads})")



#: MLA attention (deepseek_v2 / v3) tables: HF ``self_attn.<name>`` -> (local name under the
#: framework's attention module, TP split, the HF array fused in front of it in the same local
#: tensor). Splits: ``R`` replicated over TP, ``S0`` column-parallel (dim 0, whole heads), ``S1``
#: row-parallel (dim 1, whole heads).
MlaTable = Mapping[str, tuple[str, str, "str | None"]]


def mla_rule(table: MlaTable, attn: Callable[[C, Site], str]) -> Rule[C]:
    """The layer-table row of MLA attention: the arrays ``table`` names, placed into the local
    tensors under ``attn(ctx, site)`` (the framework's attention module prefix); MLA models only."""
    names = "|".join(re.escape(k) for k in table)

    def place(ctx: C, site: Site, m: re.Match[str]) -> None:
        _place_mla(ctx.b, site, attn(ctx, site), table[m.group(1)], ctx.preset)

    return Rule(rf"self_attn\.({names})", place, when=lambda info: info.mla)


def _place_mla(b: Builder, site: Site, attn: str, entry: tuple[str, str, str | None], label: str) -> None:
    """Place one MLA attention array into the local tensors under ``attn``."""
    local, split, after = entry
    fqn, rest, stage = site.fqn, site.rest, site.stage
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
        b.spread(fqn, attn + local, {"pp": stage}, l0=l0)
    elif split == "S0":
        b.column(fqn, T, stage, attn + local, 0, heads.format("its output dim", b.arrays[fqn][0][0]))
    else:
        b.row_parallel(fqn, T, stage, attn + local, heads.format("its input dim", b.arrays[fqn][0][1]))


def _unmapped(preset: str, info: ModelInfo, names: list[str]) -> PresetError:
    more = f" ... ({len(names)} in all)" if len(names) > 8 else ""
    hint = (" (DeepSeek MTP layers: use fsdp2 / hf, or a rule-based layout)"
            if info.mla and any(".embed_tokens." in n or ".eh_proj." in n for n in names) else "")
    return PresetError(f"preset {preset}: model_type {info.model_type!r}: no mapping for array(s) "
                        f"{', '.join(names[:8])}{more}{hint}")


