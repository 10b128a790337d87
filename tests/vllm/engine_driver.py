"""Runs vLLM engines one after another in one process and prints what they generate (JSON).

    python engine_driver.py JOB.json OUT.json

JOB: ``{"tp": 1, "prompts": [[ids]], "max_tokens": N, "logprobs": K, "runs": [RUN, ...]}`` (and
``"expert_parallel": true`` for vLLM's EP: experts whole over the TP ranks). A RUN
is ``{"model": DIR}`` (a fresh engine loaded from DIR) or ``{"model": DIR, "refit": {"rendezvous":
PATH, "timeout": S, "steps": N, "manifests": DIR, "then": {"rendezvous": PATH2, "timeout": S}}}``:
an engine with the ``shardstream`` weight-transfer backend that joins the trainer's session and
generates after each of N updates. ``manifests``: every worker's engine writes the manifests it
described (both expert namings) and what its updates did to ``DIR/rank-R.json``. ``then``: after
the N updates, leave the session and join another one at PATH2 for one more update. Greedy tokens
and the top-K logprobs of every generated position are recorded per prompt.

``"missed_join": INIT_INFO`` in a RUN's ``refit``: after the steps, a session no trainer joins
(``missed_join``). ``"sabotage": "tied"`` in a RUN's ``refit``: every update skips rebuilding tied layers
(``sabotaged_update``; TP 1 only) and records the error the audit raises. ``"refused": true`` in a RUN's ``refit``: the engine's ``init_weight_transfer_engine`` must refuse
the model (its error is recorded as ``refused``; nothing is pushed). ``"init_info": {...}`` adds to
the backend's init_info (``verify``...). A JOB of ``{"jobs": [JOB, ...]}`` runs each job in turn in
this process (the coverage matrix: vLLM is imported once) and writes the list of their results.
``"engine_in_process": true``: the engine core runs in this process at any TP size (the workers
stay processes of their own).

Block FP8: ``"fp8_block": [R, C]`` in the JOB installs the reference kernel of fp8_reference.py in
every vLLM process (a test-only plugin, ``fp8_kernel_plugin``), and every RUN's model is first
written as a block-FP8 checkpoint ``DIR-fp8`` (DeepGEMM's quantizer), which the engine loads. A
refit RUN then also saves every FP8 layer's weight and scale after each update to
``MANIFESTS/step-N/fp8-rank-R.pt``.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def generate(llm: Any, job: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=job["max_tokens"], logprobs=job["logprobs"], detokenize=False,
                        ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in job["prompts"]], sp, use_tqdm=False)
    return [_record(o, job) for o in outs]


def _record(o: Any, job: dict[str, Any]) -> dict[str, Any]:
    c = o.outputs[0]
    got = {"tokens": list(c.token_ids), "logprobs": [{str(t): lp.logprob for t, lp in pos.items()} for pos in c.logprobs]}
    if job.get("block_size"):  # prefix-caching runs: how many prompt tokens came from the cache
        got["cached"] = int(o.num_cached_tokens or 0)
    return got


def update_while_serving(llm: Any, job: dict[str, Any], version: int | None) -> dict[str, Any]:
    """An update opened while the engine serves (no pause): the prompts are added and stepped by
    hand (the engine core runs in this process), ``start_weight_update``, one more step that serves
    them, then ``update_weights``, whose error is recorded; then the requests run to the end."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=job["max_tokens"], logprobs=job["logprobs"], detokenize=False,
                        ignore_eos=True)
    eng, done = llm.llm_engine, {}
    for i, p in enumerate(job["prompts"]):
        eng.add_request(f"running-{i}", {"prompt_token_ids": p}, sp)

    def step() -> None:
        done.update({o.request_id: o for o in eng.step() if o.finished})

    step()
    step()
    llm.start_weight_update()
    step()  # the engine serves while the update is open
    try:
        llm.update_weights({"update_info": {"version": version}})
        error = None
    except Exception as e:  # noqa: BLE001 - recorded for the test to read
        error = f"{type(e).__name__}: {e}"
    late = _drain(llm, job["tp"]) if error else []
    while eng.has_unfinished_requests():
        step()
    return {"error": error, "late_errors": late, "version": llm.get_weight_version(),
            "out": [_record(done[f"running-{i}"], job) for i in range(len(job["prompts"]))]}


def generate_during_push(llm: Any, job: dict[str, Any], c: dict[str, Any], cue: Path | None) -> dict[str, Any]:
    """A long batch (``c["long_tokens"]`` tokens per prompt) stepped by hand while the trainer
    pushes: ``cue`` (the trainer's go-ahead) is written once the batch runs. The engine steps on
    during the push, never paused; should the push take longer than the batch, the batch holds
    its last steps until the trainer's ``c["pushed"]`` file appears (up to 300 s), so that the
    push always returns while requests are in flight. Records the batch and the steps that ran
    while the push did."""
    from vllm import SamplingParams

    tokens = c["long_tokens"]
    sp = SamplingParams(temperature=0, max_tokens=tokens, logprobs=1, detokenize=False, ignore_eos=True)
    eng, done = llm.llm_engine, {}
    for i, p in enumerate(job["prompts"]):
        eng.add_request(f"long-{i}", {"prompt_token_ids": p}, sp)

    def step() -> None:
        done.update({o.request_id: o for o in eng.step() if o.finished})

    step()  # prefilled, decoding: the trainer may push now
    if cue is not None:
        cue.write_text("")
    pushed, during, t0 = Path(c["pushed"]), 0, time.monotonic()
    while not pushed.exists() and during < tokens - 3:
        step()
        during += 1
    held = not pushed.exists()  # the batch waits for the push at its last steps (reported)
    t1 = time.monotonic()
    _wait_file(str(pushed), 300)
    t2 = time.monotonic()
    in_flight = eng.has_unfinished_requests() and not done
    while eng.has_unfinished_requests():
        step()
    return {"long": [_record(done[f"long-{i}"], job) for i in range(len(job["prompts"]))],
            "steps_during_push": during, "in_flight_at_push": in_flight, "held": held,
            "decode_seconds": t1 - t0, "push_seen_seconds": t2 - t0,
            "version": llm.get_weight_version()}


def dump(worker: Any, out: str) -> None:
    """In each worker (collective_rpc): what its shardstream engine described and did."""
    from formats.manifest.wire import Manifest, dumps_manifest

    eng = worker.weight_transfer_engine
    d = eng.described
    if d is None:  # reload "load_weights": nothing described, the arrays arrive whole
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "last": eng.last}))
        return
    body = {"rank": d.rank, "naming": eng.naming, "last": eng.last,
            "manifests": {k: json.loads(dumps_manifest(m)) for k, m in d.manifests.items()},
            "tensors": {k: [dataclasses.asdict(t) for t in ts] for k, ts in d.tensors.items()}}
    assert all(isinstance(m, Manifest) for m in d.manifests.values())
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank-{d.rank}.json").write_text(json.dumps(body))


def update(llm: Any, version: str, job: dict[str, Any], info: dict[str, Any] | None = None) -> dict[str, Any]:
    t = time.perf_counter()
    llm.start_weight_update()
    llm.update_weights({"update_info": info or {}})
    llm.finish_weight_update(weight_version=version)
    return {"update_seconds": time.perf_counter() - t, "version": llm.get_weight_version(), "out": generate(llm, job)}


def sabotaged_update(llm: Any, version: str, job: dict[str, Any]) -> dict[str, Any]:
    """An update whose engine skips rebuilding its tied layers (the defect the engine had): the
    audit must refuse it at finish, naming the stale head, and the engine must not take the
    version. In-process engines only (TP 1): the patch reaches the worker in this process."""
    from streamer.vllm.engine import ShardstreamWeightTransferEngine as E

    keep = E._process_aliases
    E._process_aliases = lambda self: None  # type: ignore[method-assign]
    try:
        update(llm, version, job)
        return {"error": None}
    except Exception as e:  # noqa: BLE001 - recorded for the test to read
        return {"error": f"{type(e).__name__}: {e}", "version": llm.get_weight_version()}
    finally:
        E._process_aliases = keep  # type: ignore[method-assign]


def missed_join(llm: Any, init_info: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """A session no trainer joins: ``init_weight_transfer_engine`` returns at once (the join runs on
    a thread), ``start_weight_update`` waits out the timeout and returns, ``update_weights`` raises
    the timeout once (every worker's call answered: no reply left for the next call to read)."""
    llm.shutdown_weight_transfer_engine()
    t0 = time.monotonic()
    llm.init_weight_transfer_engine({"init_info": init_info})
    out: dict[str, Any] = {"init_seconds": time.monotonic() - t0, "error": None}
    try:
        update(llm, "missed", job)
    except Exception as e:  # noqa: BLE001 - recorded for the test to read
        # the stale replies can be read only with the engine core in this process; elsewhere the
        # next session's calls show it (a reply left behind would be read as theirs)
        late = _drain(llm, job["tp"]) if job.get("engine_in_process") or job["tp"] == 1 else None
        out.update(error=f"{type(e).__name__}: {e}", late_errors=late, version=llm.get_weight_version(),
                   out=generate(llm, job))
    return out


def _wait_file(path: str, timeout: float = 600) -> None:
    t0 = time.monotonic()
    while not Path(path).exists():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


def staged_commits(llm: Any, rf: dict[str, Any], job: dict[str, Any]) -> list[dict[str, Any]]:
    """Staging "host": commit each ``rf["commits"][i]`` (``{"version": N|null, "fail_at": K}``) in
    turn (``{"check_only": true}``: no update, only what it serves and its staging state;
``{"while_serving": true}``: the update is opened while requests run (``update_while_serving``);
``"reset_prefix_cache": true``: vLLM's ``reset_prefix_cache()`` first; ``{"long_tokens": T,
"pushed": PATH}``: a long batch decoded while the trainer pushes, ``generate_during_push``), first
waiting for ``rf["wait_before"][str(i)]`` (a file) when given; after each, write
    ``rf["signal"]/committed-i``. ``fail_at``: that commit's K-th layer raises (in every worker)."""
    out = []
    for i, c in enumerate(rf["commits"]):
        wait = rf.get("wait_before", {}).get(str(i))
        if wait:
            _wait_file(wait)
        if c.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
        if c.get("check_only"):  # no update: what the engine serves and what its staging holds now
            out.append({"out": generate(llm, job), "version": llm.get_weight_version(),
                        "staging": llm.collective_rpc(_staging_state)})
            if rf.get("signal"):
                Path(rf["signal"], f"committed-{i}").write_text("")
            continue
        if c.get("long_tokens"):  # a push made while a long batch decodes (its cue: committed-i)
            out.append(generate_during_push(llm, job, c, Path(rf["signal"], f"committed-{i}")))
            continue
        if c.get("while_serving"):  # an update the engine serves through: refused, nothing written
            out.append({**update_while_serving(llm, job, c.get("version")), "after": generate(llm, job)})
            if rf.get("signal"):
                Path(rf["signal"], f"committed-{i}").write_text("")
            continue
        if c.get("fail_at"):
            llm.collective_rpc(_fail_hook, args=(c["fail_at"],))
        t0 = time.time()
        try:
            r = update(llm, str(i), job, {"version": c.get("version")})
            r["error"] = None
        except Exception as e:  # noqa: BLE001 - recorded for the test to read
            r = {"error": f"{type(e).__name__}: {e}", "out": generate(llm, job), "version": llm.get_weight_version()}
            r["late_errors"] = _drain(llm, job["tp"])
        finally:
            if c.get("fail_at"):
                llm.collective_rpc(_fail_hook, args=(0,))
        r["started"] = t0
        r["last"] = llm.collective_rpc(_last_info)
        out.append(r)
        if rf.get("signal"):
            Path(rf["signal"], f"committed-{i}").write_text("")
    return out


def _drain(llm: Any, tp: int) -> list[str]:
    """vLLM 0.32's multiprocess executor raises a failed RPC's first error and leaves the other
    workers' responses unread: the next RPC would read them as its own (off by one from then on).
    The backend raises from the last worker only (streamer/vllm/replies.py), so none should be
    left: read any here (engine core in this process only; nothing is in flight, so a response
    waiting in a worker's queue is a stale one) for the test to see."""
    if tp == 1:
        return []
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    late = []
    for mq in executor.response_mqs:
        try:
            status, result = mq.dequeue(timeout=2.0)
            late.append(f"{status}: {result}")
        except TimeoutError:
            pass
    return late


def _fail_hook(worker: Any, k: int) -> None:
    """In each worker: the next commit's ``k``-th layer raises (``k`` 0: the hook removed)."""
    cls = type(worker.weight_transfer_engine)
    keep = cls.__dict__.get("_kept_commit_layer") or cls._commit_layer
    cls._kept_commit_layer = keep
    if not k:
        cls._commit_layer = keep
        return
    calls = [0]

    def failing(self: Any, *a: Any) -> Any:
        calls[0] += 1
        if calls[0] == k:
            raise RuntimeError(f"test hook: layer {k} of this commit fails")
        return keep(self, *a)

    cls._commit_layer = failing


def _staging_state(worker: Any) -> dict[str, Any]:
    stager = worker.weight_transfer_engine.stager
    return {"error": stager.error, "buffers": [(b.role, b.version) for b in stager.buffers]}


def _last_info(worker: Any) -> dict[str, Any]:
    return dict(worker.weight_transfer_engine.last)


def engine(model: str, job: dict[str, Any], refit: bool) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if refit:
        kw["weight_transfer_config"] = {"backend": "shardstream"}
    if job["tp"] == 1:
        kw["distributed_executor_backend"] = "uni"
    if job.get("expert_parallel"):
        kw["enable_expert_parallel"] = True
    if job.get("block_size"):  # prefix caching with blocks small enough for the test's prompts
        kw.update(block_size=job["block_size"], enable_prefix_caching=True)
    return LLM(model=model, dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
               tensor_parallel_size=job["tp"], seed=0, **kw)


def run(job: dict[str, Any]) -> list[dict[str, Any]]:
    results = []
    for r in job["runs"]:
        t0 = time.perf_counter()
        model = r["model"]
        if job.get("fp8_block"):
            from fp8_reference import write_fp8_checkpoint

            model = str(write_fp8_checkpoint(Path(model), Path(model + "-fp8"), tuple(job["fp8_block"])))
        llm = engine(model, job, "refit" in r)
        entry: dict[str, Any] = {"model": r["model"], "start_seconds": time.perf_counter() - t0}
        if "refit" in r:
            rf = r["refit"]
            t1 = time.perf_counter()
            init_info = {"rendezvous": rf["rendezvous"], "timeout": rf["timeout"], **rf.get("init_info", {})}
            if rf.get("refused"):
                # an architecture the backend does not support: refused by name before any push
                try:
                    llm.init_weight_transfer_engine({"init_info": init_info})
                    entry["refused"] = None
                except Exception as e:  # noqa: BLE001 - recorded for the test to read
                    entry["refused"] = f"{type(e).__name__}: {e}"
                results.append(entry)
                del llm
                gc.collect()
                continue
            llm.init_weight_transfer_engine({"init_info": init_info})
            entry["init_seconds"] = time.perf_counter() - t1
            entry["before"] = generate(llm, job)
            if rf.get("ready_file"):  # the engine is up and serving (staged: no trainer needed for that)
                Path(rf["ready_file"]).write_text("")
            entry["steps"] = []
            if rf.get("commits"):
                entry["commits"] = staged_commits(llm, rf, job)
            for step in range(rf["steps"]):
                if rf.get("sabotage") == "tied":
                    entry["steps"].append(sabotaged_update(llm, str(step), job))
                    continue
                entry["steps"].append(update(llm, str(step), job))
                if rf.get("manifests"):
                    llm.collective_rpc(dump, args=(str(Path(rf["manifests"], f"step-{step}")),))
                    if job.get("fp8_block"):
                        from fp8_reference import dump_fp8

                        llm.collective_rpc(dump_fp8, args=(str(Path(rf["manifests"], f"step-{step}")),))
            if rf.get("missed_join"):
                entry["missed"] = missed_join(llm, rf["missed_join"], job)
            then = rf.get("then")
            if then:
                llm.shutdown_weight_transfer_engine()
                llm.init_weight_transfer_engine({"init_info": {k: v for k, v in then.items() if k != "refused"}})
                if then.get("refused"):
                    # a refused push: update_weights raises, the engine keeps serving its last weights
                    try:
                        update(llm, "refused", job)
                        entry["then"] = {"error": None}
                    except Exception as e:  # noqa: BLE001 - recorded for the test to read
                        entry["then"] = {"error": f"{type(e).__name__}: {e}", "out": generate(llm, job),
                                         "version": llm.get_weight_version()}
                else:
                    entry["then"] = update(llm, "then", job)
                if rf.get("manifests"):
                    llm.collective_rpc(dump, args=(str(Path(rf["manifests"], "then")),))
        else:
            entry["out"] = generate(llm, job)
            if job.get("long_tokens"):  # the batch a staged engine decoded during a push, fresh
                entry["long"] = generate(llm, {**job, "max_tokens": job["long_tokens"], "logprobs": 1})
        results.append(entry)
        del llm
        gc.collect()
    return results


def fp8_kernel_plugin() -> None:
    """Install fp8_reference's kernel in every vLLM process (this one and the workers it starts):
    a ``vllm.general_plugins`` entry point in a throwaway dist-info on sys.path and PYTHONPATH, which
    vLLM loads in each process before it builds the model. Test-only; shardstream ships none."""
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="shardstream-fp8-reference-"))
    info = d / "shardstream_tier_fp8_reference-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: shardstream-tier-fp8-reference\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nfp8_reference = fp8_reference:install_kernel\n")
    sys.path.insert(0, str(d))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(d)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH")
                                                           else []))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function (dump)
    job = json.loads(Path(sys.argv[1]).read_text())
    if job.get("fp8_block"):
        fp8_kernel_plugin()
    if job["tp"] == 1 or job.get("engine_in_process"):
        # the engine core in this process: starts in seconds (at TP > 1 the workers are still
        # processes of their own, where the weight-transfer engine runs; 8-14 s against 28-54 s)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if job["tp"] > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(job["tp"])))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    # the coverage matrix: several jobs (one per architecture) in one process, so vLLM is imported once
    out = [run(j) for j in job["jobs"]] if "jobs" in job else run(job)
    tmp = Path(sys.argv[2] + ".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, sys.argv[2])
