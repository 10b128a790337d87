"""Manifest from a live Megatron-core model: ``manifest_from_megatron(model)``.

Called on every rank of a Megatron job (``torchrun``, megatron-core's ``parallel_state``
initialised), with the model chunk megatron-core built, or the list of virtual-pipeline chunks,
bare or wrapped in megatron-core's ``DistributedDataParallel`` / ``Float16Module``. Each rank
reports what it holds (its coordinates in the tensor, pipeline, expert and data parallel groups,
the global layer numbers of its chunks, its parameters' names, shapes and dtypes: metadata, never
tensor data) in one ``all_gather_object``; every rank then builds the same manifest
(:func:`formats.megatron.live.live_manifest`), whose arrays are the Hugging Face arrays that vLLM,
an HF checkpoint or shardstream's own receivers name. ``session.push(model)`` then sends each
rank's parameters as they are: nothing is gathered.

The vocabulary: a ``GPTModel`` knows only its padded size; pass the tokenizer's as
``vocab_size=``, or leave it to the receivers' manifest (``open_rows``). torch and megatron-core are imported by the caller: importing this costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from formats.errors import FormatError, ValidationError
from formats.manifest.dtypes import from_torch
from formats.manifest.spec import Manifest
from formats.megatron.live import MegatronConfig, RankReport, live_manifest

__all__ = ["MegatronError", "is_megatron_model", "manifest_from_megatron", "megatron_tensors"]

#: wrappers a Megatron trainer holds its model in: their ``.module`` is the model
_WRAPPERS = ("DistributedDataParallel", "Float16Module", "TorchFullyShardedDataParallel")
#: TransformerConfig fields the layout reads (plain values, the same on every rank)
_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
           "normalization", "gated_linear_unit", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
           "multi_latent_attention", "num_moe_experts", "moe_ffn_hidden_size", "moe_router_topk",
           "moe_shared_expert_intermediate_size", "moe_layer_freq", "mtp_num_layers")


class MegatronError(ValidationError):
    """A Megatron model that cannot be described (an architecture or layout this does not map);
    every problem is one line in ``problems``, the same on every rank. Exit code 1."""


def _unwrap(m: Any) -> Any:
    while type(m).__name__ in _WRAPPERS and hasattr(m, "module"):
        m = m.module
    return m


def _chunks(model: Any) -> list[Any]:
    return [_unwrap(c) for c in (model if isinstance(model, (list, tuple)) else [model])]


def is_megatron_model(obj: Any) -> bool:
    """A megatron-core module (wrapped or not), or a list of them (virtual pipeline chunks)."""
    items = obj if isinstance(obj, (list, tuple)) and obj else [obj]
    return all(type(_unwrap(m)).__module__.startswith("megatron.") for m in items)


def megatron_tensors(model: Any) -> dict[str, Any]:
    """This rank's parameters under the manifest's local names (``model{v}.`` with several chunks)."""
    chunks = _chunks(model)
    out: dict[str, Any] = {}
    for v, c in enumerate(chunks):
        prefix = f"model{v}." if len(chunks) > 1 else ""
        for n, p in c.named_parameters():
            out[prefix + n] = p.detach()
    return out


def _activation(fn: Any) -> str:
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return "silu" if name in ("silu", "SiLU") else str(name)


def _config(chunks: Sequence[Any]) -> tuple[dict[str, Any], int, bool]:
    m = chunks[0]
    if type(m).__name__ != "GPTModel" or not hasattr(m, "decoder"):
        raise FormatError(f"megatron: a {type(m).__name__} is not a megatron-core GPTModel (only GPTModel is mapped)")
    c = m.config
    fields = {f: getattr(c, f, None) for f in _FIELDS}
    fields["activation"] = _activation(getattr(c, "activation_func", None))
    fields["position_embedding_type"] = getattr(m, "position_embedding_type", "rope")
    if fields.get("mtp_num_layers"):
        raise FormatError("megatron: multi-token prediction layers (mtp_num_layers) are not mapped")
    return fields, int(m.vocab_size), bool(getattr(m, "share_embeddings_and_output_weights", False))


def _report(model: Any, rank: int) -> tuple[RankReport | None, dict[str, Any] | None, str | None]:
    """This rank's report and the model-wide facts, or the reason it cannot say."""
    from megatron.core import parallel_state as ps

    try:
        chunks = _chunks(model)
        fields, padded, tied = _config(chunks)
        sizes = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
                 "vpp": len(chunks), "ep": ps.get_expert_model_parallel_world_size(),
                 "etp": ps.get_expert_tensor_parallel_world_size(), "cp": ps.get_context_parallel_world_size()}
        ep = sizes["ep"]
        params: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, t in megatron_tensors(model).items():
            try:
                params[name] = (tuple(int(n) for n in t.shape), from_torch(t.dtype).name)
            except FormatError:
                raise FormatError(f"megatron: parameter {name} has dtype {t.dtype}, which a manifest cannot name") from None
        report = RankReport(
            rank=rank, pp=ps.get_pipeline_model_parallel_rank(), tp=ps.get_tensor_model_parallel_rank(),
            dp=ps.get_expert_data_parallel_rank() if ep > 1 else ps.get_data_parallel_rank(),
            ep=ps.get_expert_model_parallel_rank(), etp=ps.get_expert_tensor_parallel_rank(),
            cp=ps.get_context_parallel_rank(),
            layers=tuple(tuple(int(layer.layer_number) - 1 for layer in c.decoder.layers) for c in chunks),
            params=params)
        return report, {"fields": fields, "padded": padded, "tied": tied, "sizes": sizes}, None
    except FormatError as e:
        return None, None, "; ".join(e.problems)
    except (AttributeError, AssertionError, RuntimeError) as e:
        return None, None, f"megatron: cannot read the model or megatron-core's parallel state ({type(e).__name__}: {e})"


def manifest_from_megatron(model: Any, *, vocab_size: int | None = None, name: str | None = None) -> Manifest:
    """The manifest of what every rank of this Megatron job holds, as regions of the Hugging Face
    arrays. Collective: every rank of the job calls it (one ``all_gather_object``), and every rank
    gets the same manifest, or the same :class:`MegatronError`.

    ``model``: the GPTModel chunk of this rank, or its list of virtual-pipeline chunks, bare or in
    megatron-core's ``DistributedDataParallel`` / ``Float16Module``. ``vocab_size``: the unpadded
    vocabulary (the tokenizer's, the HF config's ``vocab_size``): the model holds it padded, and
    the padding rows are never sent. None: the receivers' manifest decides at ``open()`` (the
    arrays are ``open_rows``); receivers that hold more rows than the padded vocabulary, or a
    ``vocab_size`` that differs from theirs, are refused naming the array.
    """
    import torch.distributed as dist

    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)):
        raise MegatronError(f"manifest_from_megatron: vocab_size must be an integer, got {vocab_size!r}")
    rank = dist.get_rank() if dist.is_initialized() else 0
    mine = _report(model, rank)
    got: list[Any] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(got, mine)
    else:
        got[0] = mine
    errors = sorted({f"rank {r}: {e}" if len(got) > 1 else e for r, (_, _, e) in enumerate(got) if e})
    if errors:
        raise MegatronError(problems=errors)
    facts = got[0][1]
    if any(g[1] != facts for g in got[1:]):
        raise MegatronError("megatron: ranks disagree on the model's config or parallel sizes")
    cfg = MegatronConfig(facts["fields"], facts["padded"], facts["tied"], **facts["sizes"])
    try:
        return live_manifest(cfg, [g[0] for g in got], vocab_size, name=name)
    except FormatError as e:
        raise MegatronError(problems=e.problems) from None
