"""EAGLE-3 draft heads in the layout SGLang/SpecForge and vLLM publish them in.

A head directory holds `config.json` (`LlamaForCausalLMEagle3`: the block's shape,
`draft_vocab_size`, the target layers it reads in `eagle_config.eagle_aux_hidden_state_layer_ids`)
and safetensors with `fc` (fuses the target's low, middle and high hidden states, 3·H -> H), one
`midlayer` decoder block whose attention reads [normed embedding; normed hidden] (2·H wide),
`norm`, `lm_head` over the draft vocabulary and `d2t` (draft id -> target id offsets). The
embeddings are the target's unless the file carries its own `embed_tokens`.

Position t reads the fused states of position t and the embedding of token t+1, and predicts
token t+2; for k > 1 it chains on its own pre-norm output state (then `fc` is skipped, as in
SGLang's llama_eagle3).

Which target layers: SGLang reads `eagle_config.eagle_aux_hidden_state_layer_ids` as the layers
whose *output* it captures; vLLM reads a top-level `eagle_aux_hidden_state_layer_ids` as the
layers whose *input* it captures (one lower); with neither, both capture the inputs of layers
(2, L // 2, L - 3). `aux_outputs` below is always "after layer i".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from ..errors import ModelLoadError
from . import draft_vocab

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"
# Prefixes the published files put before the block's names (SpecForge: midlayer; the
# speculators library: layers.0; some conversions keep model.).
BLOCK_PREFIXES = ("midlayer.", "model.midlayer.", "layers.0.", "model.layers.0.")


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_outputs: tuple[int, ...] | None  # target layers whose outputs it reads; None: default

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> "Eagle3Config":
        raw = {**raw, **(raw.get("transformer_layer_config") or {})}  # the speculators layout
        archs = raw.get("architectures") or []
        if not any("eagle3" in a.lower() for a in archs) and raw.get("speculators_model_type") != "eagle3":
            raise ModelLoadError(f"{where}: architectures {archs} is not an EAGLE-3 head "
                                 f"(expected {ARCHITECTURE})")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
                   if k not in raw]
        if missing:
            raise ModelLoadError(f"{where}: missing {', '.join(missing)}")
        if raw.get("num_hidden_layers", 1) != 1:
            raise ModelLoadError(f"{where}: num_hidden_layers = {raw['num_hidden_layers']}; an "
                                 "EAGLE-3 head has one decoder block")
        heads = raw["num_attention_heads"]
        return cls(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=raw.get("rope_scaling"),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            vocab_size=raw["vocab_size"], draft_vocab_size=raw.get("draft_vocab_size") or raw["vocab_size"],
            target_hidden_size=raw.get("target_hidden_size") or raw["hidden_size"],
            aux_outputs=_aux_outputs(raw))

    def layer_args(self) -> llama.ModelArgs:
        return llama.ModelArgs(
            model_type="llama", hidden_size=self.hidden_size, num_hidden_layers=1,
            intermediate_size=self.intermediate_size, num_attention_heads=self.num_attention_heads,
            rms_norm_eps=self.rms_norm_eps, vocab_size=self.vocab_size, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            num_key_value_heads=self.num_key_value_heads, rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling)

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """The target layers whose outputs the head fuses (the published default when unset)."""
        if self.aux_outputs is not None:
            return self.aux_outputs
        return (1, num_layers // 2 - 1, num_layers - 4)  # inputs of (2, L // 2, L - 3)


def _aux_outputs(raw: dict) -> tuple[int, ...] | None:
    nested = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if nested:  # SGLang / SpecForge: outputs of these layers
        return tuple(int(i) for i in nested)
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if top:  # vLLM / speculators: inputs of these layers
        return tuple(int(i) - 1 for i in top)
    return None


class Eagle3Block(nn.Module):
    """The midlayer: attention over [input_layernorm(embedding); hidden_norm(hidden)], then a
    Llama MLP; the residual is the hidden state."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        args = config.layer_args()
        width, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = llama.Attention(args)
        inner = config.num_attention_heads * config.head_dim
        kv = config.num_key_value_heads * config.head_dim
        self.self_attn.q_proj = nn.Linear(2 * width, inner, bias=False)
        self.self_attn.k_proj = nn.Linear(2 * width, kv, bias=False)
        self.self_attn.v_proj = nn.Linear(2 * width, kv, bias=False)
        self.mlp = llama.MLP(args)
        self.input_layernorm = nn.RMSNorm(width, eps=eps)
        self.hidden_norm = nn.RMSNorm(width, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(width, eps=eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, mask, cache) -> mx.array:
        h = hidden + self.attend(embeds, hidden, mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))

    def attend(self, embeds: mx.array, hidden: mx.array, mask, cache) -> mx.array:
        """The attention over [input_layernorm(embedding); hidden_norm(hidden)] (writes `cache`)."""
        x = mx.concatenate([self.input_layernorm(embeds), self.hidden_norm(hidden)], axis=-1)
        return self.self_attn(x, mask, cache)


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config, own_embed: bool = False):
        super().__init__()
        self.config = config
        width = config.hidden_size
        self.fc = nn.Linear(3 * config.target_hidden_size, width, bias=False)
        self.midlayer = Eagle3Block(config)
        self.norm = nn.RMSNorm(width, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(width, config.draft_vocab_size, bias=False)
        if own_embed:
            self.embed_tokens = nn.Embedding(config.vocab_size, width)
        self.set_vocab_map(mx.arange(config.draft_vocab_size), config.vocab_size)

    @property
    def fused_width(self) -> int:
        """The width of the target's states it reads: three layers' hidden states."""
        return 3 * self.config.target_hidden_size

    def __call__(self, tokens: mx.array, states: mx.array, target, cache=None):
        """tokens [B, L] (token t+1), states [B, L, 3·H] (the target's, fused by fc) or [B, L, H]
        (its own output, chained) -> (logits over the target's vocabulary, output state)."""
        h = self.hidden(tokens, states, target, cache)
        return self.logits(h, target), h

    def hidden(self, tokens: mx.array, states: mx.array, target, cache=None) -> mx.array:
        """The block's output states [B, L, H] alone: logits are read where a draft is made."""
        return self.midlayer(*self._block_input(tokens, states, target, cache), cache)

    def logits(self, h: mx.array, target=None) -> mx.array:
        """Output states -> logits over the target's vocabulary."""
        logits = self._draft_logits(h)
        return logits if self.identity_vocab else self.to_target_vocab(logits)

    def _draft_logits(self, h: mx.array) -> mx.array:
        return self.lm_head(self.norm(h))

    def forward(self, tokens: mx.array, states: mx.array, target, cache=None):
        """As __call__, with logits over the draft vocabulary (training)."""
        h = self.hidden(tokens, states, target, cache)
        return self._draft_logits(h), h

    def feed(self, tokens: mx.array, states: mx.array, target, cache) -> None:
        """Write these positions' keys and values into `cache` without their outputs."""
        self.midlayer.attend(*self._block_input(tokens, states, target, cache), cache)

    def _block_input(self, tokens: mx.array, states: mx.array, target, cache):
        embed = self.embed_tokens if "embed_tokens" in self else target.embed
        hidden = self.fc(states) if states.shape[-1] == self.fused_width else states
        # The batched cache wants an array mask once rows differ in length.
        mask = create_attention_mask(hidden, cache, return_array=True)
        return embed(tokens).astype(hidden.dtype), hidden, mask

    def to_target_vocab(self, logits: mx.array) -> mx.array:
        """Draft-vocabulary logits [..., N] -> [..., target vocab], -inf elsewhere."""
        return draft_vocab.to_target_vocab(logits, self.target_ids, self.target_width)

    def set_vocab_map(self, target_ids: mx.array, target_width: int) -> None:
        """Row i of lm_head scores target token target_ids[i]; the target's logits are
        `target_width` wide (a padded embedding may exceed vocab_size)."""
        self.target_ids = target_ids.astype(mx.int32)
        self.target_width = target_width
        n = self.target_ids.shape[0]
        self.identity_vocab = n == target_width and bool(
            mx.array_equal(self.target_ids, mx.arange(n)).item())
        self.freeze(keys=["target_ids"], recurse=False)

    # ---- the published layout ----------------------------------------------------------
    def published_weights(self) -> dict[str, mx.array]:
        """Parameter names as SpecForge saves them, plus d2t (offsets) and t2d (a mask)."""
        from mlx.utils import tree_flatten

        out = {k: v for k, v in tree_flatten(self.parameters()) if k != "target_ids"}
        out["d2t"] = draft_vocab.d2t(self.target_ids)
        t2d = np.zeros(self.config.vocab_size, dtype=bool)
        t2d[np.array(self.target_ids)] = True
        out["t2d"] = mx.array(t2d)
        return out


def published_config(config: Eagle3Config) -> dict:
    """config.json as SpecForge writes it."""
    return {
        "architectures": [ARCHITECTURE], "model_type": "llama",
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size, "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size, "tie_word_embeddings": False,
        "hidden_act": "silu", "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(config.aux_outputs or ()),
                         "use_aux_hidden_state": True},
    }


def save_head(head: Eagle3Head, out: Path, dtype=mx.bfloat16, extra: dict | None = None) -> None:
    """The head in the published layout: config.json + model.safetensors."""
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in head.published_weights().items()}
    mx.save_safetensors(str(out / WEIGHTS_FILE), weights, metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps({**published_config(head.config), **(extra or {})},
                                              indent=2) + "\n")


# ---- loading ------------------------------------------------------------------------------

def read_head(path: Path) -> tuple[Eagle3Config, dict[str, mx.array]]:
    """The config and the raw weights of a head directory (or its config.json's dir)."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"EAGLE-3 head {path}: no {CONFIG_FILE}")
    try:
        raw = json.loads(config_path.read_text())
    except ValueError as err:
        raise ModelLoadError(f"EAGLE-3 head {config_path}: not JSON ({err})") from None
    config = Eagle3Config.from_dict(raw, str(config_path))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = (f" (it has {', '.join(bins)}: convert them to safetensors, e.g. with "
                "safetensors.torch.save_file)") if bins else ""
        raise ModelLoadError(f"EAGLE-3 head {path}: no *.safetensors{hint}")
    weights: dict[str, mx.array] = {}
    for file in files:
        weights.update(mx.load(str(file)))
    return config, _canonical_names(weights)


def _canonical_names(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    out = {}
    for key, value in weights.items():
        for prefix in BLOCK_PREFIXES:
            if key.startswith(prefix):
                key = "midlayer." + key[len(prefix):]
                break
        else:
            key = key[len("model."):] if key.startswith("model.") else key
        out[key] = value
    return out


def build_head(config: Eagle3Config, weights: dict[str, mx.array], target_view, num_layers: int,
               dtype, where: str, target_vocab_size: int | None = None) -> Eagle3Head:
    """Check the head against the target (`target_vocab_size`: its config's, when its embedding
    is padded wider), then load it: every mismatch is named."""
    target_vocab = int(target_view.inner.embed_tokens.weight.shape[0])  # its logits' width
    target_hidden = int(target_view.inner.norm.weight.shape[0])
    problems = []
    if config.target_hidden_size != target_hidden:
        problems.append(f"it reads hidden states of width {config.target_hidden_size}; the target's "
                        f"are {target_hidden} (a head for another target?)")
    if config.vocab_size not in (target_vocab, target_vocab_size):
        problems.append(f"its vocab_size is {config.vocab_size}; the target has {target_vocab_size} "
                        "tokens (a head for another tokenizer?)")
    own_embed = "embed_tokens.weight" in weights
    if not own_embed and config.hidden_size != target_hidden:
        problems.append(f"its hidden_size {config.hidden_size} differs from the target's "
                        f"{target_hidden} and it has no embed_tokens of its own")
    layers = config.target_layers(num_layers)
    if len(layers) != 3 or any(not 0 <= i < num_layers for i in layers):
        problems.append(f"it reads target layers {list(layers)} (outputs); the target has layers "
                        f"0..{num_layers - 1} and the head fuses three")
    if problems:
        raise ModelLoadError(f"EAGLE-3 head {where} does not fit the target: " + "; ".join(problems))
    head = Eagle3Head(config, own_embed=own_embed)
    head.set_vocab_map(draft_vocab.target_ids(weights.get("d2t"), config.draft_vocab_size, config.vocab_size,
                                              target_vocab, f"EAGLE-3 head {where}"), target_vocab)
    _load_checked(head, weights, where)
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    return head


def _load_checked(head: Eagle3Head, weights: dict[str, mx.array], where: str) -> None:
    from mlx.utils import tree_flatten, tree_unflatten

    expected = dict(tree_flatten(head.parameters()))
    expected.pop("target_ids", None)
    given = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    missing = sorted(set(expected) - set(given))
    if missing:
        raise ModelLoadError(f"EAGLE-3 head {where}: missing weights {', '.join(missing)}")
    wrong = [f"{k} {tuple(given[k].shape)} (expected {tuple(v.shape)})" for k, v in expected.items()
             if tuple(given[k].shape) != tuple(v.shape)]
    if wrong:
        raise ModelLoadError(f"EAGLE-3 head {where}: wrong shapes: {'; '.join(wrong)}")
    extra = sorted(set(given) - set(expected))
    if extra:
        logger.info("EAGLE-3 head %s: ignoring %s", where, ", ".join(extra))
    head.update(tree_unflatten([(k, given[k]) for k in expected]))


def check_files(path: Path, target_config: dict | None) -> str:
    """What doctor says of a head dir without loading it: its config, its weights' names and
    shapes (safetensors headers) and, given the target's config, whether they fit it."""
    from .store import safetensors_header
    from .textconfig import language_config

    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ModelLoadError(f"EAGLE-3 head {path}: no {CONFIG_FILE}")
    config = Eagle3Config.from_dict(json.loads(config_path.read_text()), str(config_path))
    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        names |= {k for k in safetensors_header(file) if k != "__metadata__"}
    names = set(_canonical_names(dict.fromkeys(names)))
    needed = {"fc.weight", "midlayer.self_attn.q_proj.weight", "norm.weight", "lm_head.weight"}
    if not needed <= names:
        raise ModelLoadError(f"EAGLE-3 head {path}: missing weights {', '.join(sorted(needed - names))}")
    if target_config is not None:
        text = language_config(target_config)
        layers = config.target_layers(int(text["num_hidden_layers"]))
        problems = []
        if config.target_hidden_size != text["hidden_size"]:
            problems.append(f"it reads hidden states of width {config.target_hidden_size}; the "
                            f"target's are {text['hidden_size']}")
        if config.vocab_size != text["vocab_size"]:
            problems.append(f"its vocab_size is {config.vocab_size}; the target's is {text['vocab_size']}")
        if any(not 0 <= i < text["num_hidden_layers"] for i in layers):
            problems.append(f"it reads layers {list(layers)}; the target has {text['num_hidden_layers']}")
        if problems:
            raise ModelLoadError(f"EAGLE-3 head {path} does not fit the target: " + "; ".join(problems))
        return (f"draft vocabulary {config.draft_vocab_size}, reads layers {list(layers)} of "
                f"{text['num_hidden_layers']}")
    return f"draft vocabulary {config.draft_vocab_size}"
