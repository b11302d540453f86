"""A benchmark's decode steps by batch size and window, read off /v1/status `steps_by_window`:
where adaptive speculation and a fixed k (or spec off) part ways, and what each window cost."""

from __future__ import annotations


def engine_seconds(engine: dict) -> tuple[float, float]:
    """A /v1/status engine section's (prefill, decode) seconds so far: decode is every step part
    but prefill (plan, build, sync, commit, close)."""
    busy = {part: ms / 1e3 for part, ms in engine["time_ms"].items()}
    return busy.pop("prefill", 0.0), sum(busy.values())


def window_mix(before: dict, after: dict) -> dict[str, list[float]]:
    """What ran between two /v1/status `steps_by_window` snapshots, by (rows, window):
    "16 2" -> [steps, seconds, tokens committed]."""
    mix: dict[str, list[float]] = {}
    for rows, cells in after.items():
        for window, cell in cells.items():
            was = before.get(rows, {}).get(window, {"steps": 0, "seconds": 0.0, "tokens": 0})
            if cell["steps"] > was["steps"]:
                mix[f"{rows} {window}"] = [cell[key] - was[key] for key in ("steps", "seconds", "tokens")]
    return mix


ROW_RANGES = [(1, 1), (2, 3), (4, 4), (5, 8), (9, 16), (17, 1 << 30)]


def window_line(mix: dict[str, list[float]]) -> str:
    """Per row range: each window's steps, their seconds ÷ what plain steps at the same row counts
    took (ms where none ran) and the tokens they committed a row."""
    plain = {int(k.split()[0]): v[1] / v[0] for k, v in mix.items() if k.endswith(" 1")}
    spans: dict[tuple[int, int], dict[int, list[float]]] = {}
    for key, (steps, seconds, tokens) in mix.items():
        rows, window = map(int, key.split())
        span = next(r for r in ROW_RANGES if rows <= r[1])
        # steps, seconds, tokens, row-steps; where plain steps ran at its row count, its seconds
        # and theirs for as many steps
        cell = spans.setdefault(span, {}).setdefault(window, [0, 0.0, 0, 0, 0.0, 0.0])
        priced = rows in plain
        for i, value in enumerate((steps, seconds, tokens, steps * rows, seconds * priced,
                                   steps * plain.get(rows, 0.0))):
            cell[i] += value
    parts = []
    for (lo, hi), windows in sorted(spans.items()):
        cells = []
        for window, (steps, seconds, tokens, row_steps, priced_s, plain_s) in sorted(windows.items()):
            cost = f"{priced_s / plain_s:.2f}x" if window > 1 and plain_s else f"{seconds / steps * 1e3:.0f} ms"
            cells.append(f"W{window} {steps} x {cost} {tokens / row_steps:.2f} tok/row")
        parts.append(f"{lo if lo == hi else f'{lo}-{hi}'} rows: " + ", ".join(cells))
    return "; ".join(parts)


def merge(mixes: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Several runs' mixes summed (a benchmark's repeats)."""
    out: dict[str, list[float]] = {}
    for mix in mixes:
        for key, cell in mix.items():
            out[key] = [a + b for a, b in zip(out.get(key, [0] * len(cell)), cell)]
    return out
