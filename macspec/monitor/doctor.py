"""`macspec doctor`: is this machine (and its peers) ready for a profile? One Check per line,
each failure with the exact fix. Commands go through `Commands`, so tests replay recorded
macOS outputs (sysctl, rdma_ctl, ibv_devinfo, ...) on Linux."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..config import Profile
from . import macos
from .memory import GB_FIT_SLACK, MB, kv_bytes_per_token, mtp_size, weight_sizes
from ..models.textconfig import language_config

OK, WARN, FAIL, NA = "ok", "warn", "fail", "n/a"
SYMBOLS = {OK: "✓", WARN: "⚠", FAIL: "✗", NA: "·"}
JACCL_MIN_MACOS = (26, 2)


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None


class Commands:
    """Runs a command -> (exit code, stdout+stderr); 127 when it does not exist."""

    def run(self, argv: list[str], timeout: float = 15.0) -> tuple[int, str]:
        if shutil.which(argv[0]) is None:
            return 127, ""
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return 124, f"{argv[0]} timed out after {timeout:.0f} s"
        return done.returncode, done.stdout + done.stderr


def exit_code(checks: list[Check]) -> int:
    statuses = {c.status for c in checks}
    return 2 if FAIL in statuses else 1 if WARN in statuses else 0


class Doctor:
    def __init__(self, profile: Profile, commands: Commands | None = None,
                 system: str | None = None, environ: dict | None = None):
        self.profile = profile
        self.commands = commands or Commands()
        self.system = system or platform.system()  # "Darwin" | "Linux"
        self.environ = os.environ if environ is None else environ
        self.checks: list[Check] = []
        self.model_dirs: dict[str, Path | None] = {}
        self.model_configs: dict[str, dict] = {}  # config.json of each model found
        self.unbuilt: list[str] = []  # built:, pulled: and .gguf refs the first run will make

    @property
    def macos(self) -> bool:
        return self.system == "Darwin"

    @property
    def jaccl(self) -> bool:
        return self.profile.parallel.backend == "jaccl"

    def add(self, name: str, status: str, detail: str, fix: str | None = None) -> None:
        self.checks.append(Check(name, status, detail, fix))

    def run(self, peers: bool = False) -> list[Check]:
        self.software()
        self.machine()
        self.models()
        self.fit()
        self.parallel()
        self.macos_checks()
        if peers:
            self.peer_checks()
        return self.checks

    # ---- everywhere ------------------------------------------------------------------
    def software(self) -> None:
        import mlx.core as mx
        import mlx_lm

        from .. import __version__
        from ..blas import blas_info
        from .memory import backend_name

        py = sys.version_info
        self.add("python", OK if py >= (3, 10) else FAIL, platform.python_version(),
                 None if py >= (3, 10) else "install Python 3.10 or newer")
        self.add("versions", OK, f"macspec {__version__}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}")
        backend = backend_name()
        if backend == "cuda" and not self.macos:
            from .memory import gpu_description

            self.add("MLX backend", OK, f"cuda: {gpu_description()}")
        elif backend == "metal":
            self.add("MLX backend", OK, backend)
        elif self.macos:
            self.add("MLX backend", FAIL, "CPU only: Metal is unavailable",
                     "install the macOS arm64 wheel: pip install --force-reinstall mlx")
        else:
            self.add("MLX backend", OK, "cpu")
            self.blas(blas_info())

    def blas(self, blas) -> None:
        """The CPU BLAS as loaded and as checked: library, version, kernels, the probe's verdict."""
        from ..blas import cpu_model

        if blas.name == "openblas":
            self.add("BLAS", OK, f"{blas.config} ({blas.core} kernels for {cpu_model()}), "
                                 f"{blas.threads} thread(s), probe passed; {blas.library}")
        elif blas.verdict:  # the probe refused it: say why and how to override
            self.add("BLAS", WARN, f"reference (slow): {blas.detail}",
                     "OPENBLAS_CORETYPE=Haswell (or another core) forces other kernels; "
                     "MACSPEC_BLAS=/path/to/libopenblas.so uses another build; "
                     "MACSPEC_BLAS=reference accepts the slow one")
        else:
            self.add("BLAS", WARN, f"{blas.name}: {blas.detail}",
                     None if "disabled" in blas.detail else
                     "pip install scipy-openblas32 (float32 matmuls 40-80x faster)")

    def machine(self) -> None:
        import psutil

        vm = psutil.virtual_memory()
        free_ratio = vm.available / vm.total
        self.add("memory", OK if free_ratio > 0.1 else WARN,
                 f"{vm.total / 2**30:.0f} GB RAM, {vm.available / 2**30:.1f} GB available",
                 None if free_ratio > 0.1 else "close memory-hungry apps before loading a model")
        cache = Path(self.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
        probe = cache if cache.exists() else Path.home()
        free = shutil.disk_usage(probe).free
        self.add("disk", OK if free > 50 * 2**30 else WARN, f"{free / 2**30:.0f} GB free at {probe}",
                 None if free > 50 * 2**30 else "free disk space: large models need hundreds of GB")
        declared = self.profile.hardware.memory_gb
        if declared and declared * 2**30 > vm.total * 1.1:
            self.add("profile hardware", WARN, f"the profile is for {declared} GB; this machine has "
                     f"{vm.total / 2**30:.0f} GB", "run it on the machine the profile describes")

    def models(self) -> None:
        from ..models.compat import check_draft_compatible

        wanted = self.profile.models()
        for role, ref in wanted.items():
            self.model_dirs[role] = self._model_check(role, ref)
        if self.model_dirs.get("target") and self.model_dirs.get("draft"):
            try:
                from mlx_lm.utils import load_tokenizer

                check_draft_compatible(load_tokenizer(self.model_dirs["target"]),
                                       load_tokenizer(self.model_dirs["draft"]),
                                       wanted["target"], wanted["draft"])
                self.add("draft tokenizer", OK, "same vocabulary and special tokens as the target")
            except Exception as err:
                self.add("draft tokenizer", FAIL, str(err),
                         "use a draft of the same model family (same tokenizer), or --method mtp / ngram")
        self._mtp_check()
        self._eagle3_check()
        self._dflash_check()

    def _model_check(self, role: str, ref: str) -> Path | None:
        from ..models.loader import find_local_model, source_of

        source = source_of(ref)
        if source.first_use is not None and find_local_model(ref) is None:
            self._made_on_first_use(role, ref, source)
            return None
        local = Path(ref).expanduser()
        if source.name == "directory":
            problem = invalid_model_reason(local)
            if problem:
                self.add(f"{role} model", FAIL, f"{local} exists but is not a valid mlx-lm model: "
                         f"{problem}", "point the profile's model path at an mlx-lm model folder "
                         "(config.json, tokenizer, model*.safetensors), e.g. one written by "
                         "`hf download OWNER/NAME --local-dir DIR` or mlx_lm.convert")
                return None
        path = find_local_model(ref)
        if path is None:
            self.add(f"{role} model", FAIL, f"{ref} is not on this machine",
                     f"hf download {ref}" if "/" in ref and not ref.startswith(("/", "."))
                     else f"check model path {ref!r} in {self.profile.source}")
            return None
        problem = invalid_model_reason(path)
        if problem:
            self.add(f"{role} model", FAIL, f"{path} is not a valid mlx-lm model: {problem}",
                     f"download it again: hf download {ref}" if "/" in ref and not
                     ref.startswith(("/", ".", "embedded:")) else "restore the model's files")
            return None
        config = json.loads((path / "config.json").read_text())
        try:
            from mlx_lm.utils import _get_classes

            _get_classes(config)
        except Exception as err:
            self.add(f"{role} model", FAIL, f"{path}: {err}",
                     "upgrade mlx-lm (pip install -U mlx-lm) or choose a supported model")
            return None
        self.add(f"{role} model", OK, f"{ref} ({config.get('model_type')}, {path})")
        self.model_configs[role] = language_config(config)
        return path

    def _made_on_first_use(self, role: str, ref: str, source) -> None:
        """built:, pulled:, a .gguf not made yet: the first run makes it (sized then)."""
        from ..errors import ModelLoadError

        try:
            detail, fix = source.first_use(ref)
        except ModelLoadError as err:
            self.add(f"{role} model", FAIL, str(err), f"check model path {ref!r} in {self.profile.source}")
            return
        self.unbuilt.append(ref)
        # A download needs the network once: worth a warning; a local build is not.
        self.add(f"{role} model", WARN if source.needs_network else OK, detail, fix)

    def _mtp_check(self) -> None:
        target = self.model_dirs.get("target")
        uses_mtp = self.profile.speculative.method == "mtp"
        if target is None:
            return
        config = self.model_configs["target"]
        layer = config.get("num_hidden_layers")
        if not config.get("num_nextn_predict_layers"):
            if uses_mtp:
                self.add("MTP head", FAIL, "the target's config declares no MTP layer",
                         "use --method draft or ngram, or a checkpoint with its MTP layer")
            return
        names = weight_names(target)
        mtp = [n for n in names if n.startswith(f"model.layers.{layer}.")]
        if not mtp:
            self.add("MTP head", FAIL if uses_mtp else WARN, f"no model.layers.{layer}.* weights "
                     "(mlx_lm.convert strips them)", "convert keeping the MTP layer, or use --method draft")
        else:
            self.add("MTP head", OK, f"layer {layer}, {len(mtp)} tensors, " + self._mtp_bytes(target))

    def _mtp_bytes(self, target: Path) -> str:
        """The head's bytes (and bits): as stored, or unpacked where the profile asks."""
        size = mtp_size(target)
        if not size.bits:
            return f"{_size(size.stored)}, not quantized"
        bits = "/".join(str(b) for b in size.bits)
        if self.profile.speculative.mtp_dequantize:
            return (f"{bits}-bit, {_size(size.stored)} stored, unpacked at load to "
                    f"{_size(size.unpacked)} (speculative.mtp_dequantize)")
        return f"{bits}-bit, {_size(size.stored)}, run quantized ({_size(size.unpacked)} if unpacked)"

    def _eagle3_check(self) -> None:
        """The head a method = eagle3 profile names (or the target ships): there, in the published
        layout, and shaped for this target (read from the files' headers; nothing loaded)."""
        from .. import proposers
        from ..models.eagle3 import check_files

        proposer = proposers.BY_NAME.get(self.profile.speculative.method)
        if proposer is None or "eagle3" not in (proposer.parts or (proposer.name,)):
            return
        self._beside_target_check("EAGLE-3 head", self.profile.speculative.eagle3_head, "eagle3", check_files,
                                  "set speculative.eagle3_head to a head made for this target "
                                  "(SGLang/SpecForge layout), or use another method")

    def _dflash_check(self) -> None:
        """The drafter a method = dflash profile names (or the target ships), checked likewise."""
        from ..models.dflash import check_files

        if self.profile.speculative.method != "dflash":
            return
        self._beside_target_check("DFlash drafter", self.profile.speculative.dflash_drafter, "dflash", check_files,
                                  "set speculative.dflash_drafter to a drafter made for this target "
                                  "(z-lab's layout), or use another method")

    def _beside_target_check(self, label: str, ref: str | None, shipped: str, check_files, fix: str) -> None:
        """A proposer's own files, `ref` or `shipped/` beside the target (as loader.beside_target
        finds them): there, and fitting the target, by `check_files(path, target_config)`."""
        target = self.model_dirs.get("target")
        try:
            from ..models.loader import find_local_model

            if ref:
                path = find_local_model(ref)
                if path is None:
                    self.add(label, WARN, f"{ref} is not on this machine yet (downloaded on first use)",
                             f"hf download {ref}")
                    return
            elif target is not None:
                path = target / shipped
            else:
                return
            self.add(label, OK, f"{path}: {check_files(path, self.model_configs.get('target'))}")
        except Exception as err:  # any problem with the files is this check's finding
            self.add(label, FAIL, str(err), fix)

    def fit(self) -> None:
        from .memory import device_limits

        target = self.model_dirs.get("target")
        if target is None and self.profile.model.path in self.unbuilt:
            self.add("fits in memory", NA, f"{self.profile.model.path} is sized once it is there "
                     "(built, pulled or imported)")
            return
        if target is None:
            self.add("fits in memory", WARN, "cannot size the target model: see the target model check")
            return
        config = self.model_configs["target"]
        tp = self.profile.parallel.tensor_parallel
        limits = device_limits()
        on_cpu = limits["backend"] == "cpu"
        sizes = weight_sizes(target)
        weights = sizes.per_rank(tp, float32=on_cpu)
        if self.profile.speculative.method == "mtp":
            head = mtp_size(target).unpacked if self.profile.speculative.mtp_dequantize else sizes.mtp
            weights += head * (2 if on_cpu else 1)  # the head runs on rank 0
        dtype_bytes = 4 if on_cpu else 2
        kv = self.profile.kv
        per_token = kv_bytes_per_token(config, dtype_bytes, tp)
        draft = self.model_dirs.get("draft")
        if draft is not None:
            weights += weight_sizes(draft).per_rank(1, float32=on_cpu)
            per_token += kv_bytes_per_token(self.model_configs["draft"], dtype_bytes)
        one = weights + per_token * kv.max_context
        full = weights + per_token * kv.max_context * self.profile.server.max_batch
        limit = self.memory_limit(limits)
        detail = (f"per rank: weights {weights / 2**30:.2f} GB + KV {per_token / 1024:.1f} KB/token "
                  f"({kv.max_context} tokens: {per_token * kv.max_context / 2**30:.2f} GB) vs limit "
                  f"{limit / 2**30:.1f} GB")
        if one > limit:
            self.add("fits in memory", FAIL, detail, self._fit_fix(one))
        elif full > limit:
            self.add("fits in memory", WARN, detail + f"; a full batch of {self.profile.server.max_batch} "
                     "at max context does not fit (admission control will queue)",
                     "lower kv.max_context or server.max_batch")
        else:
            self.add("fits in memory", OK, detail)

    def memory_limit(self, limits: dict) -> int:
        wired = self.profile.hardware.wired_limit_mb
        if limits["backend"] == "metal" and wired:
            return min(wired * MB, limits["limit_bytes"])
        return limits["limit_bytes"]

    def _fit_fix(self, needed: int) -> str:
        if self.macos:
            return (f"raise the GPU wired limit: sudo sysctl iogpu.wired_limit_mb="
                    f"{int(needed * GB_FIT_SLACK / MB)}, or shard over more Macs (tensor_parallel)")
        return "use a smaller model, more ranks (parallel.tensor_parallel), or a shorter kv.max_context"

    def parallel(self) -> None:
        par = self.profile.parallel
        if par.tensor_parallel == 1:
            self.add("parallelism", OK, "single process")
            return
        if self.jaccl and not self.macos:
            self.add("parallelism", FAIL, "backend jaccl needs macOS 26.2+ with Thunderbolt 5 RDMA",
                     "run on the Macs, or set parallel.backend = 'ring' to test over TCP")
            return
        self.add("parallelism", OK, f"TP={par.tensor_parallel} over {par.backend}: "
                 f"{', '.join(par.hosts)}")
        if self.jaccl:
            matrix = par.ibv_devices or []
            missing = [(i, j) for i in range(par.tensor_parallel) for j in range(par.tensor_parallel)
                       if i != j and not (i < len(matrix) and j < len(matrix[i]) and matrix[i][j])]
            self.add("RDMA mesh", FAIL if missing else OK,
                     f"no RDMA device for rank pairs {missing}" if missing else "a device for every pair",
                     "list every pair in parallel.ibv_devices (mlx.distributed_config --backend jaccl "
                     "--over thunderbolt writes it)" if missing else None)

    # ---- macOS ------------------------------------------------------------------------
    def macos_checks(self) -> None:
        names = ["macOS version", "GPU wired limit", "RDMA", "RDMA devices", "Thunderbolt bridge",
                 "Thunderbolt links", "MLX_METAL_FAST_SYNCH"]
        if not self.macos:
            for name in names:
                self.add(name, NA, "macOS only")
            return
        self._macos_version()
        self._wired_limit()
        if self.jaccl:
            self._rdma()
            self._bridge()
            self._thunderbolt()
        else:
            for name in names[2:6]:
                self.add(name, NA, f"backend {self.profile.parallel.backend}: no RDMA needed")
        fast = self.environ.get("MLX_METAL_FAST_SYNCH")
        self.add("MLX_METAL_FAST_SYNCH", WARN if fast else OK, f"set to {fast!r}" if fast else "not set",
                 "unset MLX_METAL_FAST_SYNCH: it can wedge the GPU until reboot" if fast else None)

    def _macos_version(self) -> None:
        code, out = self.commands.run(["sw_vers"])
        info = macos.parse_sw_vers(out) if code == 0 else {}
        version = info.get("ProductVersion", "?")
        detail = f"macOS {version} ({info.get('BuildVersion', '?')})"
        if self.jaccl and macos.version_tuple(version) < JACCL_MIN_MACOS:
            self.add("macOS version", FAIL, detail + "; JACCL needs 26.2+",
                     "update macOS to 26.2 or later (System Settings > General > Software Update)")
        else:
            self.add("macOS version", OK, detail)

    def _wired_limit(self) -> None:
        import psutil

        code, out = self.commands.run(["sysctl", "iogpu.wired_limit_mb"])
        value = macos.parse_sysctl_value(out) if code == 0 else None
        if value is None:
            self.add("GPU wired limit", WARN, "could not read iogpu.wired_limit_mb")
            return
        effective = value * MB if value else int(psutil.virtual_memory().total * 0.75)
        wanted = self.profile.hardware.wired_limit_mb
        detail = f"iogpu.wired_limit_mb = {value}" + (" (default, ~75% of RAM)" if not value else "")
        if wanted and effective < wanted * MB:
            self.add("GPU wired limit", FAIL, detail + f"; the profile wants {wanted} MB",
                     f"sudo sysctl iogpu.wired_limit_mb={wanted}")
        else:
            self.add("GPU wired limit", OK, detail)

    def _rdma(self) -> None:
        code, out = self.commands.run(["rdma_ctl", "status"])
        enabled = macos.parse_rdma_ctl(out) if code == 0 else None
        if enabled:
            self.add("RDMA", OK, "rdma_ctl: enabled")
        else:
            self.add("RDMA", FAIL, "rdma_ctl: " + ("disabled" if enabled is False else "not available"),
                     "boot into recoveryOS (hold the power button), open Terminal, run "
                     "`rdma_ctl enable`, reboot")
        code, out = self.commands.run(["ibv_devinfo"])
        ports = macos.parse_ibv_devinfo(out) if code == 0 else {}
        mine = self._my_devices()
        if not ports:
            self.add("RDMA devices", FAIL, "ibv_devinfo lists no device",
                     "connect the Macs with Thunderbolt 5 cables and enable RDMA (rdma_ctl enable)")
            return
        for device in mine or list(ports):
            states = ports.get(device)
            if states is None:
                self.add("RDMA devices", FAIL, f"{device} (from parallel.ibv_devices) is not present; "
                         f"found {', '.join(ports)}", "fix parallel.ibv_devices or the cabling")
            elif "PORT_ACTIVE" in states:
                self.add("RDMA devices", OK, f"{device}: PORT_ACTIVE")
            else:
                self.add("RDMA devices", FAIL, f"{device}: {', '.join(states) or 'no port'}",
                         f"{device} is down: reseat the Thunderbolt 5 cable to the peer, check "
                         "the other Mac is on and has RDMA enabled")

    def _my_devices(self) -> list[str]:
        par = self.profile.parallel
        here = {socket.gethostname(), socket.getfqdn(), socket.gethostname().split(".")[0] + ".local"}
        rank = next((r for r, h in enumerate(par.hosts) if h in here), 0)
        matrix = par.ibv_devices or []
        return [d for d in (matrix[rank] if rank < len(matrix) else []) if d]

    def _bridge(self) -> None:
        code, out = self.commands.run(["ifconfig", "bridge0"])
        bridge = macos.parse_ifconfig(out) if code == 0 else None
        if bridge and bridge["up"] and bridge["members"]:
            self.add("Thunderbolt bridge", FAIL, f"bridge0 is up with {', '.join(bridge['members'])}",
                     "the Thunderbolt Bridge holds the Thunderbolt ports: sudo ifconfig bridge0 down "
                     "(and disable it in System Settings > Network to keep it down)")
        else:
            self.add("Thunderbolt bridge", OK, "bridge0 down" if bridge else "no bridge0")

    def _thunderbolt(self) -> None:
        code, out = self.commands.run(["system_profiler", "SPThunderboltDataType", "-json"], timeout=30)
        try:
            ports = macos.parse_thunderbolt(out) if code == 0 else []
        except ValueError:
            ports = []
        slow = [p for p in ports if (p["speed_gbps"] or 0) < 80]
        if not ports:
            self.add("Thunderbolt links", FAIL, "no Thunderbolt device connected",
                     "connect the Macs with Thunderbolt 5 cables (ports marked TB5)")
        elif slow:
            desc = ", ".join(f"{p['bus']} to {p['device']} at {p['speed_gbps']} Gb/s" for p in slow)
            self.add("Thunderbolt links", FAIL, f"{desc}: Thunderbolt 4 links create rdma devices "
                     "but do not do RDMA", "use Thunderbolt 5 ports and cables (80 Gb/s) on both Macs")
        else:
            self.add("Thunderbolt links", OK, f"{len(ports)} link(s) at 80 Gb/s (Thunderbolt 5)")

    # ---- peers --------------------------------------------------------------------------
    def peer_checks(self) -> None:
        from ..distributed.bootstrap import is_local

        par = self.profile.parallel
        if par.tensor_parallel == 1:
            self.add("peers", NA, "single process: no peers")
            return
        local = self.local_facts()
        for rank in range(1, par.tensor_parallel):
            host = par.hosts[rank] if len(par.hosts) > 1 else par.hosts[0]
            if is_local(host):
                self.add(f"peer rank {rank}", OK, f"{host}: this machine")
                continue
            target = f"{par.ssh_user}@{host}" if par.ssh_user else host
            probe = (f"{par.python} -c \"import json, platform, mlx.core as mx, macspec; "
                     f"print(json.dumps({{'mlx': mx.__version__, 'macspec': macspec.__version__, "
                     f"'macos': platform.mac_ver()[0]}}))\"; sw_vers -buildVersion")
            code, out = self.commands.run(["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=5",
                                           target, probe], timeout=20)
            if code != 0:
                self.add(f"peer rank {rank}", FAIL, f"{host}: ssh failed ({code}): {out.strip()[:200]}",
                         f"set up key-based ssh: ssh-copy-id {target}; check `{par.python} -m macspec` "
                         "works there (parallel.python)")
                continue
            self.add(f"peer rank {rank}", *self._compare_peer(host, out, local))

    def local_facts(self) -> dict:
        import mlx.core as mx

        from .. import __version__

        build = ""
        if self.macos:
            code, out = self.commands.run(["sw_vers", "-buildVersion"])
            build = out.strip() if code == 0 else ""
        return {"mlx": mx.__version__, "macspec": __version__, "build": build}

    @staticmethod
    def _compare_peer(host: str, out: str, local: dict) -> tuple[str, str, str | None]:
        lines = [line for line in out.strip().splitlines() if line.strip()]
        try:
            facts = json.loads(lines[0])
        except (IndexError, ValueError):
            return FAIL, f"{host}: unexpected reply {out.strip()[:200]!r}", "install macspec on the peer"
        facts["build"] = lines[1].strip() if len(lines) > 1 else ""
        diffs = [f"{k} {facts.get(k)} vs {local[k]} here" for k in ("macspec", "mlx", "build")
                 if local[k] and facts.get(k) != local[k]]
        if diffs:
            return FAIL, f"{host}: " + "; ".join(diffs), \
                "install the same macspec and MLX versions (and macOS build) on every Mac"
        return OK, f"{host}: reachable, macspec {facts['macspec']}, mlx {facts['mlx']}", None


def invalid_model_reason(path: Path) -> str | None:
    """Why the folder at `path` cannot load as an mlx-lm model (None: it looks loadable)."""
    if not path.is_dir():
        return "it is not a folder"
    config_file = path / "config.json"
    if not config_file.exists():
        return "no config.json" + ("" if any(path.iterdir()) else " (the folder is empty)")
    try:
        config = json.loads(config_file.read_text())
    except OSError as err:
        return f"config.json is unreadable ({err.strerror or err})"
    except ValueError as err:
        return f"config.json is not valid JSON ({err})"
    if not isinstance(config, dict):
        return "config.json is not a JSON object"
    if "model_type" not in config:
        return "config.json has no model_type"
    if not any(path.glob("model*.safetensors")):
        return "no weights (model*.safetensors)"
    return None


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MB"


def weight_names(model_dir: Path) -> list[str]:
    from ..models.store import safetensors_header

    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    return [n for f in sorted(model_dir.glob("*.safetensors")) for n in safetensors_header(f)
            if n != "__metadata__"]


def render(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        lines.append(f"{SYMBOLS[check.status]} {check.name}: {check.detail}")
        if check.fix and check.status in (WARN, FAIL):
            lines.append(f"    fix: {check.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in (OK, WARN, FAIL)}
    lines.append(f"{counts[OK]} ok, {counts[WARN]} warnings, {counts[FAIL]} failures")
    return "\n".join(lines)


def as_json(profile: Profile, checks: list[Check]) -> str:
    return json.dumps({"profile": profile.name, "exit_code": exit_code(checks),
                       "checks": [asdict(c) for c in checks]}, indent=2)
