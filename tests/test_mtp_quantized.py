"""A quantized MTP head runs quantized: its bytes as stored, each module at the packing mlx-lm
would give it, greedy speculation with it equal to plain decoding; unpacking is opt-in."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from macspec.config import Profile
from macspec.engine.runtime import Runtime
from macspec.models.checkpoint import load_dir, load_mtp_head
from macspec.models.loader import load_model, resolve_path
from macspec.models.view import ModelView
from macspec.monitor.doctor import Doctor
from macspec.monitor.memory import mtp_size
from macspec.sampling import SamplingParams

from .conftest import engine_for, generate

GROUP, BITS = 64, 4
EH_PROJ = {"group_size": 32, "bits": 8}  # a per-layer entry, as mixed-precision converts write


def _quantizable(module: nn.Module) -> bool:
    return hasattr(module, "to_quantized") and module.weight.shape[-1] % GROUP == 0


def write_quantized_tiny(out):
    """The embedded tiny target and its trained MTP head, 4-bit g64 as mlx_lm.convert -q writes
    them (the head's eh_proj 8-bit g32 by a per-layer entry): a small quantized model."""
    src = resolve_path("embedded:tiny-target")
    target = load_dir(src)
    head, layer = load_mtp_head(target), target.config["num_hidden_layers"]
    nn.quantize(target.model, GROUP, BITS, class_predicate=lambda _, m: _quantizable(m))
    nn.quantize(head, GROUP, BITS, class_predicate=lambda p, m: EH_PROJ if p == "eh_proj"
                else _quantizable(m))
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((src / name).read_bytes())
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(target.model.parameters())))
    mx.save_safetensors(str(out / "mtp.safetensors"), head.layout_weights(layer))
    quant = {"group_size": GROUP, "bits": BITS, "mode": "affine", f"model.layers.{layer}.eh_proj": EH_PROJ}
    config = {**json.loads((src / "config.json").read_text()), "quantization": quant}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def quantized_dir(tmp_path_factory):
    return write_quantized_tiny(tmp_path_factory.mktemp("q") / "tiny-q4")


def _stored_bytes(path) -> int:
    return sum(v.nbytes for v in mx.load(str(path / "mtp.safetensors")).values())


def _head_bytes(head) -> int:
    return sum(v.nbytes for _, v in tree_flatten(head.parameters()))


def test_doctor_reports_the_quantized_heads_bytes_and_bits(quantized_dir):
    """From the files' headers: nothing is loaded, no warning that the head is quantized."""
    size = mtp_size(quantized_dir)
    assert size.stored == _stored_bytes(quantized_dir) and size.bits == (4, 8)
    assert size.unpacked > 2.5 * size.stored
    profile = Profile()
    profile.model.path, profile.speculative.method = str(quantized_dir), "mtp"
    doctor = Doctor(profile)
    doctor.models()
    check = next(c for c in doctor.checks if c.name == "MTP head")
    assert check.status == "ok" and "4/8-bit" in check.detail and "run quantized" in check.detail
    profile.speculative.mtp_dequantize = True
    doctor = Doctor(profile)
    doctor.models()
    check = next(c for c in doctor.checks if c.name == "MTP head")
    assert "unpacked at load" in check.detail


def test_a_quantized_head_loads_quantized_as_stored(quantized_dir):
    target = load_model(str(quantized_dir))
    head = load_mtp_head(target)
    assert _head_bytes(head) == _stored_bytes(quantized_dir)  # the bytes as shipped, no copy
    assert (head.eh_proj.bits, head.eh_proj.group_size) == (8, 32)  # the per-layer entry
    assert (head.block.mlp.gate_proj.bits, head.block.mlp.gate_proj.group_size) == (BITS, GROUP)
    unpacked = load_mtp_head(target, dequantize=True)
    assert not any(k.endswith(".scales") for k, _ in tree_flatten(unpacked.parameters()))
    assert _head_bytes(unpacked) > 3 * _head_bytes(head)
    # Both are the same weights: the same proposals from the same hidden states.
    view, tokens = ModelView(target.model), mx.array([[5, 17, 300, 42, 7, 99, 100, 3]])
    _, hidden = view.forward(tokens)
    quantized, _ = head(tokens[:, 1:], hidden[:, :-1], view)
    float_, _ = unpacked(tokens[:, 1:], hidden[:, :-1], view)
    assert mx.array_equal(quantized.argmax(-1), float_.argmax(-1)).item()


@pytest.mark.slow
def test_greedy_speculation_with_a_quantized_head_equals_plain(quantized_dir):
    target = load_model(str(quantized_dir))
    profile = Profile()
    profile.model.path, profile.speculative.method = str(quantized_dir), "mtp"
    mtp = Runtime.load(profile)  # the head as the engine loads it: run quantized
    assert any(k.endswith(".scales") for k, _ in tree_flatten(mtp.mtp_head.parameters()))
    plain = Runtime(profile, target, "none")
    prompts = [[5, 17, 300, 42, 7], [9, 8, 7, 6, 5, 4, 3, 2], [11, 12, 13]]
    alone = [generate(plain, p, 24, SamplingParams())[0] for p in prompts]
    for k in (1, 3):
        tokens, done = generate(mtp, prompts[0], 24, SamplingParams(), k=k)
        assert tokens == alone[0]
        assert done.stats["spec"]["accepted"] > 0  # the trained head still drafts well
    batch = engine_for(mtp).generate(prompts, SamplingParams(), 24, num_draft=3)
    assert [c.tokens for c in batch] == alone
