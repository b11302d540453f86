"""Sparse upcycling: built:tiny-moe, an MoE target whose logits equal the dense tiny target's.

The embedded target, widened to hidden 512 (widen.py), becomes a GLM-4.5-style MoE (mlx-lm's
`glm4_moe`, the family of GLM-5's MoE layers): layer 0 stays dense, as the first layers of
DeepSeek-V3 and Kimi K2.5 do; in every other layer, and in the MTP head's block (GLM-5's MTP
layer is an MoE layer too), the MLP's 768 trained units are split in two: the first half is
one shared expert, the second half is copied into each of 64 routed experts. A fixed random
router (sigmoid scores, top 8, gates renormalised to sum to 1, as GLM's `noaux_tc` with
`norm_topk_prob`) picks 8 copies per token, so Σ gate · copy equals the dense half: the logits
equal the dense target's up to float rounding, and the draft and MTP head keep their
acceptance. Routed experts are 2/3 of the bytes a token reads (Kimi K2.5: about as much).

Which copies a window's tokens pick sets what verifying it costs (the distinct experts it reads),
so the router is fitted to a routing statistic, never left to chance: a random projection of the
hidden state routes by popularity (a few experts for every token: 0.29-0.42 overlap between far
apart tokens), which trained, load-balanced routers do not. Each layer's router reads the
hidden state's components (mean removed) that change slowly from token to token and those that
change fast (slow feature analysis on the stdlib corpus), mixed so that consecutive tokens share
NEXT_TOKEN_OVERLAP of their experts (`trained`, a trained router's ~38 %), or fast ones only, so
tokens route independently (`independent`, 8/64 = 12.5 % by chance): the two ends of the cost
surface (benchmarks/cost_surface.py).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import glm4_moe

from .. import corpus
from .mtp import MTPHead, make_block_like

MOE_HIDDEN = 512
EXPERTS = 64
TOP_K = 8
EXPERT_UNITS = 384  # each routed expert and the shared expert; 2 x 384 = the 768 trained units
DENSE_LAYERS = 1
ROUTER_SEED = 0
ROUTINGS = ("trained", "independent")
NEXT_TOKEN_OVERLAP = 0.38  # of a token's experts, shared with the token before (Cohere, 2026-04)
FIT_TOKENS = 4096  # corpus tokens whose hidden states the routers are fitted on


def moe_config(wide: dict) -> dict:
    """The glm4_moe config for a widened llama config (same attention, norms and RoPE)."""
    keep = ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings",
            "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
            "rms_norm_eps", "rope_theta", "eos_token_id", "num_nextn_predict_layers")
    return {**{k: wide[k] for k in keep if k in wide}, "model_type": "glm4_moe",
            "architectures": ["Glm4MoeForCausalLM"], "moe_intermediate_size": EXPERT_UNITS,
            "n_routed_experts": EXPERTS, "num_experts_per_tok": TOP_K, "n_shared_experts": 1,
            "norm_topk_prob": True, "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
            "first_k_dense_replace": DENSE_LAYERS, "rope_scaling": None, "use_qk_norm": False,
            "attention_bias": False, "partial_rotary_factor": 1.0, "tie_word_embeddings": False}


def _moe_mlp(mlp: dict[str, mx.array], router: mx.array) -> dict[str, mx.array]:
    """A dense MLP's parameters (gate_proj/up_proj/down_proj.weight) -> glm4_moe MoE parameters:
    units [0, 384) the shared expert, units [384, 768) every routed expert."""
    gate, up, down = mlp["gate_proj.weight"], mlp["up_proj.weight"], mlp["down_proj.weight"]
    if gate.shape[0] < 2 * EXPERT_UNITS or mx.any(gate[2 * EXPERT_UNITS:] != 0).item():
        raise ValueError(f"the MLP's trained units must be the first {2 * EXPERT_UNITS}")
    shared, routed = slice(0, EXPERT_UNITS), slice(EXPERT_UNITS, 2 * EXPERT_UNITS)

    def copies(w: mx.array) -> mx.array:
        return mx.broadcast_to(w[None], (EXPERTS, *w.shape))

    return {"shared_experts.gate_proj.weight": gate[shared], "shared_experts.up_proj.weight": up[shared],
            "shared_experts.down_proj.weight": down[:, shared],
            "switch_mlp.gate_proj.weight": copies(gate[routed]), "switch_mlp.up_proj.weight": copies(up[routed]),
            "switch_mlp.down_proj.weight": copies(down[:, routed]),
            "gate.weight": router, "gate.e_score_correction_bias": mx.zeros((EXPERTS,))}


def _convert(flat: dict[str, mx.array], moe_layers: set[str], key: mx.array,
             routers: dict[str, mx.array] | None = None) -> dict[str, mx.array]:
    """Flat llama parameters -> glm4_moe names: MLPs under a prefix in `moe_layers` upcycled
    (each its router from `routers`, else a random one from `key`), the rest copied."""
    out, mlps = {}, {}
    for name, value in flat.items():
        layer, sep, rest = name.partition(".mlp.")
        if sep and layer in moe_layers:
            mlps.setdefault(layer, {})[rest] = value
        else:
            out[name] = value
    for index, (layer, mlp) in enumerate(sorted(mlps.items())):
        hidden = mlp["gate_proj.weight"].shape[1]
        router = routers[layer] if routers else (
            mx.random.normal((EXPERTS, hidden), key=mx.random.split(key, len(mlps))[index]) * hidden ** -0.5)
        out.update({f"{layer}.mlp.{k}": v for k, v in _moe_mlp(mlp, router).items()})
    return out


def upcycle_target(wide: nn.Module, wide_cfg: dict, tokens: list[int] | None = None,
                   routing: str = "trained") -> tuple[nn.Module, dict]:
    """The widened dense target -> (glm4_moe model, its config), same logits; its routers fitted
    on the hidden states of `tokens` (None: random projections, popularity routing)."""
    config = moe_config(wide_cfg)
    model = glm4_moe.Model(glm4_moe.ModelArgs.from_dict(config))
    flat = dict(tree_flatten(wide.parameters()))
    flat["lm_head.weight"] = flat["model.embed_tokens.weight"]  # the tiny target ties them
    moe_layers = {f"model.layers.{i}" for i in range(DENSE_LAYERS, config["num_hidden_layers"])}
    routers = None
    if tokens is not None:
        states = mlp_inputs(wide, tokens, sorted(moe_layers))
        routers = {layer: mx.array(fit_router(x, routing, seed=i).astype(np.float32))
                   for i, (layer, x) in enumerate(states.items())}
    model.update(tree_unflatten(list(_convert(flat, moe_layers, mx.random.key(ROUTER_SEED), routers).items())))
    mx.eval(model.parameters())
    return model, config


def upcycle_mtp_head(head: MTPHead, moe_model: nn.Module, config: dict) -> MTPHead:
    """The widened MTP head with its block's MLP upcycled like the target's (its own router)."""
    layer = config["num_hidden_layers"]
    moe_head = MTPHead(make_block_like(moe_model, layer), config["hidden_size"], config["rms_norm_eps"])
    flat = dict(tree_flatten(head.parameters()))
    moe_head.update(tree_unflatten(list(_convert(flat, {"block"}, mx.random.key(ROUTER_SEED + layer)).items())))
    mx.eval(moe_head.parameters())
    return moe_head


def fit_tokens(tokenizer) -> list[int]:
    """FIT_TOKENS tokens of the stdlib corpus's training side (the forge's held-out files stay out)."""
    tokens: list[int] = []
    for text in corpus.read_texts(heldout=False):
        tokens += tokenizer.encode(text)
        if len(tokens) >= FIT_TOKENS:
            break
    return tokens[:FIT_TOKENS]


def mlp_inputs(model: nn.Module, tokens: list[int], layers: list[str]) -> dict[str, np.ndarray]:
    """Each named layer's MLP input (the post-attention-norm hidden state) for `tokens` run
    through the dense model in 512-token segments -> {layer: [T, D]}."""
    caught: dict[str, list] = {name: [] for name in layers}
    blocks = {f"model.layers.{i}": block for i, block in enumerate(model.model.layers)}

    def recorder(name, mlp):
        def record(x):
            caught[name].append(np.array(x.reshape(-1, x.shape[-1])))
            return mlp(x)
        return record

    originals = {name: blocks[name].mlp for name in layers}
    for name in layers:
        blocks[name].mlp = recorder(name, originals[name])
    try:
        for start in range(0, len(tokens), 512):
            mx.eval(model(mx.array([tokens[start:start + 512]])))
    finally:
        for name in layers:
            blocks[name].mlp = originals[name]
    return {name: np.concatenate(parts) for name, parts in caught.items()}


def _overlap(states: np.ndarray, router: np.ndarray) -> float:
    """Mean fraction of a token's top-k experts shared with the token before."""
    top = np.argsort(-(states @ router.T), axis=1)[:, :TOP_K]
    shared = (top[1:, :, None] == top[:-1, None, :]).any(-1).sum(-1)
    return float(shared.mean() / TOP_K)


def fit_router(states: np.ndarray, routing: str, seed: int) -> np.ndarray:
    """A router [E, D] for hidden states [T, D] (in order): random combinations of the slow and
    the fast features, mixed to NEXT_TOKEN_OVERLAP (`trained`) or of the fast ones only."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, not {routing!r}")
    mean = states.mean(0)
    ahead = mean / np.linalg.norm(mean)
    flat = states - np.outer(states @ ahead, ahead)  # no popular experts: the mean direction out
    cov = np.cov(flat.T, bias=True)
    step = np.diff(flat, axis=0)
    spread, basis = np.linalg.eigh(cov)
    live = spread > 1e-6 * spread.max()  # the widened stream lives in a subspace
    whiten = basis[:, live] / np.sqrt(spread[live])
    change, features = np.linalg.eigh(np.cov((step @ whiten).T, bias=True))  # slowest first
    directions = whiten @ features  # [D, live], unit variance each, slowest first
    rng = np.random.default_rng(ROUTER_SEED + seed)
    half = directions.shape[1] // 2
    slow = rng.normal(size=(EXPERTS, 8)) @ directions[:, :8].T
    fast = rng.normal(size=(EXPERTS, half)) @ directions[:, -half:].T
    slow, fast = (w / np.std(flat @ w.T) for w in (slow, fast))
    if routing == "independent":
        return fast
    low, high = 0.0, 1.0  # the share of slow features: overlap grows with it
    for _ in range(20):
        mix = (low + high) / 2
        if _overlap(flat, mix * slow + (1 - mix) * fast) < NEXT_TOKEN_OVERLAP:
            low = mix
        else:
            high = mix
    return mix * slow + (1 - mix) * fast
