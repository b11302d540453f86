"""Draft/target tokenizer compatibility: a mismatch means 0% acceptance, so say so at load."""

from __future__ import annotations

from ..errors import IncompatibleDraftError


def _vocab(tokenizer) -> dict[str, int]:
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    return inner.get_vocab()


def tokenizer_mismatch(target_tok, draft_tok) -> str | None:
    """A human-readable reason the two tokenizers differ, or None when they agree."""
    target_vocab, draft_vocab = _vocab(target_tok), _vocab(draft_tok)
    if target_vocab != draft_vocab:
        differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda kv: kv[1])
        example = ", ".join(f"{tok!r}->{idx}" for tok, idx in differing[:3])
        return (f"vocabularies differ (target {len(target_vocab)} tokens, draft {len(draft_vocab)}; "
                f"{len(differing)} differing entries, e.g. {example})")
    if set(target_tok.eos_token_ids) != set(draft_tok.eos_token_ids):
        return (f"end-of-sequence tokens differ (target {sorted(target_tok.eos_token_ids)}, "
                f"draft {sorted(draft_tok.eos_token_ids)})")
    for attr in ("bos_token_id", "pad_token_id"):
        a, b = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if a != b:
            return f"{attr} differs (target {a}, draft {b})"
    return None


def check_draft_compatible(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    reason = tokenizer_mismatch(target_tok, draft_tok)
    if reason:
        raise IncompatibleDraftError(
            f"draft {draft_name} cannot propose for {target_name}: {reason}. Its tokens would "
            "never be accepted. Use a draft with the same tokenizer, --method ngram, or set "
            "speculative.allow_fallback = true to fall back to n-gram proposals.")
