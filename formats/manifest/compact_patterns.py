"""Local tensor name patterns of compact manifests: ``{layer}`` (the integer after ``layers.``
in an array's name) and ``{expert}`` (after ``experts.``), optionally shifted (``{layer-4}``);
``{{`` / ``}}`` are literal braces. Filled per array (:func:`fill_pattern`), found from a name
(:func:`templatize`). No I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from functools import lru_cache

__all__ = ["array_vars", "check_pattern", "fill_pattern", "templatize"]

_VAR_OF = {"layers": "layer", "experts": "expert", "local_experts": "expert"}
_VARS_RE = re.compile(r"(?<![^.])(layers|experts|local_experts)\.(\d+)(?![^.])")
_TOKEN_RE = re.compile(r"\{\{|\}\}|\{([a-z]+)(?:([+-])(\d+))?\}|[{}]")


@lru_cache(maxsize=1 << 18)
def array_vars(fqn: str) -> Mapping[str, int]:
    """The pattern variables of an array name: ``{layer}`` and ``{expert}`` (first occurrence);
    cached (each array's name is read on both sides of a plan and again for its local tensor),
    so the mapping is shared: do not modify it.

    >>> array_vars("model.layers.3.mlp.experts.17.gate_proj.weight")
    {'layer': 3, 'expert': 17}
    """
    # _VARS_RE by components: as exact, several times faster (every array's name is read)
    out: dict[str, int] = {}
    parts = fqn.split(".")
    for name, num in zip(parts, parts[1:]):
        var = _VAR_OF.get(name)
        if var is not None and num.isdecimal():
            out.setdefault(var, int(num))
    return out


def check_pattern(pattern: str) -> str | None:
    """None when ``pattern`` is a well-formed tensor pattern, else what is wrong."""
    for m in _TOKEN_RE.finditer(pattern):
        tok = m.group(0)
        if tok in ("{", "}"):
            return f"tensor pattern {pattern!r} has a lone {tok!r} (write {tok * 2} for a literal brace)"
        if m.group(1) is not None and m.group(1) not in ("layer", "expert"):
            return f"tensor pattern {pattern!r} uses {{{m.group(1)}}} (expected {{layer}} or {{expert}})"
    return None


def fill_pattern(pattern: str, fqn: str, vs: Mapping[str, int] | None = None) -> str:
    """The local tensor name of array ``fqn`` under ``pattern`` (ValueError naming what is missing);
    ``vs``: :func:`array_vars` of ``fqn`` when the caller has it.

    >>> fill_pattern("decoder.layers.{layer-4}.mlp.linear_fc1.weight", "model.layers.6.mlp.up_proj.weight")
    'decoder.layers.2.mlp.linear_fc1.weight'
    """
    if "{" not in pattern and "}" not in pattern:
        return pattern
    if vs is None:
        vs = array_vars(fqn)
    fmt, fields = _format_of(pattern)
    if fmt is not None:  # the common case, one str.format (every array's name is filled)
        try:
            values = [vs[var] + delta for var, delta in fields]
        except KeyError:
            values = [-1]
        if min(values, default=0) >= 0:
            return fmt.format(*values)
    parts: list[str] = []  # the slow path names what is wrong
    for t in _tokens(pattern):
        if isinstance(t, str):
            parts.append(t)
            continue
        tok, var, delta = t
        if var is None or var not in vs:
            raise ValueError(f"tensor pattern {pattern!r} needs {tok} but the array name has no "
                             f"'{'layers' if var == 'layer' else 'experts'}.N' part")
        v = vs[var] + delta
        if v < 0:
            raise ValueError(f"tensor pattern {pattern!r} gives a negative {var} ({v})")
        parts.append(str(v))
    return "".join(parts)


@lru_cache(maxsize=65536)
def _format_of(pattern: str) -> tuple[str | None, tuple[tuple[str, int], ...]]:
    """``pattern`` as a ``str.format`` template and its (variable, shift) fields; None when it
    has a lone brace."""
    fmt: list[str] = []
    fields: list[tuple[str, int]] = []
    for t in _tokens(pattern):
        if isinstance(t, str):
            fmt.append(t.replace("{", "{{").replace("}", "}}"))
        elif t[1] is None:
            return None, ()
        else:
            fmt.append("{}")
            fields.append((t[1], t[2]))
    return "".join(fmt), tuple(fields)


@lru_cache(maxsize=65536)
def _tokens(pattern: str) -> tuple[str | tuple[str, str | None, int], ...]:
    """``pattern`` parsed once: literal text, and ``(token, variable, shift)`` for each
    ``{layer±k}`` / ``{expert±k}`` (variable None: a lone brace). Arrays of a layout share its
    pattern, so validation parses each once, not once per array."""
    out: list[str | tuple[str, str | None, int]] = []
    last = 0
    for m in _TOKEN_RE.finditer(pattern):
        out.append(pattern[last:m.start()])
        tok = m.group(0)
        if tok in ("{{", "}}"):
            out.append(tok[0])
        else:
            shift = int(m.group(3)) if m.group(2) else 0
            out.append((tok, m.group(1), -shift if m.group(2) == "-" else shift))
        last = m.end()
    out.append(pattern[last:])
    return tuple(out)


def templatize(tensor: str, fqn: str, vs: Mapping[str, int] | None = None) -> str:
    """The pattern of local tensor ``tensor`` of array ``fqn``: ``layers.N`` / ``experts.N`` parts
    become ``{layer±k}`` / ``{expert±k}`` relative to the array's own numbers (``vs``: its
    :func:`array_vars`, when the caller has them)."""
    if vs is None:
        vs = array_vars(fqn)
    parts: list[str] = []
    last = 0
    for m in _VARS_RE.finditer(tensor):
        var = _VAR_OF[m.group(1)]
        parts.append(_escape(tensor[last:m.start(2)]))
        if var in vs:
            d = int(m.group(2)) - vs[var]
            parts.append("{" + var + (f"+{d}" if d > 0 else f"-{-d}" if d < 0 else "") + "}")
        else:
            parts.append(m.group(2))
        last = m.end(2)
    parts.append(_escape(tensor[last:]))
    return "".join(parts)


def _escape(s: str) -> str:
    return s.replace("{", "{{").replace("}", "}}")
