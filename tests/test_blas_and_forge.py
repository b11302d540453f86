"""Fast BLAS selection, and a smoke run of the forge (a few steps, tiny sizes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mlx_lm import load as mlx_load

from macspec.engine.runtime import Runtime
from macspec.sampling import SamplingParams
from macspec.config import load_profile
from macspec.forge.build import RECIPES, forge

from .conftest import generate

pytestmark = pytest.mark.slow  # loads a model or starts a server/process

PROBE = "import macspec, json; from macspec.blas import blas_info; print(json.dumps(blas_info().as_dict()))"


def blas_in_subprocess(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env={**os.environ, **env},
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(sys.platform != "linux", reason="OpenBLAS preloading is Linux-only")
def test_openblas_is_loaded_automatically_on_linux():
    assert blas_in_subprocess()["name"] == "openblas"


def test_blas_opt_out():
    info = blas_in_subprocess(MACSPEC_BLAS="reference")
    assert info["name"] in ("reference", "accelerate")


def test_forge_smoke_writes_loadable_family(tmp_path, monkeypatch):
    report = forge(tmp_path, RECIPES["smoke"])
    assert report["target_params"] > report["draft_params"] > 0 and report["mtp_params"] > 0
    for name in ("tiny-target", "tiny-draft"):
        model, tokenizer = mlx_load(str(tmp_path / name))  # standard mlx-lm dirs
        assert tokenizer.eos_token_ids
    monkeypatch.setenv("MACSPEC_EMBEDDED_DIR", str(tmp_path))
    for profile_name in ("tiny", "tiny-mtp"):
        runtime = Runtime.load(load_profile(profile_name))
        tokens, gen = generate(runtime, [5, 6, 7], 6, SamplingParams(), k=2)
        assert gen.stats["spec"]["drafted"] > 0
