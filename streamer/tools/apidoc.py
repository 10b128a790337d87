"""Generate docs/api.md, the Python API reference, from the code's own docstrings and field comments.

    .venv/bin/python -m streamer.tools.apidoc            # writes docs/api.md
    .venv/bin/python -m streamer.tools.apidoc --check    # exit 1 when docs/api.md is out of date

The sources are read with ``ast``, never imported: the vLLM classes need vLLM, which the core venv
does not have, and reading keeps the page the same on every machine. ``tests/unit/test_apidoc.py``
fails when the page and the code differ.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "api.md"


@dataclass(frozen=True)
class Entry:
    """One documented object: ``module`` (dotted), ``name`` (a class or a function), and for a
    class the public methods to show (None: every public one)."""

    module: str
    name: str
    methods: tuple[str, ...] | None = None
    #: show the dataclass fields (not for a class built by a factory: ``RefitSession.open``)
    fields: bool = True


#: the page, section by section: what a trainer, an engine and a script reach for
SECTIONS: tuple[tuple[str, str, tuple[Entry, ...]], ...] = (
    ("Live refit", "`from streamer import RefitSession, RefitOptions, StepStats`", (
        Entry("streamer.refit.session", "RefitSession",
              ("open", "push", "pull", "close", "replica_sessions", "version", "await_receipts", "refuse",
               "save", "local_tensors", "forget_base", "staging_bytes", "quant_report"), fields=False),
        Entry("streamer.refit.options", "RefitOptions", ()),
        Entry("streamer.refit.session", "StepStats", ()),
        Entry("streamer.refit.fleet", "ReplicaResult", ()),
    )),
    ("Manifests from live models", "`from streamer import manifest_from_state_dict, manifest_from_megatron`", (
        Entry("streamer.refit.torch_state", "manifest_from_state_dict"),
        Entry("streamer.refit.megatron", "manifest_from_megatron"),
    )),
    ("The vLLM backend", "`weight_transfer_config={\"backend\": \"shardstream\"}` (engine) and "
                         "`WeightTransferTrainerFactory` (trainer); needs vLLM 0.32", (
        Entry("streamer.vllm.engine", "ShardstreamInitInfo", ()),
        Entry("streamer.vllm.engine", "ShardstreamUpdateInfo", ()),
        Entry("streamer.vllm.trainer", "ShardstreamTrainerInitInfo", ("engine_init_info",)),
        Entry("streamer.vllm.trainer", "ShardstreamTrainerEngine", ("trainer_init", "send_weights", "shutdown")),
        Entry("streamer.vllm.manifest", "manifest_from_vllm"),
        Entry("streamer.vllm.lora", "adapter_names"),
    )),
)


def _path(module: str) -> Path:
    base = ROOT.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _find(tree: ast.Module, name: str) -> ast.ClassDef | ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return node
    raise LookupError(name)


def _doc(node: ast.AST) -> str:
    text = ast.get_docstring(node) if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.Module)) else None
    return (text or "").strip()


def _signature(fn: ast.FunctionDef) -> str:
    args = fn.args
    shown = ast.unparse(ast.arguments(posonlyargs=args.posonlyargs, args=[a for a in args.args
                                                                           if a.arg not in ("self", "cls")],
                                      vararg=args.vararg, kwonlyargs=args.kwonlyargs, kw_defaults=args.kw_defaults,
                                      kwarg=args.kwarg, defaults=args.defaults[-len(args.args):] if args.defaults
                                      else []))
    ret = f" -> {ast.unparse(fn.returns)}" if fn.returns is not None else ""
    return f"{fn.name}({shown}){ret}"


def _comment(lines: list[str], lineno: int) -> str:
    """The ``#:`` comment lines right above line ``lineno`` (1-based), joined."""
    out: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith("#:"):
        out.insert(0, lines[i].strip()[2:].strip())
        i -= 1
    return " ".join(out)


def _fields(cls: ast.ClassDef, lines: list[str]) -> list[str]:
    rows = []
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and not node.target.id.startswith("_"):
            default = "" if node.value is None else ast.unparse(node.value)
            if default.startswith("field(default_factory="):
                default = default[len("field(default_factory="):-1] + "()"
            rows.append(f"| `{node.target.id}` | `{ast.unparse(node.annotation)}` | "
                        f"{f'`{default}`' if default else 'required'} | {_comment(lines, node.lineno)} |")
    return rows


def _base_fields(cls: ast.ClassDef, tree: ast.Module) -> list[str]:
    """The fields of a base class imported from this package (``StepStats(ExecStats)``)."""
    rows: list[str] = []
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and any(a.name == base.id for a in node.names):
                if node.module.split(".")[0] in ("streamer", "formats"):
                    btree = ast.parse(_path(node.module).read_text())
                    rows += _fields(_find(btree, base.id), _path(node.module).read_text().splitlines())  # type: ignore[arg-type]
    return rows


def _method(node: ast.FunctionDef) -> str:
    deco = {ast.unparse(d) for d in node.decorator_list}
    kind = "property" if "property" in deco else "classmethod" if "classmethod" in deco else ""
    head = f"`{node.name}`" if kind == "property" else f"`{_signature(node)}`"
    body = _doc(node) or "(no docstring)"
    return f"- {head}{f' ({kind})' if kind else ''}: " + body.replace("\n", "\n  ")


def _entry(e: Entry) -> list[str]:
    src = _path(e.module).read_text()
    tree, lines = ast.parse(src), src.splitlines()
    node = _find(tree, e.name)
    rel = _path(e.module).relative_to(ROOT).as_posix()
    if isinstance(node, ast.FunctionDef):
        return [f"### `{e.module}.{e.name}`", "", f"`{_signature(node)}` ([source]({'../' + rel}))", "",
                _doc(node) or "(no docstring)", ""]
    out = [f"### `{e.module}.{e.name}`", "", f"class `{node.name}` ([source]({'../' + rel}))", "",
           _doc(node) or "(no docstring)", ""]
    rows = _base_fields(node, tree) + _fields(node, lines) if e.fields else []
    if rows:
        out += ["| field | type | default | meaning |", "|---|---|---|---|", *rows, ""]
    funcs = {n.name: n for n in node.body if isinstance(n, ast.FunctionDef)}
    wanted = e.methods if e.methods is not None else tuple(n for n in funcs if not n.startswith("_"))
    missing = [m for m in wanted if m not in funcs]
    if missing:
        raise LookupError(f"{e.module}.{e.name} has no {', '.join(missing)}")
    out += [_method(funcs[m]) for m in wanted]
    return out + ([""] if wanted else [])


def render() -> str:
    out = ["# Python API reference", "",
           "Generated from the docstrings and field comments by `python -m streamer.tools.apidoc`; "
           "`tests/unit/test_apidoc.py` fails when this page and the code differ. The guides: "
           "[refit](refit.md), [vLLM](vllm.md), [Megatron](megatron.md).", ""]
    for title, how, entries in SECTIONS:
        out += [f"## {title}", "", how + ".", ""]
        for e in entries:
            out += _entry(e)
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m streamer.tools.apidoc", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/api.md is out of date")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE.relative_to(ROOT)} is out of date: run python -m streamer.tools.apidoc", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
