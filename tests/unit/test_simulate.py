"""streamer.tools.simulate: the cluster cost model, on hand-computable cases, the layer-kind scaling
against the planner itself, and every shipped workload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from formats.errors import UsageError
from formats.layouts.models import arrays_from_config, arrays_from_model, parallel_from_dict, parse_m2n_system
from streamer.cli.app import main
from streamer.execute.delta import ENCODE_GBPS
from streamer.tools.simulate import (
    CLUSTERS,
    Cluster,
    broadcast_cost,
    delta_cost,
    group_layers,
    reshard_cost,
    simulate,
    with_overrides,
)

ROOT = Path(__file__).resolve().parents[2]
WORKLOADS = ROOT / "workloads"  # the shipped model shapes (small)
MODELS = WORKLOADS / "models"
M2N = WORKLOADS / "nccl-m2n"
needs_workloads = pytest.mark.skipif(not MODELS.is_dir(), reason="workloads/ missing")

#: round numbers: NIC 1 GB/s, NVLink 4 GB/s, 1 ms per message, one big bucket
NIC, NVL, LAT = 1e9, 4e9, 1e-3
CHUNK = 1 << 20


def cluster(domain_size: int, **kw: Any) -> Cluster:
    return Cluster("test", domain_size, NVL, NIC, latency_s=LAT, bucket_bytes=kw.pop("bucket_bytes", 1 << 30), **kw)


def par(**sizes: int) -> dict[str, Any]:
    return parallel_from_dict({k if k == "num_gpus" else f"{k}_size": v for k, v in sizes.items()})


W = {"lm_head.weight": ((1000, 1000), "bfloat16")}  # 2e6 bytes; the generic rules shard it S(0) on tp
NB = 2_000_000


# ---------------------------------------------------------------- hand-computed cases


def test_one_tensor_two_domains() -> None:
    """1 trainer GPU -> 2 generator replicas in two domains (domain size 1): the trainer sends the
    tensor twice over its NIC, one message each; each generator receives it once. No phase 2."""
    r = simulate(W, par(num_gpus=1), par(num_gpus=2, dp=2), cluster(1))
    assert r["phase1_s"] == pytest.approx(2 * (NB / NIC + LAT))  # 6 ms: the trainer's sends serialise
    assert r["phase2_s"] == 0.0
    assert r["reshard_s"] == pytest.approx(0.006)
    assert (r["network_bytes"], r["local_bytes"], r["moved_bytes"]) == (2 * NB, 0, 2 * NB)
    assert r["busiest"] == {"rank": 0, "job": "trainer", "job_rank": 0, "phase": 1, "direction": "send",
                            "link": "network", "seconds": pytest.approx(0.006), "bytes": 2 * NB}
    # baseline: the root holds everything (no gather); ring root -> g0 -> g1 at NIC speed, one bucket:
    # M/bw + (L-1)(c/bw + lat) + 1 · lat
    tb = NB / NIC + (CHUNK / NIC + LAT) + LAT
    assert r["broadcast"]["gather_s"] == 0.0
    assert r["broadcast_s"] == pytest.approx(tb)
    assert r["speedup"] == pytest.approx(tb / 0.006)


def test_one_tensor_one_domain_two_phases() -> None:
    """Same tensor, both generator replicas in one domain: it crosses the network once, split in
    halves over the two ranks (phase 1), then each forwards its half over NVLink (phase 2)."""
    r = simulate(W, par(num_gpus=1), par(num_gpus=2, dp=2), cluster(2))
    p1 = 2 * (NB / 2 / NIC + LAT)  # the trainer sends two halves: 4 ms
    p2 = NB / 2 / NVL + LAT  # each generator sends (and receives) one half: 1.25 ms
    assert (r["phase1_s"], r["phase2_s"]) == (pytest.approx(p1), pytest.approx(p2))
    assert r["reshard_s"] == pytest.approx(p1 + p2)  # p2 is below one bucket: the whole of it trails
    assert (r["network_bytes"], r["local_bytes"]) == (NB, NB)
    assert r["min_network_bytes"] == NB and r["bytes_per_generator_gpu"] == NB


def test_two_sources_gather_over_network() -> None:
    """Trainer TP2 (rows split), generator 2 replicas in 2 domains: each trainer sends its half to
    both generators; the baseline root gathers the other half over the network first."""
    r = simulate(W, par(num_gpus=2, tp=2), par(num_gpus=2, dp=2), cluster(1))
    assert r["phase1_s"] == pytest.approx(2 * (NB / 2 / NIC + LAT))  # 4 ms, senders and receivers alike
    tg = NB / 2 / NIC + 1 * LAT  # one chunk pulled over the root's NIC
    tb = NB / NIC + (CHUNK / NIC + LAT) + LAT
    b = r["broadcast"]
    assert (b["gather_network_bytes"], b["gather_local_bytes"], b["gather_chunks"]) == (NB // 2, 0, 1)
    assert b["gather_s"] == pytest.approx(tg)
    assert r["broadcast_s"] == pytest.approx(max(tg, tb) + min(tg, tb) / 1)  # one bucket: no overlap
    # in one domain the root pulls over NVLink instead
    r2 = simulate(W, par(num_gpus=2, tp=2), par(num_gpus=2, dp=2), cluster(2))
    assert r2["broadcast"]["gather_s"] == pytest.approx(NB / 2 / NVL + LAT)


def test_messages_are_buckets() -> None:
    """A pair exchanging b bytes sends ceil(b / bucket) messages, each paying the latency."""
    r = simulate(W, par(num_gpus=1), par(num_gpus=2, dp=2), cluster(1, bucket_bytes=500_000))
    assert r["messages"] == 8
    assert r["phase1_s"] == pytest.approx(2 * (NB / NIC + 4 * LAT))


def test_pipelining_formula() -> None:
    """total = max(p1, p2) + one bucket of the other phase (or all of it when it is smaller)."""
    c = cluster(2, bucket_bytes=500_000_000)
    # phase 2 dominates: 1 GB over the network, 8 GB over NVLink (2 s), one 0.5 GB network bucket trails
    r = reshard_cost({(1, 0, 1): 10**9, (2, 1, 2): 8 * 10**9}, S=1, cluster=c)
    p1, p2 = 1.0 + 2 * LAT, 2.0 + 16 * LAT
    assert (r["phase1_s"], r["phase2_s"]) == (pytest.approx(p1), pytest.approx(p2))
    assert r["seconds"] == pytest.approx(p2 + 0.5 + LAT)
    assert r["busiest"]["link"] == "nvlink" and r["busiest"]["job"] == "generator"
    # phase 1 dominates: the trailing phase 2 is one NVLink bucket at most
    r = reshard_cost({(1, 0, 1): 4 * 10**9, (2, 1, 2): 4 * 10**9}, S=1, cluster=c)
    assert r["seconds"] == pytest.approx(4.0 + 8 * LAT + 0.5e9 / NVL + LAT)
    assert (r["network_bytes"], r["local_bytes"]) == (4 * 10**9, 4 * 10**9)


def test_delta_formula() -> None:
    """1 trainer GPU -> 2 generator replicas in two domains (as above), 10% of the bytes on the
    wire: the wire takes 2 x (0.2 MB / NIC + 1 ms); the trainer codes 4 MB at 1 GB/s (4 ms), the
    slower of the two, plus one bucket (here the whole 2 MB tensor) at each end."""
    r = simulate(W, par(num_gpus=1), par(num_gpus=2, dp=2), cluster(1), delta_fraction=0.1, encode_gbps=1)
    d = r["delta"]
    assert d["wire_s"] == pytest.approx(2 * (0.1 * NB / NIC + LAT))
    assert d["coding_s"] == pytest.approx(2 * NB / 1e9)
    assert d["seconds"] == pytest.approx(max(d["wire_s"], d["coding_s"]) + 2 * NB / 1e9)
    assert d["network_bytes"] == 2 * NB // 10
    # all the bytes and free coding: the full-weight reshard
    pairs = {(1, 0, 1): NB, (1, 0, 2): NB}
    assert delta_cost(pairs, S=1, cluster=cluster(1), fraction=1.0, encode_bytes_per_s=1e30)["seconds"] == \
        pytest.approx(r["reshard_s"])
    with pytest.raises(UsageError, match="between 0 and 1"):
        delta_cost(pairs, S=1, cluster=cluster(1), fraction=1.5, encode_bytes_per_s=1e9)
    with pytest.raises(UsageError, match="goes with --delta-fraction"):
        simulate(W, par(num_gpus=1), par(num_gpus=2, dp=2), cluster(1), encode_gbps=1)
    # without a rate: one CPU core, as bench refit --delta measured it
    d0 = simulate(W, par(num_gpus=1), par(num_gpus=2, dp=2), cluster(1), delta_fraction=0.1)["delta"]
    assert d0["coding_s"] == pytest.approx(2 * NB / (ENCODE_GBPS * 1e9))


def test_broadcast_formula_and_rings() -> None:
    c = cluster(8, bucket_bytes=10**9)
    r = broadcast_cost(gather_local_bytes=0, gather_network_bytes=3 * 10**9, gather_chunks=10, total_bytes=4 * 10**9,
                       ring_ranks=16, cluster=c)
    tg, tb = 3.0 + 10 * LAT, 4.0 + 15 * (CHUNK / NIC + LAT) + 4 * LAT
    assert (r["gather_s"], r["broadcast_s"], r["buckets"]) == (pytest.approx(tg), pytest.approx(tb), 4)
    assert r["seconds"] == pytest.approx(tb + tg / 4)
    # several rings over several NICs, capped by the root's NVLink
    r8 = broadcast_cost(gather_local_bytes=0, gather_network_bytes=0, gather_chunks=0, total_bytes=4 * 10**9,
                        ring_ranks=16, cluster=with_overrides(c, broadcast_rings=8))
    assert r8["ring_gb_per_s"] == pytest.approx(NVL / 1e9)


def test_overrides_and_clusters() -> None:
    h = CLUSTERS["dgx-h100"]
    assert (h.domain_size, h.nvlink_bytes_per_s, h.nic_bytes_per_s) == (8, 450e9, 50e9)
    g = CLUSTERS["gb200-nvl72"]
    assert (g.domain_size, g.nvlink_bytes_per_s, g.nic_bytes_per_s) == (72, 900e9, 50e9)
    o = with_overrides(h, nvlink_gbps=100, nic_gbps=25, latency_us=3, bucket_bytes=1 << 20)
    assert (o.nvlink_bytes_per_s, o.nic_bytes_per_s, o.latency_s, o.bucket_bytes) == (100e9, 25e9, 3e-6, 1 << 20)
    with pytest.raises(Exception, match="nic_bytes_per_s must be > 0"):
        with_overrides(h, nic_gbps=0)
    with pytest.raises(Exception, match="unknown cluster"):
        simulate(W, par(num_gpus=1), par(num_gpus=1), "dgx-a100")


# ---------------------------------------------------------------- layer-kind scaling

TINY_MOE: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_experts": 8, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 1000, "mlp_only_layers": [0],
}
TINY_DSV3: dict[str, Any] = {
    "model_type": "deepseek_v3", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "n_routed_experts": 8, "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 5,
    "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 8, "vocab_size": 1000,
}
LAYOUTS = [
    ({"num_gpus": 8, "pp": 2, "ep": 4}, {"num_gpus": 8, "tp": 2, "dp": 4}),
    ({"num_gpus": 8, "pp": 2, "tp": 2, "dp": 2}, {"num_gpus": 12, "tp": 3, "dp": 4}),
    ({"num_gpus": 16, "pp": 4, "tp": 2, "ep": 4}, {"num_gpus": 8, "tp": 4, "dp": 2}),
]
#: a cluster where bandwidth, not latency, dominates these tiny models (and pairs need several messages)
BW_BOUND = Cluster("bw", 4, 100e9, 10e9, latency_s=1e-6, bucket_bytes=1 << 16)
EXACT = ("network_bytes", "local_bytes", "total_bytes", "moved_bytes", "min_network_bytes", "transfers")


def test_group_layers() -> None:
    misc, kinds = group_layers(arrays_from_config(TINY_DSV3))
    assert sorted(misc) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    assert sorted(kinds.values()) == [[0], [1, 2, 3, 4]]  # one dense layer, then MoE layers


@pytest.mark.parametrize("cfg", [TINY_MOE, TINY_DSV3], ids=["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(("train", "gen"), LAYOUTS, ids=["pp2ep4-tp2dp4", "pp2tp2dp2-tp3dp4", "pp4tp2ep4-tp4dp2"])
def test_scaled_equals_planning_every_layer(cfg: dict[str, Any], fp8: bool, train: dict[str, int],
                                            gen: dict[str, int]) -> None:
    """One plan per layer kind, multiplied and shifted by pipeline stage, gives exactly the figures
    of planning every layer on its own; its bytes are exactly those of one whole-model plan, and
    its seconds within a few percent (the whole plan also balances across layers)."""
    a = arrays_from_config(cfg, fp8=fp8)
    t, g = par(**train), par(**gen)
    c = BW_BOUND
    scaled = simulate(a, t, g, c)
    each = simulate(a, t, g, c, planning="per-layer")
    whole = simulate(a, t, g, c, planning="whole")
    assert scaled["plans"] < each["plans"]
    for k in ("reshard_s", "phase1_s", "phase2_s", "broadcast_s"):
        assert scaled[k] == pytest.approx(each[k], rel=1e-12), k
    for k in ("max_send_bytes", "max_recv_bytes", "messages", *EXACT):
        assert scaled[k] == each[k], k
    for k in EXACT:
        assert scaled[k] == whole[k], k
    assert scaled["broadcast_s"] == pytest.approx(whole["broadcast_s"], rel=1e-12)
    assert scaled["reshard_s"] == pytest.approx(whole["reshard_s"], rel=0.1)


def test_direct_has_no_phase_two() -> None:
    a = arrays_from_config(TINY_MOE)
    r = simulate(a, par(num_gpus=8, pp=2, ep=4), par(num_gpus=8, tp=2, dp=4), BW_BOUND, direct=True)
    assert r["direct_network_bytes"] == r["total_bytes"] > r["network_bytes"]
    assert r["direct_s"] > r["reshard_s"]


# ---------------------------------------------------------------- shipped workloads


def _run(model: str, system: str) -> tuple[str, str, float, float]:
    train, gen = parse_m2n_system(M2N / system)
    r = simulate(arrays_from_model(WORKLOADS / model), train, gen, "gb200-nvl72" if "gb200" in system else "dgx-h100")
    return model, system, r["reshard_s"], r["broadcast_s"]


def _workloads() -> list[tuple[str, str]]:
    """Every model description with every system config, except that the MoE models run only on
    the smaller system configs (their own when small enough): a DSv3 MoE layer on 64 or 128 GB200
    generators plans ~0.5-0.9 million transfers, several seconds each, so the full cross product
    takes minutes. Those big cases run in ``scripts/make_benchmarks.py``."""
    if not MODELS.is_dir():
        return []
    models = [f"models/{p.name}" for p in sorted(MODELS.glob("*.config.json"))]
    models += [f"nccl-m2n/{p.name}" for p in sorted(M2N.glob("*.model.json"))]
    systems = sorted(p.name for p in M2N.glob("*.json") if not p.name.endswith(".model.json"))
    small = ("dsv3-pp-64gpus-gb200.json", "qwen3-32b-tp4pp4dp2-to-tp4dp8-64gpus-h100.json")
    out = []
    for m in models:
        for s in systems:
            moe = any(k in m for k in ("deepseek-v3", "dsv3-toy", "kimi-k2", "qwen3-235b", "qwen3-30b"))
            if not moe or s in small or s.startswith("qwen3-32b-dp1") or ("235b" in m and s.startswith("qwen235b")):
                out.append((m, s))
    return out


@pytest.mark.slow  # the scale tier
@needs_workloads
def test_every_shipped_workload_simulates() -> None:
    work = _workloads()
    assert len({m for m, _ in work}) == 7 and len({s for _, s in work}) == 9  # every file is exercised
    for model, system in work:
        _, _, reshard, bcast = _run(model, system)
        assert 0 < reshard < 100 and 0 < bcast < 100, (model, system)


@needs_workloads
def test_cli_simulate_json(capsys: Any) -> None:
    rc = main(["simulate", "--model", str(M2N / "qwen3-32b.model.json"), "--system",
               str(M2N / "qwen3-32b-tp4pp4dp2-to-tp4dp8-64gpus-h100.json"), "--cluster", "dgx-h100", "--json",
               "--direct", "--nic-gbps", "25"])
    out, err = capsys.readouterr()
    assert rc == 0
    r = json.loads(out)
    for k in ("reshard_s", "broadcast_s", "speedup", "network_bytes", "local_bytes", "direct_s"):
        assert k in r
    assert r["constants"]["nic_gb_per_s"] == 25
    # Qwen3-32B (65.5 GB) TP4 x DP8 on 4 domains of 8: every domain needs the model once
    assert r["network_bytes"] == r["min_network_bytes"] == 4 * r["model_bytes"]
    assert "speedup" in err and "reshard" in err
    rc = main(["simulate", "--model", str(MODELS / "qwen3-32b.config.json"), "--train", "num_gpus=8,tp=8",
               "--generation", "num_gpus=16,tp=4,dp=4", "--cluster", "gb200-nvl72"])
    out, _ = capsys.readouterr()
    assert rc == 0 and "reshard" in out and "speedup" in out


@pytest.mark.parametrize(("argv", "code", "msg"), [
    (["--train", "num_gpus=2,tp=2"], 2, "needs --system"),
    (["--train", "tp=two", "--generation", "num_gpus=1"], 2, "expected KEY=N"),
    (["--train", "num_gpus=3,tp=2", "--generation", "num_gpus=1"], 1, r"tp(2) = 2 != num_gpus(3)"),
    (["--train", "num_gpus=1", "--generation", "num_gpus=1", "--nic-gbps", "-1"], 2, "must be > 0"),
])
def test_cli_simulate_errors(tmp_path: Path, capsys: Any, argv: list[str], code: int, msg: str) -> None:
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_MOE))
    rc = main(["simulate", "--model", str(cfg), "--cluster", "dgx-h100", *argv])
    err = capsys.readouterr().err
    assert rc == code and msg in err and "Traceback" not in err


def test_simulate_is_pure() -> None:
    """Planning code imports without mpi4py or torch.distributed (design §2)."""
    code = ("import sys\n"
            "for m in ('mpi4py', 'mpi4py.MPI', 'torch', 'torch.distributed'): sys.modules[m] = None\n"
            "import formats.layouts.models, streamer.tools.simulate\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\n"
            "print('PURE')\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    assert p.returncode == 0 and "PURE" in p.stdout, p.stderr
