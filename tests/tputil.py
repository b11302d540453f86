"""A real tensor-parallel daemon: `python -m macspec serve` as rank 0, which starts its worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import requests


class TPServer:
    def __init__(self, profile: str, home: Path, *args: str):
        self.home = home
        self.log = home / "serve.log"
        home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "MACSPEC_HOME": str(home)}
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "macspec", "serve", "--profile", profile, "--port", "0", *args],
                env=env, stdout=out, stderr=subprocess.STDOUT)
        self.url = self._wait_ready()

    def _wait_ready(self, timeout: float = 120.0) -> str:
        records = self.home / "state" / "servers"  # one <port>.json per running server
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            for record in records.glob("*.json"):
                try:
                    data = json.loads(record.read_text())
                except (OSError, ValueError):
                    continue
                if data.get("pid") == self.proc.pid:
                    return f"http://127.0.0.1:{data['port']}"
            time.sleep(0.2)
        raise RuntimeError(f"server not ready: {self.log.read_text()[-3000:]}")

    def status(self) -> dict:
        return requests.get(self.url + "/v1/status", timeout=10).json()["engine"]

    def complete(self, **body) -> dict:
        reply = requests.post(self.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(60)
