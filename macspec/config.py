"""Profiles: TOML files describing hardware, target, speculation, sampling defaults, KV and TP.

One dataclass per TOML table; unknown keys and bad values raise ProfileError naming the file,
the key, the value and what is allowed. Precedence: CLI flag > profile > default, and every
resolved value remembers where it came from (`Profile.sources`).
"""

from __future__ import annotations

import difflib
import os
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from .errors import ProfileError
from .proposers import BY_NAME as PROPOSERS, METHODS, own_model

DEFAULT_PROFILE = "tiny"
PROFILE_SUFFIX = ".toml"
HOME_ENV = "MACSPEC_HOME"
BUILTIN_PROFILE_DIR = Path(__file__).resolve().parent / "profiles"

DTYPES = ("auto", "float32", "bfloat16", "float16")
BACKENDS = ("none", "ring", "jaccl")


def _choice(allowed):
    def check(value):
        return None if value in allowed else f"one of {', '.join(map(repr, allowed))}"
    return check


def _range(lo=None, hi=None, integer=False):
    def check(value):
        kind = "an integer" if integer else "a number"
        if isinstance(value, bool) or not isinstance(value, (int,) if integer else (int, float)):
            return kind
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]" if lo is not None else f"<= {hi}"
            return f"{kind} {bounds}"
        return None
    return check


def _string(value):
    return None if isinstance(value, str) and value.strip() else "a non-empty string"


def _bool(value):
    return None if isinstance(value, bool) else "true or false"


def _optional(check):
    return lambda value: None if value is None else check(value)


def _string_list(value):
    ok = isinstance(value, list) and all(isinstance(v, str) and v for v in value)
    return None if ok else "a list of non-empty strings"


def _device_matrix(value):
    ok = isinstance(value, list) and all(
        isinstance(row, list) and len(row) == len(value) and all(isinstance(d, str) for d in row)
        for row in value)
    return None if ok else "a square list of lists of device names (\"\" on the diagonal)"


def spec(default, check, doc: str, factory=None):
    meta = {"check": check, "doc": doc}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelConfig:
    path: str = spec("embedded:tiny-target", _string,
                     "target: local dir, Hugging Face id, embedded:NAME, built:NAME, "
                     "pulled:NAME or a .gguf file")
    dtype: str = spec("auto", _choice(DTYPES), "compute dtype; auto = float32 on CPU, as stored elsewhere")
    revision: str | None = spec(None, _optional(_string), "Hugging Face revision")
    trust_remote_code: bool = spec(False, _bool, "allow custom tokenizer code")
    chat: bool = spec(True, _bool, "apply the chat template to prompts (macspec run --chat/--raw)")
    cpu_prefill: bool = spec(True, _bool, "CPU backend: prefill's attention and SiLU in NumPy (its "
                             "vectorised exp; MLX's CPU exp is ~5x slower); false = MLX everywhere")
    expert_union: bool = spec(True, _bool, "MoE targets: a multi-token step (a verify window, a batch) "
                              "reads each distinct expert once; false = mlx-lm's per-pair gathers")
    cpu_row_padding: bool = spec(True, _bool, "CPU backend: run each small matmul at the row count measured "
                                 "fastest here (OpenBLAS ran 6 rows 1.7x slower than 8); false = as given")


@dataclass
class SpeculativeConfig:
    method: str = spec("ngram", _choice(METHODS), "proposer (ngram needs no extra model)")
    draft_model: str | None = spec(None, _optional(_string), "draft model (method = draft)")
    eagle3_head: str | None = spec(None, _optional(_string), "EAGLE-3 head dir or Hugging Face id "
                                   "(method = eagle3; default: the head shipped with the target)")
    dflash_drafter: str | None = spec(None, _optional(_string), "DFlash drafter dir or Hugging Face "
                                      "id (method = dflash; made for this target; default: the one shipped with it)")
    num_draft_tokens: int = spec(4, _range(1, 32, integer=True), "max draft tokens per step (k)")
    adaptive: bool = spec(True, _bool, "choose k per request from measured acceptance and cost")
    ngram_max: int = spec(4, _range(1, 16, integer=True), "longest n-gram matched (method = ngram)")
    ngram_min: int = spec(1, _range(1, 16, integer=True), "shortest n-gram matched")
    suffix_max_tokens: int = spec(16, _range(1, 32, integer=True),
                                  "longest draft of method = suffix (its drafts run long where the "
                                  "context repeats)")
    suffix_factor: float = spec(1.0, _range(0.1, 8.0), "suffix: draft at most factor x match length")
    suffix_min_prob: float = spec(0.1, _range(0.0, 1.0), "suffix: stop where the continuation's "
                                  "estimated probability falls below this")
    suffix_cache_requests: int = spec(64, _range(0, 4096, integer=True),
                                      "suffix: recent answers drafted from (0 = this request only)")
    probe_min_steps: int = spec(64, _range(1, integer=True), "first probe after turning off")
    probe_max_steps: int = spec(4096, _range(1, integer=True), "probe interval cap")
    allow_fallback: bool = spec(False, _bool, "use n-gram when the draft is incompatible")
    mtp_dequantize: bool = spec(False, _bool, "method = mtp: unpack a quantized MTP head to the "
                                "compute dtype (default: it runs quantized, as stored)")
    head_context: int = spec(0, _range(0, integer=True), "MTP, EAGLE-3, DFlash: the newest positions "
                             "of a request's context its head takes at its first draft; 0 = all "
                             "(measure first: benchmarks/head_context.py)")


@dataclass
class SamplingConfig:
    temperature: float = spec(0.0, _range(0.0, 10.0), "0 = greedy")
    top_p: float = spec(1.0, _range(0.0, 1.0), "nucleus mass kept")
    top_k: int = spec(0, _range(0, integer=True), "0 = off")
    min_p: float = spec(0.0, _range(0.0, 1.0), "drop tokens below min_p * p_max")
    repetition_penalty: float = spec(1.0, _range(0.0, 10.0), "1 = off")
    repetition_context_size: int = spec(20, _range(1, integer=True), "tokens the penalty looks back")
    max_tokens: int = spec(256, _range(1, integer=True), "macspec run: tokens generated "
                           "(serve: server.max_output_tokens)")
    seed: int | None = spec(None, _optional(_range(0, integer=True)), "sampling seed")


@dataclass
class KVConfig:
    max_context: int = spec(4096, _range(16, integer=True), "prompt + generation tokens")
    prefill_chunk: int = spec(512, _range(1, integer=True), "tokens per prefill forward")
    prefix_cache_mb: int = spec(512, _range(0, integer=True),
                                "serve: KV of finished requests kept for shared prompt prefixes")
    prefix_cache_disk_gb: float = spec(0.0, _range(0.0), "serve: prefix-cache entries also kept "
                                       "on disk, for restarts (cache dir, LRU); 0 = off")
    prefix_cache_disk_dir: str | None = spec(None, _optional(_string), "where those entries go "
                                             "(default: <cache dir>/prefix-kv)")
    kv_budget_mb: int | None = spec(None, _optional(_range(1, integer=True)),
                                    "serve: cap on KV memory for running requests (default: what "
                                    "the memory limit leaves after the weights)")


@dataclass
class ParallelConfig:
    tensor_parallel: int = spec(1, _range(1, 64, integer=True), "ranks the target is sharded over")
    backend: str = spec("none", _choice(BACKENDS), "mx.distributed backend")
    hosts: list[str] = spec(None, _string_list, "one host per rank (rank 0 first)",
                            factory=lambda: ["127.0.0.1"])
    ibv_devices: list[list[str]] | None = spec(None, _optional(_device_matrix),
                                              "JACCL: RDMA device per (rank, peer); \"\" on the diagonal")
    coordinator: str | None = spec(None, _optional(_string), "JACCL coordinator host:port")
    ssh_user: str | None = spec(None, _optional(_string), "user for ssh to remote hosts")
    port: int = spec(32323, _range(1, 65535, integer=True),
                     "ring: rank r listens on port + r (all-local groups pick free ports)")
    python: str = spec("python3", _string, "interpreter with macspec on remote hosts (ssh)")
    step_timeout_s: float = spec(60.0, _range(0.5, 3600), "a collective step slower than this "
                                 "fails the requests and stops the daemon")
    join_timeout_s: float = spec(30.0, _range(1, 3600), "start-up: every rank must join the group "
                                 "within this time, or start-up fails naming the missing one")


@dataclass
class HardwareConfig:
    chip: str | None = spec(None, _optional(_string), "e.g. Apple M3 Ultra")
    memory_gb: int | None = spec(None, _optional(_range(1, integer=True)), "unified memory per host")
    wired_limit_mb: int | None = spec(None, _optional(_range(0, integer=True)), "Metal wired limit")


@dataclass
class ServerConfig:
    host: str = spec("127.0.0.1", _string, "bind address")
    port: int = spec(8000, _range(0, 65535, integer=True), "0 = any free port")
    max_batch: int = spec(8, _range(1, 256, integer=True), "requests decoded together")
    max_queue: int = spec(64, _range(1, integer=True), "waiting requests before 429")
    api_key_env: str | None = spec(None, _optional(_string), "env var holding the Bearer key")
    max_body_kb: int = spec(1024, _range(1, integer=True), "largest accepted request body")
    model_aliases: list[str] = spec(None, _string_list, "more names accepted as `model` (and "
                                    "listed by /v1/models), e.g. [\"gpt-4o\"]; \"default\" "
                                    "is always accepted", factory=list)
    strict_model_names: bool = spec(False, _bool, "answer 404 for a `model` that is not one "
                                    "of the served names; false = any name is served (and echoed)")
    max_output_tokens: int = spec(32768, _range(1, integer=True), "tokens generated for a request "
                                  "that names no max_tokens / max_output_tokens (also at most "
                                  "what the context leaves)")
    clamp_max_tokens: bool = spec(True, _bool, "a max_tokens past what the context leaves "
                                  "generates up to the context; false = a 400 "
                                  "context_length_exceeded")
    allowed_hosts: list[str] = spec(None, _string_list, "Host header names accepted besides "
                                    "localhost, 127.0.0.1, [::1] and the bind address (checked "
                                    "only when bound to loopback; guards against DNS rebinding)",
                                    factory=list)
    max_connections: int | None = spec(None, _optional(_range(1, integer=True)),
                                       "open client connections; over it the oldest idle one is "
                                       "closed, or the new one gets 503 (default: the open-file "
                                       "limit less a reserve)")
    idle_timeout_s: float = spec(30.0, _range(0.05, 86400), "a connection without a complete "
                                 "request header for this long (idle keep-alive, slow sender) "
                                 "is closed")
    body_timeout_s: float = spec(60.0, _range(0.05, 86400), "a request body not received within "
                                 "this long gets 408")
    tool_parser: str = spec("auto", _choice(("auto", "kimi", "glm", "json")), "how the model "
                            "writes tool calls; auto = from its chat template and tokens")
    strict_json_schema: bool = spec(True, _bool, "an object schema that names properties but "
                                    "not additionalProperties admits only those (as vLLM); "
                                    "false = any extra key, as JSON Schema reads it")
    inject_tool_prompt: bool = spec(True, _bool, "when the chat template ignores `tools`, "
                                    "describe them in the system message (Qwen2.5's <tool_call> "
                                    "wording) and render calls and results as text")
    reasoning_parser: str = spec("auto", _choice(("auto", "think", "none")), "<think>…</think> "
                                 "as reasoning_content / thinking blocks; auto = when the chat "
                                 "template uses <think>")
    responses_store: int = spec(256, _range(0, 100000, integer=True), "stored /v1/responses "
                                "(for GET and previous_response_id), oldest dropped first; 0 = "
                                "none stored")
    answer_ids_kept: int = spec(256, _range(0, 100000, integer=True), "recent answers whose "
                                "generated token ids replace their re-encoded text when a later "
                                "prompt re-sends them (multi-turn prefix-cache reuse); 0 = "
                                "prompts always tokenized from text")


@dataclass
class TestingConfig:
    """Switches for driving real agent clients with models too small to act as agents."""
    force_tool_call: list[str] = spec(None, _string_list, "a request whose last turn is the "
                                      "user's and that offers one of these tools (\"*\" = any) "
                                      "must call the first offered, its arguments the model's",
                                      factory=list)
    answer_pattern: str | None = spec(None, _optional(_string), "a regex the answer to a tool's "
                                      "result must match (then the turn ends), for a model that "
                                      "never stops on its own")


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "speculative": SpeculativeConfig,
    "sampling": SamplingConfig,
    "kv": KVConfig,
    "parallel": ParallelConfig,
    "hardware": HardwareConfig,
    "server": ServerConfig,
    "testing": TestingConfig,
}
TOP_LEVEL = ("name", "description")


@dataclass
class Profile:
    name: str = DEFAULT_PROFILE
    description: str = ""
    model: ModelConfig = field(default_factory=ModelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    testing: TestingConfig = field(default_factory=TestingConfig)
    source: str = "<defaults>"
    sources: dict[str, str] = field(default_factory=dict)

    def models(self) -> dict[str, str]:
        """Role -> model reference for every model this profile loads: the target, and the
        proposer's own model when its method has one."""
        own = own_model(self.speculative.method, self.speculative)
        whole = own and PROPOSERS[self.speculative.method].model_is_lm  # a head is not a model
        return {"target": self.model.path, **({"draft": own} if whole else {})}

    def override(self, key: str, value: Any, origin: str) -> None:
        """Apply `section.key = value` (a CLI flag), validated like a profile value."""
        section, name = key.split(".")
        table = getattr(self, section)
        _set_checked(table, name, value, f"{origin} ({key})", self.source)
        self.sources[key] = origin
        _cross_check(self, origin)

    def resolved(self) -> dict[str, dict[str, tuple[Any, str]]]:
        """section -> key -> (value, where it came from)."""
        out = {}
        for section in SECTIONS:
            table = getattr(self, section)
            out[section] = {
                f.name: (getattr(table, f.name), self.sources.get(f"{section}.{f.name}", "default"))
                for f in fields(table)
            }
        return out


# Keys that existed once: a profile that still has one is told why it is gone.
REMOVED_KEYS = {
    "kv.kv_bits": "quantized KV was removed: mlx-lm's MLA attention (Kimi K2.5, Moonlight, "
                  "GLM-5) cannot use a quantized cache, and the batched cache keeps the model's dtype",
    "kv.kv_group_size": "quantized KV was removed (see kv.kv_bits)",
    "server.accept_any_model": "any `model` name is now served by default; "
                               "server.strict_model_names = true answers 404 for unknown ones",
}


def _set_checked(table, name: str, value: Any, where: str, file: str) -> None:
    known = {f.name: f for f in fields(table)}
    if str(where) in REMOVED_KEYS:
        raise ProfileError(f"{file}: {where} is no longer a profile key: {REMOVED_KEYS[str(where)]}; "
                           "delete it")
    if name not in known:
        elsewhere = [f"{section}.{name}" for section, cls in SECTIONS.items()
                     if name in {f.name for f in fields(cls)}]
        hint = f" (did you mean {' or '.join(elsewhere)}?)" if elsewhere else ""
        raise ProfileError(
            f"{file}: unknown key {where!s}{hint}; allowed keys: {', '.join(sorted(known))}"
        )
    if isinstance(value, int) and not isinstance(value, bool) and known[name].type in ("float", "float | None"):
        value = float(value)
    problem = known[name].metadata["check"](value)
    if problem:
        raise ProfileError(f"{file}: {where} = {value!r} is invalid; expected {problem}")
    setattr(table, name, value)


def _cross_check(profile: Profile, file: str) -> None:
    spec_cfg, par = profile.speculative, profile.parallel
    proposer = PROPOSERS.get(spec_cfg.method)
    if proposer and proposer.model_key and proposer.model_required and not getattr(spec_cfg, proposer.model_key):
        raise ProfileError(f"{file}: speculative.method = {spec_cfg.method!r} needs "
                           f"speculative.{proposer.model_key}")
    if spec_cfg.ngram_min > spec_cfg.ngram_max:
        raise ProfileError(f"{file}: speculative.ngram_min = {spec_cfg.ngram_min} exceeds "
                           f"speculative.ngram_max = {spec_cfg.ngram_max}")
    if spec_cfg.probe_min_steps > spec_cfg.probe_max_steps:
        raise ProfileError(f"{file}: speculative.probe_min_steps exceeds probe_max_steps")
    if par.tensor_parallel > 1 and par.backend == "none":
        raise ProfileError(f"{file}: parallel.tensor_parallel = {par.tensor_parallel} needs "
                           "parallel.backend = 'ring' or 'jaccl'")
    if par.tensor_parallel > 1 and len(par.hosts) not in (1, par.tensor_parallel):
        raise ProfileError(f"{file}: parallel.hosts has {len(par.hosts)} entries; expected "
                           f"{par.tensor_parallel} (one per rank) for tensor_parallel = {par.tensor_parallel}")


def profile_from_dict(data: dict, source: str) -> Profile:
    profile = Profile(source=source)
    for key, value in data.items():
        if key in TOP_LEVEL:
            if not isinstance(value, str):
                raise ProfileError(f"{source}: {key} = {value!r} is invalid; expected a string")
            setattr(profile, key, value)
        elif key in SECTIONS:
            if not isinstance(value, dict):
                raise ProfileError(f"{source}: [{key}] must be a table, got {value!r}")
            table = getattr(profile, key)
            for name, item in value.items():
                _set_checked(table, name, item, f"{key}.{name}", source)
                profile.sources[f"{key}.{name}"] = source
        else:
            allowed = ", ".join([*TOP_LEVEL, *(f"[{s}]" for s in SECTIONS)])
            raise ProfileError(f"{source}: unknown key {key!r}; allowed: {allowed}")
    _cross_check(profile, source)
    return profile


def load_profile_file(path: Path) -> Profile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ProfileError(f"{path}: cannot read profile: {err.strerror or err}") from None
    except UnicodeDecodeError:
        raise ProfileError(f"{path}: profile is not UTF-8 text") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ProfileError(f"{path}: invalid TOML: {err}") from None
    profile = profile_from_dict(data, str(path))
    if "name" not in data:
        profile.name = path.stem
    return profile


def user_dir() -> Path:
    """Where user profiles live; MACSPEC_HOME overrides (tests use it)."""
    home = os.environ.get(HOME_ENV)
    if home:
        return Path(home)
    import platformdirs

    return Path(platformdirs.user_config_dir("macspec"))


def profile_dirs() -> list[Path]:
    return [Path.cwd() / "profiles", user_dir() / "profiles", BUILTIN_PROFILE_DIR]


def _looks_like_path(name: str) -> bool:
    return os.sep in name or "/" in name or name.endswith(PROFILE_SUFFIX)


def find_profile(name: str) -> Path:
    if _looks_like_path(name):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ProfileError(f"{path}: profile file not found{_model_hint(name)}")
        return path
    for directory in profile_dirs():
        candidate = directory / f"{name}{PROFILE_SUFFIX}"
        if candidate.is_file():
            return candidate
    known = sorted(list_profiles())
    close = difflib.get_close_matches(name, known, n=1)
    if close and not _model_hint(name):
        raise ProfileError(f"profile {name!r} not found; did you mean {close[0]!r}?")
    searched = ", ".join(str(d) for d in profile_dirs())
    raise ProfileError(f"profile {name!r} not found (searched {searched}); known profiles: "
                       f"{', '.join(known) or 'none'}{_model_hint(name)}")


def _model_hint(name: str) -> str:
    """`macspec import x.gguf --out my-model` then `--profile my-model`: a model, not a profile."""
    path = Path(name).expanduser()
    if (path / "config.json").is_file() or (path.is_file() and path.suffix == ".gguf"):
        return f"; {name} is a model: give it as --model {name}"
    return ""


def load_profile(name: str | None) -> Profile:
    return load_profile_file(find_profile(name or DEFAULT_PROFILE))


def list_profiles() -> dict[str, Path]:
    """name -> file, earlier search-path entries shadowing later ones."""
    found: dict[str, Path] = {}
    for directory in profile_dirs():
        if directory.is_dir():
            for path in sorted(directory.glob(f"*{PROFILE_SUFFIX}")):
                found.setdefault(path.stem, path)
    return found
