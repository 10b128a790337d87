"""``formats/`` stays a short list of packages a reader can scan (issue 35): at most 12 entries
(modules other than ``__init__.py``, and subpackages), every package's ``__init__`` says in its
docstring what the package owns, the packages' ``__init__`` files import nothing but their own
modules (importing one module of a package loads no other part of ``formats``), and what
``formats`` exported before the packages still imports from ``formats``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "formats"
MAX_ENTRIES = 12

#: the names ``formats/__init__.py`` exported when its modules were one flat folder
PUBLIC = ("Box", "ShardstreamError", "ArraySpec", "Chunk", "Manifest", "Source", "TensorSpec",
          "load_manifest", "parse_manifest", "save_manifest")


def _entries(root: Path = ROOT) -> list[str]:
    out = []
    for p in sorted(root.iterdir()):
        if p.is_dir() and (p / "__init__.py").is_file():
            out.append(p.name + "/")
        elif p.suffix == ".py" and p.name != "__init__.py":
            out.append(p.name)
    return out


def test_formats_has_at_most_12_entries() -> None:
    entries = _entries()
    assert len(entries) <= MAX_ENTRIES, f"{len(entries)} entries in formats/: {entries}"


def test_every_folder_of_python_files_is_a_package() -> None:
    """A folder without ``__init__.py`` would be a namespace package the entry count misses."""
    loose = sorted(str(d.relative_to(ROOT)) for d in ROOT.rglob("*") if d.is_dir() and d.name != "__pycache__"
                   and any(d.glob("*.py")) and not (d / "__init__.py").is_file())
    assert loose == []


def test_every_package_says_what_it_owns() -> None:
    missing = [str(p.relative_to(ROOT.parent)) for p in sorted(ROOT.rglob("__init__.py"))
               if not (ast.get_docstring(ast.parse(p.read_text(encoding="utf-8"))) or "").strip()]
    assert missing == [], f"no docstring: {missing}"


def test_package_inits_import_only_their_own_modules() -> None:
    """Each subpackage's ``__init__`` stays light: no import but ``__future__`` and (layouts) its own
    modules, so ``from formats.safetensors.header import ...`` loads nothing else of the package."""
    found = []
    for init in sorted(ROOT.glob("*/__init__.py")):
        for node in ast.parse(init.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Import) or (isinstance(node, ast.ImportFrom) and node.level != 1
                                                and node.module != "__future__"):
                found.append(f"{init.relative_to(ROOT.parent)}:{node.lineno}")
    assert found == [], found


def test_public_names_still_import_from_formats() -> None:
    import formats

    assert set(PUBLIC) <= set(formats.__all__)
    missing = [n for n in PUBLIC if getattr(formats, n, None) is None]
    assert missing == []


def test_the_entry_count_sees_modules_and_packages(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text('"""A package."""\n')
    (tmp_path / "data").mkdir()
    (tmp_path / "mod.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "py.typed").write_text("")
    assert _entries(tmp_path) == ["mod.py", "pkg/"]
