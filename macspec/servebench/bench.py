"""`macspec bench`: start (or reach) the servers, run the scenarios, write the report."""

from __future__ import annotations

import asyncio
import datetime
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import click

from ..config import load_profile
from ..errors import MacspecError
from ..modelflag import use_model
from . import report as reports
from .launch import LaunchedServer, float32_copy
from .prompts import load_prompts
from .runner import Target, run_target, scenarios

SPEC_OFF = {"speculative": {"method": "none"}}


@dataclass
class BenchOptions:
    profile: str | None
    url: str | None
    out: Path
    api_key: str | None = None
    scenario_names: tuple[str, ...] = ("single", "sequential", "concurrent")
    sequential: int = 3
    concurrent: int = 4
    max_tokens: int = 128
    prompts_file: str | None = None
    compare: bool = False
    peer: str | None = None
    model: str | None = None  # --model: instead of the profile's


def run_bench(opts: BenchOptions) -> tuple[dict, list[Path]]:
    prompts = load_prompts(opts.prompts_file)
    plan = scenarios(list(opts.scenario_names), opts.sequential, opts.concurrent)
    profile = load_profile(opts.profile) if (opts.profile or not opts.url) else None
    if opts.model:  # the report and the mlx-lm peer see what the server will serve
        use_model(profile, opts.model, method_given=False)
    if opts.peer and profile is None:
        raise MacspecError("--peer mlx-lm needs --profile (the model directory to serve it from)")
    work = opts.out / "servers"
    launched: list[LaunchedServer] = []
    errors: list[str] = []
    try:
        targets = _targets(opts, profile, work, launched, errors)
        total = len(targets) * sum(s.requests for s in plan)
        runs = []
        with click.progressbar(length=total, label="macspec bench", file=sys.stderr) as bar:
            for target in targets:
                runs.append(asyncio.run(run_target(target, plan, prompts, opts.max_tokens,
                                                   lambda: bar.update(1))))
    finally:
        for server in launched:
            server.stop()
    log = next((s.log_excerpt() for s in launched if s.name == "macspec serve"), None)
    report = reports.build(_config(opts, profile, plan, prompts), runs, errors, log)
    return report, reports.write(report, opts.out)


def _targets(opts: BenchOptions, profile, work: Path, launched: list, errors: list[str]) -> list[Target]:
    if opts.url:
        url, label = opts.url.rstrip("/"), "server"
    else:
        server = _start(LaunchedServer.macspec(str(profile.source), work, opts.api_key, opts.model),
                        launched, errors)
        url, label = server.url, "macspec"
    targets = [Target(label + (" spec on" if opts.compare else ""), url, {}, opts.api_key)]
    if opts.compare:
        targets.append(Target(f"{label} spec off", url, dict(SPEC_OFF), opts.api_key))
    if opts.peer == "mlx-lm":
        targets.append(_mlx_lm_target(profile, work, launched, errors))
    return targets


def _start(server: LaunchedServer, launched: list, errors: list[str]) -> LaunchedServer:
    """Wait for it; one that fails is reported and its requests become FAIL rows."""
    launched.append(server)
    try:
        server.wait_ready()
    except MacspecError as err:
        errors.append(str(err))
    return server


def _mlx_lm_target(profile, work: Path, launched: list, errors: list[str]) -> Target:
    import mlx.core as mx

    from ..models.loader import resolve_path

    def prepared(ref: str, name: str) -> Path:
        path = resolve_path(ref)
        return float32_copy(path, work / f"{name}-float32") if mx.default_device() == mx.cpu else path

    own = profile.models().get("draft")
    draft = prepared(own, "draft") if own else None
    server = LaunchedServer.mlx_lm(prepared(profile.model.path, "target"), work, draft)
    label = "mlx_lm.server" + (" + draft" if draft else "")
    return Target(label, _start(server, launched, errors).url)


def _config(opts: BenchOptions, profile, plan, prompts: list[str]) -> dict:
    import mlx.core as mx
    import mlx_lm
    import psutil

    from .. import __version__
    from ..blas import blas_info

    return {
        "target": opts.url or f"profile {profile.name}",
        "profile": profile.name if profile else None,
        "model": profile.model.path if profile else None,
        "method": profile.speculative.method if profile else None,
        "num_draft_tokens": profile.speculative.num_draft_tokens if profile else None,
        "tensor_parallel": profile.parallel.tensor_parallel if profile else None,
        "scenarios": [s.name for s in plan], "max_tokens": opts.max_tokens, "temperature": 0,
        "prompts": opts.prompts_file or f"built-in ({len(prompts)} chat and code prompts)",
        "compare": opts.compare, "peer": opts.peer,
        "macspec": __version__, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, "
                   f"{psutil.virtual_memory().total / 2**30:.0f} GB",
        "blas": blas_info().name,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
