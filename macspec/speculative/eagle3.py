"""An EAGLE-3 head proposes from three of the target's layers, for every row of its method in
one head forward per chain step.

It is the MTP group's mechanics with another head: position t reads (the target's low, middle
and high states at t, token t+1) and predicts token t+2; for k > 1 it chains on its own output
state, and the chained positions roll back once the step is verified. The target keeps the
three layers' outputs in the forward that verifies (models/view.py `tap_layers`): no second
pass, and under tensor parallelism rank 0 has them like the final state.
"""

from __future__ import annotations

import logging
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from ..kv.batched import BatchKV, layout_of
from ..models.eagle3 import Eagle3Head, build_head, read_head
from ..models.view import ModelView, tap_layers, tapped_columns
from ..monitor.memory import compute_dtype_bytes
from ..progress import phase
from .base import kept_bytes
from .mtp import MTPGroup

logger = logging.getLogger(__name__)

SHIPPED_DIR = "eagle3"  # a head attached beside the target's weights (`macspec pull`)


def head_dir(runtime) -> Path:
    """speculative.eagle3_head (a dir or a Hugging Face id), else the head shipped with the target."""
    from ..models.loader import beside_target

    return beside_target(runtime.profile.speculative.eagle3_head, runtime.target.path, SHIPPED_DIR,
                         "EAGLE-3 head", "eagle3_head")


def load(runtime, method: str, fallback: bool = True) -> None:
    """The head, checked against the target; the target's layers it reads are tapped."""
    if runtime.eagle3_head is not None:
        return
    path = head_dir(runtime)
    with phase(f"loading the EAGLE-3 head {path}"):
        view = runtime.view
        config, weights = read_head(path)
        num_layers = len(view.inner.layers)
        target_config = runtime.target.config
        vocab = (target_config.get("text_config") or target_config).get("vocab_size")
        head = build_head(config, weights, view, num_layers, view.inner.norm.weight.dtype, str(path),
                          target_vocab_size=vocab)
        tap_layers(runtime.target.model, config.target_layers(num_layers))
    logger.info("EAGLE-3 head %s: draft vocabulary %d, target layers %s", path,
                config.draft_vocab_size, list(config.target_layers(num_layers)))
    runtime.eagle3_head = head


def make_group(runtime, method: str, vocab_size: int) -> "Eagle3Group":
    return Eagle3Group(runtime.eagle3_head, runtime.view, vocab_size, runtime.profile.speculative.head_context,
                       kept_bytes(runtime, kv_bytes_per_token(runtime, method)))


def kv_bytes_per_token(runtime, method: str) -> int:
    """Its one attention block: keys and values of every KV head."""
    config = runtime.eagle3_head.config
    return 2 * config.num_key_value_heads * config.head_dim * compute_dtype_bytes(runtime.target.model)


class Eagle3Group(MTPGroup):
    method = "eagle3"

    def __init__(self, head: Eagle3Head, view: ModelView, vocab_size: int, context: int = 0, kept_bytes: int = 0):
        self.layout_cache = lambda: [KVCache()]
        super(MTPGroup, self).__init__(BatchKV(layout_of(self.layout_cache())), vocab_size, kept_bytes)
        self.head = head
        self.view = view
        self._keep_context(context)
        self.rows = {}
        self.state = None
        self.target_width = int(view.inner.norm.weight.shape[0])

    @property
    def _dtype(self):
        return self.head.fc.weight.dtype

    @property
    def _width(self) -> int:  # the fused states: three layers of the target
        return self.head.fused_width

    def _own_states(self, states: mx.array | None) -> mx.array | None:
        return tapped_columns(states, self.target_width, self._width)
