"""The language model's own config keys, wherever the checkpoint nests them."""

from __future__ import annotations


def language_config(config: dict) -> dict:
    """Multimodal wrappers (Kimi K2.5's `kimi_k25`) keep the decoder's keys under
    `text_config`; merged over the top level, every reader finds num_hidden_layers & co."""
    nested = config.get("text_config")
    if isinstance(nested, dict):
        return {**config, **nested, "model_type": config.get("model_type")}
    return config


def moe_shape(config: dict) -> tuple[int, int] | None:
    """(routed experts, experts per token) of an MoE target's config, or None for a dense one."""
    experts = next((config[k] for k in ("n_routed_experts", "num_local_experts", "num_experts")
                    if config.get(k)), None)
    top_k = config.get("num_experts_per_tok") or config.get("moe_top_k")
    return (int(experts), int(top_k)) if experts and top_k and top_k < experts else None
