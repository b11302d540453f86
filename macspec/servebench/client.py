"""One streamed completion, timed from the client's side: TTFT, prefill and decode rates."""

from __future__ import annotations

import json
import time

import aiohttp


async def stream_completion(session: aiohttp.ClientSession, url: str, body: dict,
                            headers: dict) -> dict:
    """-> a request row; failures are rows too (status FAIL with the error), never raised."""
    start = time.perf_counter()
    ttft, pieces, usage = None, [], None
    row = {"status": "OK", "error": None}
    try:
        async with session.post(url + "/v1/completions", json={**body, "stream": True,
                                "stream_options": {"include_usage": True}}, headers=headers) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                return _failed(row, f"HTTP {resp.status}: {text}", start)
            async for raw in resp.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return _failed(row, f"in-stream error: {chunk['error'].get('message')}", start)
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    if choice.get("text"):
                        ttft = ttft or time.perf_counter() - start
                        pieces.append(choice["text"])
    except (aiohttp.ClientError, TimeoutError, ValueError) as err:
        return _failed(row, f"{type(err).__name__}: {err}", start)
    total = time.perf_counter() - start
    ttft = ttft if ttft is not None else total
    prompt_tokens = (usage or {}).get("prompt_tokens")
    completion = (usage or {}).get("completion_tokens", len(pieces))
    decode_s = total - ttft
    row.update({
        "prompt_tokens": prompt_tokens, "completion_tokens": completion,
        "ttft_s": round(ttft, 4), "total_s": round(total, 4),
        "prefill_tok_s": round(prompt_tokens / ttft, 1) if prompt_tokens and ttft > 0 else None,
        # The first token arrives with TTFT; the rest are decode.
        "decode_tok_s": round((completion - 1) / decode_s, 1) if completion > 1 and decode_s > 0 else None,
        "text_chars": sum(len(p) for p in pieces),
    })
    return row


def _failed(row: dict, error: str, start: float) -> dict:
    row.update({"status": "FAIL", "error": error, "prompt_tokens": None, "completion_tokens": 0,
                "ttft_s": None, "total_s": round(time.perf_counter() - start, 4),
                "prefill_tok_s": None, "decode_tok_s": None, "text_chars": 0})
    return row
