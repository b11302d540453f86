"""Step plans, group descriptions and peer commands: the parts of TP that need no peers."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from macspec.config import load_profile
from macspec.distributed.bootstrap import BootstrapError, Peers, group_spec, ssh_command
from macspec.distributed.plan import (BY_NAME, OPS, PlanError, decode_header, decode_ops,
                                      encode_op, encode_plan)
from macspec.engine.runner import TargetRunner


def test_every_op_is_a_target_runner_method():
    for op in OPS:
        assert callable(getattr(TargetRunner, op.name)), op.name


def test_plan_round_trip():
    ops = [encode_op("advance", ([1, 3, 2],)), encode_op("remove_row", (1, -1, 0)),
           encode_op("decode", (2, 3, [5, 6, 7, 8, 9, 10]))]
    plan = encode_plan(41, ops)
    num_ops, body_length = decode_header(plan, 41)
    decoded = decode_ops(plan[5:5 + body_length], num_ops)
    assert [(op.name, args) for op, args in decoded] == [
        ("advance", ([1, 3, 2],)), ("remove_row", (1, -1, 0)), ("decode", (2, 3, [5, 6, 7, 8, 9, 10]))]
    assert BY_NAME["decode"].forward and not BY_NAME["advance"].forward


def test_out_of_step_plans_are_refused():
    plan = encode_plan(7, [encode_op("heartbeat", ())])
    with pytest.raises(PlanError, match="expected 8"):
        decode_header(plan, 8)
    with pytest.raises(PlanError, match="same macspec"):
        decode_header([0, *plan[1:]], 7)
    with pytest.raises(PlanError, match="takes 3"):
        encode_op("remove_row", (1, 2))


def test_local_ring_groups_get_free_loopback_ports():
    spec = group_spec(load_profile("tiny-tp2").parallel)
    assert spec["backend"] == "ring" and spec["world"] == 2
    hosts = [entry[0] for entry in spec["hostfile"]]
    assert all(h.startswith("127.0.0.1:") for h in hosts) and len(set(hosts)) == 2


def test_jaccl_group_from_the_kimi_profile():
    profile = load_profile("kimi-tp2")
    spec = group_spec(profile.parallel)
    assert spec == {"backend": "jaccl", "world": 2, "devices": [["", "rdma_en5"], ["rdma_en5", ""]],
                    "coordinator": "studio-1.local:32323"}
    profile.parallel.ibv_devices = None
    with pytest.raises(BootstrapError, match="ibv_devices"):
        group_spec(profile.parallel)


def test_remote_ranks_start_over_ssh_in_batch_mode():
    par = load_profile("kimi-tp2").parallel
    par.ssh_user = "ops"
    argv = ssh_command(par, "studio-2.local", "kimi-tp2", 1, '{"backend": "jaccl"}')
    assert argv[:3] == ["ssh", "-o", "BatchMode=yes"] and "ops@studio-2.local" in argv
    assert "/opt/macspec/.venv/bin/python -m macspec tp-worker --profile kimi-tp2 --rank 1" in argv[-1]
    assert "MACSPEC_TP_GROUP='{\"backend\": \"jaccl\"}'" in argv[-1]


@pytest.mark.slow
def test_worker_refuses_to_start_by_hand():
    out = subprocess.run([sys.executable, "-m", "macspec", "tp-worker", "--rank", "1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "MACSPEC_TP_GROUP is not set" in out.stderr



def test_a_dead_worker_is_named_plainly_and_its_log_tail_stays_in_the_server_log(caplog):
    peers = Peers()
    log = peers.log_dir / "rank1.log"
    log.write_text("2026-11-26 07:49:03 INFO loading /Users/me/models/secret\nTraceback: boom\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(30)
    peers.procs.append((1, "10.0.0.7", proc, log))
    with caplog.at_level(logging.ERROR, logger="macspec.distributed.bootstrap"):
        first, again = peers.first_exited(), peers.first_exited()
    assert first == again == "rank 1 stopped (exit code 3)"  # what clients see: no host, no path
    [record] = caplog.records  # asked twice (watchdog, engine thread), logged once
    detail = record.getMessage()
    assert "10.0.0.7" in detail and str(log) in detail and "/Users/me/models/secret" in detail


@pytest.mark.slow
def test_run_on_a_tp2_profile_equals_one_process():
    cmd = [sys.executable, "-m", "macspec", "run", "def fibonacci(n):", "--max-tokens", "24"]
    tp = subprocess.run(cmd + ["--profile", "tiny-tp2", "--json"], capture_output=True, text=True, timeout=120)
    one = subprocess.run(cmd + ["--method", "none", "--json"], capture_output=True, text=True, timeout=120)
    assert tp.returncode == 0, tp.stderr
    tp_out, one_out = json.loads(tp.stdout), json.loads(one.stdout)
    assert tp_out["text"] == one_out["text"] and tp_out["method"] == "draft"
    assert tp_out.keys() == one_out.keys()  # one shape: both come from the same engine
    assert tp_out["spec"].keys() == one_out["spec"].keys()
