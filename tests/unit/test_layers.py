"""The folders are layers, and imports flow one way between them (issue 26).

``streamer/`` is grouped along the data flow::

    formats  <-  plan  <-  ops  <-  execute / transport  <-  refit  <-  cli, tools
                                                convert (offline) <-/

and ``formats/`` inside, in ARCHITECTURE.md's order (each package imports only those above it)::

    errors  <-  files, integrity  <-  manifest <-> layouts  <-  safetensors, zarr  <-  validate
            <-  dcp  <-  megatron;   store (reads every format);   quant

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` alike (a lazy
import that breaks a rule is still a dependency for a reader).
"""

from __future__ import annotations

import re
from pathlib import Path

from test_imports import import_graph

#: layer -> packages it must never import
FORBIDDEN = {
    "formats": ("streamer",),
    "streamer.plan": ("streamer.ops", "streamer.execute", "streamer.transport", "streamer.refit",
                      "streamer.convert", "streamer.cli", "streamer.tools"),
    "streamer.ops": ("streamer.execute", "streamer.transport", "streamer.refit", "streamer.convert",
                     "streamer.cli", "streamer.tools"),
    "streamer.execute": ("streamer.refit", "streamer.convert", "streamer.cli", "streamer.tools"),
    "streamer.transport": ("streamer.execute", "streamer.refit", "streamer.convert", "streamer.cli",
                           "streamer.tools"),
    # the live path never imports the offline converter
    "streamer.refit": ("streamer.convert", "streamer.cli", "streamer.tools"),
    "streamer.convert": ("streamer.refit", "streamer.transport", "streamer.execute", "streamer.cli",
                         "streamer.tools"),
}


#: the top-level entries of formats/, down the flow: each imports only entries before it
FORMATS_ORDER = ("formats.errors", "formats.files", "formats.integrity", "formats.manifest", "formats.layouts",
                 "formats.safetensors", "formats.zarr", "formats.validate", "formats.dcp", "formats.megatron",
                 "formats.store", "formats.quant")
#: the imports up the list that are allowed: the compact form (manifest.compact, compact_fit) is
#: written in the mesh and placements of layouts.mesh, and layouts build manifests
FORMATS_UP = {("formats.manifest", "formats.layouts")}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        for layer, banned in FORBIDDEN.items():
            if not _in(mod, layer):
                continue
            out += [f"{mod} imports {d} (the {layer} layer never imports {b})"
                    for d in sorted(deps) for b in banned if _in(d, b)]
    return out


def _formats_entry(module: str) -> str | None:
    return ".".join(module.split(".")[:2]) if module.startswith("formats.") else None


def formats_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        if (src := _formats_entry(mod)) is None or src not in FORMATS_ORDER:
            continue
        for d in sorted(deps):
            dst = _formats_entry(d)
            if (dst is not None and dst != src and (src, dst) not in FORMATS_UP
                    and (dst not in FORMATS_ORDER or FORMATS_ORDER.index(dst) > FORMATS_ORDER.index(src))):
                out.append(f"{mod} imports {d} ({src} comes before {dst} in formats/)")
    return out


def test_layers_import_one_way() -> None:
    bad = layer_violations(import_graph())
    assert bad == [], "\n".join(bad)


def test_formats_packages_import_one_way() -> None:
    bad = formats_violations(import_graph())
    assert bad == [], "\n".join(bad)


def test_architecture_lists_formats_in_the_flow_order() -> None:
    """ARCHITECTURE.md's layer diagram names the entries of ``formats/`` in :data:`FORMATS_ORDER`."""
    text = (Path(__file__).resolve().parents[2] / "ARCHITECTURE.md").read_text(encoding="utf-8")
    block = text[text.index("\nformats/ "):text.index("\nstreamer/\n")]
    listed = [m.group(1) for m in re.finditer(r"^  (\w+)/? ", block, re.MULTILINE)]
    assert ["formats." + n for n in listed] == list(FORMATS_ORDER)


def test_every_formats_entry_has_a_place_in_the_flow() -> None:
    """A new package (or top-level module) of ``formats/`` is placed in :data:`FORMATS_ORDER`."""
    entries = {_formats_entry(m) for m in import_graph() if m.startswith("formats.")}
    assert entries == set(FORMATS_ORDER), sorted(entries ^ set(FORMATS_ORDER))


def test_every_module_is_in_a_layer() -> None:
    """A new module goes into a layer folder, not back into the flat ``streamer/``."""
    top = {m for m in import_graph() if m.count(".") == 1 and m.startswith("streamer.")}
    packages = {"streamer.plan", "streamer.ops", "streamer.execute", "streamer.transport", "streamer.refit",
                "streamer.convert", "streamer.cli", "streamer.tools", "streamer.vllm"}
    assert top - packages <= {"streamer.__main__"}, sorted(top - packages)


def test_the_checker_finds_a_violation() -> None:
    graph = {"streamer.plan.model": {"streamer.refit.session"}, "streamer.refit.session": {"streamer.plan.model"}}
    assert layer_violations(graph) == [
        "streamer.plan.model imports streamer.refit.session (the streamer.plan layer never imports streamer.refit)"]
    graph = {"formats.manifest.spec": {"formats.validate.manifest", "formats.errors"},
             "formats.manifest.compact": {"formats.layouts.mesh"}}
    assert formats_violations(graph) == [
        "formats.manifest.spec imports formats.validate.manifest (formats.manifest comes before formats.validate "
        "in formats/)"]
