"""Command-line argument types and output shared by the ``shardstream`` subcommands
(:mod:`streamer.cli.app`, and the ones registered by library modules such as
:func:`streamer.tools.simulate.add_simulate_parser`). No other ``streamer`` imports."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

__all__ = ["emit", "parse_block", "parse_size", "positive_int"]

_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
          "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}


def parse_size(text: str) -> int:
    """``256MiB`` -> 268435456; ``1GB`` -> 10**9; plain integers are bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"invalid size {text!r} (expected bytes or a number with "
                                         "KB MB GB / KiB MiB GiB, e.g. 256MiB)")
    v = float(m.group(1)) * _UNITS[m.group(2).upper()]
    if v < 1:
        raise argparse.ArgumentTypeError(f"size {text!r} must be at least 1 byte")
    return int(v)


def parse_block(text: str) -> tuple[int, int]:
    """``128,128`` -> (128, 128): elements per scale along the last two dims."""
    m = re.fullmatch(r"\s*(\d+)\s*[,x]\s*(\d+)\s*", text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"invalid block {text!r} (expected two positive integers, e.g. 128,128)")
    return int(m.group(1)), int(m.group(2))


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def seconds(text: str) -> float:
    """A wait bound in seconds: positive and finite (0 or ``inf`` would mean no bound at all)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds (a positive number), got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds (a positive number), got {text}")
    return v


def emit(args: argparse.Namespace, obj: dict[str, Any], text: str) -> None:
    """One JSON object on stdout with --json (human text then goes to stderr), else text."""
    if getattr(args, "json", False):
        print(json.dumps(obj, sort_keys=False))
        if text:
            print(text, file=sys.stderr)
    else:
        print(text)
