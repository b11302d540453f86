"""Start-up is never silent: on a terminal `macspec run` shows each phase live on stderr;
piped or with --json nothing extra appears; at info every phase is logged with its duration;
--json reports each phase's seconds; a second start on the same models skips calibration."""

from __future__ import annotations

import pytest

import json
import os
import pty
import subprocess
import sys

pytestmark = pytest.mark.slow  # loads a model or starts a server/process


def _run(*args: str, tty: bool) -> tuple[str, str]:
    argv = [sys.executable, "-m", "macspec", "run", "def f(x):", "--max-tokens", "4", *args]
    if not tty:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout, proc.stderr
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=slave, text=True)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        err += chunk
    out = proc.stdout.read()
    assert proc.wait(120) == 0, err
    os.close(master)
    return out, err.decode(errors="replace")


def test_terminal_shows_each_phase():
    _, err = _run(tty=True)
    for phase in ("importing MLX", "loading embedded:tiny-target", "loading the draft", "prefilling"):
        assert phase in err, err


def test_piped_and_json_show_nothing_extra():
    _, err = _run(tty=False)
    assert "loading" not in err and err.startswith("prompt "), err
    out, err = _run("--json", tty=True)
    assert "loading" not in err and out.startswith("{"), err
    startup = json.loads(out)["startup"]
    phases = [p["phase"] for p in startup["phases"]]
    assert phases[0].startswith("importing MLX") and any(p.startswith("loading") for p in phases), phases
    assert 0 < sum(p["seconds"] for p in startup["phases"]) < startup["process_s"], startup


def test_info_logs_every_phase_with_its_duration():
    _, err = _run("--log-level", "info", tty=False)
    lines = [line for line in err.splitlines() if "macspec.startup" in line]
    assert any("loading embedded:tiny-target:" in line and line.endswith(" s") for line in lines), err
    assert any("prefilling" in line for line in lines), err
    assert any("calibrating the target's step cost:" in line for line in lines), err
    # The same models and settings on the same machine: the step costs the first run ended with
    # seed the next start, which then times nothing before the prompt.
    _, err = _run("--log-level", "info", tty=False)
    assert "calibrating" not in err and "step costs from" in err, err
    _, err = _run("--log-level", "info", "--num-draft", "2", tty=False)  # other settings: timed
    assert "calibrating the target's step cost:" in err, err


def test_a_damaged_step_cost_file_is_timed_again(isolated_home):
    from macspec.paths import cache_dir
    from macspec.speculative.kept import COSTS_FILE

    (cache_dir() / COSTS_FILE).write_text('{"not": "a table"')
    _, err = _run("--log-level", "info", tty=False)
    assert "calibrating the target's step cost:" in err, err
    _, err = _run("--log-level", "info", tty=False)
    assert "step costs from" in err, err
