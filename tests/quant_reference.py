"""Plain torch references of the FP8 quantization schemes, written from their definitions
(DeepGEMM ``per_block_cast_to_fp8``; OCP MX). Shared by the CPU tests and the GPU test, which
runs them on CUDA."""

from __future__ import annotations

from typing import Any


def ref_block_fp8(w: Any, block: tuple[int, int] = (128, 128), ue8m0: bool = False) -> tuple[Any, Any]:
    """DeepGEMM's ``per_block_cast_to_fp8`` for a 2-D ``w``: (fp8 data, float32 scale_inv)."""
    import torch

    m, n = w.shape
    bm, bn = block
    pm, pn = -(-m // bm) * bm, -(-n // bn) * bn
    xp = torch.zeros((pm, pn), dtype=w.dtype, device=w.device)
    xp[:m, :n] = w
    xv = xp.view(pm // bm, bm, pn // bn, bn)
    amax = xv.abs().float().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4)
    if ue8m0:
        sf = amax / 448.0
        mant, ex = torch.frexp(sf)  # smallest power of two >= sf, exactly
        sf = torch.ldexp(torch.ones_like(sf), torch.where(mant == 0.5, ex - 1, ex))
        q = (xv.float() * (1.0 / sf)).to(torch.float8_e4m3fn)
    else:
        sf = amax / 448.0
        q = (xv.float() * (448.0 / amax)).to(torch.float8_e4m3fn)
    return q.view(pm, pn)[:m, :n].contiguous(), sf.view(pm // bm, pn // bn)


def ref_mxfp8(w: Any) -> tuple[Any, Any]:
    """OCP MXFP8 along the last dim (32 elements): (fp8 data, e8m0 scale bits as uint8)."""
    import torch

    *lead, n = w.shape
    pn = -(-n // 32) * 32
    xp = torch.zeros((*lead, pn), dtype=torch.float32, device=w.device)
    xp[..., :n] = w.float()
    xv = xp.view(*lead, pn // 32, 32)
    amax = xv.abs().amax(dim=-1, keepdim=True)
    bad = ~torch.isfinite(amax)
    _, ex = torch.frexp(torch.where(bad, torch.zeros_like(amax), amax))
    e = torch.where(amax == 0, torch.full_like(ex, -127), (ex - 1 - 8).clamp(-127, 127))
    e = torch.where(bad, torch.zeros_like(e), e)
    scale = torch.ldexp(torch.ones_like(amax), e)
    q = (xv / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    q = torch.where(bad, torch.full_like(q, 0x7F), q)
    bits = torch.where(bad, torch.full_like(e, 0xFF), e + 127).to(torch.uint8)
    return q.view(*lead, pn)[..., :n].contiguous(), bits.view(*lead, pn // 32)
