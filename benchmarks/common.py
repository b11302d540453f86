"""Shared by the benchmarks: the model family (tiny and widened), prompts, timed runs."""

from __future__ import annotations

import time

import mlx.core as mx
from mlx.utils import tree_flatten

from macspec.config import load_profile
from macspec.engine.engine import Engine
from macspec.engine.launch import calibrated_engine
from macspec.engine.runtime import Runtime
from macspec.sampling import SamplingParams
from macspec import corpus
from macspec.models.built import WIDE_HIDDEN
from macspec.models.checkpoint import LoadedModel, load_mtp_head
from macspec.models.loader import load_model


def bench_prompts(tokenizer, count: int, length: int = 96) -> list[list[int]]:
    """Openings of held-out stdlib files (never trained on)."""
    texts = [t for t in corpus.read_texts(heldout=True) if len(t) > 4000]
    step = max(1, len(texts) // count)
    return [tokenizer.encode(texts[i * step][:2000], add_special_tokens=False)[:length]
            for i in range(count)]


def generate_in_batches(engine: Engine, prompts, batch: int, tokens: int, method: str, k: int | None,
                        adaptive: bool) -> int:
    """Every prompt, `batch` at a time, greedy, each answer `tokens` long; -> the tokens made."""
    made = 0
    for start in range(0, len(prompts), batch):
        done = engine.generate(prompts[start:start + batch], SamplingParams(), tokens, num_draft=k,
                               adaptive=adaptive, ignore_eos=True, method=method)
        made += sum(len(d.tokens) for d in done)
    return made


def _runtimes(target: LoadedModel, draft: LoadedModel, head) -> dict[str, Runtime]:
    profile = load_profile("tiny")
    profile.kv.max_context = 4096
    return {"none": Runtime(profile, target, "none"),
            "draft": Runtime(profile, target, "draft", draft=draft),
            "mtp": Runtime(profile, target, "mtp", mtp_head=head),
            "ngram": Runtime(profile, target, "ngram")}


def load_family(wide_hidden: int, which: list[str]) -> dict:
    target = load_model("embedded:tiny-target")
    draft = load_model("embedded:tiny-draft")
    head = load_mtp_head(target)
    targets = {}
    if "tiny" in which:
        targets["tiny"] = _runtimes(target, draft, head)
    if "wide" in which:  # built into the cache on first use, as `macspec run -p tiny-wide` does
        name = "tiny-wide" if wide_hidden == WIDE_HIDDEN else f"tiny-wide-{wide_hidden}"
        wide = load_model(f"built:{name}", dtype="float32")
        params = sum(v.size for _, v in tree_flatten(wide.model.parameters()))
        targets[f"wide-{params / 1e6:.0f}M"] = _runtimes(wide, draft, load_mtp_head(wide))
    return {"tokenizer": target.tokenizer, "targets": targets}


_ENGINES: dict[int, Engine] = {}


def engine_for(runtime: Runtime) -> Engine:
    """The engine `serve` uses, batch of one, its cost model calibrated as at start-up."""
    if id(runtime) not in _ENGINES:
        _ENGINES[id(runtime)] = calibrated_engine(runtime, max_batch=1)
    return _ENGINES[id(runtime)]


def time_macspec(runtime: Runtime, prompts, max_tokens: int, temp: float, k: int | None,
                 adaptive: bool, label: str) -> dict:
    engine = engine_for(runtime)
    tokens = forwards = drafted = accepted = 0
    seconds = 0.0
    for i, prompt in [(-1, prompts[0])] + list(enumerate(prompts)):  # i = -1: untimed warm-up
        params = SamplingParams(temperature=temp, seed=max(i, 0))
        [done] = engine.generate([prompt], params, max_tokens, num_draft=k, adaptive=adaptive)
        if done.error is not None:
            raise done.error
        s = done.stats
        if i < 0:
            continue
        tokens += s["generated_tokens"] - 1  # decode only: the first token belongs to prefill
        seconds += s["decode_s"]
        forwards += s["spec"]["target_forwards"]
        drafted += s["spec"]["drafted"]
        accepted += s["spec"]["accepted"]
    return {"config": label, "tok_s": tokens / seconds, "tokens_per_forward": tokens / max(forwards, 1),
            "acceptance": accepted / drafted if drafted else 0.0, "mean_k": drafted / max(forwards, 1)}


def time_mlx_lm_plain(runtime: Runtime, prompts, max_tokens: int, temp: float) -> dict:
    """mlx_lm.stream_generate on the same model: the outside reference for plain decoding
    (its generation_tps counts decode tokens after the first, as ours does)."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens = 0
    seconds = 0.0
    for i, prompt in [(-1, prompts[0])] + list(enumerate(prompts)):
        mx.random.seed(max(i, 0))
        last = None
        for last in stream_generate(runtime.target.model, runtime.tokenizer, prompt, max_tokens=max_tokens,
                                    sampler=make_sampler(temp=temp)):
            pass
        if i < 0 or last is None or last.generation_tokens < 2:
            continue
        decode = last.generation_tokens - 1
        tokens += decode
        seconds += decode / last.generation_tps
    return {"config": "mlx-lm plain", "tok_s": tokens / seconds, "tokens_per_forward": 1.0,
            "acceptance": 0.0, "mean_k": 0.0}


def time_mlx_lm(runtime: Runtime, prompts, max_tokens: int, temp: float, k: int) -> dict:
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.sample_utils import make_sampler

    tokens = drafted_accepted = 0
    seconds = 0.0
    for i, prompt in [(-1, prompts[0])] + list(enumerate(prompts)):  # i = -1: untimed warm-up
        mx.random.seed(max(i, 0))
        steps = speculative_generate_step(mx.array(prompt), runtime.target.model, runtime.draft.model,
                                          num_draft_tokens=k, max_tokens=max_tokens,
                                          sampler=make_sampler(temp=temp))
        first, count, from_drafts = None, 0, 0
        for n, (_, _, from_draft) in enumerate(steps):
            if n == 0:
                first = time.perf_counter()
            from_drafts += int(from_draft)
            count += 1
        if i < 0:
            continue
        seconds += time.perf_counter() - first
        tokens += count - 1
        drafted_accepted += from_drafts
    forwards = max(tokens - drafted_accepted, 1)  # each target forward yields one non-draft token
    return {"config": f"mlx-lm spec k={k}", "tok_s": tokens / seconds,
            "tokens_per_forward": tokens / forwards,
            "acceptance": drafted_accepted / max(forwards * k, 1), "mean_k": float(k)}
