"""LoRA adapters pushed straight into a running vLLM engine's adapter manager: no disk, no merge.

A trainer pushes a PEFT adapter's tensors (``base_model.model.<module>.lora_A.weight`` /
``lora_B.weight``, and an embedding's ``lora_embedding_A`` / ``lora_embedding_B``: PEFT's saved
names; ``adapter_names`` turns a live PEFT model's ``...lora_A.default.weight`` keys into them)
through an adapter session: ``init_info`` with
``"adapter": {PEFT config: r, lora_alpha, target_modules, use_rslora, ...}``. Each worker receives
the whole adapter: vLLM keeps an unsliced CPU copy of every adapter on every rank (``LoRAModel``,
the copy its GPU slots are refilled from when an adapter is evicted and used again), and its own
``set_lora`` slices that copy into the slots by its tensor-parallel rules. So the adapter is
received replicated (every worker holds every array; the planner sends each byte once per
holder), then handed to vLLM's own ``LoRAModel.from_lora_tensors``: the same cast, packing of
``qkv``/``gate_up`` and ``alpha/r`` folding into B (in the adapter dtype, after the cast) as an
adapter vLLM loads from a directory. ``update_weights({"update_info": {"lora_name": N, "lora_id":
I}})`` registers it under id ``I`` once every worker holds all of it; requests name it with
``LoRARequest(N, I, path)`` (the path is not read while the adapter stays registered: the
adapter is pinned in vLLM's CPU cache, so it never needs reloading). A version is a new id: the
previous one stays registered until the caller removes it (``LLM.remove_lora``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from formats.manifest.box import Box
from formats.manifest.spec import ArraySpec, Chunk, Manifest

__all__ = ["SCHEME", "AdapterReceiver", "adapter_names", "check_adapter", "held_adapters", "keep_adapters_once",
           "pushed_names", "replicated"]

#: PEFT's saved name of one LoRA tensor: the module, then lora_A / lora_B (a linear layer's, an
#: expert's) or lora_embedding_A / lora_embedding_B (an embedding's: no ``.weight``)
_NAME = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?:embedding_)?(?P<ab>[AB])(?:\.weight)?$")
_SUFFIXES = ("A.weight", "B.weight", "embedding_A", "embedding_B")


def adapter_names(state: Mapping[str, Any], adapter: str = "default") -> dict[str, Any]:
    """A live PEFT model's LoRA tensors under PEFT's saved names (``...lora_A.default.weight`` ->
    ``...lora_A.weight``); the base weights (``...base_layer.weight``, every non-LoRA key) are
    not part of an adapter push and are left out.

    >>> sorted(adapter_names({"base_model.model.l.q_proj.lora_A.default.weight": 1,
    ...                       "base_model.model.l.q_proj.base_layer.weight": 2,
    ...                       "base_model.model.embed_tokens.lora_embedding_B.default": 3}))
    ['base_model.model.embed_tokens.lora_embedding_B', 'base_model.model.l.q_proj.lora_A.weight']
    """
    out = {}
    for name, t in state.items():
        for suffix in _SUFFIXES:  # lora_A.default.weight, lora_embedding_A.default, ...
            head, _, tail = suffix.partition(".")
            tag = f".lora_{head}.{adapter}" + (f".{tail}" if tail else "")
            if name.endswith(tag):
                out[name[: -len(tag)] + f".lora_{suffix}"] = t
    return out


def check_adapter(src: Manifest, targets: set[str]) -> list[str]:
    """One line per array of the trainer's adapter that this engine cannot take: a name that is
    not a PEFT LoRA tensor, a module that vLLM would not load into this engine (the rule of its own
    loader: a module's last name must be one of ``targets``, the modules it wraps with LoRA,
    packed ones by their parts; an expert's name from ``experts`` on, as ``experts.3.up_proj``,
    or ``experts`` for fused 3-D experts), or a module with lora_A and no lora_B (or the reverse).

    >>> from formats.manifest.spec import Manifest
    >>> def m(*names): return Manifest(world_size=1, arrays={n: ArraySpec((2, 2), "float32", ()) for n in names})
    >>> check_adapter(m("base_model.model.mlp.experts.3.up_proj.lora_A.weight",
    ...                 "base_model.model.mlp.experts.3.up_proj.lora_B.weight"), {"experts.3.up_proj"})
    []
    >>> check_adapter(m("base_model.model.mlp.experts.9.up_proj.lora_A.weight"), {"experts.3.up_proj"})[0]
    'base_model.model.mlp.experts.9.up_proj.lora_A.weight: module mlp.experts.9.up_proj has no LoRA slot ...'
    """
    problems = []
    halves: dict[str, set[str]] = {}
    for name in sorted(src.arrays):
        m = _NAME.match(name)
        if m is None:
            problems.append(f"{name}: not a LoRA tensor (expected base_model.model.MODULE.lora_A.weight or lora_B, "
                            "or an embedding's lora_embedding_A / lora_embedding_B)")
            continue
        module = m["module"]
        if not _has_slot(module, targets):
            problems.append(f"{name}: module {module} has no LoRA slot in this engine (it wraps: "
                            f"{_listed(targets)})")
        halves.setdefault(module, set()).add(m["ab"])
    problems += [f"base_model.model.{mod}: lora_{'B' if have == {'A'} else 'A'} is missing"
                 for mod, have in sorted(halves.items()) if have != {"A", "B"}]
    return problems


def _has_slot(module: str, targets: set[str]) -> bool:
    """vLLM's own loader rule (``LoRAModel.from_local_checkpoint``): experts are matched from
    ``experts`` on; PEFT's fused 3-D form names gate_up ``experts.base_layer``, which vLLM takes as
    the ``experts`` module's first half."""
    at = module.find(".experts")
    if at >= 0:
        suffix = module[at + 1:]
        return suffix in targets or (suffix == "experts.base_layer" and "experts" in targets)
    return module.rsplit(".", 1)[-1] in targets


def _listed(targets: set[str]) -> str:
    """The wrapped modules for a message: per-expert names collapsed (a MoE has thousands)."""
    plain = sorted(t for t in targets if not t.startswith("experts."))
    experts = len(targets) - len(plain)
    return ", ".join(plain + ([f"{experts} expert projections (experts.N.PROJ)"] if experts else []))


def replicated(src: Manifest, world_size: int, name: str = "vllm-adapter") -> Manifest:
    """The receiving job's manifest: every array of ``src``, whole, on each of ``world_size``
    ranks."""
    arrays = {}
    for fqn, spec in src.arrays.items():
        box = Box((0,) * len(spec.shape), tuple(spec.shape))
        arrays[fqn] = ArraySpec(tuple(spec.shape), spec.data_type, (Chunk(box, tuple(range(world_size))),))
    return Manifest(world_size=world_size, arrays=arrays, name=name)


def keep_adapters_once(runner: Any) -> None:
    """vLLM's worker drops every LoRA adapter after ``finish_weight_update`` (its
    ``reset_lora_state``: new base weights invalidate adapters). An adapter push changes no base
    weight, so the next reset (the one right after this finish) is skipped, once: a later base
    update still resets as vLLM intends."""
    reset = runner.reset_lora_state

    def skip_once() -> None:
        runner.reset_lora_state = reset

    runner.reset_lora_state = skip_once


class AdapterReceiver:
    """One engine worker's side of an adapter session (the module docstring): picks the receiving
    manifest from the trainer's, receives each push whole, and registers it with the worker's
    LoRA manager once every worker holds all of it."""

    def __init__(self, worker: Any, config: Mapping[str, Any], group: Any) -> None:
        wm = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
        if wm is None:
            raise ValueError("shardstream: an adapter session needs an engine started with enable_lora=True")
        self.worker, self.worker_manager, self.config, self.group = worker, wm, dict(config), group
        for key in ("r", "lora_alpha", "target_modules"):
            if key not in self.config:
                raise ValueError(f"shardstream: init_info adapter lacks {key!r} (the adapter's PEFT config)")
        mgr = wm._adapter_manager
        packed = mgr.packed_modules_mapping
        # what vLLM's loader expects (WorkerLoRAManager._load_adapter): packed modules by their parts,
        # a MoE's experts per expert and projection, and ``experts`` itself (the fused 3-D form)
        self.targets = {p for m in mgr.supported_lora_modules for p in packed.get(m, [m])}
        self.targets |= {"experts"} & set(mgr.supported_lora_modules)
        self.manifest: Manifest | None = None
        self.problems: list[str] = []

    def choose(self, src: Manifest, world_size: int) -> Manifest:
        self.problems = check_adapter(src, self.targets)
        self.manifest = replicated(src, world_size)
        return self.manifest

    def refusals(self, lora_id: int | None, name: str | None, replace: bool = False) -> list[str]:
        """What refuses this push before any byte moves (every worker finds the same)."""
        problems = list(self.problems)
        if not name:
            problems.append("update_info needs lora_name for an adapter push (and lora_id to register it at once)")
        elif name in pushed_names(self.worker_manager) and not replace:
            problems.append(f"lora_name {name!r} was pushed to this engine before: vLLM's prefix cache keys an "
                            "adapter's KV blocks by name and path, so a new version under that name would reuse "
                            "blocks the old one computed; name each version (policy-v7), or pass lora_replace: true "
                            "and call reset_prefix_cache before serving it (docs/lora.md)")
        if lora_id is None:  # held by name, loaded later through vLLM's own add_lora: nothing else to check
            return problems
        mgr = self.worker_manager._adapter_manager
        if lora_id in set(mgr.list_adapters()):
            problems.append(f"LoRA id {lora_id} is registered already: a new version takes a new id (remove the "
                            "old one with LLM.remove_lora once no request uses it)")
        elif len(mgr) >= mgr.capacity:
            problems.append(f"the engine's CPU LoRA cache is full ({mgr.capacity} adapters, max_cpu_loras): remove one "
                            "first (LLM.remove_lora)")
        return problems

    def buffers(self) -> dict[str, Any]:
        import torch

        assert self.manifest is not None
        return {n: torch.empty(a.shape, dtype=getattr(torch, a.data_type)) for n, a in self.manifest.arrays.items()}

    def agreed(self, ok: bool) -> bool:
        """Every worker's verdict on its pull: True only when all received the whole adapter."""
        import torch.distributed as dist

        if self.group is None:
            return ok
        got: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(got, ok, group=self.group)
        return all(got)

    def register(self, tensors: dict[str, Any], lora_id: int, name: str) -> None:
        """vLLM's own loading from tensors, as from a directory; pinned in the CPU cache."""
        lora = self._lora_model(tensors, lora_id)
        mgr = self.worker_manager._adapter_manager
        mgr.add_adapter(lora)
        mgr._registered_adapters.pin(lora_id)  # never evicted from the CPU cache: nothing to reload it from
        pushed_names(self.worker_manager).add(name)

    def hold(self, tensors: dict[str, Any], name: str) -> None:
        """Keep the adapter under ``name`` for vLLM's own ``add_lora`` to load: a ``LoRARequest``
        (or ``vllm serve``'s ``/v1/load_lora_adapter``) whose path is ``shardstream://NAME`` gets it,
        under the id the caller or the serving layer picks (so ``/v1/models`` lists it)."""
        held = held_adapters(self.worker_manager)
        held.pop(name, None)
        held[name] = self._lora_model(tensors, 1)  # the id vLLM checks at build; a load sets the caller's
        pushed_names(self.worker_manager).add(name)
        while len(held) > held_limit(self.worker_manager._adapter_manager.capacity):
            held.pop(next(iter(held)))  # the oldest push

    def _lora_model(self, tensors: dict[str, Any], lora_id: int) -> Any:
        from streamer.vllm import internals

        wm = self.worker_manager
        config = {k: v for k, v in self.config.items() if k != "is_3d_lora_weight"}  # a LoRARequest field, not PEFT's
        peft = internals.load().PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": wm.max_position_embeddings})
        peft.validate_legal(wm.lora_config)
        mgr = wm._adapter_manager
        mapper = getattr(mgr.model, "hf_to_vllm_mapper", None)
        lora = wm._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=peft, device="cpu", dtype=wm.lora_config.lora_dtype,
            model_vocab_size=wm.vocab_size, weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(mgr.model, "lora_skip_prefixes", None))
        # the checks vLLM's own loader runs after building (WorkerLoRAManager._load_adapter), where this vLLM has them
        lora.is_3d_lora_weight = bool(self.config.get("is_3d_lora_weight", False))
        for check in ("_validate_moe_lora_format", "_validate_modules_to_save", "_validate_token_classification_lora"):
            if hasattr(mgr, check):
                getattr(mgr, check)(lora)
        return lora


#: the path that names a pushed adapter held by name: ``shardstream://NAME``
SCHEME = "shardstream://"


#: a worker keeps at least this many adapters pushed by name, beyond vLLM's CPU cache: they are what
#: vLLM reloads an evicted adapter from (as it would from its directory), so that two versions can
#: alternate on an engine whose CPU cache holds one (``max_cpu_loras=1``)
HELD_AT_LEAST = 4


def held_limit(cpu_cache: int) -> int:
    """How many adapters pushed by name a worker keeps (the oldest go first): twice vLLM's CPU
    cache (``max_cpu_loras``), and at least :data:`HELD_AT_LEAST`."""
    return max(HELD_AT_LEAST, 2 * cpu_cache)


def pushed_names(wm: Any) -> set[str]:
    """Every lora_name pushed to this worker, kept on its LoRA manager across sessions (refused
    again unless the caller asks to replace it: ``AdapterReceiver.refusals``)."""
    names: set[str] | None = getattr(wm, "_shardstream_pushed_names", None)
    if names is None:
        names = wm._shardstream_pushed_names = set()
    return names


def held_adapters(wm: Any) -> dict[str, Any]:
    """The adapters pushed by name to this worker (oldest first), kept on its LoRA manager across
    sessions; the first call routes the manager's loading of ``shardstream://NAME`` paths to them."""
    held: dict[str, Any] | None = getattr(wm, "_shardstream_held", None)
    if held is not None:
        return held
    held = wm._shardstream_held = {}
    load = wm._load_adapter

    def load_adapter(request: Any) -> Any:
        path = str(getattr(request, "lora_path", "") or "")
        if not path.startswith(SCHEME):
            return load(request)
        name = path[len(SCHEME):]
        lora = held.get(name)
        if lora is None:
            raise ValueError(f"shardstream: no adapter pushed as {name!r} on this worker (held: "
                             f"{', '.join(held) or 'none'}; the oldest are dropped beyond max(4, 2 x max_cpu_loras))")
        mine = copy.copy(lora)  # the tensors are shared; the id is the one vLLM's caller picked
        mine.id = request.lora_int_id
        return mine

    wm._load_adapter = load_adapter
    return held
