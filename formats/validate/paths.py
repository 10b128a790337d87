"""The rules for a manifest's ``source.file``: a relative path that stays inside the manifest's
directory (symlinks included), and ``{rank}`` patterns. No data file is opened.
"""

from __future__ import annotations

import os
import stat
import string
from pathlib import Path, PureWindowsPath

__all__ = ["check_file_path", "check_file_pattern", "expand_file", "file_kind"]


def check_file_path(base_dir: Path | None, rel: str) -> str | None:
    """The problem with ``rel`` as a manifest ``source.file`` (already ``{rank}``-expanded), or None.

    Syntax: relative, ``/``-separated, no ``..``, no empty component, no backslash, no NUL, no
    drive. With ``base_dir``: the real path must stay inside the real ``base_dir`` (symlinks
    included), and an existing entry must be a regular file or a directory (zarr group). The
    file need not exist.
    """
    if not isinstance(rel, str) or rel == "":
        return f"path {rel!r} is empty (expected a relative path inside the manifest's directory)"
    if "\x00" in rel:
        return f"path {rel!r} contains a NUL byte (expected a plain relative path)"
    if "\\" in rel:
        return f"path {rel!r} contains a backslash (expected '/' as the only separator)"
    win = PureWindowsPath(rel)
    if rel.startswith("/") or win.drive or win.is_absolute():
        return f"path {rel!r} is absolute (expected a relative path inside the manifest's directory)"
    parts = rel.split("/")
    if any(p == ".." for p in parts):
        return f"path {rel!r} contains '..' (expected a path inside the manifest's directory)"
    if any(p == "" for p in parts):
        return f"path {rel!r} has an empty component (expected 'dir/name' with no '//' or trailing '/')"
    if base_dir is None:
        return None
    try:
        base_real = os.path.realpath(base_dir)
        target = os.path.realpath(os.path.join(base_real, rel))
        if os.path.commonpath([base_real, target]) != base_real:
            return (f"path {rel!r} resolves outside the manifest's directory "
                    f"(expected inside {base_real}, got {target})")
        try:
            st = os.stat(target)
        except FileNotFoundError:
            return None
        except OSError as e:  # a symlink loop, permissions...
            return f"path {rel!r} cannot be examined ({e.strerror or e})"
    except (OSError, ValueError) as e:
        return f"path {rel!r} cannot be resolved ({e})"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return f"path {rel!r} is a {file_kind(st.st_mode)} (expected a regular file or a directory)"
    return None


def file_kind(mode: int) -> str:
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISFIFO(mode):
        return "named pipe"
    if stat.S_ISSOCK(mode):
        return "socket"
    return "special file"


def check_file_pattern(f: str) -> str | None:
    """Problem with a ``source.file`` ``{rank}`` pattern, or None (also None without braces)."""
    if "{" not in f:
        return None
    try:
        parsed = list(string.Formatter().parse(f))
    except ValueError as e:
        return f"source.file pattern {f!r} is not a valid format string ({e})"
    for _lit, field, spec, conv in parsed:
        if field is None:
            continue
        if field != "rank":
            return (f"source.file pattern {f!r} uses field {{{field}}} "
                    f"(expected only {{rank}}, e.g. 'rank-{{rank:05d}}.safetensors')")
        if conv is not None:
            return f"source.file pattern {f!r} uses conversion !{conv} (expected plain {{rank}} or {{rank:SPEC}})"
        if spec and ("{" in spec or "}" in spec):
            return f"source.file pattern {f!r} has a nested field in its format spec (expected e.g. {{rank:05d}})"
    try:
        f.format(rank=0)
    except (KeyError, ValueError, IndexError, AttributeError, TypeError) as e:
        return f"source.file pattern {f!r} does not format with an integer rank ({type(e).__name__}: {e})"
    return None


def expand_file(f: str, rank: int) -> str:
    return f.format(rank=rank) if "{" in f else f
