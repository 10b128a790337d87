"""``bench convert --source megatron``: a Megatron torch_dist save -> HF safetensors, timed.

Set-up (not timed): a synthetic Qwen3 (``synth``) is written as a Megatron torch_dist save with
``convert --format torch_dist`` (stacked layers, interleaved QKV, ``[gate; up]``, padded vocab).
Timed, each in its own process so peak RSS is per process: ``import --model --to hf`` (reads
``.metadata`` and every item's zip header) then ``convert`` to HF safetensors, against the raw
copy floor of the same ``.distcp`` bytes (read, write, fsync). The output is checked against
the synthetic source, byte for byte.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

__all__ = ["bench_convert_megatron", "megatron_table"]


def _config(preset: str) -> dict[str, Any]:
    from streamer.tools.synth import PRESETS

    s = PRESETS[preset]
    return {"model_type": "qwen3", "hidden_size": s.hidden, "intermediate_size": s.intermediate,
            "num_hidden_layers": s.layers, "num_attention_heads": s.heads, "num_key_value_heads": s.kv_heads,
            "head_dim": s.head_dim, "vocab_size": s.vocab, "tie_word_embeddings": False,
            "torch_dtype": s.data_type}


def _inputs(w: Path, preset: str) -> Path:
    """``w/megatron``: the torch_dist save (kept between runs); ``w/config.json``, ``w/dst.json``."""
    import subprocess

    ss = [sys.executable, "-m", "streamer"]

    def run(*args: str) -> None:
        subprocess.run(ss + list(args), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    (w / "config.json").write_text(json.dumps(_config(preset)))
    mg = w / "megatron"
    if not (mg / "latest_checkpointed_iteration.txt").exists():
        shutil.rmtree(mg, ignore_errors=True)
        run("synth", "--preset", preset, "--out", str(w / "hf"))
        run("layout", "--model", str(w / "config.json"), "--preset", "megatron", "-o", str(w / "megatron.json"))
        run("convert", str(w / "hf"), str(w / "megatron.json"), "--out", str(mg), "--format", "torch_dist")
    run("layout", "--model", str(w / "config.json"), "--preset", "hf", "-o", str(w / "dst.json"))
    return mg


def _copy_floor(src: Path, out: Path) -> None:
    """Read every ``.distcp`` file and write the same bytes, fsynced (as bench convert's floor)."""
    import os

    out.mkdir(parents=True, exist_ok=True)
    buf = memoryview(bytearray(64 << 20))
    for f in sorted(src.glob("*.distcp")):
        with open(f, "rb", buffering=0) as r, open(out / f.name, "wb", buffering=0) as wr:
            pos = 0
            while n := r.readinto(buf):
                wr.write(buf[:n])
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(wr.fileno(), pos, n, os.POSIX_FADV_DONTNEED)
                pos += n
            os.fsync(wr.fileno())


def bench_convert_megatron(work: str, *, preset: str = "qwen3-2g", memory_limit: str = "256MiB",
                           repeats: int = 2, keep: bool = False) -> dict[str, Any]:
    """Import ``--to hf`` + convert of a Megatron torch_dist save vs the copy floor (best of ``repeats``)."""
    from formats.errors import ValidationError
    from streamer.tools.bench import _sh

    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    mg = _inputs(w, preset)
    it = mg / "release"
    nbytes = sum(f.stat().st_size for f in it.glob("*.distcp"))
    ss = [sys.executable, "-m", "streamer"]
    imp, conv, floor, rss_i, rss_c, rss_f = [], [], [], [], [], []
    out = w / "megatron-hf"
    for _ in range(repeats):
        shutil.rmtree(w / "floor", ignore_errors=True)
        dt, rss, _ = _sh([sys.executable, "-c", "import sys; from pathlib import Path; "
                          "from streamer.tools.bench_megatron import _copy_floor; _copy_floor(Path(sys.argv[1]), "
                          "Path(sys.argv[2]))", str(it), str(w / "floor")])
        floor.append(dt)
        rss_f.append(rss)
        dt, rss, _ = _sh(ss + ["import", str(mg), "--model", str(w / "config.json"), "--to", "hf", "-o",
                               str(mg / "hf.json")])
        imp.append(dt)
        rss_i.append(rss)
        shutil.rmtree(out, ignore_errors=True)
        dt, rss, _ = _sh(ss + ["convert", str(mg / "hf.json"), str(w / "dst.json"), "--out", str(out),
                               "--memory-limit", memory_limit, "--json"])
        conv.append(dt)
        rss_c.append(rss)
    if (w / "hf").exists():  # the output is the synthetic source, byte for byte
        bad = _differences(out / "model.safetensors", w / "hf" / "model.safetensors")
        if bad:
            raise ValidationError(problems=[f"bench convert --source megatron: {b}" for b in bad])
    total = [a + b for a, b in zip(imp, conv)]
    res = {"source": "megatron", "preset": preset, "bytes": nbytes, "import_s": min(imp), "convert_s": min(conv),
           "total_s": min(total), "floor_s": min(floor), "ratio_to_floor": min(total) / min(floor),
           "import_peak_rss_bytes": max(rss_i), "convert_peak_rss_bytes": max(rss_c),
           "floor_peak_rss_bytes": max(rss_f), "memory_limit": memory_limit,
           "runs": {"import_s": imp, "convert_s": conv, "floor_s": floor}}
    if not keep:
        for d in (out, w / "floor"):
            shutil.rmtree(d, ignore_errors=True)
    return res


def _differences(got: Path, want: Path) -> list[str]:
    from formats.safetensors.io import read_header

    hg, hw = read_header(got), read_header(want)
    if set(hg.tensors) != set(hw.tensors):
        return [f"{got}: tensors differ from {want}"]
    out = []
    with open(got, "rb", buffering=0) as fg, open(want, "rb", buffering=0) as fw:
        for name, tw in hw.tensors.items():
            tg = hg.tensors[name]
            fg.seek(tg.start)
            fw.seek(tw.start)
            if (tg.dtype.name, tg.shape) != (tw.dtype.name, tw.shape) or fg.read(tg.nbytes) != fw.read(tw.nbytes):
                out.append(f"{got}: {name} differs from the synthetic source")
    return out


def megatron_table(r: dict[str, Any]) -> str:
    gb = r["bytes"] / 1e9
    mib = 1 << 20
    return "\n".join([
        f"bench convert --source megatron: {r['preset']} torch_dist ({gb:.2f} GB of .distcp) -> HF safetensors",
        f"  import --to hf   {r['import_s']:8.2f} s   peak RSS {r['import_peak_rss_bytes'] / mib:8.0f} MiB",
        f"  convert          {r['convert_s']:8.2f} s   peak RSS {r['convert_peak_rss_bytes'] / mib:8.0f} MiB "
        f"(--memory-limit {r['memory_limit']})",
        f"  copy floor       {r['floor_s']:8.2f} s   peak RSS {r['floor_peak_rss_bytes'] / mib:8.0f} MiB",
        f"  import+convert / floor {r['ratio_to_floor']:6.2f} x",
    ])
