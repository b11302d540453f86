"""What memory the models and their KV take, what the machine allows, and what is in use.

Estimates come from the model config and the safetensors headers (no weights loaded), so
`doctor` can say whether a profile fits before a 600 GB model starts loading; the serving
engine uses the same numbers for admission control.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import psutil

from ..errors import MacspecError
from ..models.store import safetensors_header
from ..models.textconfig import language_config

logger = logging.getLogger(__name__)

MB = 2**20
DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "U32": 4, "I16": 2,
               "U16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
GB_FIT_SLACK = 1.15  # suggested wired limit = need x this (activations, buffer cache)
HEADROOM = 0.10  # of the memory limit, kept free for activations, the buffer cache and the OS


def compute_dtype_bytes(model) -> int:
    """A loaded mlx-lm model's compute dtype size (its KV's): norms stay unquantized, unlike
    embeddings."""
    return model.model.norm.weight.dtype.size


def kv_bytes_per_token(config: dict, dtype_bytes: int, tp: int = 1, layers: int | None = None) -> int:
    """Bytes one token's KV takes on one rank. MLA models (kv_lora_rank) cache the compressed
    latent plus the RoPE key, shared by every head, so TP does not split them; standard and
    grouped-query attention cache K and V per KV head, split over the TP ranks. A DSA indexer
    (GLM-5, DeepSeek-V3.2) caches its own keys per layer, plus as many zeroed values."""
    config = language_config(config)
    layers = config["num_hidden_layers"] if layers is None else layers
    if config.get("kv_lora_rank"):
        elements = config["kv_lora_rank"] + config.get("qk_rope_head_dim", 64)
        if config.get("index_head_dim") and config.get("index_topk"):
            elements += 2 * config["index_head_dim"]
    else:
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        # Heads that do not divide stay whole on every rank (loader._shard_mlps_only).
        elements = 2 * (heads // tp if heads % tp == 0 else heads) * head_dim
    return int(layers * elements * dtype_bytes)


@dataclass
class WeightSizes:
    layers: int  # bytes in decoder layers (split over TP ranks)
    other: int  # embeddings, final norm, head (kept whole on every rank)
    half_precision: int  # of the above, BF16/F16 tensors (doubled when run in float32)
    mtp: int = 0  # MTP layers past num_hidden_layers: loaded on rank 0 only, when MTP is used

    def per_rank(self, tp: int, float32: bool = False) -> int:
        grow = self.half_precision if float32 else 0
        return int((self.layers + self.other + grow) / tp + (self.other * (tp - 1) / tp))

    @property
    def total(self) -> int:
        return self.layers + self.other


def weight_sizes(model_dir: Path) -> WeightSizes:
    """Tensor sizes from the safetensors headers: no weight is read."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise MacspecError(f"{model_dir}: no *.safetensors files")
    config = language_config(json.loads((model_dir / "config.json").read_text()))
    num_layers = config.get("num_hidden_layers", 1 << 30)
    layers = other = half = mtp = 0
    for file in files:
        for name, info in safetensors_header(file).items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            size = end - start
            index = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if index and int(index.group(1)) >= num_layers:
                mtp += size
                continue
            if index:
                layers += size
            else:
                other += size
            if info.get("dtype") in ("BF16", "F16"):
                half += size
    return WeightSizes(layers, other, half, mtp)


@dataclass
class MTPSize:
    stored: int  # bytes of the MTP layer(s) as stored (quantized ones packed)
    unpacked: int  # with every quantized weight unpacked to 16 bits (speculative.mtp_dequantize)
    bits: tuple[int, ...]  # the quantized weights' bit widths; () = not quantized


def mtp_size(model_dir: Path) -> MTPSize:
    """The MTP layers' bytes, from the safetensors headers and the config's quantization (its
    per-layer entries first, as mlx-lm quantizes)."""
    config = language_config(json.loads((model_dir / "config.json").read_text()))
    quant = config.get("quantization") or {}
    first = config.get("num_hidden_layers", 1 << 30)
    infos = {name: info for file in sorted(model_dir.glob("*.safetensors"))
             for name, info in safetensors_header(file).items()
             if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name)) and int(m.group(1)) >= first}
    stored = unpacked = 0
    bits = set()
    for name, info in infos.items():
        start, end = info["data_offsets"]
        stored += end - start
        base = name.removesuffix(".weight")
        if name.endswith((".scales", ".biases")) and f"{name.rsplit('.', 1)[0]}.weight" in infos:
            continue  # packing data: gone once unpacked
        if name.endswith(".weight") and f"{base}.scales" in infos:
            b = (quant.get(base) or {}).get("bits", quant.get("bits", 4))
            bits.add(b)
            elements = 1
            for d in info["shape"][:-1]:
                elements *= d
            unpacked += elements * info["shape"][-1] * 32 // b * 2
        else:
            unpacked += end - start
    return MTPSize(stored, unpacked, tuple(sorted(bits)))


def device_limits() -> dict:
    """Memory the process may use: the GPU's recommended working set on Metal, RAM elsewhere."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    vm = psutil.virtual_memory()
    out = {"backend": backend_name(), "system_total_bytes": vm.total,
           "system_available_bytes": vm.available}
    recommended = info.get("max_recommended_working_set_size")
    if recommended:
        out["recommended_working_set_bytes"] = int(recommended)
    # CUDA: the GPU's own memory bounds weights and KV, not the host's RAM.
    gpu_total = info.get("total_memory") or info.get("memory_size") if out["backend"] == "cuda" else None
    if gpu_total:
        out["gpu_total_bytes"] = int(gpu_total)
    out["limit_bytes"] = int(recommended or gpu_total or vm.total)
    return out


def gpu_description() -> str:
    """The CUDA GPU as MLX and the driver see it ("NVIDIA H200, 141 GB, sm_90, driver 580.x")."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    parts = [str(info.get("device_name") or "unknown GPU")]
    total = info.get("total_memory") or info.get("memory_size")
    if total:
        parts.append(f"{int(total) / 2**30:.0f} GB")
    if "compute_capability_major" in info:
        parts.append(f"sm_{info['compute_capability_major']}{info.get('compute_capability_minor', 0)}")
    try:  # the driver's version is nvidia-smi's to tell (MLX does not report it)
        import subprocess

        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=15).stdout.strip().splitlines()
        if driver:
            parts.append(f"driver {driver[0]}")
    except (OSError, subprocess.SubprocessError):
        pass
    return ", ".join(parts)


def backend_name() -> str:
    if mx.metal.is_available():
        return "metal"
    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return "cuda"
    return "cpu"


def apply_wired_limit(wired_limit_mb: int | None) -> int | None:
    """On Metal, wire the model's memory (no paging mid-decode): the profile's limit, bounded by
    the device's recommended working set; asking for more is an error with the sysctl fix."""
    if backend_name() != "metal":
        return None
    recommended = int(mx.device_info()["max_recommended_working_set_size"])
    wanted = recommended if wired_limit_mb is None else wired_limit_mb * MB
    if wanted > recommended:
        raise MacspecError(
            f"hardware.wired_limit_mb = {wired_limit_mb} exceeds what macOS lets the GPU wire "
            f"({recommended // MB} MB). Raise it first: sudo sysctl iogpu.wired_limit_mb={wired_limit_mb}")
    mx.set_wired_limit(wanted)
    logger.info("Metal wired limit %d MB", wanted // MB)
    return wanted


def usage() -> dict:
    return {"mlx_active_bytes": mx.get_active_memory(), "mlx_peak_bytes": mx.get_peak_memory(),
            "mlx_cache_bytes": mx.get_cache_memory(),
            "process_rss_bytes": psutil.Process().memory_info().rss,
            "system_available_bytes": psutil.virtual_memory().available}


class KVBudget:
    """Admission control: a request is admitted when its KV at full length (prompt + max_tokens
    + drafts) fits beside what running requests and the prefix cache hold."""

    def __init__(self, bytes_per_token: int, budget_bytes: int, source: str, limit_bytes: int = 0):
        self.bytes_per_token = max(1, bytes_per_token)
        self.budget = budget_bytes
        self.source = source
        self.limit = limit_bytes  # the device's memory limit, read once at start
        self.reserved = 0
        self.waits = 0  # admissions deferred for memory
        self.trims = 0  # buffer-cache trims under pressure

    @classmethod
    def for_engine(cls, per_token: int, cap_mb: int | None) -> "KVBudget":
        limits = device_limits()
        if cap_mb is not None:
            return cls(per_token, cap_mb * MB, "kv.kv_budget_mb", limits["limit_bytes"])
        # Weights are loaded by now: what they took is already in active memory.
        free = int(limits["limit_bytes"] * (1 - HEADROOM)) - mx.get_active_memory()
        if limits["backend"] == "cpu":  # RAM is shared with everything else on the machine
            free = min(free, int(limits["system_available_bytes"] * (1 - HEADROOM)))
        return cls(per_token, max(0, free), f"{limits['backend']} memory", limits["limit_bytes"])

    def need(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def fits(self, need: int, held_elsewhere: int) -> bool:
        return self.reserved + held_elsewhere + need <= self.budget

    def relieve_pressure(self) -> None:
        """Blocked on memory: hand MLX's buffer cache back before waiting."""
        if mx.get_cache_memory():
            mx.clear_cache()
            self.trims += 1

    def as_dict(self) -> dict:
        return {"kv_budget_bytes": self.budget, "kv_reserved_bytes": self.reserved,
                "kv_bytes_per_token": self.bytes_per_token, "budget_source": self.source,
                "admission_waits": self.waits, "cache_trims": self.trims}
