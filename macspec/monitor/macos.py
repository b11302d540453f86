"""Parsers for the macOS and RDMA tools `doctor` reads. Pure functions over the text each
command prints, so they are tested against recorded outputs on any OS."""

from __future__ import annotations

import json
import re


def parse_sw_vers(text: str) -> dict[str, str]:
    """`sw_vers` -> {"ProductName": "macOS", "ProductVersion": "26.2", "BuildVersion": "25C56"}"""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version)[:3])


def parse_sysctl_value(text: str) -> int | None:
    """`sysctl iogpu.wired_limit_mb` -> 0 (0 = the default: about 75% of RAM)."""
    match = re.search(r":\s*(-?\d+)", text) or re.fullmatch(r"\s*(-?\d+)\s*", text)
    return int(match.group(1)) if match else None


def parse_rdma_ctl(text: str) -> bool | None:
    """`rdma_ctl status` -> True (enabled), False (disabled), None (unrecognised)."""
    lowered = text.strip().lower()
    if "disabled" in lowered:
        return False
    if "enabled" in lowered:
        return True
    return None


def parse_ibv_devices(text: str) -> list[str]:
    """`ibv_devices` table -> device names (skips the header and its dashes)."""
    names = []
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] in ("device", "------") or set(parts[0]) == {"-"}:
            continue
        names.append(parts[0])
    return names


def parse_ibv_devinfo(text: str) -> dict[str, list[str]]:
    """`ibv_devinfo` -> {hca_id: [port state, ...]} e.g. {"rdma_en5": ["PORT_ACTIVE"]}."""
    devices: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        hca = re.match(r"\s*hca_id:\s*(\S+)", line)
        if hca:
            current = hca.group(1)
            devices[current] = []
            continue
        state = re.match(r"\s*state:\s*(PORT_\w+)", line)
        if state and current is not None:
            devices[current].append(state.group(1))
    return devices


def parse_ifconfig(text: str) -> dict | None:
    """`ifconfig bridge0` -> {"up": bool, "active": bool, "members": [...]}; None if absent."""
    if not text.strip() or "does not exist" in text:
        return None
    flags = re.search(r"flags=\w+<([^>]*)>", text)
    up = bool(flags and "UP" in flags.group(1).split(","))
    status = re.search(r"status:\s*(\w+)", text)
    return {"up": up, "active": bool(status and status.group(1) == "active"),
            "members": re.findall(r"member:\s*(\S+)", text)}


def parse_thunderbolt(text: str) -> list[dict]:
    """`system_profiler SPThunderboltDataType -json` -> per connected port
    {"bus", "speed_gbps", "device"}; TB5 links run at "Up to 80 Gb/s", TB4 at 40."""
    data = json.loads(text)
    ports = []
    for bus in data.get("SPThunderboltDataType", []):
        for key, tag in bus.items():
            if not key.startswith("receptacle") or not isinstance(tag, dict):
                continue
            if tag.get("receptacle_status_key") != "receptacle_connected":
                continue
            speed = re.search(r"(\d+)\s*Gb/s", tag.get("current_speed_key", ""))
            items = bus.get("_items") or [{}]
            ports.append({"bus": bus.get("_name", "?"),
                          "speed_gbps": int(speed.group(1)) if speed else None,
                          "device": items[0].get("_name") or items[0].get("device_name_key")})
    return ports
