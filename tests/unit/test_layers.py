"""The folders are layers, and imports flow one way between them (issue 26).

``streamer/`` is grouped along the data flow::

    formats  <-  plan  <-  ops  <-  execute / transport  <-  refit  <-  cli, tools
                                                convert (offline) <-/

Every import counts: at module level, inside functions and under ``TYPE_CHECKING`` alike (a lazy
import that breaks a rule is still a dependency for a reader).
"""

from __future__ import annotations

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


def test_layers_import_one_way() -> None:
    bad = layer_violations(import_graph())
    assert bad == [], "\n".join(bad)


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
