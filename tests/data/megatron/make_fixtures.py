"""Write tiny real Megatron-core checkpoints for shardstream's Megatron import tests.

Needs megatron-core (0.16.x) and a CPU torch in a *separate* venv (tests never import it):

    python3 -m venv /tmp/mcore && /tmp/mcore/bin/pip install torch==2.13.0 megatron-core==0.16.1 psutil numpy
    cd tests/data/megatron
    /tmp/mcore/bin/torchrun --nproc-per-node 1 make_fixtures.py tp1
    /tmp/mcore/bin/torchrun --nproc-per-node 4 make_fixtures.py tp2pp2
    /tmp/mcore/bin/torchrun --nproc-per-node 1 make_fixtures.py moe-ep1
    /tmp/mcore/bin/torchrun --nproc-per-node 2 make_fixtures.py moe-ep2
    # legacy (--ckpt-format torch) saves: TP1 reference weights + logits, then each layout
    /tmp/mcore/bin/torchrun --nproc-per-node 1 make_fixtures.py legacy-ref
    /tmp/mcore/bin/torchrun --nproc-per-node 1 make_fixtures.py legacy-ref-moe
    /tmp/mcore/bin/torchrun --nproc-per-node 2 make_fixtures.py legacy-tp2
    /tmp/mcore/bin/torchrun --nproc-per-node 4 make_fixtures.py legacy-tp2pp2
    /tmp/mcore/bin/torchrun --nproc-per-node 4 make_fixtures.py legacy-moe-tp2ep2
    /tmp/mcore/bin/python make_fixtures.py legacy-clean
    /tmp/mcore/bin/python make_fixtures.py versions
    # a torch_dist save shardstream wrote from HF (convert --format torch_dist): load + logits
    /tmp/mcore/bin/torchrun --nproc-per-node 2 make_fixtures.py check-load DIR --tp 2
    /tmp/mcore/bin/torchrun --nproc-per-node 2 make_fixtures.py check-load DIR --moe --ep 2

The model is a Llama-style GPT (GQA 4 heads / 2 groups, swiglu, RMSNorm, RoPE, untied output
layer, vocab 200 padded by Megatron to 256, bf16), built with Megatron-core's *local* layer
spec (Transformer Engine does not run on CPU; its torch_dist files use the TE names anyway).

``moe-ep1`` / ``moe-ep2`` do the same for a Qwen3-MoE-style model (``moe/config.json``: 4
SequentialMLP experts, top-2, q/k norms, ``moe/logits.json``), saved at EP1 and, resharded by
Megatron, at EP2. Grouped experts (TEGroupedMLP / GroupedMLP) need Transformer Engine or the
CUDA ``grouped_gemm`` package and cannot be made on CPU.

``tp1`` (one rank) initialises the model from a fixed seed, runs Megatron's own forward on fixed
tokens (``logits.json``: the first 200 logits in float32 of the bf16 output), and saves
``torch_dist/tp1`` the way Megatron-LM's ``save_checkpoint`` lays it out: ``iter_0000001/`` with
the model, Adam optimizer state (``optimizer.state.*``, one step taken) and an ``rng_state``
ShardedObject, plus ``latest_checkpointed_iteration.txt``. ``tp2pp2`` (four ranks) loads that
checkpoint into a TP2×PP2 model with ``dist_checkpointing.load`` (Megatron's own resharding:
same weights, so the same logits) and saves ``torch_dist/tp2pp2``.

Legacy saves (``legacy/``), written as Megatron-LM's ``save_checkpoint`` writes ``--ckpt-format
torch``: per rank, ``torch.save`` with the *default* pickle protocol (2) of ``{"args": Namespace,
"checkpoint_version": 3.0, "iteration": N, "model": model.state_dict_for_save_checkpoint(),
"optimizer": optimizer.state_dict(), "rng_state": [get_rng_state()]}`` into
``iter_000000N/mp_rank_TT[_PPP]/model_optim_rng.pt``, iterations 1 and 2, and the tracker (``2``).
The RNG state holds NumPy's ``np.random.get_state()`` (an ndarray, whose bytes protocol 2 pickles
as ``_codecs.encode(text, "latin1")``), python's and torch's; ``args`` holds torch dtypes and the
``AttnBackend`` enum (megatron-core's wheel has no ``megatron.training``, so the Namespace is built
here with the fields ``parse_args`` sets). ``make_vocab_size_divisible_by`` is 16, not 128: vocab
200 is padded to 224 at TP2 (128 would give 256). ``legacy-ref[-moe]`` makes the weights at TP1
(iteration 1: the seeded init; iteration 2: after one real Adam step on the tokens' loss), saves
them to ``legacy/.scratch`` (torch_dist, removed by ``legacy-clean``) and records Megatron's own
forward of iteration 2 in float32 (a float32 model loaded with the bf16 weights) in
``legacy/logits.npy`` / ``legacy/moe-logits.npy`` (tokens: ``legacy/tokens.json``);
``legacy-tp2``, ``legacy-tp2pp2`` and ``legacy-moe-tp2ep2`` (TP2 × EP2: experts split over both,
directories ``mp_rank_TT_EEE`` as Megatron-LM names them with expert parallelism) load them into
their layout with ``dist_checkpointing.load`` and write the legacy files (``legacy-moe-tp2`` makes
the MoE model at TP2 alone; not committed, to keep the fixtures small: 2.2 MB in all).

CPU patches (only in this script): ``torch.cuda.manual_seed*`` are no-ops (Megatron's CUDA RNG
tracker is not seeded: ``model_parallel_cuda_manual_seed`` is skipped), ``torch.cuda.current_device``
returns ``"cpu"`` (``RotaryEmbedding`` moves its frequencies there), ``torch.cuda.synchronize`` is a no-op (the torch_dist
writer calls it before copying tensors), ``CudaRNGStatesTracker.fork``
is a no-op context (dropout is 0), ``moe_utils.te_general_gemm`` is set to None (0.16.1 names
it unguarded when Transformer Engine is absent), MoE uses the ``allgather`` token dispatcher
(``alltoall`` makes a CUDA stream), and the causal mask is passed explicitly (the default one is made on ``cuda``). The process group
is gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB, PADDED = 200, 256
TOKENS = [[1, 17, 42, 199, 5, 88, 123, 7, 64, 150, 3, 99]]
HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "vocab_size": VOCAB, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
    "torch_dtype": "bfloat16",
}

MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 32,
    "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "hidden_act": "silu", "attention_bias": False, "router_aux_loss_coef": 0.0, "output_router_logits": False,
    "torch_dtype": "bfloat16",
}


def _patch_cpu() -> None:
    import torch

    # Megatron seeds and forks a CUDA RNG state for TP regions; on CPU keep the default generator
    torch.cuda.manual_seed = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.manual_seed_all = lambda *a, **k: None  # type: ignore[assignment]
    # RotaryEmbedding moves inv_freq to torch.cuda.current_device(): make that the CPU
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]  # the async writer's preload
    # dropout regions fork the CUDA RNG tracker; dropout is 0 here, so run them on the CPU generator
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()
    # the MoE router's gemm names te_general_gemm, defined only when Transformer Engine imports
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _setup(tp: int, pp: int, ep: int = 1) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    _patch_cpu()
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep)
    torch.manual_seed(1234)
    from megatron.core.tensor_parallel import random as mrandom

    try:
        mrandom.model_parallel_cuda_manual_seed(1234)
    except Exception as e:  # noqa: BLE001 - the CUDA RNG tracker is not needed on CPU
        print(f"note: model_parallel_cuda_manual_seed skipped on CPU ({type(e).__name__}: {e})", file=sys.stderr)


def _model(pp: int, moe: bool = False, padded: int = PADDED, fp32: bool = False):  # type: ignore[no-untyped-def]
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    c = MOE_CONFIG if moe else HF_CONFIG
    extra = dict(num_moe_experts=c["num_experts"], moe_router_topk=c["num_experts_per_tok"],
                 moe_ffn_hidden_size=c["moe_intermediate_size"], moe_router_load_balancing_type="none",
                 moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
                 qk_layernorm=True,
                 expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size()) if moe else {}
    cfg = TransformerConfig(**extra,
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], num_query_groups=c["num_key_value_heads"],
        kv_channels=c["head_dim"], normalization="RMSNorm", layernorm_epsilon=c["rms_norm_eps"],
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False,
        bf16=not fp32, params_dtype=torch.float32 if fp32 else torch.bfloat16, use_cpu_initialization=True,
        hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32 if fp32 else torch.bfloat16, init_method_std=0.2,
        apply_rope_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False,
    )
    spec = (get_gpt_layer_local_spec(num_experts=c["num_experts"], moe_grouped_gemm=False, qk_layernorm=True,
                                     normalization="RMSNorm") if moe else get_gpt_layer_local_spec(normalization="RMSNorm"))
    return GPTModel(cfg, spec, vocab_size=padded, max_sequence_length=c["max_position_embeddings"],
                    position_embedding_type="rope", rotary_base=int(c["rope_theta"]),
                    share_embeddings_and_output_weights=False,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage())


def _forward(model):  # type: ignore[no-untyped-def]
    import torch

    ids = torch.tensor(TOKENS)
    s = ids.shape[1]
    pos = torch.arange(s).unsqueeze(0)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]  # True = masked
    model.eval()
    with torch.no_grad():
        return model(ids, pos, mask)


def _optimizer_state(model, model_sd):  # type: ignore[no-untyped-def]
    """Adam state after one step, sharded like Megatron's FP32Optimizer: ``optimizer.state.<k>.<param key>``."""
    import torch
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    params = [p for p in model.parameters()]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()  # zero grads: the weights (and the recorded logits) are unchanged
    state = opt.state_dict()
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    return state


def _rng_state():  # type: ignore[no-untyped-def]
    import torch
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    pp_r, tp_r = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
    pp_n, tp_n = (parallel_state.get_pipeline_model_parallel_world_size(),
                  parallel_state.get_tensor_model_parallel_world_size())
    rng = [{"random_rng_state": None, "np_rng_state": None, "torch_rng_state": torch.get_rng_state(),
            "cuda_rng_state": None, "rng_tracker_states": {}}]
    ep_n = parallel_state.get_expert_model_parallel_world_size()
    if ep_n > 1:  # as Megatron-LM: one RNG shard per expert-parallel rank too
        ep_r = parallel_state.get_expert_model_parallel_rank()
        return ShardedObject("rng_state", rng, (pp_n, tp_n, ep_n), (pp_r, tp_r, ep_r), replica_id=0)
    return ShardedObject("rng_state", rng, (pp_n, tp_n), (pp_r, tp_r), replica_id=0)


def _save_dist(model, root: Path) -> None:  # type: ignore[no-untyped-def]
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    it = root / "iter_0000001"
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
        it.mkdir(parents=True)
    dist.barrier()
    model_sd = model.sharded_state_dict()
    sd = {"model": model_sd, "optimizer": _optimizer_state(model, model_sd), "rng_state": [_rng_state()],
          "iteration": 1, "checkpoint_version": 3.0}
    dist_checkpointing.save(sd, str(it))
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text("1")


def _load_dist(model, root: Path) -> None:  # type: ignore[no-untyped-def]
    from megatron.core import dist_checkpointing

    sd = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(root / "iter_0000001"))
    model.load_state_dict(sd["model"])


def cmd_tp1() -> None:
    import torch

    _setup(1, 1)
    model = _model(1)
    logits = _forward(model)
    out = HERE / "torch_dist" / "tp1"
    _save_dist(model, out)
    (HERE / "config.json").write_text(json.dumps(HF_CONFIG, indent=1) + "\n")
    (HERE / "logits.json").write_text(json.dumps({
        "tokens": TOKENS, "dtype": "bfloat16",
        "logits": logits[..., :VOCAB].to(torch.float32).tolist()}) + "\n")
    print(f"wrote {out} and logits.json (shape {list(logits.shape)})")


def _reshard(tp: int, pp: int) -> object:
    _setup(tp, pp)
    model = _model(pp)
    _load_dist(model, HERE / "torch_dist" / "tp1")
    return model


def cmd_tp2pp2() -> None:
    model = _reshard(2, 2)
    _save_dist(model, HERE / "torch_dist" / "tp2pp2")


# ------------------------------------------------------------------ legacy (--ckpt-format torch) saves

#: a non-default make_vocab_size_divisible_by: 200 -> 224 at tp 2 (Megatron's default 128 gives 256)
LEGACY_DIVISOR = 16
LEGACY_TP = 2
LEGACY_PADDED = -(-VOCAB // (LEGACY_DIVISOR * LEGACY_TP)) * LEGACY_DIVISOR * LEGACY_TP  # 224
LEGACY = HERE / "legacy"
SCRATCH = LEGACY / ".scratch"  # TP1 torch_dist saves the layouts load (removed by legacy-clean)


def _train_step(model) -> None:  # type: ignore[no-untyped-def]
    """One real Adam step on the next-token loss of TOKENS: iteration 2 differs from iteration 1."""
    import torch
    import torch.nn.functional as F

    ids = torch.tensor(TOKENS)
    s = ids.shape[1]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    logits = model(ids, torch.arange(s).unsqueeze(0), mask)
    loss = F.cross_entropy(logits[0, :-1, :VOCAB].float(), ids[0, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()


def cmd_legacy_ref(moe: bool) -> None:
    """TP1: the weights of iterations 1 and 2 (one real training step apart), saved as scratch
    torch_dist checkpoints, and Megatron's own forward of iteration 2 in float32 (the bf16 weights
    upcast, a float32 model), ``legacy/[moe-]logits.npy``."""
    import numpy as np

    _setup(1, 1)
    model = _model(1, moe=moe, padded=LEGACY_PADDED)
    tag = "moe" if moe else "dense"
    _save_dist(model, SCRATCH / f"{tag}-1")
    _train_step(model)
    _save_dist(model, SCRATCH / f"{tag}-2")
    ref = _model(1, moe=moe, padded=LEGACY_PADDED, fp32=True)
    ref.load_state_dict(model.state_dict())  # bf16 -> float32 exactly
    logits = _forward(ref)[..., :VOCAB].float().numpy()
    LEGACY.mkdir(exist_ok=True)
    np.save(LEGACY / ("moe-logits.npy" if moe else "logits.npy"), logits)
    (LEGACY / "tokens.json").write_text(json.dumps(TOKENS) + "\n")
    print(f"legacy-ref {tag}: logits {logits.shape} of iteration 2")


def _legacy_args(moe: bool, iteration: int):  # type: ignore[no-untyped-def]
    """The args Namespace of a Megatron-LM run: the fields ``parse_args`` sets for this model and
    layout (megatron-core's wheel does not ship megatron.training), with the value types a real one
    holds: torch dtypes and the ``AttnBackend`` enum next to ints, floats, strings and bools."""
    import argparse as ap

    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import AttnBackend

    c = MOE_CONFIG if moe else HF_CONFIG
    a = ap.Namespace(
        num_layers=c["num_hidden_layers"], hidden_size=c["hidden_size"], ffn_hidden_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"], group_query_attention=True,
        num_query_groups=c["num_key_value_heads"], kv_channels=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"], seq_length=len(TOKENS[0]),
        position_embedding_type="rope", rotary_base=int(c["rope_theta"]), normalization="RMSNorm",
        norm_epsilon=c["rms_norm_eps"], swiglu=True, untie_embeddings_and_output_weights=True,
        add_bias_linear=False, add_qkv_bias=False, qk_layernorm=moe, transformer_impl="local",
        attention_backend=AttnBackend.auto, vocab_size=VOCAB, make_vocab_size_divisible_by=LEGACY_DIVISOR,
        padded_vocab_size=LEGACY_PADDED, tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(), expert_tensor_parallel_size=None,
        data_parallel_size=1, world_size=int(os.environ.get("WORLD_SIZE", "1")), rank=int(os.environ.get("RANK", "0")),
        bf16=True, fp16=False, params_dtype=torch.bfloat16, main_grads_dtype=torch.float32,
        main_params_dtype=torch.float32, exp_avg_dtype=torch.float32, exp_avg_sq_dtype=torch.float32,
        optimizer="adam", lr=1e-2, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8, weight_decay=0.0,
        micro_batch_size=1, global_batch_size=1, train_iters=2, iteration=iteration, consumed_train_samples=iteration,
        seed=1234, ckpt_format="torch", use_dist_ckpt=False, save="legacy", no_save_optim=None, no_save_rng=None,
        use_distributed_optimizer=False, tokenizer_type="NullTokenizer", init_method_std=0.2, hidden_dropout=0.0,
        attention_dropout=0.0, num_experts=c.get("num_experts"), moe_router_topk=c.get("num_experts_per_tok", 2),
        moe_ffn_hidden_size=c.get("moe_intermediate_size"), moe_grouped_gemm=False,
        moe_token_dispatcher_type="allgather")
    return a


def _legacy_optimizer(model):  # type: ignore[no-untyped-def]
    """``optimizer.state_dict()`` of an Adam over the model's parameters after one step (zero
    grads: the weights stay). Megatron-LM's bf16 optimizer would add float32 main params; they are
    left out to keep the fixtures small (they are plain tensors, nothing new to the unpickler)."""
    import torch

    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in params:
        p.grad = None
    return opt.state_dict()


def _rng_list():  # type: ignore[no-untyped-def]
    """Megatron-LM's ``get_rng_state``: python, NumPy and torch RNG states (CUDA only where there is
    one) and the model-parallel tracker's states; one entry per data-parallel rank (here one)."""
    import random

    import numpy as np
    import torch
    from megatron.core import tensor_parallel

    st = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
          "torch_rng_state": torch.get_rng_state(),
          "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        st["cuda_rng_state"] = torch.cuda.get_rng_state()
    return [st]


def cmd_legacy(layout: str) -> None:
    """Load the scratch TP1 weights of iterations 1 and 2 into ``layout`` (Megatron's own resharding)
    and write each rank's ``model_optim_rng.pt`` as Megatron-LM's ``save_checkpoint`` does for
    ``--ckpt-format torch``: ``torch.save`` with the default pickle protocol."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    tp, pp, ep, moe = {"tp2": (2, 1, 1, False), "tp2pp2": (2, 2, 1, False), "moe-tp2": (2, 1, 1, True),
                       "moe-tp2ep2": (2, 1, 2, True)}[layout]
    _setup(tp, pp, ep)
    random.seed(1234)
    np.random.seed(1234)
    model = _model(pp, moe=moe, padded=LEGACY_PADDED)
    root = LEGACY / layout
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.barrier()
    t, p, e = (ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank(),
               ps.get_expert_model_parallel_rank())
    # Megatron-LM's get_checkpoint_name: _PPP with pipeline parallelism, then _EEE with expert parallelism
    rank_dir = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{e:03d}" if ep > 1 else "")
    if ep > 1 and ps.get_expert_data_parallel_rank() != 0:
        rank_dir = ""  # as Megatron-LM: only expert-data-parallel rank 0 writes a legacy file
    for it in (1, 2):
        sd = dist_checkpointing.load({"model": model.sharded_state_dict()},
                                     str(SCRATCH / f"{'moe' if moe else 'dense'}-{it}" / "iter_0000001"))
        model.load_state_dict(sd["model"])
        f = root / f"iter_{it:07d}" / rank_dir / "model_optim_rng.pt"
        if not rank_dir:
            dist.barrier()
            continue
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"args": _legacy_args(moe, it), "checkpoint_version": 3.0, "iteration": it,
                    "model": model.state_dict_for_save_checkpoint(), "optimizer": _legacy_optimizer(model),
                    "rng_state": _rng_list()}, f)
        dist.barrier()
        if dist.get_rank() == 0:
            (root / "latest_checkpointed_iteration.txt").write_text(str(it))
    dist.barrier()


def cmd_legacy_clean() -> None:
    shutil.rmtree(SCRATCH, ignore_errors=True)


def cmd_moe_ep1() -> None:
    import torch

    _setup(1, 1)
    model = _model(1, moe=True)
    logits = _forward(model)
    _save_dist(model, HERE / "moe" / "ep1")
    (HERE / "moe" / "config.json").write_text(json.dumps(MOE_CONFIG, indent=1) + "\n")
    (HERE / "moe" / "logits.json").write_text(json.dumps({
        "tokens": TOKENS, "dtype": "bfloat16",
        "logits": logits[..., :VOCAB].to(torch.float32).tolist()}) + "\n")


def cmd_moe_ep2() -> None:
    from megatron.core import dist_checkpointing

    _setup(1, 1, ep=2)
    model = _model(1, moe=True)
    sd = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(HERE / "moe" / "ep1" / "iter_0000001"))
    model.load_state_dict(sd["model"])
    _save_dist(model, HERE / "moe" / "ep2")


def cmd_check_load(path: str, tp: int, ep: int = 1, moe: bool = False) -> None:
    """Load a torch_dist save (e.g. one shardstream wrote from HF) into a TP=tp model and compare
    its forward with logits.json."""
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    _setup(tp, 1, ep=ep)
    model = _model(1, moe=moe)
    root = Path(path)
    tracker = (root / "latest_checkpointed_iteration.txt").read_text().strip()
    it = root / ("release" if tracker == "release" else f"iter_{int(tracker):07d}")
    sd = dist_checkpointing.load({"model": model.sharded_state_dict()}, str(it))
    model.load_state_dict(sd["model"], strict=False)
    logits = _forward(model)
    if tp > 1:  # vocab-parallel output: gather the columns
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

        logits = gather_from_tensor_model_parallel_region(logits)
    ref = torch.tensor(json.loads((HERE / ("moe" if moe else ".") / "logits.json").read_text())["logits"])
    diff = (logits[..., :VOCAB].float() - ref).abs().max().item()
    if dist.get_rank() == 0:
        print(f"check-load {path} tp={tp} ep={ep} moe={moe}: max |logits - Megatron's recorded logits| = {diff}")


def cmd_versions() -> None:
    import platform

    import megatron.core
    import numpy
    import torch

    (HERE / "VERSIONS").write_text(
        f"megatron-core {megatron.core.__version__}\ntorch {torch.__version__}\nnumpy {numpy.__version__}\n"
        f"python {platform.python_version()}\n"
        "made by tests/data/megatron/make_fixtures.py (see its docstring for the commands)\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["tp1", "tp2pp2", "moe-ep1", "moe-ep2", "versions", "check-load", "legacy-ref",
                                     "legacy-ref-moe", "legacy-tp2", "legacy-tp2pp2", "legacy-moe-tp2", "legacy-moe-tp2ep2",
                                     "legacy-clean"])
    ap.add_argument("path", nargs="?", help="check-load: a torch_dist save root")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--moe", action="store_true", help="check-load: the MoE model (moe/config.json)")
    a = ap.parse_args()
    if a.what == "check-load":
        cmd_check_load(a.path, a.tp, a.ep, a.moe)
        return
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if a.what.startswith("legacy-"):
        what = a.what.removeprefix("legacy-")
        if what.startswith("ref"):
            cmd_legacy_ref(moe=what == "ref-moe")
        elif what == "clean":
            cmd_legacy_clean()
        else:
            cmd_legacy(what)
        return
    {"tp1": cmd_tp1, "tp2pp2": cmd_tp2pp2, "moe-ep1": cmd_moe_ep1, "moe-ep2": cmd_moe_ep2,
     "versions": cmd_versions}[a.what]()


if __name__ == "__main__":
    main()
