"""The language model's own config keys, wherever the checkpoint nests them."""

from __future__ import annotations


def language_config(config: dict) -> dict:
    """Multimodal wrappers (Kimi K2.5's `kimi_k25`) keep the decoder's keys under
    `text_config`; merged over the top level, every reader finds num_hidden_layers & co."""
    nested = config.get("text_config")
    if isinstance(nested, dict):
        return {**config, **nested, "model_type": config.get("model_type")}
    return config
