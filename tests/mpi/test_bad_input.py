"""Bad input on any rank of any launch ends every rank promptly (issue 24; docs/failures.md).

One table: every input file missing, broken (bad JSON) or of the wrong size (a manifest for
another rank count) on either side, options that one side alone gets wrong, a used or locked
output directory; launched as one MPMD ``mpiexec`` (senders : receivers), as a single-program
``mpiexec -n 3 shardstream convert``, as two ``mpiexec`` jobs joined by a rendezvous file, and
with ``torchrun`` senders on the store plane. Each case asserts:

- the exit code of every launch (1 invalid input, 2 usage, 3 runtime);
- exactly one stderr line per launch names the problem, and no traceback of ours;
- the time: every launch ends far under ``--timeout`` (killed at 90 s of 120), and within
  ``REACTION`` seconds of the last launch printing the problem (nobody waited for a peer that
  had given up);
- no process of any launch is left running (each launch is its own session).

The cases run a few at a time in threads (each is mostly waiting on its subprocesses), so the
table takes well under a minute on two cores.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from mpi_helpers import BIN, ENV, Ckpt, ok, session_pids, tp_rules

pytestmark = pytest.mark.mpi

TORCHRUN = shutil.which("torchrun", path=str(BIN))
#: every launch gets this --timeout; a case must end in far less (HARD_KILL < TIMEOUT: a launch
#: still running then has waited for something that will never come)
TIMEOUT = 120
HARD_KILL = 90
#: seconds from the moment every launch has printed the problem until the last process is gone:
#: nobody waits for a peer that gave up. (Starting Python, MPI and torch comes before and is not
#: counted: on a loaded CI node three torch imports at once take longer than this.) torchrun
#: itself takes seconds to notice its workers' exit and report it.
REACTION = {"mpi": 5.0, "torch": 20.0}
#: cases run this many at a time
PARALLEL = 4


@dataclass(frozen=True)
class World:
    """Small inputs: a 2-rank trainer (TP2) and its files, 2- and 3-rank serving layouts."""

    root: Path
    src: Path  # the HF checkpoint's manifest (one rank)
    train: Path  # convert output: 2 rank files + manifest.json
    serve1: Path  # one rank, HF names
    serve2: Path
    serve3: Path
    broken: Path
    train_hole: Path  # the trainer's files with rank 1's file missing


@dataclass
class Case:
    name: str
    #: launches in start order: the first is backgrounded until it wrote ``rdv`` when there are two
    launches: list[list[str]]
    code: int
    #: what the one line names (a fragment of it)
    says: str
    torch: bool = False
    hold_lock: Path | None = None


@dataclass
class Outcome:
    codes: list[int | None] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: seconds from "every launch printed the problem" to "every launch exited" (None: never printed)
    reaction: float | None = None
    left: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def world(ckpt: Ckpt, tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("bad-input")
    train_m, serve2, serve3 = root / "train.json", root / "serve2.json", root / "serve3.json"
    ok(["shardstream", "layout", "--like", ckpt.hf_manifest, "--mesh", "tp=2", *tp_rules(1), "-o", train_m])
    ok(["shardstream", "convert", ckpt.hf_manifest, train_m, "--out", root / "train"])
    ok(["shardstream", "layout", "--like", ckpt.hf_manifest, "--mesh", "tp=2", *tp_rules(1), "-o", serve2])
    ok(["shardstream", "layout", "--like", ckpt.hf_manifest, "--mesh", "tp=3", *tp_rules(1), "-o", serve3])
    broken = root / "broken.json"
    broken.write_text('{"format_version": 1, "arrays": {')
    hole = root / "train-hole"
    shutil.copytree(root / "train", hole)
    (hole / "rank-00001.safetensors").unlink()
    return World(root, ckpt.hf_manifest, root / "train", ckpt.hf1, serve2, serve3, broken, hole)


def _cases(w: World, tmp: Path, make_dirs: bool = True) -> list[Case]:
    t = ["--timeout", str(TIMEOUT)]
    send, recv = ["shardstream", "refit", "send", *t], ["shardstream", "refit", "recv", *t]

    # few ranks (each is a Python start): 1 sender + 2 receivers, 2 convert workers, 1 + 1 for two jobs
    def mpmd(s: list[object], r: list[object], n_send: int = 1) -> list[list[str]]:
        return [list(map(str, ["mpiexec", "-n", n_send, *send, *s, ":", "-n", "2", *recv, *r]))]

    def conv(*a: object) -> list[list[str]]:
        return [list(map(str, ["mpiexec", "-n", "2", "shardstream", "convert", *a]))]

    def pair(name: str, s: list[object], r: list[object], torch: bool = False) -> list[list[str]]:
        rdv = tmp / name / "rdv"
        senders = ([TORCHRUN or "torchrun", "--standalone", "--nproc-per-node", "1", str(BIN / "shardstream"),
                    "refit", "send", *t] if torch else ["mpiexec", "-n", "1", *send])
        plane = ["--control", "store"] if torch else []
        return [list(map(str, ["mpiexec", "-n", "1", *recv, *plane, "--rendezvous", rdv, *r])),
                list(map(str, [*senders, "--rendezvous", rdv, *s]))]

    used, locked, used_save, locked_save = (tmp / n for n in ("used", "locked", "used-save", "locked-save"))
    if make_dirs:
        for d in (used, used_save):
            d.mkdir()
            (d / "rank-00003.safetensors").write_bytes(b"stale")  # an earlier, larger job's file
        for d in (locked, locked_save):
            (d / ".shardstream").mkdir(parents=True)
    missing = tmp / "missing.json"
    ok_s, ok_r, one = [w.src], [w.serve2], [w.serve1]
    return [
        # ---- one MPMD launch: the senders' side and the receivers' side
        Case("mpmd: receiver manifest missing", mpmd(["--manifest", *ok_s], ["--manifest", missing]), 1,
             f"{missing}: no such file or directory"),
        Case("mpmd: sender manifest missing", mpmd(["--manifest", missing], ["--manifest", *ok_r]), 1,
             f"{missing}: no such file or directory"),
        Case("mpmd: receiver manifest broken", mpmd(["--manifest", *ok_s], ["--manifest", w.broken]), 1,
             "not valid JSON"),
        Case("mpmd: sender manifest broken", mpmd(["--manifest", w.broken], ["--manifest", *ok_r]), 1,
             "not valid JSON"),
        Case("mpmd: receiver manifest of another size", mpmd(["--manifest", *ok_s], ["--manifest", w.serve3]), 1,
             "receiver manifest: world_size 3 but the receiver job has 2 ranks"),
        Case("mpmd: sender manifest of another size", mpmd(["--manifest", w.train], ["--manifest", *ok_r]), 1,
             "sender manifest: world_size 2 but the sender job has 1 ranks"),
        Case("mpmd: sender rank file missing", mpmd(["--manifest", w.train_hole], ["--manifest", *ok_r], 2), 1,
             "rank-00001.safetensors"),
        Case("mpmd: bad option on the receivers only",
             mpmd(["--manifest", *ok_s], ["--manifest", *ok_r, "--bucket-size", "12 parsecs"]), 2,
             "shardstream refit recv: error: argument --bucket-size: invalid size '12 parsecs'"),
        Case("mpmd: bad option on the senders only",
             mpmd(["--manifest", *ok_s, "--steps", "0"], ["--manifest", *ok_r]), 2,
             "shardstream refit send: error: argument --steps"),
        Case("mpmd: no such role", [list(map(str, ["mpiexec", "-n", "1", *send, "--manifest", *ok_s, ":", "-n", "2",
                                                   "shardstream", "refit", "rcv", "--manifest", *ok_r]))], 2,
             "invalid choice: 'rcv'"),
        Case("mpmd: transports differ", mpmd(["--manifest", *ok_s, "--transport", "gloo"], ["--manifest", *ok_r]), 2,
             "the two jobs asked for different transports (senders: gloo; receivers: mpi)"),
        Case("mpmd: strategies differ", mpmd(["--manifest", *ok_s, "--strategy", "broadcast"], ["--manifest", *ok_r]),
             1, "the two jobs asked for different --strategy values"),
        Case("mpmd: delta with broadcast on one side",
             mpmd(["--manifest", *ok_s, "--delta"], ["--manifest", *ok_r, "--strategy", "broadcast"]), 1,
             "different --strategy values"),
        Case("mpmd: --save on the senders", mpmd(["--manifest", *ok_s, "--save", tmp / "x"], ["--manifest", *ok_r]),
             2, "--save is for the receiving side"),
        Case("mpmd: --save into a used directory", mpmd(["--manifest", *ok_s], ["--manifest", *ok_r, "--save",
                                                                               used_save]), 2,
             f"{used_save}: output directory is not empty; choose an empty directory"),
        Case("mpmd: --save into a locked directory", mpmd(["--manifest", *ok_s], ["--manifest", *ok_r, "--save",
                                                                                 locked_save]), 3,
             f"{locked_save}: another shardstream convert or refit --save is writing this directory",
             hold_lock=locked_save),
        # ---- one single-program launch: convert's workers
        Case("convert: source missing", conv(missing, w.serve3, "--out", tmp / "c1"), 1,
             f"{missing}: no such file or directory"),
        Case("convert: source broken", conv(w.broken, w.serve3, "--out", tmp / "c2"), 1, "not valid JSON"),
        Case("convert: destination broken", conv(w.src, w.broken, "--out", tmp / "c3"), 1, "not valid JSON"),
        Case("convert: a source file missing", conv(w.train_hole / "manifest.json", w.serve3, "--out", tmp / "c4"), 1,
             "rank-00001.safetensors"),
        Case("convert: output directory used", conv(w.src, w.serve3, "--out", used), 2,
             f"{used}: output directory is not empty"),
        Case("convert: output directory locked", conv(w.src, w.serve3, "--out", locked), 3,
             f"{locked}: another shardstream convert or refit --save is writing this directory",
             hold_lock=locked),
        Case("convert: bad option", conv(w.src, w.serve3, "--out", tmp / "c5", "--memory-limit", "lots"), 2,
             "shardstream convert: error: argument --memory-limit"),
        # ---- two mpiexec jobs joined by a rendezvous file (MPI port)
        Case("rendezvous: receiver manifest missing", pair("rv1", ["--manifest", *ok_s], ["--manifest", missing]), 1,
             f"{missing}: no such file or directory"),
        Case("rendezvous: sender manifest broken", pair("rv2", ["--manifest", w.broken], ["--manifest", *one]), 1,
             "not valid JSON"),
        Case("rendezvous: bad option on the senders",
             pair("rv3", ["--manifest", *ok_s, "--bucket-size", "zz"], ["--manifest", *one]), 2,
             "shardstream refit send: error: argument --bucket-size"),
        # ---- torchrun senders, mpiexec receivers on the store plane
        Case("torchrun: sender manifest missing", pair("tr1", ["--manifest", missing], ["--manifest", *one], True),
             1, f"{missing}: no such file or directory", torch=True),
        Case("torchrun: receiver manifest of another size",
             pair("tr2", ["--manifest", *ok_s], ["--manifest", w.serve2], True), 1,
             "receiver manifest: world_size 2 but the receiver job has 1 ranks", torch=True),
        Case("torchrun: bad option on the senders",
             pair("tr3", ["--manifest", *ok_s, "--bucket-size", "zz"], ["--manifest", *one], True), 2,
             "shardstream refit send: error: argument --bucket-size", torch=True),
    ]


def _held(path: Path) -> int:
    """Take DIR/.shardstream/lock as a running convert would (released when the fd closes)."""
    fd = os.open(path / ".shardstream" / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        return subprocess.Popen(cmd, env=ENV, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)


def _watch(procs: list[subprocess.Popen[bytes]], logs: list[Path], says: str,
           deadline: float) -> tuple[list[int | None], float | None]:
    """Every launch's exit code (None: still running at ``deadline``), and when the last launch
    had printed ``says``."""
    seen: dict[int, float] = {}
    while time.monotonic() < deadline:
        for i, log in enumerate(logs):
            if i not in seen and says in log.read_text(errors="replace"):
                seen[i] = time.monotonic()
        if all(p.poll() is not None for p in procs):
            break
        time.sleep(0.05)
    for i, log in enumerate(logs):  # printed just before the exit
        if i not in seen and says in log.read_text(errors="replace"):
            seen[i] = time.monotonic()
    return [p.poll() for p in procs], max(seen.values()) if len(seen) == len(logs) else None


def _left(pids: list[int]) -> list[int]:
    """Processes of the launches' sessions still alive (after a moment for the launcher's cleanup)."""
    deadline = time.monotonic() + 3
    while True:
        left = [q for p in pids for q in session_pids(p)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def _run(case: Case, tmp: Path) -> Outcome:
    d = tmp / case.name.replace(" ", "_").replace(":", "").replace("-", "")
    d.mkdir(parents=True, exist_ok=True)
    fd = _held(case.hold_lock) if case.hold_lock is not None else None
    procs: list[subprocess.Popen[bytes]] = []
    out = Outcome()
    try:
        t0 = time.monotonic()
        deadline = t0 + HARD_KILL
        for i, cmd in enumerate(case.launches):
            if i:  # the receivers write the rendezvous file first, or give up before
                rdv = Path(case.launches[0][case.launches[0].index("--rendezvous") + 1])
                while not rdv.exists() and procs[0].poll() is None and time.monotonic() < deadline:
                    time.sleep(0.05)
            procs.append(_start(cmd, d / f"launch{i}.err"))
        logs = [d / f"launch{i}.err" for i in range(len(procs))]
        out.codes, t_known = _watch(procs, logs, case.says, deadline)
        out.seconds = time.monotonic() - t0
        out.reaction = None if t_known is None else time.monotonic() - t_known
        out.left = _left([p.pid for p in procs])
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
        if fd is not None:
            os.close(fd)
    out.stderr = [(d / f"launch{i}.err").read_text(errors="replace") for i in range(len(procs))]
    return out


@pytest.fixture(scope="module")
def outcomes(world: World, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[Case, Outcome]]]:
    """Every case of the table, run PARALLEL at a time."""
    tmp = tmp_path_factory.mktemp("bad-input-runs")
    for name in ("rv1", "rv2", "rv3", "tr1", "tr2", "tr3"):
        (tmp / name).mkdir()
    # the torchrun rows are the longest (torch imports): start them early, but one at a time
    rows = [c for c in _cases(world, tmp) if TORCHRUN is not None or not c.torch]
    torch_rows, others = [c for c in rows if c.torch], [c for c in rows if not c.torch]
    cases = []
    for i, c in enumerate(others):
        if i % (PARALLEL * 2) == 0 and torch_rows:
            cases.append(torch_rows.pop(0))
        cases.append(c)
    cases += torch_rows
    t0 = time.monotonic()
    with ThreadPoolExecutor(PARALLEL) as pool:
        results = list(pool.map(lambda c: _run(c, tmp), cases))
    print(f"\nbad-input table: {len(cases)} rows in {time.monotonic() - t0:.1f} s, {PARALLEL} at a time")
    for c, r in zip(cases, results):
        print(f"  {r.seconds:5.1f} s (reaction {r.reaction or 0:4.1f} s)  {r.codes}  {c.name}")
    yield {c.name: (c, r) for c, r in zip(cases, results)}


#: the rows' names (the table built over placeholder paths: nothing is read at collection)
_NOWHERE = Path("/nonexistent")
CASE_NAMES = [c.name for c in _cases(World(*(_NOWHERE,) * 8), _NOWHERE, make_dirs=False)]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_bad_input(outcomes: dict[str, tuple[Case, Outcome]], name: str) -> None:
    """One row: exit codes, one line per launch, time, nothing left running."""
    if name not in outcomes:
        pytest.skip("torchrun is not installed (the torch extra)")
    case, out = outcomes[name]
    why = _check(case, out)
    assert not why, f"{name}: {why} (codes {out.codes}, {out.seconds:.1f} s)\n" + "\n".join(
        f"launch {i} stderr:\n{s[-2000:]}" for i, s in enumerate(out.stderr))


def _check(case: Case, out: Outcome) -> str:
    if any(c is None for c in out.codes):
        return f"still running after {HARD_KILL} s (--timeout {TIMEOUT}): codes {out.codes}"
    # torchrun exits 1 whatever its workers' code, and says theirs in its report
    want = [1 if cmd[0] == (TORCHRUN or "torchrun") else case.code for cmd in case.launches]
    if out.codes != want:
        return f"exit codes {out.codes}, expected {want}"
    if case.torch and f"exitcode  : {case.code}" not in out.stderr[-1]:
        return f"torchrun does not report its workers' exit code {case.code}"
    if out.reaction is None:
        return "a launch never printed the problem"
    limit = REACTION["torch" if case.torch else "mpi"]
    if out.reaction > limit:
        return (f"{out.reaction:.1f} s from the problem being printed to the last exit (limit {limit} s, "
                f"--timeout {TIMEOUT})")
    if out.left:
        return f"processes left running: {out.left}"
    for i, err in enumerate(out.stderr):
        naming = [ln for ln in err.splitlines() if case.says in ln]
        if len(naming) != 1:
            return f"launch {i}: {len(naming)} lines name the problem ({case.says!r}), expected exactly one"
        if "streamer/" in err or "formats/" in err:
            return f"launch {i}: a traceback of ours"
    return ""
