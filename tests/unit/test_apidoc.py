"""docs/api.md is generated from the code's docstrings (``streamer.tools.apidoc``): it must match."""

from __future__ import annotations

from streamer.tools import apidoc


def test_the_api_page_matches_the_code() -> None:
    assert apidoc.PAGE.read_text() == apidoc.render(), "docs/api.md is out of date: run python -m streamer.tools.apidoc"


def test_every_documented_object_has_a_docstring() -> None:
    text = apidoc.render()
    assert "(no docstring)" not in text, [line for line in text.splitlines() if "(no docstring)" in line]
    for _, _, entries in apidoc.SECTIONS:
        for e in entries:
            assert f"### `{e.module}.{e.name}`" in text
