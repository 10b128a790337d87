"""Every repository path and module a Markdown page names exists (issue 35: pages named moved modules,
``streamer/simulate.py`` among them, and a ``../shared`` folder beside the repository that a clone
does not have).

What a page names, checked against the repository a clone has (git's tracked and unignored files):

- a path in inline code or in a fenced block that starts with a top-level entry of the repository
  (``formats/``, ``streamer/``, ``tests/``, ``.ci/``, ...; computed from the root) or ends in
  ``.py``/``.md``/``.sh`` with a slash in it (``.json``: under a folder beside the page; elsewhere
  ``hf/manifest.json`` is what an example wrote). It resolves from the repository root, from the
  page's folder, or as the tail of a repository path (``refit/session.py``). ``$REPO/``, ``./``,
  ``:LINE`` and ``::test`` are stripped first.
- a link's target, from its page: it must exist and stay inside the repository.
- a glob or a placeholder (``*``, ``{a,b}``, ``<name>``, ``...``, and the upper-case words of
  ``PLACEHOLDERS``) is a pattern: it must match at least one repository path.
- a dotted name ``streamer.x.y`` or ``formats.x.y`` (``module:name`` too) in inline code or a fenced
  block: the longest module prefix must exist and each further name must be defined there (read
  with ``ast``, nothing imported, so vLLM- and torch-only modules are checked too; ``from ...
  import`` inside the repository and lazy ``__all__`` exports are followed; a class's methods,
  fields and ``self.x``). ``dir/module.name`` (``transport/rendezvous.join``) likewise, for a folder of
  a package.
- any ``shared/`` or ``../`` path that leaves the repository fails, wherever it appears, and so does
  the folder the repository sits in on this machine.

The failure lists every bad reference as ``FILE:LINE: what``.
"""

from __future__ import annotations

import ast
import functools
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _visible() -> set[str]:
    """The repository's files and folders as a clone has them (tracked or untracked-but-not-ignored),
    relative to the root; without git, everything on disk outside the usual build and cache folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=REPO, capture_output=True, check=True, timeout=60).stdout.decode()
        files = [f for f in out.split("\0") if f and (REPO / f).exists()]
    except (OSError, subprocess.SubprocessError):
        skip = {".git", ".venv", "__pycache__", ".mypy_cache", ".ruff_cache", ".hypothesis", ".pytest_cache"}
        files = [str(p.relative_to(REPO)) for p in REPO.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(REPO).parts)
                 and not any(s.endswith(".egg-info") for s in p.relative_to(REPO).parts)]
    out_set = set()
    for f in files:
        parts = f.split("/")
        for k in range(1, len(parts) + 1):
            out_set.add("/".join(parts[:k]))
    return out_set


VISIBLE = _visible()
TOP = {p for p in VISIBLE if "/" not in p}
TOP_DIRS = {p for p in TOP if (REPO / p).is_dir()}
PACKAGES = {p for p in TOP_DIRS if (REPO / p / "__init__.py").exists()}
#: every folder name of the repository, to the folders that hold a folder of that name
DIR_PARENTS: dict[str, set[str]] = {}
for _p in VISIBLE:
    if (REPO / _p).is_dir():
        DIR_PARENTS.setdefault(_p.rpartition("/")[2], set()).add(_p.rpartition("/")[0])


def _pages() -> list[Path]:
    pages = [REPO / p for p in VISIBLE if p.endswith(".md") and (REPO / p).is_file()]
    return sorted(pages)


PAGES = _pages()
PAGE_IDS = [str(p.relative_to(REPO)) for p in PAGES]

#: upper-case words the pages use for a name the reader picks (``shardstream COMMAND``, ``DIR/``, ``rank-N``):
#: each stands for "any name here", and the path must still match a repository path
PLACEHOLDERS = {"NAME", "COMMAND", "DIR", "N"}
#: what a path in a page ends with when it is a repository file (with a slash before it)
SOURCE_SUFFIXES = (".py", ".md", ".sh")
FILE_SUFFIXES = (*SOURCE_SUFFIXES, ".json")

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)|^\s*\[[^\]]+\]:\s*(\S+)")
#: a ``../`` path (which must stay inside the repository) or a relative ``shared/`` path (the folder beside
#: the repository a clone does not have), anywhere in a line; ``/shared/...`` is a cluster filesystem
OUTSIDE = re.compile(r"(?<![\w./-])((?:\.\./)+[\w.-]*(?:/[\w.-]+)*|shared/[\w./-]*)")
TOKEN_SPLIT = re.compile(r"[\s,;|()\[\]'\"=]+")
DOTTED = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")


def _lines(text: str) -> Iterator[tuple[int, str, bool]]:
    """(line number, text, inside a fenced block) for each line of a page, fence lines left out."""
    fence: str | None = None
    for n, ln in enumerate(text.splitlines(), 1):
        m = FENCE.match(ln)
        if m and fence is None:
            fence = m.group(1)
            continue
        if fence is not None and ln.strip().startswith(fence) and set(ln.strip()) == {fence[0]}:
            fence = None
            continue
        yield n, ln, fence is not None


def _code_tokens(text: str) -> Iterator[tuple[int, str]]:
    """Whitespace-separated words of inline code spans and of fenced blocks."""
    for n, ln, fenced in _lines(text):
        codes = [ln] if fenced else [m.group(2) for m in CODE_SPAN.finditer(ln)]
        for code in codes:
            for tok in TOKEN_SPLIT.split(code):
                if tok:
                    yield n, tok


def _links(text: str) -> Iterator[tuple[int, str]]:
    """(line number, target) of each relative link outside code, the ``#anchor`` dropped."""
    for n, ln, fenced in _lines(text):
        if fenced:
            continue
        for m in LINK.finditer(CODE_SPAN.sub("", ln)):
            target = m.group(1) or m.group(2)
            if target and not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#"):
                yield n, target.partition("#")[0]


def _clean(tok: str) -> str:
    """A word of code reduced to the path it names: no ``$REPO/``, ``./``, ``:LINE``, ``::test``, ``#anchor``,
    trailing punctuation or backslash-escapes."""
    tok = tok.replace("\\", "")
    for prefix in ("$REPO/", "${REPO}/", "./"):
        if tok.startswith(prefix):
            tok = tok[len(prefix):]
    tok = tok.split("::")[0].split("#")[0]
    tok = re.sub(r":\d+(?:-\d+)?$", "", tok)
    return tok.rstrip(".:,;`!?")


def _is_repo_path(p: str, page: Path) -> bool:
    """Whether a word of code names a repository path: it starts with a top-level entry, or it ends in
    ``.py``/``.md``/``.sh`` with a slash in it, or in ``.json`` under a folder beside the page."""
    head = p.split("/")[0]
    if head in TOP_DIRS and "/" in p:
        return True
    if head in TOP and head not in TOP_DIRS and p == head:
        return True
    if "/" not in p or p.startswith(("/", "~", "$", "-")) or "://" in p:
        return False
    if p.endswith(SOURCE_SUFFIXES):
        return True
    # the examples' outputs (``hf/manifest.json``, ``tp2/manifest.json``) are not repository paths;
    # workloads/README.md's ``models/*.config.json`` is
    return p.endswith(".json") and (page.parent / head).is_dir()


def _resolves(p: str, page: Path) -> bool:
    """A path from the repository root, from the page's folder, or the tail of a repository path
    (``refit/session.py`` for ``streamer/refit/session.py``)."""
    if _exists(p):
        return True
    here = page.parent.relative_to(REPO)
    if str(here) != "." and _exists(f"{here}/{p}"):
        return True
    head = p.split("/")[0]
    return head not in TOP and any(_exists(f"{d}/{p}") for d in DIR_PARENTS.get(head, ()))


_PLACEHOLDER = re.compile(r"\*\*/?|\*|\{[^}/]*\}|<[^>/]*>|\.\.\.|…|(?<![A-Za-z0-9])(?:" +
                          "|".join(sorted(PLACEHOLDERS, key=len, reverse=True)) + r")(?![A-Za-z0-9])")


def _pattern(p: str) -> re.Pattern[str] | None:
    """The regular expression a path with globs or placeholders stands for; None: a plain path."""
    if not _PLACEHOLDER.search(p):
        return None
    out, pos = [], 0
    for m in _PLACEHOLDER.finditer(p):
        out.append(re.escape(p[pos:m.start()]))
        s = m.group(0)
        if s.startswith("**"):
            out.append(".*")
        elif s.startswith("{"):
            out.append("(?:" + "|".join(re.escape(a) for a in s[1:-1].split(",")) + ")")
        elif s in ("...", "…"):
            out.append(".*")
        else:
            out.append("[^/]*")
        pos = m.end()
    out.append(re.escape(p[pos:]))
    return re.compile("".join(out).rstrip("/") + "/?")


def _exists(rel: str) -> bool:
    rel = rel.rstrip("/")
    if not rel:
        return True
    pat = _pattern(rel)
    if pat is None:
        return rel in VISIBLE
    return any(pat.fullmatch(v) for v in VISIBLE)


# ------------------------------------------------------------------------------------- dotted names
@functools.cache
def _module_file(mod: str) -> Path | None:
    base = REPO.joinpath(*mod.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.is_file():
            return cand
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _targets(node: ast.AST) -> Iterator[str]:
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for e in node.elts:
            yield from _targets(e)


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """The names a module or class body binds (under ``if``/``try`` too), to the node that binds each."""
    out: dict[str, ast.AST] = {}
    for st in body:
        if isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[st.name] = st
        elif isinstance(st, ast.Assign):
            for t in st.targets:
                out.update(dict.fromkeys(_targets(t), st))
        elif isinstance(st, (ast.AnnAssign, ast.AugAssign)):
            out.update(dict.fromkeys(_targets(st.target), st))
        elif isinstance(st, (ast.Import, ast.ImportFrom)):
            for a in st.names:
                out[(a.asname or a.name).split(".")[0]] = st
        elif isinstance(st, (ast.If, ast.Try)):
            for part in (st.body, st.orelse, getattr(st, "finalbody", []),
                         *[h.body for h in getattr(st, "handlers", [])]):
                out.update(_definitions(part))
    return out


def _all_names(node: ast.AST | None) -> set[str]:
    """The strings of a literal ``__all__ = [...]``."""
    if isinstance(node, ast.Assign) and isinstance(node.value, (ast.List, ast.Tuple)):
        return {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def _lazy_modules(defs: dict[str, ast.AST]) -> dict[str, str]:
    """``name -> submodule`` from the module's literal dicts of strings (``streamer._LAZY``)."""
    out: dict[str, str] = {}
    for node in defs.values():
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            for k, v in zip(node.value.keys, node.value.values):
                if isinstance(k, ast.Constant) and isinstance(v, ast.Constant) and isinstance(v.value, str):
                    out[str(k.value)] = v.value
    return out


def _class_names(cls: ast.ClassDef) -> set[str]:
    """A class's methods, class attributes and fields, and the ``self.x`` its methods assign."""
    names = set(_definitions(cls.body))
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
    return names


def _resolve_import(mod: str, st: ast.ImportFrom, name: str) -> tuple[str, str] | None:
    """(module, name) that ``from X import name`` in module ``mod`` refers to, inside the repository."""
    if st.level:
        path = _module_file(mod)
        pkg = mod if path is not None and path.name == "__init__.py" else mod.rpartition(".")[0]
        for _ in range(st.level - 1):
            pkg = pkg.rpartition(".")[0]
        src = f"{pkg}.{st.module}" if st.module else pkg
    else:
        src = st.module or ""
    if src.split(".")[0] not in PACKAGES:
        return None
    for a in st.names:
        if (a.asname or a.name) == name:
            return src, a.name
    return None


def _lookup(mod: str, names: list[str], depth: int = 0) -> bool:
    """Whether ``names[0]`` is defined in module ``mod`` (and ``names[1]`` in that class, if any)."""
    path = _module_file(mod)
    if path is None or depth > 8:
        return False
    first = names[0]
    if _module_file(f"{mod}.{first}"):
        return len(names) == 1 or _lookup(f"{mod}.{first}", names[1:], depth + 1)
    defs = _definitions(_tree(path).body)
    node = defs.get(first)
    if node is None:
        # a lazy export (``__all__`` plus a module ``__getattr__``, as ``streamer/__init__.py`` has): followed
        # where a literal ``{name: "submodule"}`` says where it lives
        if "__getattr__" not in defs or first not in _all_names(defs.get("__all__")):
            return False
        where = _lazy_modules(defs).get(first)
        return len(names) == 1 or (where is not None and _lookup(f"{mod}.{where}", names, depth + 1))
    if len(names) == 1:
        return True
    if isinstance(node, ast.ClassDef):
        return names[1] in _class_names(node) or any(  # a method or field of a base class in the same module
            isinstance(b, ast.Name) and _lookup(mod, [b.id, names[1]], depth + 1) for b in node.bases)
    if isinstance(node, ast.ImportFrom):
        target = _resolve_import(mod, node, first)
        if target is None:
            return True  # a name imported from outside the repository: not ours to check
        src, name = target
        return _lookup(src, [name, *names[1:]], depth + 1)
    return True  # an instance, a function's attribute: deeper names are not checked


#: ``dir/module.name``: a module named by its path under a package, then a name in it (ARCHITECTURE.md's
#: ``transport/rendezvous.join``)
PATH_DOTTED = re.compile(r"^([a-z_]\w*(?:/[a-z_]\w*)+)\.([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)$")
#: what follows the dot when ``dir/name.x`` is a file, not a module's name
DATA_SUFFIXES = {"json", "npy", "safetensors", "pt", "txt", "toml", "yaml", "md", "py", "sh", "log", "bin",
                 "checksums", "rdv", "zarr"}


def _path_dotted(p: str) -> tuple[bool, str | None]:
    """``dir/module.name``: (whether ``p`` is one, for a folder of a package; the problem, or None when
    the module defines the name). An example's ``hf/x.json`` is none."""
    m = PATH_DOTTED.match(p)
    if not m or m.group(2).split(".")[0] in DATA_SUFFIXES or p in VISIBLE:  # a file (``formats/py.typed``)
        return False, None
    path, names = m.group(1), m.group(2)
    head = path.split("/")[0]
    if head in PACKAGES:  # ``streamer/transport/base.Transport``
        mods = [path.replace("/", ".")]
    else:  # ``transport/rendezvous.join``: a folder of a package
        mods = [f"{d}/{path}".replace("/", ".") for d in DIR_PARENTS.get(head, ()) if d.split("/")[0] in PACKAGES]
    if not mods:
        return False, None
    found = [mod for mod in mods if _module_file(mod)]
    if not found:
        return True, f"{p}: no module {' or '.join(mods)}"
    if any(_lookup(mod, names.split(".")) for mod in found):
        return True, None
    return True, f"{p}: {found[0]} defines no {names}"


def _dotted_problem(name: str) -> str | None:
    parts = name.split(".")
    for k in range(len(parts), 0, -1):
        mod = ".".join(parts[:k])
        if _module_file(mod):
            if k == len(parts) or _lookup(mod, parts[k:]):
                return None
            return f"{name}: {mod} defines no {'.'.join(parts[k:])}"
    return f"{name}: no module {parts[0]}"


# ------------------------------------------------------------------------------------------- checks
def problems_of(doc: Path, text: str | None = None) -> list[str]:
    """Every stale reference of a page (``text``: its content, when not the file's), as ``FILE:LINE: what``."""
    where = doc.relative_to(REPO)
    if text is None:
        text = doc.read_text(encoding="utf-8")
    out: list[str] = []
    seen: set[tuple[int, str]] = set()

    def bad(n: int, what: str) -> None:
        if (n, what) not in seen:
            seen.add((n, what))
            out.append(f"{where}:{n}: {what}")

    for n, ln in enumerate(text.splitlines(), 1):
        for m in OUTSIDE.finditer(ln):
            p = m.group(1)
            if p.startswith("shared/") or "/shared" in p or not (doc.parent / p).resolve().is_relative_to(REPO):
                bad(n, f"{p} (outside the repository)")
        if len(REPO.parent.parts) > 1 and f"{REPO.parent}/" in ln:
            bad(n, f"{REPO.parent}/... (a path of this machine)")
    for n, tok in _code_tokens(text):
        p = _clean(tok)
        if not p:
            continue
        head = p.split(".")[0]
        if head in PACKAGES and re.fullmatch(r"[\w.]+:\w+", p):  # an entry point, ``module:name``
            p = p.replace(":", ".")
        if head in PACKAGES and "/" not in p and DOTTED.match(p):
            dotted = DOTTED.match(p).group(1)  # type: ignore[union-attr]
            if not dotted.endswith(FILE_SUFFIXES) and (problem := _dotted_problem(dotted)):
                bad(n, problem)
            continue
        is_module, problem = _path_dotted(p)
        if is_module:
            if problem:
                bad(n, problem)
            continue
        if p.startswith("../") or not _is_repo_path(p, doc):
            continue
        if not _resolves(p, doc):
            bad(n, f"{p} (no such repository path)")
    for n, target in _links(text):
        if not target:
            continue
        dest = (doc.parent / target).resolve()
        if not dest.is_relative_to(REPO):
            bad(n, f"{target} (link outside the repository)")
        elif not _exists(str(dest.relative_to(REPO))):
            bad(n, f"{target} (link to a missing repository path)")
    return sorted(out, key=lambda s: int(s.split(":")[1]))


@pytest.mark.parametrize("doc", PAGES, ids=PAGE_IDS)
def test_named_paths_and_modules_exist(doc: Path) -> None:
    problems = problems_of(doc)
    assert not problems, "stale references:\n" + "\n".join(problems)


def test_pages_found() -> None:
    names = set(PAGE_IDS)
    assert {"README.md", "ARCHITECTURE.md", "BENCHMARKS.md", "docs/refit.md"} <= names, names
    assert {"formats", "streamer"} <= PACKAGES and {"docs", "scripts", "tests"} <= TOP_DIRS


@pytest.mark.parametrize("ref, ok", [
    ("streamer/refit/session.py", True), ("streamer/simulate.py", False),
    ("docs/cli/COMMAND.md", True), ("docs/cli/NAME.txt", False), ("tests/unit/test_*.py", True),
    ("workloads/models/{qwen3-32b,deepseek-v3}.config.json", True), ("workloads/models/nope/", False),
])
def test_paths_and_patterns(ref: str, ok: bool) -> None:
    assert _exists(ref) is ok


@pytest.mark.parametrize("name, ok", [
    ("streamer.refit.session.RefitSession", True), ("streamer.refit.session.RefitSession.open", True),
    ("streamer.refit.session.RefitSession.no_such_method", False), ("streamer.refit", True),
    ("streamer.simulate", False), ("formats.load_manifest", True), ("streamer.refit.session.nothing", False),
    ("streamer.PushFailed", True), ("streamer.PushFailed.nothing", False), ("streamer.NoSuchName", False),
    ("streamer.RefitSession.push", True),
])
def test_dotted_names(name: str, ok: bool) -> None:
    assert (_dotted_problem(name) is None) is ok, _dotted_problem(name)


STALE_PAGE = """# a page

Run `streamer/simulate.py` (see [the guide](../../elsewhere.md) and `../shared/notes.md`).
Then `python -m streamer.simulate`, `streamer.refit.session.RefitSession.nothing`, `shared/x.json`.
See `transport/nojobs.connect`, `docs/cli/NAME.txt`, `streamer.vllm.plugin:nothing`, `formats/load.nothing`.

```bash
python $REPO/scripts/no_such_script.py --out hf/manifest.json
```

Fine: `streamer/tools/simulate.py`, `hf/manifest.json`, `docs/cli/COMMAND.md`, [refit](refit.md),
`streamer.refit.session.RefitSession.push`, `transport/rendezvous.join`, `/shared/refit.rdv`,
`streamer/transport/base.Transport`, `formats/py.typed`.
"""


def test_a_stale_page_fails_with_every_reference() -> None:
    problems = problems_of(REPO / "docs" / "page.md", STALE_PAGE)
    assert problems == [
        "docs/page.md:3: ../../elsewhere.md (outside the repository)",
        "docs/page.md:3: ../shared/notes.md (outside the repository)",
        "docs/page.md:3: streamer/simulate.py (no such repository path)",
        "docs/page.md:3: ../../elsewhere.md (link outside the repository)",
        "docs/page.md:4: shared/x.json (outside the repository)",
        "docs/page.md:4: streamer.simulate: streamer defines no simulate",
        "docs/page.md:4: streamer.refit.session.RefitSession.nothing: streamer.refit.session defines no "
        "RefitSession.nothing",
        "docs/page.md:5: transport/nojobs.connect: no module streamer.transport.nojobs",
        "docs/page.md:5: docs/cli/NAME.txt (no such repository path)",
        "docs/page.md:5: streamer.vllm.plugin.nothing: streamer.vllm.plugin defines no nothing",
        "docs/page.md:5: formats/load.nothing: no module formats.load",
        "docs/page.md:8: scripts/no_such_script.py (no such repository path)",
    ], "\n".join(problems)
