"""Compare two safetensors files tensor by tensor (names, dtypes, shapes, bytes); exit 1 on any
difference. Used by the demo; never imported."""

from __future__ import annotations

import hashlib
import sys

from formats.safetensors.io import SafetensorsReader


def main(a: str, b: str) -> int:
    with SafetensorsReader(a) as ra, SafetensorsReader(b) as rb:
        ta, tb = ra.header.tensors, rb.header.tensors
        problems = [f"{n}: only in {a}" for n in ta if n not in tb] + [f"{n}: only in {b}" for n in tb if n not in ta]
        total = 0
        for n, st in ta.items():
            if n not in tb:
                continue
            o = tb[n]
            if (st.dtype, tuple(st.shape)) != (o.dtype, tuple(o.shape)):
                problems.append(f"{n}: {st.dtype.name}{list(st.shape)} vs {o.dtype.name}{list(o.shape)}")
                continue
            if hashlib.sha256(ra.read(n).tobytes()).digest() != hashlib.sha256(rb.read(n).tobytes()).digest():
                problems.append(f"{n}: bytes differ")
            total += st.nbytes
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        print(f"DIFFERENT: {len(problems)} problem(s)")
        return 1
    print(f"identical: {len(ta)} tensors, {total / 1e6:.1f} MB compared byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
