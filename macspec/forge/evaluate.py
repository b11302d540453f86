"""Held-out quality of a forged family: what speculation will see before it runs."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..models.mtp import MTPHead
from ..models.view import ModelView


def evaluate_family(target: nn.Module, draft: nn.Module, head: MTPHead, tokens: np.ndarray,
                    seq_len: int = 256, max_windows: int = 32) -> dict:
    """Perplexities, draft/target top-1 agreement (~ greedy acceptance at k = 1) and the MTP
    head's top-1 accuracy at t+2 (against the data and against the target's own greedy choice)."""
    view = ModelView(target)
    n = min(max_windows, (len(tokens) - 1) // seq_len)
    sums = dict(target_nll=0.0, draft_nll=0.0, agree=0.0, mtp_data=0.0, mtp_target=0.0)
    for i in range(n):
        window = mx.array(tokens[i * seq_len:(i + 1) * seq_len + 1])[None]
        inputs, labels = window[:, :-1], window[:, 1:]
        logits, hidden = view.forward(inputs)
        draft_logits = draft(inputs)
        mtp_logits, _ = head(inputs[:, 1:], hidden[:, :-1], view)
        target_top = logits.argmax(-1)
        sums["target_nll"] += nn.losses.cross_entropy(logits, labels, reduction="mean").item()
        sums["draft_nll"] += nn.losses.cross_entropy(draft_logits, labels, reduction="mean").item()
        sums["agree"] += (draft_logits.argmax(-1) == target_top).mean().item()
        mtp_top = mtp_logits.argmax(-1)  # position t predicts t+2
        sums["mtp_data"] += (mtp_top[:, :-1] == inputs[:, 2:]).mean().item()
        sums["mtp_target"] += (mtp_top == target_top[:, 1:]).mean().item()
    avg = {k: v / max(n, 1) for k, v in sums.items()}
    return {
        "heldout_ppl_target": round(float(np.exp(avg["target_nll"])), 2),
        "heldout_ppl_draft": round(float(np.exp(avg["draft_nll"])), 2),
        "draft_target_top1_agreement": round(avg["agree"], 4),
        "mtp_top1_t2_vs_data": round(avg["mtp_data"], 4),
        "mtp_top1_t2_vs_target_greedy": round(avg["mtp_target"], 4),
    }
