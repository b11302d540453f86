"""`macspec doctor`: parsers and checks against recorded macOS outputs, and a real run here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from macspec.config import load_profile
from macspec.monitor import macos
from macspec.monitor.doctor import FAIL, NA, OK, WARN, Commands, Doctor, exit_code

FIXTURES = Path(__file__).parent / "fixtures" / "macos"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


class RecordedCommands(Commands):
    """macOS tools cannot run here: answer with outputs recorded from real Macs."""

    def __init__(self, **outputs: str):
        defaults = {"sw_vers": "sw_vers_26_2.txt", "sysctl": "sysctl_wired_480000.txt",
                    "rdma_ctl": "rdma_ctl_enabled.txt", "ibv_devinfo": "ibv_devinfo_active.txt",
                    "ifconfig": "ifconfig_bridge0_down.txt", "system_profiler": "thunderbolt_tb5.json"}
        self.outputs = {**defaults, **outputs}
        self.calls: list[list[str]] = []

    def run(self, argv, timeout=15.0):
        self.calls.append(argv)
        name = self.outputs.get(argv[0])
        if name is None:
            return 127, ""
        return 0, fixture(name)


def mac_doctor(**outputs) -> dict:
    checks = Doctor(load_profile("kimi-tp2"), RecordedCommands(**outputs), system="Darwin",
                    environ={}).run()
    return {c.name: c for c in checks if c.name in (
        "macOS version", "GPU wired limit", "RDMA", "RDMA devices", "Thunderbolt bridge",
        "Thunderbolt links", "MLX_METAL_FAST_SYNCH", "RDMA mesh")}


# ---- parsers -----------------------------------------------------------------------------
def test_parsers_on_recorded_outputs():
    assert macos.parse_sw_vers(fixture("sw_vers_26_2.txt"))["ProductVersion"] == "26.2"
    assert macos.version_tuple("26.2") >= (26, 2) > macos.version_tuple("15.5")
    assert macos.parse_sysctl_value(fixture("sysctl_wired_default.txt")) == 0
    assert macos.parse_sysctl_value(fixture("sysctl_wired_480000.txt")) == 480000
    assert macos.parse_rdma_ctl(fixture("rdma_ctl_enabled.txt")) is True
    assert macos.parse_rdma_ctl(fixture("rdma_ctl_disabled.txt")) is False
    assert macos.parse_ibv_devices(fixture("ibv_devices.txt")) == ["rdma_en5", "rdma_en6"]
    assert macos.parse_ibv_devinfo(fixture("ibv_devinfo_active.txt")) == {
        "rdma_en5": ["PORT_ACTIVE"], "rdma_en6": ["PORT_DOWN"]}
    up = macos.parse_ifconfig(fixture("ifconfig_bridge0_up.txt"))
    assert up == {"up": True, "active": True, "members": ["en5", "en6"]}
    assert macos.parse_ifconfig(fixture("ifconfig_bridge0_down.txt"))["up"] is False
    assert macos.parse_ifconfig("ifconfig: interface bridge0 does not exist") is None
    assert macos.parse_thunderbolt(fixture("thunderbolt_tb5.json")) == [
        {"bus": "thunderbolt_bus_1", "speed_gbps": 80, "device": "Mac Studio"}]
    assert macos.parse_thunderbolt(fixture("thunderbolt_tb4.json"))[0]["speed_gbps"] == 40


# ---- macOS checks, from recordings ------------------------------------------------------
def test_a_ready_mac_passes_every_rdma_check():
    checks = mac_doctor()
    for name in ("macOS version", "GPU wired limit", "RDMA", "RDMA devices", "Thunderbolt bridge",
                 "Thunderbolt links", "MLX_METAL_FAST_SYNCH", "RDMA mesh"):
        assert checks[name].status == OK, checks[name]


@pytest.mark.parametrize("outputs, name, detail, fix", [
    ({"rdma_ctl": "rdma_ctl_disabled.txt"}, "RDMA", "disabled", "`rdma_ctl enable`"),
    ({"ibv_devinfo": "ibv_devinfo_port_down.txt"}, "RDMA devices", "rdma_en5: PORT_DOWN",
     "reseat the Thunderbolt 5 cable"),
    ({"system_profiler": "thunderbolt_tb4.json"}, "Thunderbolt links", "40 Gb/s",
     "use Thunderbolt 5 ports and cables"),
    ({"ifconfig": "ifconfig_bridge0_up.txt"}, "Thunderbolt bridge", "bridge0 is up with en5, en6",
     "sudo ifconfig bridge0 down"),
    ({"sw_vers": "sw_vers_15_5.txt"}, "macOS version", "JACCL needs 26.2+", "update macOS to 26.2"),
    ({"sysctl": "sysctl_wired_default.txt"}, "GPU wired limit", "wants 480000 MB",
     "sudo sysctl iogpu.wired_limit_mb=480000"),
])
def test_each_rdma_problem_fails_with_its_fix(outputs, name, detail, fix):
    check = mac_doctor(**outputs)[name]
    assert check.status == FAIL, check
    assert detail in check.detail and fix in check.fix, check


def test_fast_synch_warns():
    checks = Doctor(load_profile("kimi-tp2"), RecordedCommands(), system="Darwin",
                    environ={"MLX_METAL_FAST_SYNCH": "1"}).run()
    check = next(c for c in checks if c.name == "MLX_METAL_FAST_SYNCH")
    assert check.status == WARN and "unset MLX_METAL_FAST_SYNCH" in check.fix


def test_incomplete_rdma_mesh_fails():
    profile = load_profile("kimi-tp2")
    profile.parallel.ibv_devices = [["", "rdma_en5"], ["", ""]]
    checks = Doctor(profile, RecordedCommands(), system="Darwin", environ={}).run()
    mesh = next(c for c in checks if c.name == "RDMA mesh")
    assert mesh.status == FAIL and "(1, 0)" in mesh.detail and "ibv_devices" in mesh.fix


def test_peers_compared_over_ssh():
    import mlx.core as mx

    from macspec import __version__

    class Peer(RecordedCommands):
        def run(self, argv, timeout=15.0):
            if argv[0] == "ssh":
                self.calls.append(argv)
                return 0, json.dumps({"mlx": "0.31.0", "macspec": __version__, "macos": "26.2"}) + "\n25C56\n"
            if argv[:2] == ["sw_vers", "-buildVersion"]:
                return 0, "25C56\n"
            return super().run(argv, timeout)

    commands = Peer()
    checks = Doctor(load_profile("kimi-tp2"), commands, system="Darwin", environ={}).run(peers=True)
    peer = next(c for c in checks if c.name == "peer rank 1")
    assert peer.status == FAIL and f"mlx 0.31.0 vs {mx.__version__} here" in peer.detail
    ssh = next(call for call in commands.calls if call[0] == "ssh")
    assert "BatchMode=yes" in ssh and "studio-2.local" in ssh


def test_exit_codes():
    from macspec.monitor.doctor import Check

    assert exit_code([Check("a", OK, ""), Check("b", NA, "")]) == 0
    assert exit_code([Check("a", OK, ""), Check("b", WARN, "")]) == 1
    assert exit_code([Check("a", WARN, ""), Check("b", FAIL, "")]) == 2


# ---- for real, on this machine ------------------------------------------------------------
@pytest.mark.slow
def test_doctor_runs_for_real_here():
    out = subprocess.run([sys.executable, "-m", "macspec", "doctor", "--json"], capture_output=True,
                         text=True, timeout=120)
    report = json.loads(out.stdout)
    assert out.returncode == report["exit_code"] in (0, 1)
    by_name = {c["name"]: c for c in report["checks"]}
    assert by_name["target model"]["status"] == OK and by_name["draft tokenizer"]["status"] == OK
    assert by_name["fits in memory"]["status"] == OK
    if sys.platform != "darwin":
        assert by_name["RDMA"]["status"] == NA and by_name["RDMA"]["detail"] == "macOS only"


@pytest.mark.slow
def test_doctor_fails_a_profile_that_cannot_run_here():
    out = subprocess.run([sys.executable, "-m", "macspec", "doctor", "--profile", "kimi-tp2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "✗ target model: mlx-community/Kimi-K2.5 is not on this machine" in out.stdout
    assert "fix: hf download mlx-community/Kimi-K2.5" in out.stdout
