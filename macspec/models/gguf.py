"""Import a llama.cpp GGUF file into a plain mlx-lm model directory.

The header (metadata, tensor names and types) is read here, so an unsupported architecture or
tensor type is refused before any weight is read; the tensors come from `mx.load`, which turns
Q4_0/Q4_1/Q8_0 blocks into MLX affine weight/scales/biases (group 32). llama.cpp's converter
permutes the rows of q/k for its interleaved-pair RoPE; `unpermute_rows` restores Hugging Face's
half-split order that mlx-lm's llama uses. The tokenizer is rebuilt by gguf_tokenizer.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from ..paths import cache_dir
from .store import STAMP, build, is_current

IMPORT_VERSION = 1  # bump when the written files change, so cached imports are redone
IMPORT_DTYPES = ("keep", "float32", "bfloat16")
GROUP_SIZE = 32  # every GGUF block type mx.load keeps quantized has 32 weights per block
ARCHITECTURES = ("llama",)

# ggml tensor types by id (ggml.h); mx.load keeps the quantized ones as affine bits/group 32.
GGML_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
              9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
              16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
              22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
              29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}
QUANT_BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}
FLOAT_TYPES = ("F32", "F16")
SUPPORTED_TYPES = FLOAT_TYPES + tuple(QUANT_BITS)

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGUF tensor base names -> mlx-lm llama parameter paths ("{n}": the layer index).
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_SUFFIXES = ("weight", "bias", "scales", "biases")  # scales/biases: mx.load's quantized parts
_LAYER = re.compile(r"blk\.(\d+)\.(\w+)")


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # MLX order (rows first), the reverse of GGUF's dims
    type_name: str
    offset: int  # from the start of the file


@dataclass
class GGUFHeader:
    version: int
    metadata: dict
    tensors: list[TensorInfo]


class _Reader:
    def __init__(self, f):
        self.f = f

    def unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise EOFError
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        return self.f.read(self.unpack("<Q")).decode("utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<I"), self.unpack("<Q")
            if item in _SCALARS:  # one read for numeric arrays (token types, scores)
                fmt = _SCALARS[item][1]
                return list(struct.unpack(f"<{count}{fmt}", self.f.read(count * struct.calcsize(fmt))))
            return [self.value(item) for _ in range(count)]
        return self.unpack(_SCALARS[kind])


def read_header(path: Path) -> GGUFHeader:
    """Metadata and tensor infos of a GGUF file (v2/v3); no tensor data is read."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(f"{path}: not a GGUF file (no GGUF magic)")
            reader = _Reader(f)
            version = reader.unpack("<I")
            if version not in (2, 3):
                raise ModelLoadError(f"{path}: GGUF version {version} is not supported (2 or 3)")
            num_tensors, num_kv = reader.unpack("<Q"), reader.unpack("<Q")
            metadata = {}
            for _ in range(num_kv):
                key = reader.string()
                metadata[key] = reader.value(reader.unpack("<I"))
            infos = []
            for _ in range(num_tensors):
                name = reader.string()
                dims = [reader.unpack("<Q") for _ in range(reader.unpack("<I"))]
                kind, offset = reader.unpack("<I"), reader.unpack("<Q")
                infos.append((name, tuple(reversed(dims)), GGML_TYPES.get(kind, f"type {kind}"), offset))
            alignment = metadata.get("general.alignment", 32)
            start = -(-f.tell() // alignment) * alignment
    except (EOFError, KeyError, UnicodeDecodeError, struct.error) as err:
        raise ModelLoadError(f"{path}: truncated or malformed GGUF header "
                             f"({type(err).__name__})") from None
    return GGUFHeader(version, metadata, [TensorInfo(n, s, t, start + o) for n, s, t, o in infos])


def mlx_name(name: str) -> str | None:
    """A GGUF tensor name (`blk.3.attn_q.weight`) -> mlx-lm's llama path, or None if unknown."""
    base, _, suffix = name.rpartition(".")
    if suffix not in _SUFFIXES:
        return None
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    match = _LAYER.fullmatch(base)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{suffix}"
    return None


def check_supported(header: GGUFHeader, path: Path) -> None:
    """Refuse, naming what, an architecture, tensor type or tensor this importer cannot map."""
    arch = header.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported (supported: "
                             f"{', '.join(ARCHITECTURES)})")
    bad = [f"{t.name} ({t.type_name})" for t in header.tensors if t.type_name not in SUPPORTED_TYPES]
    if bad:
        raise ModelLoadError(
            f"{path}: {len(bad)} tensor(s) of a type macspec cannot import: "
            f"{', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}. Supported: "
            f"{', '.join(SUPPORTED_TYPES)} (mx.load dequantizes K-quants to float16 or fails, "
            "so they are refused); use a Q4_0, Q4_1, Q8_0 or F16 file of the model")
    unknown = [t.name for t in header.tensors if mlx_name(t.name) is None]
    if unknown:
        raise ModelLoadError(f"{path}: tensor(s) with no mlx-lm {arch} equivalent: "
                             f"{', '.join(unknown[:4])}{' ...' if len(unknown) > 4 else ''}")


def _f32(value: float) -> float:
    return float(f"{value:.7g}")  # 9.999999747e-06 (a float32) -> 1e-05


def llama_config(metadata: dict, tensor_names: set[str]) -> dict:
    """mlx-lm llama config.json keys from the GGUF's llama.* (and tokenizer.*) metadata."""
    def key(name, default=None):
        value = metadata.get(f"llama.{name}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata lacks llama.{name}")
        if isinstance(value, list):
            raise ModelLoadError(f"GGUF llama.{name} varies per layer; macspec imports uniform llamas")
        return value

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError("GGUF llama with partial rotary embedding: not supported")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "num_hidden_layers": key("block_count"),
        "intermediate_size": key("feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": _f32(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(key("rope.freq_base", 10000.0)),
        "vocab_size": key("vocab_size", len(metadata.get("tokenizer.ggml.tokens", []))),
        "max_position_embeddings": key("context_length"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names, "mlp_bias": False,
    }
    scaling = metadata.get("llama.rope.scaling.type", "none")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _f32(key("rope.scaling.factor"))}
    elif scaling != "none":
        raise ModelLoadError(f"GGUF rope scaling {scaling!r} is not supported (none, linear)")
    if "tokenizer.ggml.bos_token_id" in metadata:
        config["bos_token_id"] = metadata["tokenizer.ggml.bos_token_id"]
    # End of generation: EOS, and the end-of-turn token where a chat model names another one.
    eos = [metadata[f"tokenizer.ggml.{k}_token_id"] for k in ("eos", "eot")
           if f"tokenizer.ggml.{k}_token_id" in metadata]
    if eos:
        config["eos_token_id"] = eos[0] if len(set(eos)) == 1 else sorted(set(eos))
    return config


def unpermute_rows(w, num_heads: int):
    """Undo llama.cpp's q/k row permutation: per head, rows (pair i, member j) -> (half j, i).
    Quantization groups run along a row, so a packed weight, its scales and its biases are
    unpermuted alike."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_weights(tensors: dict, config: dict, dtype: str) -> tuple[dict, dict | None]:
    """GGUF tensors (as mx.load gives them) -> (mlx-lm weights, quantization config or None)."""
    import mlx.core as mx

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    quantized: dict[str, int] = {}  # mlx-lm module path -> bits
    out = {}
    for name, value in tensors.items():
        match = _LAYER.fullmatch(name.rpartition(".")[0])
        if match and match.group(2) in heads:
            value = unpermute_rows(value, heads[match.group(2)])
        target = mlx_name(name)
        if target.endswith(".scales"):
            module = target[: -len(".scales")]
            packed = tensors[name.replace(".scales", ".weight")]
            quantized[module] = packed.shape[-1] * 32 // (value.shape[-1] * GROUP_SIZE)
        out[target] = value
    if dtype != "keep":
        return _dequantized(out, quantized, getattr(mx, dtype)), None
    return out, _quantization(quantized)


def _dequantized(weights: dict, quantized: dict[str, int], dtype) -> dict:
    import mlx.core as mx

    for module, bits in quantized.items():
        scales = weights.pop(f"{module}.scales").astype(mx.float32)  # dequantize in float32
        biases = weights.pop(f"{module}.biases").astype(mx.float32)
        weights[f"{module}.weight"] = mx.dequantize(weights[f"{module}.weight"], scales, biases,
                                                    group_size=GROUP_SIZE, bits=bits)
    return {k: v.astype(dtype) for k, v in weights.items()}


def _quantization(quantized: dict[str, int]) -> dict | None:
    """mlx-lm's form: a default, plus an entry per module whose bits differ from it."""
    if not quantized:
        return None
    bits = max(set(quantized.values()), key=list(quantized.values()).count)
    config = {"group_size": GROUP_SIZE, "bits": bits}
    config.update({m: {"group_size": GROUP_SIZE, "bits": b} for m, b in quantized.items() if b != bits})
    return config


def import_gguf(gguf: Path, out: Path, dtype: str = "keep") -> Path:
    """Write `gguf` as an mlx-lm model dir at `out` (atomically, replacing an earlier import).
    dtype: keep (quantized tensors stay quantized, MLX's format) or float32/bfloat16."""
    gguf = Path(gguf).expanduser().resolve()
    stamp = {"recipe": "gguf", "source": gguf.name, "size": gguf.stat().st_size, "dtype": dtype,
             "version": IMPORT_VERSION}
    return build(Path(out), stamp, lambda tmp: write_model_dir(gguf, tmp, dtype, stamp), True,
                  f"importing {gguf.name}")


def write_model_dir(gguf: Path, out: Path, dtype: str, stamp: dict) -> None:
    import mlx.core as mx

    from .gguf_tokenizer import write_tokenizer

    if dtype not in IMPORT_DTYPES:
        raise ModelLoadError(f"import dtype {dtype!r}: use one of {', '.join(IMPORT_DTYPES)}")
    header = read_header(gguf)
    check_supported(header, gguf)
    config = llama_config(header.metadata, {t.name for t in header.tensors})
    write_tokenizer(header.metadata, out)  # refuses an unsupported tokenizer before the weights
    try:
        tensors = mx.load(str(gguf))
    except (RuntimeError, ValueError) as err:
        raise ModelLoadError(f"{gguf}: mx.load cannot read its tensors: {err}") from None
    weights, quantization = convert_weights(tensors, config, dtype)
    if quantization:
        config["quantization"] = config["quantization_config"] = quantization
    half = any(v.dtype == mx.float16 for v in weights.values())  # F16 tensors or Q* scales
    config["torch_dtype"] = dtype if dtype != "keep" else "float16" if half else "float32"
    mx.save_safetensors(str(out / "model.safetensors"), weights, {"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / STAMP).write_text(json.dumps(stamp, indent=2) + "\n")


def default_import_dtype() -> str:
    """float32 on CPU (quantized and half matmuls are slow there), else keep the GGUF's own."""
    import mlx.core as mx

    return "float32" if mx.default_device() == mx.cpu else "keep"


def imported_dir(gguf: Path, dtype: str) -> Path:
    key = hashlib.sha256(str(gguf.resolve()).encode()).hexdigest()[:10]
    return cache_dir() / "models" / "gguf" / f"{gguf.stem}-{key}-{dtype}"


def _cache_stamp(gguf: Path, dtype: str) -> dict:
    stat = gguf.stat()  # a changed file (size or mtime) is imported again
    return {"recipe": "gguf", "source": str(gguf.resolve()), "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns, "dtype": dtype, "version": IMPORT_VERSION}


def find_imported(gguf: Path) -> Path | None:
    """The cached import of a profile's `.gguf` path if it is current; never imports."""
    dtype = default_import_dtype()
    out = imported_dir(gguf, dtype)
    return out if gguf.is_file() and is_current(out, _cache_stamp(gguf, dtype)) else None


def ensure_imported(gguf: Path) -> Path:
    """A profile's `.gguf` path -> its mlx-lm dir in the cache, imported once (locked, atomic)."""
    gguf = gguf.expanduser()
    if not gguf.is_file():
        raise ModelLoadError(f"{gguf}: no such GGUF file")
    dtype = default_import_dtype()
    stamp = _cache_stamp(gguf, dtype)
    return find_imported(gguf) or build(
        imported_dir(gguf, dtype), stamp, lambda tmp: write_model_dir(gguf, tmp, dtype, stamp),
        False, f"importing {gguf.name} (first use)")
