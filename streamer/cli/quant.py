"""The quantize flags that plan, convert and refit share, and the lines that report what was quantized."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamer.cli.args import parse_block

if TYPE_CHECKING:
    pass


def fmt_quantized(q: dict[str, Any] | None) -> list[str]:
    """Lines naming the arrays quantized (by convert, or by a refit's senders or receivers), their
    scheme and the bytes saved (stored; and, in a refit, on the wire)."""
    if not q or not q.get("arrays"):
        return []
    arrays = q["arrays"]
    schemes = sorted({a["scheme"] for a in arrays.values()})
    if "wire_bytes_saved" in q:  # a refit plan (quant_refit.refit_quant_report)
        where = f"refit: {q['on_sender']} by the senders, {q['on_receiver']} by the receivers"
        lines = [f"{'quantized on refit':32s} {len(arrays):12d} arrays ({', '.join(schemes)}; {where}), "
                 f"{q['wire_bytes_saved'] / 1e9:.4f} GB fewer on the wire, {q['bytes_saved'] / 1e9:.4f} GB stored"]
        lines += [f"  {f}: {a['from']} -> {a['scheme']} on the {a['where']}, {a['wire_bytes_saved']} B fewer on the wire"
                  for f, a in list(arrays.items())[:8]]
    else:
        where = next(iter(arrays.values()))["where"]
        lines = [f"{'quantized on write':32s} {len(arrays):12d} arrays ({', '.join(schemes)}; {where}), "
                 f"{q['bytes_saved'] / 1e9:.4f} GB saved"]
        lines += [f"  {f}: {a['from']} -> {a['scheme']}, {a['bytes_saved']} B saved" for f, a in list(arrays.items())[:8]]
    if len(arrays) > 8:
        lines.append(f"  … and {len(arrays) - 8} more (--json lists every one)")
    return lines


def add_quant_flags(p: Any, *, refit: bool = False) -> None:
    p.add_argument("--fp8-block", type=parse_block, default=None if refit else (128, 128), metavar="R,C",
                   help="quantize: elements per float32 scale of FP8 weights fed from bf16/fp32 "
                        "(default 128,128, DeepSeek-V3" + ("; or what the other job asks)" if refit else ")"))
    p.add_argument("--ue8m0", action="store_true",
                   help="quantize: round block-FP8 scales up to a power of two (DeepGEMM use_ue8m0)"
                        + ("; on if either job asks" if refit else ""))
