"""Validate shardstream manifests in CI: ``python scripts/validate_manifests.py [--data] [--json] PATTERN...``

Each PATTERN is a path or a glob (``**`` recurses); a directory stands for ``DIR/manifest.json``.
Every manifest is parsed (``formats.manifest.wire.load_manifest``) and checked
(``formats.validate.manifest.validate_manifest``; with ``--data`` also ``validate_data``: files, headers,
byte ranges, checksums). One summary line each on stdout::

    ok PATH: N arrays, M chunks
    FAIL PATH: K problems
        PATH: ARRAY: what is wrong ...

``--json`` prints one JSON object on stdout instead (the human lines go to stderr).

Exit status: 0 all valid; 1 some manifest failed; 2 usage error or a PATTERN that matches nothing
(the manifests that did match are still validated and reported).

A launch helper: never imported by the ``formats`` / ``streamer`` packages.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from pathlib import Path
from typing import Any

try:
    from formats.errors import ShardstreamError
except ImportError:  # run from a checkout without the package installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from formats.errors import ShardstreamError

from formats.manifest.wire import load_manifest
from formats.validate.manifest import validate_data, validate_manifest


def expand(pattern: str) -> list[str]:
    """The manifest paths ``pattern`` names (sorted glob matches; a directory -> DIR/manifest.json)."""
    if glob.has_magic(pattern):
        matches = sorted(glob.glob(pattern, recursive=True))
    else:
        matches = [pattern] if os.path.lexists(pattern) else []
    return [os.path.join(m, "manifest.json") if os.path.isdir(m) else m for m in matches]


def check(path: str, data: bool) -> dict[str, Any]:
    """Validate one manifest; never raises for bad input."""
    info: dict[str, Any] = {"manifest": path}
    try:
        m = load_manifest(path)
        problems = validate_manifest(m, where=path)
        if data and not problems:
            problems = validate_data(m, where=path)
        info["arrays"] = len(m.arrays)
        info["chunks"] = m.chunk_count()
        info["world_size"] = m.world_size
    except ShardstreamError as e:
        problems = e.problems or [str(e)]
    except (OSError, UnicodeError, RecursionError, MemoryError) as e:
        problems = [f"{path}: cannot read ({type(e).__name__}: {e})"]
    info["ok"] = not problems
    info["problems"] = problems
    return info


def summary(info: dict[str, Any]) -> list[str]:
    path = info["manifest"]
    if info["ok"]:
        return [f"ok {path}: {info['arrays']} arrays, {info['chunks']} chunks"]
    k = len(info["problems"])
    return [f"FAIL {path}: {k} problems"] + [f"    {p}" for p in info["problems"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="validate_manifests.py",
                                 description="Validate shardstream manifests (globs; a directory means DIR/manifest.json).")
    ap.add_argument("patterns", nargs="+", metavar="PATTERN")
    ap.add_argument("--data", action="store_true", help="also open the files: headers, byte ranges, checksums")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout; human lines on stderr")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    human = sys.stderr if args.json else sys.stdout

    paths: list[str] = []
    unmatched: list[str] = []
    for pat in args.patterns:
        found = expand(pat)
        if not found:
            unmatched.append(pat)
        for p in found:
            if p not in paths:
                paths.append(p)
    for pat in unmatched:
        print(f"validate_manifests.py: {pat}: matches no file or directory", file=sys.stderr)

    results = []
    for p in paths:
        info = check(p, args.data)
        results.append(info)
        for line in summary(info):
            print(line, file=human)
    failed = sum(not r["ok"] for r in results)
    if args.json:
        print(json.dumps({"ok": failed == 0 and not unmatched, "data": args.data, "failed": failed,
                          "unmatched": unmatched, "manifests": results}))
    if unmatched:
        return 2
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
