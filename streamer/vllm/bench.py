"""``shardstream bench vllm``: three ways to put new weights into one running vLLM engine, side by side.

One engine (the vLLM venv; TP 1 in-process, or ``--dst-tp N``: N worker processes), one HF
checkpoint, the same weights every time:

- **shardstream**: the ``shardstream`` weight-transfer backend; a sender process pushes the
  checkpoint's tensors (``RefitSession``), the engine pulls its regions in place;
- **full tensors + load_weights**: every HF tensor handed to the worker whole (what vLLM's NCCL
  backend and checkpoint-engine deliver), then ``model.load_weights`` inside vLLM's layerwise
  reload (``initialize_layerwise_reload`` / ``finalize_layerwise_reload``);
- **reload from disk**: vLLM's ``reload_weights`` from the checkpoint directory.

For each: the apply time (median over ``repeats``), per worker the bytes it receives (shardstream:
what its pull received; full tensors: every tensor's bytes; disk: the checkpoint's bytes read) and
its peak extra memory (its resident set above the level before the update: the kernel's peak,
reset through ``collective_rpc`` before each update; a thread sampling every millisecond where
Linux's ``clear_refs`` is not available), and whether the engine then serves exactly
what it served from its first load (greedy tokens and top-5 logprobs). The engine's start and the
sender's connection are not timed.

    python -m streamer.vllm.bench MODEL_DIR [--repeats N] [--tp N]
    shardstream bench vllm --model DIR [--repeats N] [--dst-tp N]
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["bench_cli", "bench_vllm", "vllm_text"]

PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 100, 200, 9]]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


#: in each worker: the peak tracking under way (``_sample_start`` / ``_sample_stop``)
_SAMPLER: dict[str, Any] = {}


def _hwm() -> int | None:
    """The kernel's peak resident set of this process (``VmHWM``), None where it is not read."""
    try:
        with open("/proc/self/status") as f:
            line = next(x for x in f if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def _sample_start(worker: Any = None) -> None:
    """In each worker (collective_rpc): start tracking this process's peak resident set. Linux
    resets its peak (``clear_refs`` 5) and counts every page exactly, with nothing running beside
    the timed update; elsewhere a thread samples the resident set every millisecond, which shares
    the GIL with an in-process engine and slows what it measures."""
    _SAMPLER.clear()
    base = _rss()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        if _hwm() is not None:
            _SAMPLER.update(base=base, kernel=True)
            return
    except OSError:
        pass
    top = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            top[0] = max(top[0], _rss())
            time.sleep(0.001)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    _SAMPLER.update(base=base, top=top, done=done, thread=t)


def _sample_stop(worker: Any = None) -> int:
    """In each worker: the peak resident-set growth (bytes) since ``_sample_start``."""
    if _SAMPLER.get("kernel"):
        return int(max(_hwm() or 0, _rss()) - _SAMPLER["base"])
    _SAMPLER["done"].set()
    _SAMPLER["thread"].join()
    return int(max(_SAMPLER["top"][0], _rss()) - _SAMPLER["base"])


def _noop(worker: Any) -> None:
    """In each worker: nothing (``_rpc_seconds`` times the call's round trip)."""


def _rpc_seconds(llm: Any, n: int = 7) -> float:
    """The median round trip of an empty ``collective_rpc``: what each of the update loop's three
    engine calls costs before any worker does anything."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        llm.collective_rpc(_rpc()._noop)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _last(worker: Any) -> dict[str, Any]:
    """In each worker: what its shardstream engine's last update did."""
    return dict(worker.weight_transfer_engine.last)


def _full_tensors(worker: Any, model_dir: str) -> None:
    """In each worker: every HF tensor whole in this worker's memory (what vLLM's NCCL backend and
    checkpoint-engine deliver), then ``model.load_weights`` inside vLLM's layerwise reload."""
    from safetensors.torch import load_file

    from streamer.vllm import internals

    v = internals.load()
    weights: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(f))
    model = worker.model_runner.get_model()
    v.initialize_layerwise_reload(model)
    model.load_weights(iter(weights.items()))
    v.finalize_layerwise_reload(model, worker.model_runner.model_config)


def _generate(llm: Any, lora: Any = None) -> list[Any]:
    """Greedy tokens and top-5 logprobs of ``PROMPTS`` (under the ``LoRARequest`` ``lora``, if any)."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=6, logprobs=5, detokenize=False, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False, lora_request=lora)
    return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs])
            for o in outs]


def _rpc(module: str = "streamer.vllm.bench") -> Any:
    """This module (or ``module``) under its import name: functions sent to the workers must be
    pickled by reference (run as ``python -m``, ``__main__``'s would travel by value, each with a
    copy of its globals)."""
    import importlib

    return importlib.import_module(module)


def _timed(llm: Any, fn: Callable[[], None], repeats: int, before: Callable[[int], None] | None = None,
           after: Callable[[int], None] | None = None) -> tuple[list[float], list[int]]:
    """``fn``'s wall times, and per worker its peak resident-set growth over the repeats;
    ``before(i)`` and ``after(i)`` run untimed before and after repeat ``i``."""
    times: list[float] = []
    peaks: list[int] = []
    for i in range(repeats):
        if before is not None:
            before(i)
        llm.collective_rpc(_rpc()._sample_start)
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            times.append(time.perf_counter() - t0)
            got = [int(x) for x in llm.collective_rpc(_rpc()._sample_stop)]
        peaks = [max(a, b) for a, b in zip(peaks, got)] if peaks else got
        if after is not None:
            after(i)
    return times, peaks


def _engine(model_dir: str, tp: int, lora: dict[str, Any] | None = None) -> Any:
    """An engine with the shardstream backend: in-process at TP 1, vLLM's worker processes above;
    ``lora``: vLLM's LoRA arguments (``enable_lora``, ``max_loras``, ...)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with this module's functions
    kw: dict[str, Any] = {}
    if tp == 1:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        kw["distributed_executor_backend"] = "uni"
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    from vllm import LLM

    return LLM(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
               tensor_parallel_size=tp, weight_transfer_config={"backend": "shardstream"}, **kw, **(lora or {}))


def _lower_bound(worker: Any) -> int:
    """In each worker: the bytes of the regions it holds (what any refit must bring it)."""
    from formats.manifest.dtypes import DTYPES

    eng = worker.weight_transfer_engine
    m = eng.described.manifests[eng.naming]
    me = eng.described.rank
    return sum(c.region.volume * DTYPES[spec.data_type].itemsize for _, spec, c in m.iter_chunks() if me in c.holders)


def _host_copy_seconds(worker: Any) -> float:
    """In each worker: one host copy of the bytes its staged buffer holds (the fastest of 3)."""
    import torch

    n = int(worker.weight_transfer_engine.last["staging_bytes"]) // 2  # two buffers
    src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return best


def _shardstream_way(llm: Any, sender: list[str], rdv: str, repeats: int, timeout: float,
                     first: list[Any], staging: str = "none", init: dict[str, Any] | None = None) -> dict[str, Any]:
    """The shardstream backend fed by the ``sender`` command (which pushes ``repeats`` times).
    ``staging`` "host": each timed update is the commit of a staged push (the engine's pause),
    started once the trainer's push of it returned. ``init``: more of the backend's ``init_info``."""
    go = Path(rdv).with_name(Path(rdv).name + ".go")
    go.mkdir()
    proc = subprocess.Popen([*sender, str(go)])
    try:
        llm.init_weight_transfer_engine({"init_info": {"rendezvous": rdv, "timeout": timeout, "staging": staging,
                                                       **(init or {})}})
        done = [0]

        def update() -> None:
            llm.start_weight_update()
            llm.update_weights({"update_info": {}})
            llm.finish_weight_update()
            done[0] += 1
            (go / str(done[0])).write_text("")  # the sender's next push may go

        def staged(i: int) -> None:  # an RL loop commits once the trainer's push returned
            deadline = time.monotonic() + timeout
            while not (go / f"pushed-{i}").exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the bench's sender did not push version {i} (exit {proc.poll()})")
                time.sleep(0.005)

        splits: list[list[dict[str, Any]]] = []  # each update's own record, per worker

        def split(i: int) -> None:
            splits.append(llm.collective_rpc(_rpc()._last))

        times, peaks = _timed(llm, update, repeats, staged if staging != "none" else None,
                              split if staging != "none" else None)
        if proc.wait(timeout) != 0:
            raise RuntimeError(f"the bench's sender exited with {proc.returncode}")
    finally:
        if proc.poll() is None:
            proc.kill()
    lasts = llm.collective_rpc(_rpc()._last)
    out = {"seconds": times, "peak_extra_bytes": peaks, "bytes_received": [int(x["bytes_received"]) for x in lasts],
           "lower_bound_bytes": [int(x) for x in llm.collective_rpc(_rpc()._lower_bound)],
           "pull_seconds": [x.get("pull_seconds", x.get("pull_s")) for x in lasts],
           "process_seconds": [x.get("process_seconds", x.get("load_s")) for x in lasts],
           "serves_first_load": _generate(llm) == first}
    if staging != "none":
        out.update(copy_seconds=[x["copy_seconds"] for x in lasts],
                   host_copy_seconds=[float(x) for x in llm.collective_rpc(_rpc()._host_copy_seconds)],
                   # per update, the slowest worker's copying and processing: each pause is set
                   # against its own commit's split, not against the last one's
                   update_copy_seconds=[max(float(w["copy_seconds"]) for w in ws) for ws in splits],
                   update_process_seconds=[max(float(w["process_seconds"]) for w in ws) for ws in splits])
    llm.shutdown_weight_transfer_engine()
    return out


def bench_vllm(model_dir: str, repeats: int = 3, timeout: float = 600, tp: int = 1,
               megatron: tuple[int, int] | None = None) -> dict[str, Any]:
    """Run the ways on one engine (TP ``tp``) loaded from ``model_dir``; see the module docstring.
    ``megatron``: (tp, pp) of a megatron-core trainer that pushes first (``bench_megatron``)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    disk_bytes = sum(f.stat().st_size for f in files)
    t0 = time.perf_counter()
    llm = _engine(model_dir, tp)
    first = _generate(llm)
    out: dict[str, Any] = {"model": model_dir, "repeats": repeats, "tp": tp, "checkpoint_bytes": disk_bytes,
                           "engine_start_seconds": time.perf_counter() - t0}
    with tempfile.TemporaryDirectory() as d:
        if megatron is not None:
            mt, mp = megatron
            sender = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                      str(mt * mp), "-m", "streamer.vllm.bench_megatron", model_dir, str(Path(d) / "mg.rdv"),
                      str(repeats), str(timeout), str(mt), str(mp), str(Path(d) / "mg.json")]
            out["megatron"] = _shardstream_way(llm, sender, str(Path(d) / "mg.rdv"), repeats, timeout, first)
            out["megatron"]["trainer"] = json.loads((Path(d) / "mg.json").read_text())
        _sender_ways(out, llm, model_dir, Path(d), repeats, timeout, first)
    out["rpc_seconds"] = _rpc_seconds(llm)
    out["full_tensors"] = _vllm_way(llm, lambda: llm.collective_rpc(_rpc()._full_tensors, args=(model_dir,)),
                                    repeats, first, [disk_bytes] * tp)

    def from_disk() -> None:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": model_dir, "is_checkpoint_format": True})

    if "error" in out["full_tensors"]:
        # the failed reload left the engine mid-reload (layers on the meta device): nothing more runs on it
        out["reload_from_disk"] = {"error": "not run: the failed full-tensors reload left the engine mid-reload",
                                   "bytes_received": [disk_bytes] * tp, "serves_first_load": None}
    else:
        out["reload_from_disk"] = _vllm_way(llm, from_disk, repeats, first, [disk_bytes] * tp)
    for k in (*WAYS, "megatron"):
        if k in out and "seconds" in out[k]:
            out[k]["median_seconds"] = statistics.median(out[k]["seconds"])
    return out


def _sender_ways(out: dict[str, Any], llm: Any, model_dir: str, d: Path, repeats: int, timeout: float,
                 first: list[Any]) -> None:
    """The ways fed by one sender process: the regions pulled inside ``update_weights``; every array
    pushed whole to every worker and loaded by vLLM's ``load_weights`` (the backend's public path:
    what a full-tensor backend moves, over the same transport); staged, each update only the commit
    of a push that already returned; and staged again behind a sender made slower (a link paced at
    a quarter of the unpaced push's rate): the pause must not follow the transfer."""
    def way(key: str, staging: str = "none", init: dict[str, Any] | None = None, slow_gbps: float = 0.0) -> None:
        rdv, res = str(d / f"{key}.rdv"), d / f"{key}.json"
        sender = [sys.executable, "-m", "streamer.vllm.bench", "--send", model_dir, rdv, str(repeats), str(timeout),
                  str(res), str(slow_gbps)]
        out[key] = _shardstream_way(llm, sender, rdv, repeats, timeout, first, staging, init)
        out[key].update(json.loads(res.read_text()))

    way("shardstream")
    way("pushed_whole", init={"reload": "load_weights"})
    way("staged", "host")
    st = out["staged"]
    gbps = st["bytes_sent"] / statistics.median(st["push_seconds"]) / 1e9 / 4
    way("staged_slow", "host", slow_gbps=gbps)
    out["staged_slow"]["link_gbps"] = gbps


def _vllm_way(llm: Any, fn: Callable[[], None], repeats: int, first: list[Any], received: list[int]) -> dict[str, Any]:
    """One of vLLM's own ways, timed; a way that raises is reported by its error (one line), not
    measured. The engine is then not asked to generate (a failed reload leaves layers on the meta
    device, and generating hangs vLLM's workers): "serves" is None."""
    try:
        times, peaks = _timed(llm, fn, repeats)
    except Exception as e:  # noqa: BLE001 - vLLM's own path failing is a result of the bench
        lines = [ln for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
        return {"error": f"{type(e).__name__}: {lines[0][:300]}", "bytes_received": received,
                "serves_first_load": None}
    return {"seconds": times, "peak_extra_bytes": peaks, "bytes_received": received,
            "serves_first_load": _generate(llm) == first}


WAYS = {"shardstream": "shardstream pull", "pushed_whole": "pushed whole + load_weights",
        "staged": "shardstream staged: commit only", "staged_slow": "staged, sender at 1/4 speed",
        "full_tensors": "full tensors + load_weights", "reload_from_disk": "vLLM reload from disk"}
#: bench vllm --source megatron: the first row
MEGATRON_WAY = "shardstream from Megatron"


def _per_worker(xs: list[int]) -> str:
    """MiB per worker: one figure when every worker has it, else each one, "/"-separated."""
    vals = [f"{x / 2**20:.2f}" for x in xs]
    return vals[0] if len(set(vals)) == 1 else "/".join(vals)


def vllm_text(r: dict[str, Any]) -> str:
    rows = [f"bench vllm ({r['model']}, TP {r['tp']}{' in-process' if r['tp'] == 1 else ''}, median of "
            f"{r['repeats']}; checkpoint {r['checkpoint_bytes'] / 2**20:.2f} MiB; engine start "
            f"{r['engine_start_seconds']:.0f} s):",
            f"  {'way':34} {'apply s':>9} {'received MiB/worker':>20} {'peak extra MiB/worker':>22}  serves a "
            f"fresh load's output"]
    labels = dict(WAYS)
    if "megatron" in r:
        t = r["megatron"]["trainer"]
        labels = {"megatron": f"{MEGATRON_WAY} TP{t['tp']}xPP{t['pp']}", **labels,
                  "shardstream": "shardstream, full HF tensors"}
    for k, label in labels.items():
        x = r[k]
        if "error" in x:
            rows.append(f"  {label:34} FAILED: {x['error']}")
            continue
        rows.append(f"  {label:34} {x['median_seconds']:9.3f} {_per_worker(x['bytes_received']):>20} "
                    f"{_per_worker(x['peak_extra_bytes']):>22}  {'yes' if x['serves_first_load'] else 'NO'}")
    rows += _staged_text(r)
    if "megatron" in r and "median_seconds" in r["shardstream"]:
        m, sh = r["megatron"], r["shardstream"]["median_seconds"]
        lb = sum(m["lower_bound_bytes"])
        rows.append(f"  Megatron -> vLLM: the workers received {sum(m['bytes_received']) / lb:.3f}x the lower bound "
                    f"({_per_worker(m['lower_bound_bytes'])} MiB/worker; full tensors: "
                    f"{r['checkpoint_bytes'] * r['tp'] / lb:.2f}x); apply time {m['median_seconds'] / sh:.2f}x the "
                    f"full-HF-tensor sender's; the trainer's push (slowest rank, median) "
                    f"{statistics.median(m['trainer']['push_seconds']):.3f} s")
    return "\n".join(rows)


def _pause_split(st: dict[str, Any]) -> tuple[float, float]:
    """A staged way's median processing seconds, and the median over its updates of each pause
    against (a host copy of the worker's bytes + that update's processing)."""
    copy, procs = max(st["host_copy_seconds"]), st["update_process_seconds"]
    ratios = [t / (copy + p) for t, p in zip(st["seconds"], procs)]
    return statistics.median(procs), statistics.median(ratios)


def _staged_text(r: dict[str, Any]) -> list[str]:
    """The staged ways' summary: the pause against the push, against a host copy plus vLLM's own
    processing, and against a slower sender; the regions against every array pushed whole."""
    rows = []
    st, slow = r.get("staged", {}), r.get("staged_slow", {})
    if "median_seconds" in st:
        pause, push = st["median_seconds"], statistics.median(st["push_seconds"])
        copy, proc, ratio = max(st["host_copy_seconds"]), *_pause_split(st)
        rows.append(f"  staged: the engine pauses {pause:.3f} s per update (the commit: copying "
                    f"{statistics.median(st['update_copy_seconds']):.3f} s, vLLM's processing {proc:.3f} s, slowest "
                    f"worker) while the trainer's push takes {push:.3f} s; pause / (a host copy of the worker's bytes "
                    f"{copy:.3f} s + that processing) = {ratio:.2f} (median over the updates, each against its own "
                    f"processing); without staging the pause is the whole pull and processing "
                    f"({r['shardstream']['median_seconds']:.3f} s)")
        if "rpc_seconds" in r:
            rows.append(f"  an empty engine call (collective_rpc) takes {r['rpc_seconds'] * 1e3:.1f} ms: the loop's "
                        f"three calls are {3 * r['rpc_seconds'] / pause:.0%} of the pause")
    if "median_seconds" in st and "median_seconds" in slow:
        paced, unpaced = statistics.median(slow["push_seconds"]), statistics.median(st["push_seconds"])
        rows.append(f"  a sender paced at {slow['link_gbps']:.3f} GB/s: its push takes {paced:.3f} s "
                    f"({paced / unpaced:.1f}x), the pause {slow['median_seconds']:.3f} s "
                    f"({slow['median_seconds'] / st['median_seconds']:.2f}x the unpaced one)")
    whole, sh = r.get("pushed_whole", {}), r.get("shardstream", {})
    if "median_seconds" in whole and "median_seconds" in sh:
        rows.append(f"  regions in place against every array pushed whole + load_weights (one sender, the same "
                    f"transport): apply {sh['median_seconds'] / whole['median_seconds']:.2f}x, bytes per worker "
                    f"{sum(sh['bytes_received']) / max(1, sum(whole['bytes_received'])):.2f}x")
    return rows


def bench_cli(model: str | None, repeats: int | None, tp: int | None = None,
              megatron: tuple[int, int] | None = None) -> tuple[dict[str, Any], str]:
    """``shardstream bench vllm --model DIR [--repeats N] [--dst-tp N] [--source megatron --train-mesh
    pp=P,tp=T]``: the figures and their table."""
    from formats.errors import UsageError

    if not model:
        raise UsageError("bench vllm needs --model DIR (an HF checkpoint directory)")
    if megatron is not None:
        from streamer.vllm.bench_megatron import example_dir

        example_dir()  # a clear error before the engine starts
    r = bench_vllm(model, repeats=repeats or 3, tp=tp or 1, megatron=megatron)
    return r, vllm_text(r)


def _send(model_dir: str, rdv: str, pushes: int, timeout: float, out: str | None = None,
          slow_gbps: float = 0.0, go: str | None = None) -> int:
    """The bench's trainer stand-in: push the checkpoint's tensors ``pushes`` times; ``out``: write
    each push's seconds and bytes there (JSON); ``slow_gbps``: pace every message as a link of that
    many GB/s would (0: unpaced); ``go``: before push ``i`` > 0, wait for the file ``go/i`` (the
    engine committed the one before: a staged engine keeps one version ahead at most), and after
    push ``i`` write ``go/pushed-i``."""
    from safetensors.torch import load_file

    from streamer import RefitSession, manifest_from_state_dict

    weights: dict[str, Any] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        weights.update(load_file(f))
    seconds, sent = [], 0
    with RefitSession.open(manifest_from_state_dict(weights), "send", rendezvous=rdv, timeout=timeout) as s:
        if slow_gbps:
            _pace(s, slow_gbps)
        for i in range(pushes):
            while go and i and not Path(go, str(i)).exists():
                time.sleep(0.01)
            st = s.push(weights)
            seconds.append(st.seconds)
            sent = st.bytes_sent
            if go:
                Path(go, f"pushed-{i}").write_text("")
    if out:
        Path(out).write_text(json.dumps({"push_seconds": seconds, "bytes_sent": sent}))
    return 0


def _pace(session: Any, gbps: float) -> None:
    """A slower link, emulated on the sender: each message leaves only once the previous ones would
    have crossed a link of ``gbps`` GB/s."""
    isend, free = session.transport.isend, [time.perf_counter()]

    def paced(buf: Any, dst: int, tag: int) -> Any:
        n = int(getattr(buf, "nbytes", 0))
        free[0] = max(free[0], time.perf_counter()) + n / (gbps * 1e9)
        time.sleep(max(0.0, free[0] - time.perf_counter()))
        return isend(buf, dst, tag)

    session.transport.isend = paced


if __name__ == "__main__":
    if sys.argv[1:2] == ["--send"]:
        sys.exit(_send(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), sys.argv[6],
                       float(sys.argv[7]), sys.argv[8]))
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="an HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tp", type=int, default=1, help="the engine's tensor_parallel_size")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    a = ap.parse_args()
    res = bench_vllm(a.model, a.repeats, tp=a.tp)
    print(json.dumps(res) if a.json else vllm_text(res))
