"""`macspec bench` against real servers: the report's numbers agree with the server's own
/v1/status counters, the JSON schema is stable, failures are rows, peers run side by side."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import requests

from macspec.servebench.launch import free_port
from macspec.servebench.prompts import BUILTIN, load_prompts
from macspec.errors import MacspecError

from .serverutil import RunningServer, runtime_with

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

TOP = {"schema", "config", "runs", "comparisons", "totals", "errors", "server_log_excerpt"}
RUN = {"label", "url", "extra", "warmup", "scenarios", "server_counters"}
SCENARIO = {"name", "requests", "summary", "speculation", "server_counters"}
SUMMARY = {"requests", "ok", "failed", "prompt_tokens", "completion_tokens", "wall_s", "throughput_tok_s",
           "decode_tok_s_mean", "prefill_tok_s_mean", "ttft_p50_ms", "ttft_p95_ms"}
ROW = {"index", "status", "error", "prompt_tokens", "completion_tokens", "ttft_s", "total_s",
       "prefill_tok_s", "decode_tok_s", "text_chars"}


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "macspec", "bench", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def server():
    with RunningServer(runtime_with("tiny"), max_batch=8) as running:
        yield running


def test_report_agrees_with_the_servers_counters(server, tmp_path):
    status = lambda: requests.get(server.url + "/v1/status", timeout=10).json()["engine"]  # noqa: E731
    before = status()["totals"]
    out = bench("--url", server.url, "--compare", "--sequential", "2", "--concurrent", "3",
                "--max-tokens", "24", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    after = status()["totals"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert {p.name for p in tmp_path.iterdir()} >= {"report.json", "report.md", "report.png"}

    # Schema: stable key sets at every level.
    assert set(report) == TOP and report["schema"] == "macspec.bench/1"
    for run in report["runs"]:
        assert set(run) == RUN
        for scenario in run["scenarios"]:
            assert set(scenario) == SCENARIO and set(scenario["summary"]) == SUMMARY
            assert all(set(row) == ROW for row in scenario["requests"])
    assert [r["label"] for r in report["runs"]] == ["server spec on", "server spec off"]
    assert [s["name"] for s in report["runs"][0]["scenarios"]] == ["single", "sequential x2", "concurrent x3"]

    # Every scenario's client-side token count is the server's own count for that scenario.
    for run in report["runs"]:
        for scenario in run["scenarios"]:
            assert scenario["summary"]["failed"] == 0
            assert scenario["server_counters"]["generated_tokens"] == scenario["summary"]["completion_tokens"]
            assert scenario["server_counters"]["completed"] == scenario["summary"]["requests"]
    warmups = [run["warmup"] for run in report["runs"]]
    assert after["completed"] - before["completed"] == report["totals"]["requests"] + len(warmups)
    assert after["generated_tokens"] - before["generated_tokens"] == \
        report["totals"]["completion_tokens"] + sum(w["completion_tokens"] for w in warmups)
    # Speculation stats come from the server, per scenario: spec off drafted nothing.
    off = report["runs"][1]["scenarios"]
    assert all(set(s["speculation"]) == {"none"} for s in off)
    assert len(report["comparisons"]) == 3
    md = (tmp_path / "report.md").read_text()
    for section in ("## Configuration", "## Summary", "## Ratios", "## Speculation", "## Errors",
                    "## Server log excerpt"):
        assert section in md


def test_unreachable_server_gives_fail_rows_not_a_crash(tmp_path):
    out = bench("--url", f"http://127.0.0.1:{free_port()}", "--scenarios", "single,concurrent",
                "--concurrent", "2", "--out", str(tmp_path))
    assert out.returncode == 1 and "Traceback" not in out.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    rows = [r for s in report["runs"][0]["scenarios"] for r in s["requests"]]
    assert len(rows) == 3 and all(r["status"] == "FAIL" and "Connect" in r["error"] for r in rows)
    assert "FAIL" in (tmp_path / "report.md").read_text()


def test_profile_bench_starts_its_server_and_the_mlx_lm_peer(tmp_path):
    out = bench("--profile", "tiny", "--peer", "mlx-lm", "--scenarios", "single,concurrent",
                "--concurrent", "2", "--max-tokens", "12", "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [r["label"] for r in report["runs"]] == ["macspec", "mlx_lm.server + draft"]
    assert report["totals"]["failed"] == 0 and report["totals"]["completion_tokens"] == 2 * 3 * 12
    assert "serving embedded:tiny-target" in report["server_log_excerpt"]
    assert report["runs"][1]["scenarios"][0]["speculation"] is None  # no /v1/status there


def test_prompt_files(tmp_path):
    assert load_prompts(None) == BUILTIN
    (tmp_path / "a.txt").write_text("one\n\ntwo\n")
    (tmp_path / "b.json").write_text('["x", "y"]')
    (tmp_path / "c.jsonl").write_text('{"prompt": "p1"}\n{"prompt": "p2"}\n')
    assert load_prompts(str(tmp_path / "a.txt")) == ["one", "two"]
    assert load_prompts(str(tmp_path / "b.json")) == ["x", "y"]
    assert load_prompts(str(tmp_path / "c.jsonl")) == ["p1", "p2"]
    (tmp_path / "d.json").write_text("[1, 2]")
    with pytest.raises(MacspecError, match="expected non-empty prompts"):
        load_prompts(str(tmp_path / "d.json"))
    with pytest.raises(MacspecError, match="No such file"):
        load_prompts(str(tmp_path / "missing.txt"))
