"""What a decode step costs, measured: seconds per step by (chain, rows, window), from the steps
actually run, plain ones included. The number is the whole step (plan, drafting, target forward,
verification, commit), so whatever a step really costs is in it: an MoE target's expert reads, a
head's marginal cost, sampled rows, host work. A cell is one row count, not a range: a batch
draining from 16 rows to 9 costs ~25 % less a step, and a range priced those steps at its
fuller ones (drafting while it drained read as a gain; tiny-wide, c = 16).

`chain` names the proposers whose draft chain ran in the step ("" when none did: plain steps and
lookup drafts); the window is k + 1 positions per row. Start-up calibration seeds cells; a seed
stands until the first real step of its cell, and that step rescales the other seeds at its row
count by how far it was off (calibration times the forward alone, not the host work). A cell
nothing measured or seeded is read off its neighbours: linear in rows between row counts that
know its window, where some below and some above do (a batch draining through 15 rows, its
window of 2 alone measured there, read deeper windows at that window's cost, and a probe there
ran W = 5 at 2.2x a plain step; SmolLM2, 16 clients; read flat from 16 rows down to one, a
window of 3 measured only there would price one row's at 16 rows' cost). Else a window is
read at each row count as the nearest window below it (so it gets tried, and measured: a
window's cost need not grow linearly, and tiny-wide's 4 rows cost less at W = 4 than at W = 3;
read linearly from the seeds at 2 and 5, W = 4 was priced 17 % high and adaptive trailed k = 3
by 5.5 % there, simulated), then linear in rows. A chain never timed costs what the forward
alone does (so it gets tried).

A step over ONE_OFF times what the table expects of its cell did one-off work, not the cell's:
on a GPU a new shape's first step builds its kernels (on an H200 a window of 4 at one row read
2,266 ms once where it costs ~5 ms; kept, and rescaling the seeds at one row by it, windows read
~100x a plain step there). It is skipped, once per cell (a cell that costs that much is measured
by its next step), and it is no one's evidence: judged, such steps put a request whose drafts
all landed at 0.17x its plain pace, and behind it vetoed its own windows (policy.py; simulated).
On this CPU no step read over 2.8x what the table expected of its cell (benchmarks/step_ratios.py:
tiny, tiny-moe and SmolLM2, adaptive at 1, 4 and 16 rows, 7,492 steps). A cell's first step in a
process is skipped the same way once it reads dearer than the table expected at all: a cell's
first step is often a request's first, with its one-off work (a lookup's index of the prompt, a
head taking the row on, new shapes), and it replaced the seed and rescaled the other seeds at its
row count. Kept (kept.py) and loaded, run after run, that ratcheted: SmolLM2's first n-gram window
of 2 at one row read 124 ms where the next read 85-94, the seeds at one row rose 1.44x with it,
and tables saved over many runs priced windows of 3-5 there at 3.0-3.4x a plain step where they
cost 1.2-1.3x. Adaptive n-gram then drafted one token a step at 0.91 acceptance (agents' tools at
one client, 1.39-1.52x spec off in two repeats of three, 2.01x in the third; 2.27x fresh).

A cell's first YOUNG steps read as their median, and plain decoding runs that often at a batch
bucket before anything drafts there (policy.py): a guard compared with one plain step for its
next 64, and one stalled 3x by a busy machine (10 ms on a 4 ms step) had a random draft, a window of
2 costing 1.8x a plain step, read 1.29x plain and draft 45 of a request's 47 steps (tiny, CI).

Cells are kept apart from the machine's load: how much slower than its cell each step ran,
followed over LOAD_MEMORY steps and shared by every cell. A cell is read at today's load, so one
not run while a neighbour slowed the machine reads slower too: before, only the cells a loaded
step met moved, and a window of 2 measured earlier read 1.30-1.37x a plain step where it cost
1.4x (EAGLE-3 then drafted at 0.30-0.38 acceptance; SmolLM2, tools at four clients through
serve, traced). Only a cell measured STRETCH times moves the load: a young cell off by its
first steps' noise read its stretches as the machine's load and kept its error (a window of 2
costing 1.40x a plain step whose first step read 15 % fast was read at 1.32-1.36x through
stretches of 4-63 steps, by the table and by the guard; tests/test_policy.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from .acceptance import STRETCH

LOAD_MEMORY = 4.0  # steps the machine's load is followed over: a neighbour's burst lasts seconds
ONE_OFF = 4.0  # a step this many times its cell's expected cost did one-off work (a GPU's kernels)
YOUNG = 3  # a cell's first steps read as their median, and plain decoding is measured that often


def bucket(rows: int) -> int:
    """Batch sizes sharing a guard (policy.py) and a plain step's re-measurement: 1, 2, 3, 4
    each, then up to the next power of two."""
    return rows if rows <= 4 else 1 << (rows - 1).bit_length()


@dataclass
class Cell:
    seconds: float
    steps: float = 0.0  # real steps averaged (decayed); 0: a calibration seed
    last: int = 0  # the step counter when it was last measured
    first: list[float] = field(default_factory=list)  # its first YOUNG steps' seconds (÷ load)
    rescaled: bool = False  # its first step rescaled the seeds at its row count (it was a seed)


class StepCosts:
    def __init__(self):
        self.cells: dict[tuple[str, int, int], Cell] = {}
        self.clock = 0  # steps observed
        self.load = 1.0  # how much slower than its cells every step runs now
        self.one_off: set[tuple[str, int, int]] = set()  # cells that skipped a one-off step

    def observe(self, chain: str, rows: int, window: int, seconds: float) -> bool:
        """Record a step; -> whether it is evidence (not a clock glitch, not one-off work)."""
        if not math.isfinite(seconds) or seconds <= 0:
            return False  # a clock glitch must not poison the table
        self.clock += 1
        cell = self.cells.get((chain, rows, window))
        fresh = cell is None or not cell.steps  # its first step here: dearer than expected, one-off
        if (chain, rows, window) not in self.one_off and seconds > (1.0 if fresh else ONE_OFF) * self.seconds(
                chain, rows, window):
            self.one_off.add((chain, rows, window))
            return False
        if fresh:
            if cell is not None:  # a seed's first real step: the other seeds at its row count
                self._rescale_seeds(rows, seconds / self.load / cell.seconds)  # lacked the same host work
            self.cells[(chain, rows, window)] = Cell(seconds / self.load, 1.0, self.clock, [seconds / self.load],
                                                     rescaled=cell is not None)
            return True
        cell.last = self.clock
        if cell.steps < YOUNG:  # one slow step is the machine's, not the cell's: their median
            cell.first.append(seconds / self.load)
            cell.steps, cell.seconds = cell.steps + 1.0, statistics.median(cell.first)
            if cell.steps == YOUNG:
                if cell.rescaled:  # by its first step alone: now by their median
                    self._rescale_seeds(rows, cell.seconds / cell.first[0])
                cell.first = []
            return True
        if cell.steps >= STRETCH:  # the load is read off cells measured well (see above)
            self.load *= (seconds / (cell.seconds * self.load)) ** (1.0 / LOAD_MEMORY)
        cell.steps = min(cell.steps + 1.0, STRETCH)
        cell.seconds += (seconds / self.load - cell.seconds) / cell.steps
        return True

    def seed(self, chain: str, rows: int, window: int, seconds: float) -> None:
        cell = self.cells.get((chain, rows, window))
        if cell is None or not cell.steps:
            self.cells[(chain, rows, window)] = Cell(seconds)

    def _rescale_seeds(self, rows: int, ratio: float) -> None:
        for (_, r, _), cell in self.cells.items():
            if r == rows and not cell.steps:
                cell.seconds *= ratio

    def knows(self, chain: str) -> bool:
        """Whether any cell of `chain` was seeded or measured."""
        return any(c == chain for c, _, _ in self.cells)

    def plain_measured(self, rows: int) -> tuple[int | None, float]:
        """At this batch bucket: steps since a plain step was measured (None: never), and how many
        were (a cell's counted up to STRETCH)."""
        cells = [cell for (chain, r, window), cell in self.cells.items()
                 if not chain and window == 1 and cell.steps and bucket(r) == bucket(rows)]
        return (self.clock - max(c.last for c in cells) if cells else None), sum(c.steps for c in cells)

    def seconds(self, chain: str, rows: int, window: int) -> float:
        return self.base(chain, rows, window) * self.load

    def base(self, chain: str, rows: int, window: int) -> float:
        """What the step costs at the load its cells are kept at (seconds() ÷ load)."""
        cell = self.cells.get((chain, rows, window))
        if cell is not None:
            return cell.seconds
        by_rows: dict[int, dict[int, float]] = {}
        for (c, r, w), known in self.cells.items():
            if c == chain:
                by_rows.setdefault(r, {})[w] = known.seconds
        at_window = {r: ws[window] for r, ws in by_rows.items() if window in ws}
        if at_window and min(at_window) <= rows <= max(at_window):  # known on both sides
            return _interpolate(at_window, rows)
        value = _interpolate({r: ws[_at_or_below(ws, window)] for r, ws in by_rows.items()}, rows)
        if value is None:
            return self.base("", rows, window) if chain else 1.0  # nothing measured: all alike
        return value

    def now(self) -> dict[tuple[str, int, int], float]:
        """Every cell's seconds at today's load (what /v1/status shows and a later run keeps)."""
        return {key: cell.seconds * self.load for key, cell in sorted(self.cells.items())}

    def as_dict(self) -> dict:
        out: dict = {}
        for (chain, rows, window), seconds in self.now().items():
            out.setdefault(chain or "none", {}).setdefault(str(rows), {})[str(window)] = \
                round(seconds * 1e3, 3) if self.cells[chain, rows, window].steps else f"{seconds * 1e3:.3f} (seed)"
        return out


def _at_or_below(points: dict[int, float], x: int) -> int:
    """The nearest known point at or below x (the lowest, with none below)."""
    return max((p for p in points if p <= x), default=min(points))


def _interpolate(points: dict[int, float], x: int) -> float | None:
    """Linear between the nearest known points around x; flat beyond them; None with none."""
    if not points:
        return None
    lo = _at_or_below(points, x)  # none below: the lowest, flat
    hi = min((p for p in points if p >= x), default=max(points))  # none above: the highest
    return points[lo] if lo == hi else points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)
