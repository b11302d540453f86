"""An on/off for a path macspec installs into mlx-lm (cpu_prefill, expert_union): the profile
sets it at load (Runtime.load and the TP workers); tests and benchmarks turn it off for a
reference run."""

from __future__ import annotations

from contextlib import contextmanager


class Switch:
    def __init__(self) -> None:
        self.on = True

    def set(self, on: bool) -> None:
        self.on = on

    @contextmanager
    def off(self):
        """mlx-lm's own path inside (a reference to compare with)."""
        before, self.on = self.on, False
        try:
            yield
        finally:
            self.on = before
