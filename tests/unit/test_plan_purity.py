"""The planner and the data model are pure (design §2): every module of ``streamer.plan`` and ``formats.*`` import
and plan with ``mpi4py`` and ``torch`` / ``torch.distributed`` blocked, and importing them does
not load torch or mpi4py. Each check runs in a fresh interpreter so nothing is already imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BLOCKED = ("mpi4py", "mpi4py.MPI", "torch", "torch.distributed")
PLAN_MODULES = (
    "streamer.plan",
    "streamer.plan.balance",
    "streamer.plan.check",
    "streamer.plan.classes",
    "streamer.plan.forwards",
    "streamer.execute.schedule",
    "streamer.plan.fp8",
    "streamer.plan.gcpause",
    "streamer.plan.layout",
    "streamer.plan.local_shapes",
    "streamer.plan.match",
    "streamer.plan.open_rows",
    "streamer.plan.model",
    "streamer.plan.planner",
    "streamer.plan.rankplan",
    "streamer.plan.stats",
    "streamer.plan.template",
    "streamer.plan.topology",
)


def _formats_modules() -> tuple[str, ...]:
    """Every module of ``formats/`` (packages included), whatever package it lives in."""
    names = set()
    for path in (ROOT / "formats").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return tuple(sorted(names))


#: the data model and file formats: all of formats/
FORMATS_MODULES = _formats_modules()
PURE_MODULES = PLAN_MODULES + FORMATS_MODULES

IMPORTS = ("from streamer.plan.check import validate_plan\n"
           "from streamer.plan.forwards import forward_keys\n"
           "from streamer.plan.planner import plan_transfers\n")

SMALL_PLAN = """
from formats.layouts import Mesh, Replicate, Shard, build_manifest
from formats.manifest.wire import dumps_manifest, loads_manifest
arrays = {"w": ((7, 5), "bfloat16"), "s": ((), "int64")}
src_pl = {"w": (Replicate(), Shard(0)), "s": (Replicate(), Replicate())}
src = build_manifest(arrays, Mesh(("dp", "tp"), (2, 2)), src_pl, file_pattern=None)
dst = build_manifest(arrays, Mesh(("tp",), (3,)), {"w": (Shard(1),), "s": (Replicate(),)}, file_pattern=None)
src = loads_manifest(dumps_manifest(src))
plan = plan_transfers(src, dst, dst_domain_size=3, split_bytes=1)
assert validate_plan(plan, src, dst) == [], validate_plan(plan, src, dst)
assert plan.stats().moved_bytes == plan.stats().lower_bound_bytes == 7 * 5 * 2 + 3 * 8
forward_keys(plan, None, 16)  # the message order's planning part
print("PLAN-OK", plan.digest())
"""


def test_every_planning_module_is_checked() -> None:
    """A module added to (or split out in) ``streamer/plan/`` is held to the same rule."""
    here = {"streamer.plan." + p.stem for p in (ROOT / "streamer" / "plan").glob("*.py") if p.stem != "__init__"}
    assert here - set(PURE_MODULES) == set()


def test_formats_modules_are_all_checked() -> None:
    """Every package of ``formats/`` is held to the rule, the model's and the formats' alike."""
    assert {"formats", "formats.manifest.wire", "formats.validate.manifest", "formats.layouts",
            "formats.safetensors.io", "formats.zarr.io", "formats.dcp.io", "formats.megatron.legacy"} <= set(
        FORMATS_MODULES)


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-c", code],
        check=False,
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_plan_and_formats_work_with_mpi_and_torch_blocked() -> None:
    code = "import sys\n"
    code += "".join(f"sys.modules[{m!r}] = None\n" for m in BLOCKED)
    code += textwrap.dedent("""
        for m in ("mpi4py", "torch", "torch.distributed"):
            try:
                __import__(m)
            except ImportError:
                pass
            else:
                raise SystemExit(f"blocking {m} did not work")
    """)
    code += "".join(f"import {m}\n" for m in PURE_MODULES)
    code += IMPORTS
    code += SMALL_PLAN
    r = _run(code)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PLAN-OK" in r.stdout


def test_importing_the_planner_loads_neither_torch_nor_mpi() -> None:
    code = "import sys, json\n"
    code += "".join(f"import {m}\n" for m in PURE_MODULES)
    code += IMPORTS
    code += SMALL_PLAN
    code += "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mpi4py'))))\n"
    r = _run(code)
    assert r.returncode == 0, r.stdout + r.stderr
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing/running the planner loaded {loaded}"


def test_same_digest_in_separate_interpreters() -> None:
    """Every rank computes the same plan: the digest does not depend on the process (hash
    randomisation, dict order of a fresh interpreter)."""
    code = IMPORTS + SMALL_PLAN
    digests = set()
    for seed in ("0", "1", "12345"):
        env_code = f"import os; os.environ['PYTHONHASHSEED'] = {seed!r}\n"
        r = subprocess.run(
            [sys.executable, "-c", env_code + code],
            check=False,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={
                **os.environ,
                "PYTHONHASHSEED": seed,
                "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            },
        )
        assert r.returncode == 0, r.stdout + r.stderr
        digests.add(r.stdout.split("PLAN-OK", 1)[1].strip())
    assert len(digests) == 1
