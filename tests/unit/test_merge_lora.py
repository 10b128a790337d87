"""PEFT adapters through ``convert``: a LoRA adapter merged into a transformers checkpoint
(``--merge-lora``) equals PEFT's own merge made in float32 and cast once, the merged checkpoint
loads in transformers and gives the PEFT model's logits, sharded sources and destinations merge
the same bytes, an adapter resharded and back is a PEFT directory PEFT loads, and adapters that
cannot merge are refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from safetensors.torch import load_file  # noqa: E402

from streamer.cli import main as run  # noqa: E402

# PEFT 0.17 calls transformers' deprecated is_gradient_checkpointing (not ours to fix)
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TP2_RULES = ["*.q_proj.weight=S(0)", "*.k_proj.weight=S(0)", "*.v_proj.weight=S(0)", "*.o_proj.weight=S(1)",
             "*.gate_proj.weight=S(0)", "*.up_proj.weight=S(0)", "*.down_proj.weight=S(1)"]


def _config() -> Any:
    return transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A bf16 Llama checkpoint and a PEFT adapter for it (rank 8, alpha 16, B not zero, as after
    training), both saved by the libraries themselves."""
    d = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(_config()).to(torch.bfloat16).save_pretrained(d / "base")
    for name, extra in (("adapter", {}), ("rslora", {"use_rslora": True, "rank_pattern": {"down_proj": 4},
                                                       "alpha_pattern": {"o_proj": 4}})):
        torch.manual_seed(1)
        pm = peft.get_peft_model(transformers.LlamaForCausalLM(_config()),
                                 peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, **extra))
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.05)
        pm.save_pretrained(d / name)
    return d


def _cli(*argv: object) -> tuple[int, str]:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = run([str(a) for a in argv])
    return rc, err.getvalue()


def _peft_merged(world: Path, adapter: str) -> dict[str, Any]:
    """PEFT's merge_and_unload on the base model loaded in float32, then cast to bf16 once."""
    base = transformers.LlamaForCausalLM.from_pretrained(world / "base", torch_dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(base, world / adapter).merge_and_unload()
    return {k: v.to(torch.bfloat16) for k, v in merged.state_dict().items()}


@pytest.mark.parametrize("adapter", ["adapter", "rslora"])
def test_merged_weights_equal_peft_merging_in_float32(world: Path, tmp_path: Path, adapter: str) -> None:
    assert _cli("layout", "--like", world / "base", "-o", tmp_path / "one.json")[0] == 0
    rc, err = _cli("convert", world / "base", tmp_path / "one.json", "--out", tmp_path / "out", "--merge-lora",
                   world / adapter)
    assert rc == 0, err
    got = load_file(tmp_path / "out" / "model.safetensors")
    want = _peft_merged(world, adapter)
    base = load_file(world / "base" / "model.safetensors")
    changed = 0
    for k, w in got.items():
        assert w.dtype == torch.bfloat16, k
        ref = want[k]
        # float32 sums in another order (numpy here, torch in PEFT) may round a bf16 element the
        # other way: one unit in the last place at most, on very few elements
        diff = (w.float() - ref.float()).abs()
        ulp = ref.float().abs().clamp_min(2 ** -126) * 2 ** -7
        assert bool((diff <= ulp).all()), k
        assert float((diff > 0).float().mean()) < 0.01, k
        changed += int(not torch.equal(w, base[k]))
    assert changed == 14  # every targeted weight of both layers moved, nothing else
    assert (tmp_path / "out" / "config.json").is_file()  # the merged checkpoint loads as a model


def test_the_merged_checkpoint_serves_the_peft_models_logits(world: Path, tmp_path: Path) -> None:
    assert _cli("layout", "--like", world / "base", "-o", tmp_path / "one.json")[0] == 0
    assert _cli("convert", world / "base", tmp_path / "one.json", "--out", tmp_path / "out", "--cast", "float32",
                "--merge-lora", world / "adapter")[0] == 0
    ids = torch.tensor([[1, 5, 9, 42, 7, 100, 3]])
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    base = transformers.LlamaForCausalLM.from_pretrained(world / "base", torch_dtype=torch.float32)
    with torch.no_grad():
        want = peft.PeftModel.from_pretrained(base, world / "adapter")(ids).logits
        got = merged(ids).logits
        unmerged = transformers.LlamaForCausalLM.from_pretrained(world / "base", torch_dtype=torch.float32)(ids).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(unmerged, want, atol=1e-3)  # the adapter matters here


@pytest.mark.parametrize("block", [None, 300])
def test_sharded_sources_and_destinations_merge_the_same_bytes(world: Path, tmp_path: Path, block: int | None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    if block is not None:  # a row or two merged at a time: every block's offsets matter
        monkeypatch.setattr("streamer.convert.merge_lora.MERGE_BLOCK", block)
    rules = [x for r in TP2_RULES for x in ("--rule", r)]
    assert _cli("layout", "--like", world / "base", "-o", tmp_path / "one.json")[0] == 0
    assert _cli("layout", "--like", world / "base", "--mesh", "tp=2", *rules, "-o", tmp_path / "tp2.json")[0] == 0
    lora = ("--merge-lora", world / "adapter")
    assert _cli("convert", world / "base", tmp_path / "one.json", "--out", tmp_path / "ref", *lora)[0] == 0
    # merged into a TP2 layout, then gathered back without merging again
    assert _cli("convert", world / "base", tmp_path / "tp2.json", "--out", tmp_path / "tp2", *lora)[0] == 0
    assert _cli("convert", tmp_path / "tp2", tmp_path / "one.json", "--out", tmp_path / "back")[0] == 0
    # and merged while reading a TP2 source (rows and columns of each shard offset in the adapter)
    assert _cli("convert", world / "base", tmp_path / "tp2.json", "--out", tmp_path / "plain")[0] == 0
    assert _cli("convert", tmp_path / "plain", tmp_path / "one.json", "--out", tmp_path / "from_tp2", *lora)[0] == 0
    ref = load_file(tmp_path / "ref" / "model.safetensors")
    for other in ("back", "from_tp2"):
        got = load_file(tmp_path / other / "model.safetensors")
        assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref), other


def test_an_adapter_resharded_and_back_is_a_peft_directory(world: Path, tmp_path: Path) -> None:
    rules = ["*.q_proj.lora_B.weight=S(0)", "*.o_proj.lora_A.weight=S(1)", "*.down_proj.lora_A.weight=S(1)"]
    assert _cli("layout", "--like", world / "adapter", "--mesh", "tp=2", *[x for r in rules for x in ("--rule", r)],
                "-o", tmp_path / "tp2.json")[0] == 0
    assert _cli("convert", world / "adapter", tmp_path / "tp2.json", "--out", tmp_path / "tp2")[0] == 0
    assert _cli("layout", "--like", tmp_path / "tp2", "-o", tmp_path / "one.json")[0] == 0
    assert _cli("convert", tmp_path / "tp2", tmp_path / "one.json", "--out", tmp_path / "back")[0] == 0
    back = tmp_path / "back"
    assert json.loads((back / "adapter_config.json").read_text()) == json.loads(
        (world / "adapter" / "adapter_config.json").read_text())
    got, want = load_file(back / "adapter_model.safetensors"), load_file(world / "adapter" / "adapter_model.safetensors")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    model = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM(_config()), back)  # PEFT loads it
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_adapters_that_cannot_merge_are_refused_by_name(world: Path, tmp_path: Path) -> None:
    assert _cli("layout", "--like", world / "base", "-o", tmp_path / "one.json")[0] == 0

    def refused(adapter: Path) -> str:
        rc, err = _cli("convert", world / "base", tmp_path / "one.json", "--out", tmp_path / "out", "--merge-lora",
                       adapter)
        assert rc == 1 and "Traceback" not in err and not (tmp_path / "out").exists(), err
        return err

    dora = tmp_path / "dora"
    shutil.copytree(world / "adapter", dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True, "fan_in_fan_out": True}))
    err = refused(dora)
    assert "use_dora" in err and "fan_in_fan_out" in err
    assert "no adapter_config.json" in refused(world / "base")
    other = tmp_path / "other"  # an adapter for a model with another hidden size
    torch.manual_seed(2)
    small = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=128, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2)
    peft.get_peft_model(transformers.LlamaForCausalLM(small), peft.LoraConfig(r=4, target_modules=["q_proj"])
                        ).save_pretrained(other)
    err = refused(other)
    assert "model.layers.0.self_attn.q_proj.weight is [64, 64], the adapter's B @ A is [32, 32]" in err
    assert "model.layers.2.self_attn.q_proj.weight: the adapter's module has no base weight here" in err
