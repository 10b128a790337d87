"""``bench refit --delta``: full against delta refit in one run, on weights that change like RL.

Every sender rank builds the same small transformers Llama (from a config, seeded) with fp32
master weights and takes the same real AdamW steps (``lr`` default 1e-6, random tokens as a
language-model batch), so data-parallel replicas stay identical. After each step the senders
push their shards (fp32, TP-sharded) to receivers holding bf16 shards on another mesh: the cast
happens on the way, and the delta is taken on the bf16 bytes that are served. Each step pushes
three times (the order rotating), timed from a barrier to the slowest rank, over three sessions:
``full``; ``delta`` as a user gets it (``auto``: here every rank is on one host, shared memory,
where encoding loses to a copy, so it sends full bytes); ``encoded``, a delta session told its
link is slow (every message encoded). Each learning rate (``lrs``) restarts from the same model.
Reported per learning rate: bytes on the wire against full, the fraction of bf16 elements
changed, seconds, encode/decode GB/s per core (each rank is one process on one core: full bytes
of its delta messages over its encode or decode CPU seconds), and the break-even link speed
(``delta.break_even_gbps`` of the encoded wire fraction and those speeds): below it a delta
push beats a full one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

__all__ = ["ENCODED_LINK_GBPS", "KINDS", "LLAMA_CONFIG", "bench_refit_delta", "delta_table", "delta_worker"]

#: the link the ``encoded`` session states (GB/s): slow enough that every message is encoded
ENCODED_LINK_GBPS = 1e-3
KINDS = ("full", "delta", "encoded")

#: a small Llama: about 14M parameters (56 MB fp32 masters, 28 MB served in bf16)
LLAMA_CONFIG: dict[str, Any] = {"vocab_size": 8192, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
                "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256,
                "tie_word_embeddings": False}


def bench_refit_delta(work: str, *, senders: int = 2, receivers: int = 2, train_mesh: str | None = None,
                      serve_mesh: str | None = None, steps: int = 3, lrs: tuple[float, ...] = (1e-6, 1e-5),
                      bucket_size: int = 64 << 20) -> dict[str, Any]:
    """Run ``delta_worker`` under ``mpiexec -n senders+receivers`` and return its figures."""
    w = Path(work)
    w.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    mpiexec = shutil.which("mpiexec") or str(Path(py).parent / "mpiexec")
    env = dict(os.environ, HYDRA_LAUNCHER=os.environ.get("HYDRA_LAUNCHER", "fork"), OMP_NUM_THREADS="1")
    out = w / "refit_delta.json"
    cmd = [mpiexec, "-n", str(senders + receivers), py, "-c",
           "import gc, sys; from streamer.tools.bench_delta import delta_worker; rc = delta_worker(sys.argv[1:]); gc.freeze(); sys.exit(rc)",
           "--senders", str(senders), "--train-mesh", train_mesh or f"tp={senders}",
           "--serve-mesh", serve_mesh or f"tp={receivers}", "--steps", str(steps), "--lr", *map(repr, lrs),
           "--bucket-size", str(bucket_size), "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, timeout=3600)
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def delta_table(r: dict[str, Any]) -> str:
    """The human summary of ``bench_refit_delta``."""
    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.2%}"

    def gbps(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    lines = [f"bench refit --delta ({r['senders']}+{r['receivers']} ranks, fp32 {r['train_mesh']} -> bf16 "
             f"{r['serve_mesh']}, Llama {r['parameters'] / 1e6:.1f}M parameters; full push "
             f"{r['full_bytes'] / 1e6:.1f} MB; delta = auto (one host: shared memory), encoded = every message "
             "encoded):"]
    for run in r["runs"]:
        lines += [f"  AdamW lr {run['lr']:g}:",
                  "    step  changed  wire/full  full s  delta s  encoded s  encode GB/s/core  decode GB/s/core"]
        for row in run["rows"]:
            lines.append(f"    {row['step']:4d}  {pct(row['changed_fraction']):>7s}  "
                         f"{row['encoded_wire_bytes'] / row['encoded_full_bytes']:9.2%}  {row['full_s']:6.3f}  "
                         f"{row['delta_s']:7.3f}  {row['encoded_s']:9.3f}  {gbps(row['encode_gbps_per_core']):>16s}  "
                         f"{gbps(row['decode_gbps_per_core']):>16s}")
        lines.append(f"    median after the first push: delta {run['delta_vs_full']:.2f}x the full push's time "
                     f"(encoded {run['encoded_vs_full']:.2f}x), {pct(run['delta_bytes_ratio'])} of the full bytes "
                     f"encoded, {pct(run['changed_fraction'])} of the elements changed; delta wins below "
                     f"{gbps(run['break_even_gbps'])} GB/s")
    lines.append(f"  encoding senders keep {r['base_bytes'] / 1e6:.1f} MB of last-sent bytes (step 0 is each "
                 "session's full first push)")
    return "\n".join(lines)


def _manifests(arrays: dict[str, tuple[tuple[int, ...], str]], train_mesh: str, serve_mesh: str) -> Any:
    from formats.layouts import apply_layout, manifest_from_arrays, parse_mesh, parse_rule
    from streamer.tools.synth import QWEN3_TP_RULES

    def lay(data_type: str, mesh_text: str) -> Any:
        mesh = parse_mesh(mesh_text)
        rules = [parse_rule(r.split("=", 1)[0] + "=" + ",".join(r.split("=", 1)[1] if ax == "tp" else "R"
                                                                   for ax in mesh.axes), mesh)
                 for r in QWEN3_TP_RULES]
        src = manifest_from_arrays({n: (s, data_type) for n, (s, _) in arrays.items()})
        return apply_layout(src, mesh, rules, file_pattern=None)

    return lay("float32", train_mesh), lay("bfloat16", serve_mesh)


def _delta_args(argv: list[str]) -> Any:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--senders", type=int, required=True)
    ap.add_argument("--train-mesh", required=True)
    ap.add_argument("--serve-mesh", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-6])
    ap.add_argument("--bucket-size", type=int, default=64 << 20)
    ap.add_argument("--out", required=True)
    return ap.parse_args(argv)


def delta_worker(argv: list[str]) -> int:
    """Runs inside ``mpiexec -n S+R``: ranks < S train and send, the rest receive."""
    import torch
    from mpi4py import MPI

    from streamer.transport.jobs import Group

    a = _delta_args(argv)
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    S, rank = a.senders, world.Get_rank()
    role = "send" if rank < S else "recv"
    role_comm = world.Split(0 if role == "send" else 1, rank)
    group = Group.from_mpi(world, role_comm, role, S, world.Get_size() - S)
    runs = [_lr_run(a, lr, world, group, role, role_comm.Get_rank()) for lr in a.lr]
    if rank == 0:
        summary = {"senders": S, "receivers": world.Get_size() - S, "train_mesh": a.train_mesh,
                   "serve_mesh": a.serve_mesh, "model": LLAMA_CONFIG, "parameters": runs[0].pop("parameters"),
                   "steps": a.steps, "full_bytes": runs[0]["full_bytes"], "base_bytes": runs[0]["base_bytes"],
                   "runs": runs}
        for run in runs[1:]:
            run.pop("parameters")
        Path(a.out).write_text(json.dumps(summary))
    return 0


def _lr_run(a: Any, lr: float, world: Any, group: Any, role: str, rr: int) -> dict[str, Any]:
    """One learning rate: the model from its seed, ``a.steps`` AdamW steps, three pushes each."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from streamer.refit.options import RefitOptions
    from streamer.refit.persist import alloc_local
    from streamer.refit.session import RefitSession

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
    params = dict(model.named_parameters())
    src, dst = _manifests({n: (tuple(p.shape), "float32") for n, p in params.items()}, a.train_mesh, a.serve_mesh)
    m = src if role == "send" else dst
    local = alloc_local(m, rr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr) if role == "send" else None

    def refresh() -> None:  # the trainer's shards of its fp32 masters, as its framework holds them
        for fqn, _, c in m.iter_chunks():
            if rr in c.holders:
                sl = tuple(slice(o, o + s) for o, s in zip(c.region.offsets, c.region.sizes))
                dl = tuple(slice(o, o + s) for o, s in zip(c.local_box.offsets, c.local_box.sizes))
                local[c.tensor(fqn)][dl] = params[fqn].detach().numpy()[sl]

    def train_step(step: int) -> None:
        assert opt is not None
        g = torch.Generator().manual_seed(1000 + step)
        ids = torch.randint(0, LLAMA_CONFIG["vocab_size"], (4, 128), generator=g)
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    links = {"full": None, "delta": None, "encoded": ENCODED_LINK_GBPS}
    sessions = {kind: RefitSession.open(m, role, group=group, timeout=600, options=RefitOptions(
        bucket_size=a.bucket_size, delta=kind != "full", link_gbps=links[kind])) for kind in KINDS}
    rows: list[dict[str, Any]] = []
    for step in range(a.steps + 1):
        if role == "send":
            if step:
                train_step(step)
            refresh()
        rows.append(_push_row(world, sessions, local, role, step))
    for s in sessions.values():
        s.close()
    return {"lr": lr, "parameters": sum(p.numel() for p in params.values()), **_summary(rows)}


def _push_row(world: Any, sessions: dict[str, Any], local: dict[str, Any], role: str, step: int) -> dict[str, Any]:
    """One step: a full and a delta push of the same weights (order alternating), and their figures
    summed over every rank."""
    from mpi4py import MPI

    row: dict[str, Any] = {"step": step}
    order = KINDS[step % 3:] + KINDS[:step % 3]
    for kind in order:
        world.Barrier()
        t0 = time.perf_counter()
        s = sessions[kind]
        st = s.push(local) if role == "send" else s.pull(local)
        row[f"{kind}_s"] = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        mine = {"wire": st.bytes_sent + st.bytes_received, "full": st.full_bytes_sent + st.full_bytes_received,
                "changed": (st.changed_fraction or 0.0) * st.full_bytes_sent, "enc_s": st.encode_seconds,
                "dec_s": st.decode_seconds, "enc_b": st.full_bytes_sent if st.encode_seconds else 0,
                "dec_b": st.full_bytes_received if st.decode_seconds else 0, "base": st.base_bytes,
                "sent_full": st.full_bytes_sent if role == "send" else 0}
        tot = {k: world.allreduce(v, op=MPI.SUM) for k, v in mine.items()}
        row[f"{kind}_wire_bytes"] = tot["wire"] // 2  # each byte counted by its sender and its receiver
        row[f"{kind}_full_bytes"] = tot["full"] // 2
        if kind == "encoded":
            row["changed_fraction"] = tot["changed"] / tot["sent_full"] if step and tot["sent_full"] else None
            row["encode_gbps_per_core"] = tot["enc_b"] / tot["enc_s"] / 1e9 if tot["enc_s"] else None
            row["decode_gbps_per_core"] = tot["dec_b"] / tot["dec_s"] / 1e9 if tot["dec_s"] else None
            row["base_bytes"] = tot["base"]
            row["encoded_ratio"] = row["encoded_wire_bytes"] / row["encoded_full_bytes"] if step else None
    return row


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the steps after the first (full) one, and the break-even link speed."""
    from streamer.execute.delta import break_even_gbps

    later = rows[1:]

    def med(key: str) -> float | None:
        vals = [r[key] for r in later if r.get(key) is not None]
        return median(vals) if vals else None

    out = {"full_bytes": rows[0]["full_full_bytes"], "delta_bytes_ratio": med("encoded_ratio"),
           "changed_fraction": med("changed_fraction"), "full_s": med("full_s"), "delta_s": med("delta_s"),
           "encoded_s": med("encoded_s"), "encode_gbps_per_core": med("encode_gbps_per_core"),
           "decode_gbps_per_core": med("decode_gbps_per_core"), "base_bytes": rows[-1]["base_bytes"], "rows": rows}
    # the time ratios are medians of each step's ratio (pushes of one step ran back to back)
    out["delta_vs_full"] = median(r["delta_s"] / r["full_s"] for r in later)
    out["encoded_vs_full"] = median(r["encoded_s"] / r["full_s"] for r in later)
    enc, dec, ratio = out["encode_gbps_per_core"], out["decode_gbps_per_core"], out["delta_bytes_ratio"]
    out["break_even_gbps"] = break_even_gbps(ratio, enc, dec) if enc and dec and ratio is not None else None
    return out
