"""formats.safetensors.io: golden bytes, compatibility with the official library, ranged reads,
hostile headers, atomic writer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from formats.errors import FormatError, RegionOutOfBoundsError, ShardNotFoundError
from formats.manifest.box import Box, split_box
from formats.manifest.dtypes import DTYPES
from formats.safetensors.io import (
    MAX_HEADER_BYTES,
    ReadStats,
    SafetensorsReader,
    SafetensorsWriter,
    layout_file,
    read_header,
    read_region,
    save_tensors,
)

try:  # torch is an optional dependency: only the torch-interop tests need it
    import safetensors.torch
    import torch
except ImportError:  # pragma: no cover
    torch = None  # type: ignore[assignment]

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

F32, I16, I64, BF16, U8 = (DTYPES[n] for n in ("float32", "int16", "int64", "bfloat16", "uint8"))


# --------------------------------------------------------------------------- helpers / fixtures


def _raw_file(path: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> Path:
    """Write ``length or len(header)`` as the u64 prefix, then the header, then ``data``."""
    if not isinstance(header, bytes):
        header = json.dumps(header).encode()
    n = len(header) if length is None else length
    path.write_bytes(n.to_bytes(8, "little") + header + data)
    return path


def _tbytes(t: Any) -> bytes:
    """The raw bytes of a torch tensor (works for bf16/fp8, 0-d and empty tensors)."""
    return bytes(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def _torch_cases() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "fp8": torch.randn(4, 2, 3, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),
        "mask": torch.rand(2, 3, generator=g) > 0.5,
        "f32": torch.randn(2, 2, 2, 2, generator=g),
        "scalar": torch.tensor(3.25, dtype=torch.float32),
        "scalar_bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4, dtype=torch.float32),
        "empty_bf16": torch.zeros(3, 0, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def blob(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 1 MiB file of seeded random bytes, open read-only: (fd, its bytes)."""
    data = np.random.default_rng(1234).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    p = tmp_path_factory.mktemp("blob") / "blob.bin"
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    yield fd, data
    os.close(fd)


# --------------------------------------------------------------------------- golden bytes

GOLDEN_2 = (
    b"\x88\x00\x00\x00\x00\x00\x00\x00"  # header length 136: 8 + 136 = 144 = 18 * 8
    b'{"__metadata__":{"k":"v"},'
    b'"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    b'"b":{"dtype":"I16","shape":[3],"data_offsets":[8,14]}}'
    b"   "  # 133 bytes of JSON + 3 spaces of padding
    b"\x00\x00\x80?\x00\x00\x80?"  # a = [1.0, 1.0]
    b"\x00\x00\x01\x00\x02\x00"  # b = [0, 1, 2]
)

GOLDEN_EDGE = (
    b"p\x00\x00\x00\x00\x00\x00\x00"  # 112
    b'{"s":{"dtype":"I64","shape":[],"data_offsets":[0,8]},'
    b'"z":{"dtype":"F32","shape":[0,3],"data_offsets":[8,8]}}'
    b"    "
    b"\x05\x00\x00\x00\x00\x00\x00\x00"
)


def test_layout_file_golden() -> None:
    prefix, ranges = layout_file([("a", F32, (2,)), ("b", I16, (3,))], {"k": "v"})
    assert prefix == GOLDEN_2[:144]
    assert ranges == {"a": (144, 152), "b": (152, 158)}


def test_writer_golden_bytes(tmp_path: Path) -> None:
    p = tmp_path / "g.safetensors"
    with SafetensorsWriter(p, [("a", F32, (2,)), ("b", I16, (3,))], {"k": "v"}) as w:
        assert w.tensor_ranges == {"a": (144, 152), "b": (152, 158)}
        w.write_box("b", Box((1,), (2,)), np.array([1, 2], dtype=np.int16))  # any order
        w.write("a", 0, np.ones(2, dtype=np.float32))
        w.write("b", 0, np.zeros(1, dtype=np.int16))
        w.commit()
    assert p.read_bytes() == GOLDEN_2


def test_golden_matches_official_writer(tmp_path: Path) -> None:
    # The official writer orders tensors by dtype alignment then name; these dicts are already in
    # that order, so the bytes must be identical.
    d: dict[str, np.ndarray[Any, Any]] = {"a": np.ones(2, dtype=np.float32), "b": np.arange(3, dtype=np.int16)}
    assert safetensors.numpy.save(d, metadata={"k": "v"}) == GOLDEN_2
    p = tmp_path / "ours.safetensors"
    save_tensors(p, d, metadata={"k": "v"})
    assert p.read_bytes() == GOLDEN_2

    e: dict[str, np.ndarray[Any, Any]] = {"s": np.array(5, dtype=np.int64), "z": np.zeros((0, 3), dtype=np.float32)}
    assert safetensors.numpy.save(e) == GOLDEN_EDGE
    save_tensors(p, e)
    assert p.read_bytes() == GOLDEN_EDGE


def test_empty_file_layout(tmp_path: Path) -> None:
    prefix, ranges = layout_file([])
    assert prefix == b"\x08\x00\x00\x00\x00\x00\x00\x00{}      " and ranges == {}
    p = tmp_path / "e.safetensors"
    save_tensors(p, {})
    assert p.read_bytes() == safetensors.numpy.save({}) == prefix
    h = read_header(p)
    assert h.tensors == {} and h.metadata is None and h.data_start == 16 == h.file_size


def test_layout_keeps_given_order(tmp_path: Path) -> None:
    p = tmp_path / "o.safetensors"
    save_tensors(p, {"zz": np.arange(4, dtype=np.uint8), "aa": np.arange(3, dtype=np.float64)})
    h = read_header(p)
    assert list(h.tensors) == ["zz", "aa"]
    assert h.tensors["zz"].start == h.data_start and h.tensors["aa"].start == h.data_start + 4
    with safetensors.safe_open(str(p), "np") as f:
        np.testing.assert_array_equal(f.get_tensor("aa"), np.arange(3, dtype=np.float64))
        np.testing.assert_array_equal(f.get_tensor("zz"), np.arange(4, dtype=np.uint8))


@settings(max_examples=60, deadline=None)
@given(names=st.lists(st.text(min_size=0, max_size=12), min_size=0, max_size=6, unique=True),
       meta=st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=9), max_size=3))
def test_layout_padding_and_roundtrip_property(tmp_path_factory: pytest.TempPathFactory,
                                               names: list[str], meta: dict[str, str] | None) -> None:
    names = [n for n in names if n != "__metadata__"]
    specs = [(n, (U8, I16, F32, I64)[i % 4], (i % 3, 2)) for i, n in enumerate(names)]
    prefix, ranges = layout_file(specs, meta)
    assert len(prefix) % 8 == 0
    n = int.from_bytes(prefix[:8], "little")
    assert n == len(prefix) - 8
    hdr = json.loads(prefix[8:].decode())
    assert [k for k in hdr if k != "__metadata__"] == names
    end = len(prefix)
    for name, dt, shape in specs:
        assert ranges[name] == (end, end + dt.itemsize * shape[0] * shape[1])
        end = ranges[name][1]
    p = tmp_path_factory.mktemp("pad") / "f.safetensors"
    with SafetensorsWriter(p, specs, meta) as w:
        w.commit()
    h = read_header(p)
    assert h.metadata == meta and h.file_size == end
    assert {t.name: (t.start, t.stop) for t in h.tensors.values()} == ranges


def test_layout_rejects_bad_specs() -> None:
    with pytest.raises(ValueError, match="duplicate tensor name 'a'"):
        layout_file([("a", F32, (1,)), ("a", F32, (1,))])
    with pytest.raises(ValueError, match="reserved"):
        layout_file([("__metadata__", F32, (1,))])
    with pytest.raises(ValueError, match="negative"):
        layout_file([("a", F32, (2, -1))])
    with pytest.raises(ValueError, match="int64"):
        layout_file([("a", BF16, (2**40, 2**40))])
    with pytest.raises(TypeError, match="DType"):
        layout_file([("a", "float32", (1,))])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="str to str"):
        layout_file([], {"k": 1})  # type: ignore[dict-item]
    # numpy integers are fine as sizes
    prefix, _ = layout_file([("a", F32, (np.int64(2),))])  # type: ignore[list-item]
    assert b'"shape":[2]' in prefix


# --------------------------------------------------------------------------- official-library compatibility


@needs_torch
def test_our_files_load_with_official_library(tmp_path: Path) -> None:
    cases = _torch_cases()
    p = tmp_path / "t.safetensors"
    save_tensors(p, cases, metadata={"format": "pt"})
    loaded = safetensors.torch.load_file(str(p))
    assert set(loaded) == set(cases)
    with safetensors.safe_open(str(p), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(cases)
        for name, t in cases.items():
            for got in (loaded[name], f.get_tensor(name)):
                assert got.dtype == t.dtype and got.shape == t.shape, name
                assert _tbytes(got) == _tbytes(t), name
    # and our reader agrees, tensor by tensor
    with SafetensorsReader(p) as r:
        assert r.header.metadata == {"format": "pt"}
        for name, t in cases.items():
            arr = r.read(name)
            assert arr.shape == tuple(t.shape) and arr.tobytes() == _tbytes(t), name


@needs_torch
def test_streamed_file_equals_whole_file(tmp_path: Path) -> None:
    """Writing regions in shuffled order with write_box gives the same bytes as save_tensors."""
    cases = _torch_cases()
    whole = tmp_path / "whole.safetensors"
    save_tensors(whole, cases)
    h = read_header(whole)
    specs = [(t.name, t.dtype, t.shape) for t in h.tensors.values()]
    rng = np.random.default_rng(5)
    pieces = []
    with SafetensorsReader(whole) as r:
        for name, _, shape in specs:
            for b in split_box(Box.whole(shape), 3):
                if not b.empty or b.ndim == 0:
                    pieces.append((name, b, r.read(name, b)))
    streamed = tmp_path / "streamed.safetensors"
    with SafetensorsWriter(streamed, specs) as w:
        for i in rng.permutation(len(pieces)):
            name, b, data = pieces[i]
            w.write_box(name, b, data)
        w.commit()
    assert streamed.read_bytes() == whole.read_bytes()


@needs_torch
def test_we_read_official_files(tmp_path: Path) -> None:
    cases = _torch_cases()
    p = tmp_path / "official.safetensors"
    safetensors.torch.save_file(cases, str(p), metadata={"x": "y"})
    h = read_header(p)
    assert h.metadata == {"x": "y"} and set(h.tensors) == set(cases)
    with SafetensorsReader(p) as r:
        for name, t in cases.items():
            st_ = r.tensor(name)
            assert st_.shape == tuple(t.shape) and st_.dtype.name == str(t.dtype).removeprefix("torch.")
            assert r.read(name).tobytes() == _tbytes(t)
        box = Box((1, 1, 0), (2, 1, 3))
        np.testing.assert_array_equal(r.read("fp8", box), cases["fp8"].view(torch.uint8).numpy()[1:3, 1:2, 0:3])


@needs_torch
def test_save_tensors_numpy_dtype_override(tmp_path: Path) -> None:
    bits = torch.tensor([1.0, -2.5, 3.0], dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    p = tmp_path / "b.safetensors"
    save_tensors(p, {"w": bits}, dtypes={"w": BF16})
    t = safetensors.torch.load_file(str(p))["w"]
    assert t.dtype == torch.bfloat16 and t.tolist() == [1.0, -2.5, 3.0]
    with pytest.raises(ValueError, match="2-byte"):
        save_tensors(p, {"w": np.zeros(2, dtype=np.float32)}, dtypes={"w": BF16})
    with pytest.raises(ValueError, match="no safetensors dtype"):
        save_tensors(p, {"w": np.zeros(2, dtype=np.complex64)})
    # big-endian input is stored little-endian
    save_tensors(p, {"w": np.arange(3, dtype=">i4")})
    with SafetensorsReader(p) as r:
        assert r.read("w").tolist() == [0, 1, 2]


def test_module_does_not_import_torch() -> None:
    code = "import sys, formats.safetensors.io; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- read_region


@st.composite
def _region_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], Box, int, int, int, int, bool]:
    ndim = draw(st.integers(0, 5))
    hi = {0: 0, 1: 64, 2: 20, 3: 9, 4: 6, 5: 5}[ndim]
    shape = tuple(draw(st.lists(st.integers(0, hi), min_size=ndim, max_size=ndim)))
    offs, sizes = [], []
    for n in shape:
        o = draw(st.integers(0, n))
        offs.append(o)
        sizes.append(draw(st.integers(0, n - o)))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    start = draw(st.integers(0, 100))
    max_gap = draw(st.sampled_from([0, 1, 9, 1 << 16]))
    budget = draw(st.sampled_from([1, 13, 256, 64 << 20]))
    as_memoryview = draw(st.booleans())
    return shape, Box(tuple(offs), tuple(sizes)), itemsize, start, max_gap, budget, as_memoryview


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_region_cases())
def test_read_region_matches_numpy_slicing(blob: Any, case: Any) -> None:
    fd, data = blob
    shape, box, itemsize, start, max_gap, budget, as_memoryview = case
    nelem = int(np.prod(shape, dtype=np.int64))
    full = np.frombuffer(data, np.uint8, count=nelem * itemsize, offset=start).reshape(shape + (itemsize,))
    expected = full[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].tobytes()
    need = box.volume * itemsize
    if as_memoryview:
        out_buf = bytearray(need)
        out: Any = memoryview(out_buf)
    else:
        out = np.empty(box.sizes + (itemsize,), dtype=np.uint8)
    stats = ReadStats()
    read_region(fd, start, shape, itemsize, box, out, max_gap=max_gap, budget=budget, stats=stats)
    got = bytes(out_buf) if as_memoryview else out.tobytes()
    assert got == expected
    if need == 0:
        assert stats.reads == 0 and stats.bytes_read == 0
        return
    # Never more than the span from the first to the last needed byte, never less than the region.
    strides = [itemsize * int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    first = sum(o * s for o, s in zip(box.offsets, strides))
    last = sum((o + s - 1) * st_ for o, s, st_ in zip(box.offsets, box.sizes, strides)) + itemsize
    assert need <= stats.bytes_read <= last - first
    if max_gap == 0:
        assert stats.bytes_read == need
    if max_gap >= 1 << 16 and budget >= 64 << 20:
        assert stats.reads == 1  # everything coalesced into one read


def test_read_region_batches_by_budget_and_gap(blob: Any) -> None:
    fd, data = blob
    shape, box = (64, 32), Box((0, 4), (64, 8))  # 64 runs of 8 bytes, 24-byte gaps
    full = np.frombuffer(data, np.uint8, count=64 * 32).reshape(shape)
    for max_gap, budget, reads, nbytes in [
        (0, 64 << 20, 64, 64 * 8),  # one read per run
        (24, 64 << 20, 1, 63 * 32 + 8),  # one read through all gaps
        (24, 32 * 16, 4, 4 * (15 * 32 + 8)),  # 16 runs per read (15*32+8 <= 512 < 16*32+8)
        (23, 64 << 20, 64, 64 * 8),  # gap just too big
    ]:
        out = np.empty(box.sizes, dtype=np.uint8)
        stats = ReadStats()
        read_region(fd, 0, shape, 1, box, out, max_gap=max_gap, budget=budget, stats=stats)
        np.testing.assert_array_equal(out, full[:, 4:12])
        assert (stats.reads, stats.bytes_read) == (reads, nbytes), (max_gap, budget)


def test_read_region_coalesces_across_groups(blob: Any) -> None:
    fd, data = blob
    shape, box = (8, 8, 8), Box((0, 0, 2), (8, 8, 4))  # 8 groups of 8 runs
    full = np.frombuffer(data, np.uint8, count=512).reshape(shape)
    out = np.empty(box.sizes, dtype=np.uint8)
    stats = ReadStats()
    read_region(fd, 0, shape, 1, box, out, stats=stats)
    np.testing.assert_array_equal(out, full[:, :, 2:6])
    assert stats.reads == 1 and stats.bytes_read == 512 - 2 - 2


def test_read_region_errors(tmp_path: Path, blob: Any) -> None:
    fd, _ = blob
    with pytest.raises(RegionOutOfBoundsError, match=r"dim 1 stops at 5 > 4"):
        read_region(fd, 0, (4, 4), 1, Box((0, 1), (2, 4)), bytearray(8))
    with pytest.raises(RegionOutOfBoundsError, match="has 1 dims"):
        read_region(fd, 0, (4, 4), 1, Box((0,), (2,)), bytearray(2))
    with pytest.raises(ValueError, match="out holds 3 bytes"):
        read_region(fd, 0, (4, 4), 1, Box((0, 0), (2, 2)), bytearray(3))
    with pytest.raises(ValueError, match="writable"):
        read_region(fd, 0, (4,), 1, Box((0,), (2,)), memoryview(b"xx"))
    with pytest.raises(ValueError, match="C-contiguous"):
        read_region(fd, 0, (4,), 1, Box((0,), (2,)), np.empty(4, np.uint8)[::2])
    p = tmp_path / "short.bin"
    p.write_bytes(b"x" * 20)
    sfd = os.open(p, os.O_RDONLY)
    try:
        with pytest.raises(FormatError, match=r"truncated: expected 16 bytes at offset 16, got 4"):
            read_region(sfd, 0, (4, 8), 1, Box((2, 0), (2, 8)), bytearray(16))
        with pytest.raises(FormatError, match="truncated"):
            read_region(sfd, 0, (4, 8), 1, Box((0, 1), (4, 2)), bytearray(8), max_gap=0)
    finally:
        os.close(sfd)


# --------------------------------------------------------------------------- reader


def test_reader_errors(tmp_path: Path) -> None:
    p = tmp_path / "r.safetensors"
    save_tensors(p, {f"t{i}": np.zeros((2, 3), dtype=np.float32) for i in range(7)})
    with SafetensorsReader(p) as r:
        with pytest.raises(ShardNotFoundError, match=r"no tensor 'nope'; it holds 't0', 't1', 't2', 't3', "
                                                    r"'t4' and 2 more") as ei:
            r.read("nope")
        assert isinstance(ei.value, FileNotFoundError) and str(p) in str(ei.value)
        with pytest.raises(RegionOutOfBoundsError, match=r"tensor 't0': region .* dim 0 stops at 3 > 2"):
            r.read("t0", Box((1, 0), (2, 3)))
        assert isinstance(pytest.raises(IndexError, r.read, "t0", Box((0,), (1,))).value,
                          RegionOutOfBoundsError)
        assert r.read("t6", Box((1, 1), (1, 2))).shape == (1, 2)
        assert "t6" in r and r.names()[0] == "t0"
        os.truncate(p, r.header.tensors["t6"].start + 4)  # the file shrinks after the header was read
        with pytest.raises(FormatError, match=r"tensor 't6': file truncated: expected"):
            r.read("t6")
    assert r.closed
    with pytest.raises(ValueError, match="closed"):
        r.read("t0")


def test_reader_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ShardNotFoundError, match="not found"):
        SafetensorsReader(tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError):
        read_header(tmp_path / "absent.safetensors")
    empty = tmp_path / "none.safetensors"
    save_tensors(empty, {})
    with SafetensorsReader(empty) as r, pytest.raises(ShardNotFoundError, match="holds no tensors"):
        r.read("w")


# --------------------------------------------------------------------------- hostile headers

def _w(dtype: Any = "F32", shape: Any = (2,), offs: Any = (0, 8)) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape) if isinstance(shape, tuple) else shape,
            "data_offsets": list(offs) if isinstance(offs, tuple) else offs}


HOSTILE: list[tuple[str, Any, bytes, int | None, str]] = [
    # id, header, data, claimed length (None: the real one), expected message part
    ("not-json", b'{"a": ', b"", None, "header is not valid JSON"),
    ("empty-header", b"", b"", None, "header is not valid JSON"),
    ("non-utf8", b'{"a\xff": 1}', b"", None, "header is not valid UTF-8 (byte 3"),
    ("array-top", b"[]", b"", None, "header must be a JSON object, got an array"),
    ("string-top", b'"x"', b"", None, "header must be a JSON object, got a string"),
    ("nan", b'{"w": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 0]}}', b"", None,
     "NaN is not valid JSON"),
    ("huge-int-literal", b'{"w": {"dtype": "F32", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 0]}}',
     b"", None, "header is not valid JSON"),
    ("entry-not-object", {"w": [1, 2]}, b"", None, "tensor 'w': entry must be an object"),
    ("missing-key", {"w": {"dtype": "F32", "shape": [2]}}, bytes(8), None, "tensor 'w': missing data_offsets"),
    ("extra-key", {"w": {**_w(), "offset": 3}}, bytes(8), None, "tensor 'w': unknown key 'offset'"),
    ("unknown-dtype", {"w": _w("Q7")}, bytes(8), None, "tensor 'w': unsupported safetensors dtype 'Q7'"),
    ("dtype-not-str", {"w": _w(7)}, bytes(8), None, "tensor 'w': unsupported safetensors dtype 7"),
    ("negative-shape", {"w": _w(shape=(2, -1))}, bytes(8), None,
     "tensor 'w': shape must be an array of non-negative integers, got [2, -1]"),
    ("float-shape", {"w": _w(shape=[2.0])}, bytes(8), None, "shape must be an array of non-negative integers"),
    ("bool-shape", {"w": _w(shape=[True, 2])}, bytes(8), None, "shape must be an array of non-negative"),
    ("shape-not-list", {"w": _w(shape=2)}, bytes(8), None, "shape must be an array"),
    ("offsets-3", {"w": _w(offs=(0, 4, 8))}, bytes(8), None, "data_offsets must be an array of two integers"),
    ("offsets-str", {"w": _w(offs=("0", "8"))}, bytes(8), None, "data_offsets must be an array of two"),
    ("offsets-reversed", {"w": _w(offs=(8, 0))}, bytes(8), None, "data_offsets [8, 0] must satisfy 0 <= begin"),
    ("offsets-negative", {"w": _w(offs=(-8, 0))}, bytes(8), None, "must satisfy 0 <= begin <= end"),
    ("past-eof", {"w": _w(shape=(4,), offs=(0, 16))}, bytes(8), None,
     "tensor 'w': data_offsets [0, 16] run past the end of the file: the data section holds 8 bytes"),
    ("past-eof-huge", {"w": _w(offs=(0, 2**70))}, bytes(8), None, "run past the end of the file"),
    ("overflow-shape", {"w": _w("BF16", (2**40, 2**40), (0, 0))}, b"", None,
     "tensor 'w': shape [1099511627776, 1099511627776] x BF16 overflows int64"),
    ("overflow-then-zero", {"w": _w("U8", (2**62, 2**62, 0), (0, 0))}, b"", None, "overflows int64"),
    ("overflow-many-huge", {"w": _w("U8", [10**300] * 5000, (0, 0))}, b"", None, "overflows int64"),
    ("overlap", {"a": _w(offs=(0, 8)), "b": _w(offs=(4, 12))}, bytes(12), None,
     "tensor 'b': data_offsets [4, 12] overlap tensor 'a' at [0, 8]"),
    ("overlap-empty-inside", {"a": _w(offs=(0, 8)), "z": _w(shape=(0,), offs=(4, 4))}, bytes(8), None,
     "tensor 'z': data_offsets [4, 4] overlap tensor 'a'"),
    ("duplicate-range", {"a": _w(), "b": _w()}, bytes(8), None, "overlap tensor"),
    ("gap", {"a": _w(shape=(1,), offs=(0, 4)), "b": _w(shape=(1,), offs=(8, 12))}, bytes(12), None,
     "tensor 'b': data_offsets [8, 12] leave a gap of 4 bytes after tensor 'a'"),
    ("leading-gap", {"a": _w(shape=(1,), offs=(4, 8))}, bytes(8), None,
     "tensor 'a': data_offsets [4, 8] leave 4 unused bytes at the start of the data section"),
    ("trailing-bytes", {"a": _w(shape=(1,), offs=(0, 4))}, bytes(8), None,
     "4 trailing bytes after tensor 'a'"),
    ("trailing-no-tensors", {}, bytes(8), None, "8 trailing bytes (tensors end at data offset 0"),
    ("deep-array", b"[" * 100_000 + b"]" * 100_000, b"", None, "nests too deeply"),
    ("deep-object", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, b"", None, "nests too deeply"),
    ("deep-in-metadata", b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}", b"", None,
     "nests too deeply"),
    # json.loads would silently keep the last 'w'; we refuse the ambiguity instead.
    ("duplicate-key", (b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, '
                       b'"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}}'), bytes(8), None,
     "header repeats the key 'w'"),
    ("duplicate-inner-key", b'{"w": {"dtype": "F32", "dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}',
     bytes(8), None, "header repeats the key 'dtype'"),
    ("metadata-int-value", {"__metadata__": {"k": 1}}, b"", None,
     "__metadata__['k'] must be a string, got an integer 1"),
    ("metadata-nested", {"__metadata__": {"k": {"x": "y"}}}, b"", None, "__metadata__['k'] must be a string"),
    ("metadata-list", {"__metadata__": ["k"]}, b"", None, "__metadata__ must be an object of string values"),
    ("length-past-eof", b"{}", b"", 1000, "header length 1000 runs past the end of the file (10 bytes leave 2 for the header)"),
    ("length-200MB", b"{}", b"", 200_000_000, f"header length 200000000 exceeds the {MAX_HEADER_BYTES}-byte limit"),
    ("length-u64-max", b"{}", b"", 2**64 - 1, "exceeds the 100000000-byte limit"),
]


@pytest.mark.parametrize(("header", "data", "length", "message"), [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_headers(tmp_path: Path, header: Any, data: bytes, length: int | None, message: str) -> None:
    p = _raw_file(tmp_path / "model.safetensors", header, data, length=length)
    with pytest.raises(FormatError) as ei:
        read_header(p)
    text = str(ei.value)
    assert message in text
    assert text.startswith(f"{p}: ") and "\n" not in text
    with pytest.raises(FormatError):
        SafetensorsReader(p)


def test_hostile_byte_count_message_is_exact(tmp_path: Path) -> None:
    p = _raw_file(tmp_path / "model.safetensors", {"w": _w("BF16", (4, 4), (0, 30))}, bytes(30))
    with pytest.raises(FormatError) as ei:
        read_header(p)
    assert str(ei.value) == (f"{p}: tensor 'w': data_offsets [0, 30] hold 30 bytes but shape [4, 4] x BF16 "
                             f"needs 32")


@pytest.mark.parametrize("size", [0, 1, 7])
def test_file_shorter_than_prefix(tmp_path: Path, size: int) -> None:
    p = tmp_path / "tiny.safetensors"
    p.write_bytes(b"\x01" * size)
    with pytest.raises(FormatError, match=f"truncated: file is {size} bytes, shorter than the 8-byte"):
        read_header(p)


def test_huge_claimed_header_in_sparse_file_is_not_allocated(tmp_path: Path) -> None:
    # A 201 MB sparse file claiming a 200 MB header: refused without reading or allocating it.
    p = tmp_path / "sparse.safetensors"
    with open(p, "wb") as f:
        f.write((200_000_000).to_bytes(8, "little") + b"{}")
        f.truncate(201_000_000)
    tracemalloc.start()
    try:
        with pytest.raises(FormatError, match="exceeds the 100000000-byte limit"):
            read_header(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_not_a_regular_file(tmp_path: Path) -> None:
    with pytest.raises(FormatError, match="not a regular file"):
        read_header(tmp_path)


def test_accepted_edge_headers(tmp_path: Path) -> None:
    # null metadata, unpadded header, unicode names, zero-size tensors sharing an offset
    hdr = {"__metadata__": None, "é": _w("U8", (0,), (0, 0)), "b": _w("U8", (2,), (0, 2)),
           "c": _w("U8", (0, 5), (2, 2))}
    p = _raw_file(tmp_path / "edge.safetensors", json.dumps(hdr, ensure_ascii=False).encode(), b"\x01\x02")
    h = read_header(p)
    assert h.metadata is None and list(h.tensors) == ["é", "b", "c"]
    assert h.tensors["b"].start == h.data_start and h.tensors["c"].shape == (0, 5)
    with safetensors.safe_open(str(p), "np") as f:  # the official reader accepts it too
        assert f.get_tensor("b").tolist() == [1, 2]


# A few valid files for the mutation fuzzer.
def _fuzz_seed() -> bytes:
    d: dict[str, np.ndarray[Any, Any]] = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array(7, dtype=np.int64),
         "c": np.zeros((0, 2), dtype=np.uint8)}
    return bytes(safetensors.numpy.save(d, metadata={"m": "v"}))


_SEED = _fuzz_seed()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, len(_SEED) - 1), st.integers(0, 255)), max_size=4),
       cut=st.none() | st.integers(0, len(_SEED)))
def test_fuzz_mutated_files_raise_only_format_error(tmp_path: Path, edits: list[tuple[int, int]],
                                                    cut: int | None) -> None:
    b = bytearray(_SEED)
    for i, v in edits:
        b[i] = v
    if cut is not None:
        del b[cut:]
    p = tmp_path / "fuzz.safetensors"
    p.write_bytes(bytes(b))
    try:
        h = read_header(p)
    except FormatError as e:
        assert str(e).startswith(str(p)) and "\n" not in str(e)
        return
    with SafetensorsReader(p) as r:  # whatever parsed must be readable
        for name in h.tensors:
            r.read(name)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(
        ["dtype", "shape", "data_offsets", "__metadata__", "w", "x"]), kids, max_size=4),
    max_leaves=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(header=_json, data=st.binary(max_size=16))
def test_fuzz_arbitrary_json_headers(tmp_path: Path, header: Any, data: bytes) -> None:
    p = _raw_file(tmp_path / "j.safetensors", header, data)
    try:
        read_header(p)
    except FormatError:
        pass


# --------------------------------------------------------------------------- writer


SPECS = [("w", F32, (3, 4)), ("b", I16, (5,))]


def test_writer_abort_leaves_nothing(tmp_path: Path) -> None:
    p = tmp_path / "a.safetensors"
    w = SafetensorsWriter(p, SPECS)
    assert w.temp_path == tmp_path / f".a.safetensors.tmp-{os.getpid()}" and w.temp_path.exists()
    assert w.temp_path.stat().st_size == w.file_size == w.tensor_ranges["b"][1]
    w.write("b", 0, np.arange(5, dtype=np.int16))
    w.abort()
    w.abort()  # idempotent
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="aborted"):
        w.write("b", 0, b"\x00\x00")


def test_writer_exception_inside_with_leaves_nothing(tmp_path: Path) -> None:
    p = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError, match="boom"), SafetensorsWriter(p, SPECS) as w:
        w.write("w", 0, np.ones((3, 4), np.float32))
        raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with SafetensorsWriter(p, SPECS):  # no commit: aborted as well
        pass
    assert list(tmp_path.iterdir()) == []


def test_writer_commit_is_atomic(tmp_path: Path) -> None:
    p = tmp_path / "c.safetensors"
    save_tensors(p, {"old": np.zeros(1, np.uint8)})
    old = p.read_bytes()
    w = SafetensorsWriter(p, SPECS, {"k": "v"})
    w.write("w", 0, np.arange(12, dtype=np.float32).reshape(3, 4))
    w.write("b", 4, np.array([7, 8, 9], dtype=np.int16))
    assert p.read_bytes() == old  # the old file stays whole until commit
    w.commit()
    assert w.committed and not w.temp_path.exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["c.safetensors"]
    t = safetensors.numpy.load_file(str(p))
    assert t["w"].flatten().tolist() == list(range(12)) and t["b"].tolist() == [0, 0, 7, 8, 9]
    w.abort()  # no-op after commit
    assert p.exists()
    with pytest.raises(ValueError, match="committed"):
        w.commit()


def test_dropped_writer_and_reader_clean_up(tmp_path: Path) -> None:
    w = SafetensorsWriter(tmp_path / "d.safetensors", SPECS)
    tmp = w.temp_path
    assert tmp.exists()
    del w  # never committed: the temp file goes with it
    assert not tmp.exists()
    save_tensors(tmp_path / "r.safetensors", {"a": np.zeros(2, np.uint8)})
    r = SafetensorsReader(tmp_path / "r.safetensors")
    fd = r.fd
    del r
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs")
def test_fifo_does_not_hang(tmp_path: Path) -> None:
    p = tmp_path / "fifo.safetensors"
    os.mkfifo(p)
    with pytest.raises(FormatError, match="not a regular file"):
        read_header(p)


def test_writer_checks_inputs_before_touching_disk(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="duplicate"):
        SafetensorsWriter(tmp_path / "d.safetensors", [("a", U8, (1,)), ("a", U8, (1,))])
    assert list(tmp_path.iterdir()) == []


def test_writer_bounds(tmp_path: Path) -> None:
    with SafetensorsWriter(tmp_path / "b.safetensors", SPECS) as w:
        with pytest.raises(ValueError, match=r"tensor 'b': 4 bytes at byte offset 8 overflow its 10 bytes"):
            w.write("b", 8, b"\x00" * 4)
        with pytest.raises(ValueError, match="overflow"):
            w.write("b", -1, b"\x00")
        with pytest.raises(ValueError, match="no tensor 'zz'"):
            w.write("zz", 0, b"")
        with pytest.raises(RegionOutOfBoundsError, match="dim 1 stops at 5 > 4"):
            w.write_box("w", Box((0, 1), (1, 4)), np.zeros((1, 4), np.float32))
        with pytest.raises(ValueError, match=r"data shape \[2, 1\] != region"):
            w.write_box("w", Box((0, 0), (1, 2)), np.zeros((2, 1), np.float32))
        with pytest.raises(ValueError, match="data holds 4 bytes"):
            w.write_box("w", Box((0, 0), (1, 2)), b"\x00" * 4)
        w.write("b", 0, memoryview(b"\x01\x00" * 5))
        w.write_box("w", Box((1, 1), (2, 2)), np.full((2, 2), 2.0, np.float32))
        assert w.bytes_written == 10 + 16
        w.commit()
    with SafetensorsReader(tmp_path / "b.safetensors") as r:
        assert r.read("b").tolist() == [1] * 5
        np.testing.assert_array_equal(r.read("w").view(np.float32),
                                      np.array([[0, 0, 0, 0], [0, 2, 2, 0], [0, 2, 2, 0]], np.float32))


def test_write_at_spans_tensors_and_stays_in_the_data_section(tmp_path: Path) -> None:
    with SafetensorsWriter(tmp_path / "s.safetensors", [("a", U8, (3,)), ("b", U8, (2,))]) as w:
        start = w.data_start
        assert w.tensor_ranges["a"][0] == start
        with pytest.raises(ValueError, match="outside the data section"):
            w.write_at(start - 1, b"\x00")
        with pytest.raises(ValueError, match="outside the data section"):
            w.write_at(start + 4, b"\x00\x00")
        w.write_at(start, b"\x01\x02\x03\x04\x05")  # one write across both tensors
        assert w.bytes_written == 5
        w.commit()
    with SafetensorsReader(tmp_path / "s.safetensors") as r:
        assert r.read("a").tolist() == [1, 2, 3] and r.read("b").tolist() == [4, 5]


def test_sequential_writes_start_writeback_early(tmp_path: Path, monkeypatch: Any) -> None:
    """A sequential stream gets its writeback started every WRITEBACK_BYTES (so commit's fsync
    finds little left); scattered writes are left to fsync; the bytes are the same either way."""
    import formats.safetensors.write as sio

    if not hasattr(os, "posix_fadvise"):
        pytest.skip("no posix_fadvise")
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise
    monkeypatch.setattr(sio, "WRITEBACK_BYTES", 1000)
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, off, n, adv: (calls.append((off, n)), real(fd, off, n, adv)))
    data = np.arange(4000, dtype=np.uint8)
    with SafetensorsWriter(tmp_path / "q.safetensors", [("a", U8, (4000,))]) as w:
        start = w.data_start
        for off in range(0, 4000, 400):  # sequential, 400 bytes at a time
            w.write("a", off, data[off:off + 400])
        w.commit()
    assert calls == [(start, 1200), (start + 1200, 1200), (start + 2400, 1200)]
    calls.clear()
    with SafetensorsWriter(tmp_path / "r.safetensors", [("a", U8, (4000,))]) as w:
        for off in range(3600, -1, -400):  # backwards: never one sequential run
            w.write("a", off, data[off:off + 400])
        w.commit()
    assert calls == []
    with SafetensorsReader(tmp_path / "q.safetensors") as q, SafetensorsReader(tmp_path / "r.safetensors") as r:
        assert q.read("a").tolist() == r.read("a").tolist() == data.tolist()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=4), parts=st.integers(1, 7),
       seed=st.integers(0, 2**32 - 1))
def test_write_box_tiling_property(tmp_path: Path, shape: list[int], parts: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    full = rng.integers(0, 2**16, tuple(shape), dtype=np.uint16)
    boxes = [Box.whole(shape)]
    for _ in range(2):  # split twice along different dims to get non-contiguous pieces
        boxes = [b for bb in boxes for b in split_box(bb, parts)]
    p = tmp_path / "tile.safetensors"
    with SafetensorsWriter(p, [("t", BF16, tuple(shape))]) as w:
        for i in rng.permutation(len(boxes)):
            b = boxes[i]
            sl = tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))
            w.write_box("t", b, full[sl].copy())  # (ascontiguousarray makes 0-d 1-d)
        w.commit()
    with SafetensorsReader(p) as r:
        np.testing.assert_array_equal(r.read("t"), full)
