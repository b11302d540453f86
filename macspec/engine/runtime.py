"""Everything loaded for a profile: target, proposer models, and how to make proposers."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..config import Profile
from ..errors import MacspecError, RequestError
from ..models import cpu_prefill, expert_union, row_padding
from ..models.checkpoint import LoadedModel
from ..models.loader import load_model
from ..models.dflash import DFlashDrafter
from ..models.eagle3 import Eagle3Head
from ..models.mtp import MTPHead
from ..models.view import ModelView
from ..monitor.memory import apply_wired_limit, compute_dtype_bytes, kv_bytes_per_token
from ..progress import phase
from .. import proposers
from ..speculative.base import ProposerGroup

logger = logging.getLogger(__name__)


@dataclass
class Runtime:
    profile: Profile
    target: LoadedModel
    method: str
    draft: LoadedModel | None = None
    mtp_head: MTPHead | None = None
    eagle3_head: Eagle3Head | None = None
    dflash_drafter: DFlashDrafter | None = None
    unavailable: dict[str, str] = field(default_factory=dict)  # method -> why it cannot load
    routed: set[int] = field(default_factory=set)  # id() of each model route_rows() has seen

    @property
    def view(self) -> ModelView:
        return ModelView(self.target.model)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def vocab_size(self) -> int:
        """The target's logits width (a padded embedding may exceed the tokenizer's)."""
        return int(self.view.inner.embed_tokens.weight.shape[0])

    @property
    def reads_states(self) -> bool:
        """A loaded head reads the target's states (MTP, EAGLE-3, DFlash): every row then keeps
        its prompt's, so a prefix any row stores serves the head's rows too."""
        return any(head is not None for head in (self.mtp_head, self.eagle3_head, self.dflash_drafter))

    def make_group(self, method: str, vocab_size: int) -> ProposerGroup:
        """A fresh proposer for every row of `method` (the engine holds one per method)."""
        return proposers.implementation(method).make_group(self, method, vocab_size)

    def kv_bytes_per_token(self, method: str, tp: int = 1) -> int:
        """KV bytes per token on one rank: the target's shard plus the proposer's own cache."""
        target = kv_bytes_per_token(self.target.config, compute_dtype_bytes(self.target.model), tp=tp)
        if method == proposers.PLAIN:
            return target
        return target + proposers.implementation(method).kv_bytes_per_token(self, method)

    def ensure_method(self, method: str) -> None:
        """Load what `method` needs when a request asks for one the profile did not load."""
        if method not in proposers.METHODS:
            raise RequestError(f"unknown speculative method {method!r}; one of {', '.join(proposers.METHODS)}")
        if method in self.unavailable:
            raise RequestError(self.unavailable[method])
        if method == proposers.PLAIN:
            return
        try:
            proposers.implementation(method).load(self, method, fallback=False)
        except MacspecError as err:
            self.unavailable[method] = f"speculative method {method!r} is unavailable: {err}"
            raise RequestError(self.unavailable[method]) from err
        self.route_rows()

    def route_rows(self) -> None:
        """Each model loaded since the last call: its small matmuls at the row counts this CPU runs
        fastest. Every request asks for its method: walking every module then cost 0.7 ms each."""
        for model in (self.target.model, getattr(self.draft, "model", None), self.mtp_head, self.eagle3_head,
                      self.dflash_drafter):
            if model is not None and id(model) not in self.routed:
                self.routed.add(id(model))
                row_padding.route(model)

    @classmethod
    def load(cls, profile: Profile, tp=None) -> "Runtime":
        """`tp` (a TPContext): load this rank's shard; proposers stay whole, on rank 0 only."""
        m = profile.model
        apply_wired_limit(profile.hardware.wired_limit_mb)  # Metal only: before weights land
        cpu_prefill.enable(m.cpu_prefill)
        expert_union.enable(m.expert_union)
        row_padding.enable(m.cpu_row_padding)
        with phase(f"loading {m.path}" + (f" (shard of {tp.size})" if tp else "")):
            target = load_model(m.path, m.dtype, m.revision, m.trust_remote_code,
                                group=tp.group if tp else None)
            if tp is not None:  # the workers run this check with us, inside their plan loop
                tp.send_op("check_hidden")
                target.hidden_is_final = ModelView(target.model).hidden_is_final()
        runtime = cls(profile, target, profile.speculative.method)
        if runtime.method != proposers.PLAIN:
            proposers.implementation(runtime.method).load(runtime, runtime.method)
        runtime.route_rows()
        logger.info("loaded %s (method %s)", target.path, runtime.method)
        return runtime
