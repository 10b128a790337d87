"""The ``docs`` tier: every example in README.md and docs/**/*.md runs, and every relative link resolves.

Each document's examples run in order, in one fresh scratch directory per document, as one bash
script (so a variable or a ``cd`` carries over from block to block, as it does for a reader who
pastes them into one shell). The conventions, also written in docs/README.md:

- a ```` ```bash ```` or ```` ```sh ```` block runs; a ```` ```python ```` block runs with ``python``;
- ``<!-- norun: WHY -->`` on the line before a fence: the block is shown, never run (it needs a
  GPU, a cluster, the network, or a long time); the reason is required;
- ``<!-- file: NAME -->`` on the line before a fence: the block's text is written to NAME in the
  scratch directory (a script or a manifest the next commands use) instead of being run;
- any other language (``text`` for output, ``json``) is shown only; every fence names a language,
  so a command cannot slip past the test in an unlabelled block.

The environment is a new user's after the install steps: the venv's ``bin`` first on ``PATH``,
``HYDRA_LAUNCHER=fork``, ``OMP_NUM_THREADS=1``; ``REPO`` (and ``PYTHONPATH``) is the repository
root, which examples name when they use a file shipped in it (``$REPO/examples/...``).

A failing example fails its document's test, naming the file, the line and the command, with the
tail of the output. Pages run concurrently (``SHARDSTREAM_DOCS_JOBS`` workers, default one per core
up to 4): they are independent, and most of their time is starting processes.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_VENV_BIN = REPO / ".venv" / "bin"
BIN = _VENV_BIN if (_VENV_BIN / "shardstream").exists() else Path(sys.executable).parent
DOCS = sorted([REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))])
#: one document's examples, all together (the whole tier is meant to take about a minute)
DOC_TIMEOUT_S = 300
RUN_LANGS = {"bash", "sh", "python"}
SHOWN_LANGS = {"text", "json", "console", "toml", "yaml", "diff"}
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
MARKER = re.compile(r"^\s*<!--\s*(norun|file)\s*:\s*(.*?)\s*-->\s*$")
EOF_TAG = "__SHARDSTREAM_DOC_EOF__"
#: rough seconds each page's examples take on 2 cores (measured), to start the longest first
PAGE_SECONDS = {"docs/megatron.md": 21, "README.md": 14, "docs/cli/refit.md": 10, "docs/cli/bench.md": 9,
                "docs/refit.md": 8, "docs/cli/convert.md": 7, "docs/cli/import.md": 5, "docs/cli/layout.md": 3,
                "docs/cli/simulate.md": 2}


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # 1-based line of the first code line
    lang: str
    text: str
    marker: str | None  # "norun" or "file"
    arg: str  # the marker's reason or file name

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(REPO)}:{self.line}"


def blocks_of(doc: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, each with the marker on the line before its fence."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        j = i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence) and lines[j].strip() == fence[0] * len(
                lines[j].strip())):
            j += 1
        if j >= len(lines):
            raise AssertionError(f"{doc.relative_to(REPO)}:{i + 1}: code fence never closed")
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.match(lines[k]) if k >= 0 else None
        body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j])
        out.append(Block(doc, i + 2, lang, body + "\n", mk.group(1) if mk else None, mk.group(2) if mk else ""))
        i = j + 1
    return out


def block_problems(b: Block) -> list[str]:
    if not b.lang:
        return [f"{b.where}: a code block without a language (bash, python, text, json, ...)"]
    if b.lang not in RUN_LANGS | SHOWN_LANGS:
        return [f"{b.where}: unknown code block language {b.lang!r}"]
    if b.marker == "norun" and not b.arg:
        return [f"{b.where}: <!-- norun: --> needs a reason"]
    if b.marker == "file" and (not b.arg or b.arg.startswith("/") or ".." in b.arg.split("/")):
        return [f"{b.where}: <!-- file: NAME --> needs a file name inside the scratch directory"]
    return []


def build_script(doc: Path, blocks: list[Block], work: Path) -> tuple[str, dict[int, tuple[Block, int]]]:
    """One bash script for a document's runnable blocks, and script line -> (block, line in the doc)."""
    lines = ["set -eEo pipefail",
             f"trap 'echo \"{EOF_TAG} $LINENO $? $BASH_COMMAND\" >&2' ERR"]
    where: dict[int, tuple[Block, int]] = {}

    def add(text: str, b: Block, doc_line: int) -> None:
        lines.append(text)
        where[len(lines)] = (b, doc_line)

    for n, b in enumerate(blocks):
        if b.marker == "norun":
            continue
        if b.marker == "file":
            add(f"cat > {shlex.quote(b.arg)} <<'{EOF_TAG}'", b, b.line - 1)
            lines.extend(b.text.splitlines())
            lines.append(EOF_TAG)
        elif b.lang == "python":
            path = work / "blocks" / f"{doc.stem}-line{b.line}.py"
            path.parent.mkdir(exist_ok=True)
            path.write_text(b.text)
            add(f"python {shlex.quote(str(path))}", b, b.line - 1)
        elif b.lang in ("bash", "sh"):
            for k, text in enumerate(b.text.splitlines()):
                add(text, b, b.line + k)
    lines.append("wait")
    return "\n".join(lines) + "\n", where


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HYDRA_LAUNCHER="fork", OMP_NUM_THREADS="1", REPO=str(REPO),
               PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}",
               PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])]))
    env.pop("SHARDSTREAM_DEBUG", None)
    return env


@dataclass
class Run:
    rc: int | None  # None: timed out
    log: str
    where: dict[int, tuple[Block, int]]


def run_doc(doc: Path, tmp: Path) -> Run | None:
    """Run a document's examples as one bash script in ``tmp/scratch`` (None: nothing to run)."""
    runnable = [b for b in blocks_of(doc) if b.marker != "norun" and (b.lang in RUN_LANGS or b.marker == "file")]
    if not any(b.lang in RUN_LANGS and b.marker is None for b in runnable):
        return None  # a page of prose and output samples; its links are still checked
    work = tmp / "scratch"
    work.mkdir(parents=True)
    script, where = build_script(doc, runnable, tmp)
    (tmp / "doc.sh").write_text(script)
    log = tmp / "output.log"
    with open(log, "wb") as out:
        p = subprocess.Popen(["bash", str(tmp / "doc.sh")], cwd=work, env=_env(), stdout=out,
                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc: int | None = p.wait(DOC_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            try:  # the whole session: background jobs an example left behind, or all of it on a timeout
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
    return Run(rc, log.read_text(errors="replace"), where)


@pytest.fixture(scope="module")
def doc_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Path, Future[Run | None]]]:
    """Every selected document's run, started together on ``SHARDSTREAM_DOCS_JOBS`` workers (default:
    one per core, at most 4): pages are independent, and most of their time is process start-up."""
    docs = [it.callspec.params["doc"] for it in request.session.items
            if it.originalname == "test_examples_run" and hasattr(it, "callspec")]
    jobs = int(os.environ.get("SHARDSTREAM_DOCS_JOBS", min(4, os.cpu_count() or 1)))
    # the longest pages first, so that none starts last and runs alone
    docs.sort(key=lambda d: -PAGE_SECONDS.get(str(d.relative_to(REPO)), 1))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        runs = {d: pool.submit(run_doc, d, tmp_path_factory.mktemp(d.stem)) for d in docs}
        yield runs


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_examples_run(doc: Path, doc_runs: dict[Path, Future[Run | None]]) -> None:
    problems = [p for b in blocks_of(doc) for p in block_problems(b)]
    assert not problems, "\n".join(problems)
    run = doc_runs[doc].result()
    if run is None:
        return
    name = doc.relative_to(REPO)
    tail = "\n".join(run.log.splitlines()[-40:])
    if run.rc is None:
        pytest.fail(f"{name}: the examples did not finish in {DOC_TIMEOUT_S} s\n{tail}")
    if run.rc != 0:
        fails = [ln.split(" ", 3) for ln in run.log.splitlines() if ln.startswith(EOF_TAG + " ")]
        if fails:
            _, lineno, status, cmd = (fails[0] + ["", "", "", ""])[:4]
            b, doc_line = run.where.get(int(lineno), (None, 0))
            place = f"{name}:{doc_line}" if b else f"{name} (script line {lineno})"
            pytest.fail(f"{place}: exit {status}: {cmd}\n--- output (last 40 lines) ---\n{tail}")
        pytest.fail(f"{name}: the examples exited {run.rc}\n--- output (last 40 lines) ---\n{tail}")


# ---------------------------------------------------------------------------------------------- links
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose(doc: Path) -> list[tuple[int, str]]:
    """(line number, text) outside code fences, with inline code removed."""
    out, fence = [], None
    for n, ln in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
        m = FENCE.match(ln)
        if m and fence is None:
            fence = m.group(2)
            continue
        if fence is not None:
            if ln.strip() == fence[0] * len(ln.strip()) and ln.strip().startswith(fence):
                fence = None
            continue
        out.append((n, ln))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, ln in _prose(doc):
        m = HEADING.match(ln)
        if not m:
            continue
        s = slug(m.group(2))
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.add(s if k == 0 else f"{s}-{k}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(REPO)) for d in DOCS])
def test_links_resolve(doc: Path) -> None:
    problems = []
    for n, ln in _prose(doc):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", ln)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                problems.append(f"{doc.relative_to(REPO)}:{n}: link to {target}: {path} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{doc.relative_to(REPO)}:{n}: link to {target}: no heading #{anchor} in "
                                f"{dest.relative_to(REPO)}")
    assert not problems, "\n".join(problems)


def test_docs_found() -> None:
    """The tier reads the files it should: the README and a page per command at least."""
    names = {str(d.relative_to(REPO)) for d in DOCS}
    assert "README.md" in names and len(names) > 10, names
    assert sum(b.lang in RUN_LANGS and b.marker is None for d in DOCS for b in blocks_of(d)) > 20


def test_every_command_has_a_page() -> None:
    """``shardstream --help`` lists the commands; each has ``docs/cli/COMMAND.md``, linked from the index."""
    out = subprocess.run(["shardstream", "--help"], env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    # the subcommands: "    NAME    help" lines under "COMMAND" (argparse's choices list)
    commands = re.findall(r"^    ([a-z][a-z-]*)\s{2,}\S", out.stdout, re.M)
    assert len(commands) >= 10, out.stdout
    index = (REPO / "docs" / "README.md").read_text(encoding="utf-8")
    missing = [c for c in commands if not (REPO / "docs" / "cli" / f"{c}.md").exists()]
    unlinked = [c for c in commands if f"(cli/{c}.md)" not in index]
    assert not missing and not unlinked, f"no page: {missing}; not linked from docs/README.md: {unlinked}"


#: a repository path named in prose or code spans: ``formats/...``, ``streamer/...``, ``scripts/...``
