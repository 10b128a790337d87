"""``refit`` from files onto a device transport (nccl, cuda-ipc): the loaded numpy tensors become
torch tensors of the manifest's dtypes (numpy holds bfloat16 and fp8 in uint16 / uint8 storage),
or the agreement round would refuse every bfloat16 tensor as uint16."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from formats.manifest.wire import TensorSpec
from streamer.refit.job import _on_device
from streamer.refit.local import check_local


def test_device_tensors_keep_the_manifest_dtypes() -> None:
    torch = pytest.importorskip("torch")
    specs = {"w": TensorSpec((2, 3), "bfloat16"), "q": TensorSpec((4,), "float8_e4m3fn"),
             "n": TensorSpec((), "int64"), "m": TensorSpec((2,), "bool")}
    host = {"w": np.arange(6, dtype=np.uint16).reshape(2, 3), "q": np.arange(4, dtype=np.uint8),
            "n": np.array(7, np.int64), "m": np.array([True, False])}
    out = _on_device(host, SimpleNamespace(device=torch.device("cpu")), specs)
    assert {n: str(v.dtype) for n, v in out.items()} == {
        "w": "torch.bfloat16", "q": "torch.float8_e4m3fn", "n": "torch.int64", "m": "torch.bool"}
    assert out["w"].view(torch.uint16).tolist() == host["w"].tolist()  # the same bytes
    assert check_local(out, specs, "rank 0") == []
