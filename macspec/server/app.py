"""The aiohttp application: routes, auth, errors as JSON, and the serve entry point."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import signal
import time
import uuid

from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler

from .. import __version__
from ..config import Profile
from ..engine.service import EngineService
from ..errors import MacspecError
from . import anthropic_api, openai_api, responses_api
from .hosts import is_loopback
from .metrics import metrics_text
from .state import REQUEST_ID, STARTED, STATE, USAGE, ServerState, error_body

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("macspec.access")

# Supervisors probe health without the key; Claude Code probes `HEAD /api/hello` at start.
OPEN_PATHS = ("/health", "/api/hello")
RETRY_AFTER_S = "1"
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
JSON_TYPE = "application/json"
FILE_LIMIT_BOUND = 65536  # the open-file soft limit is raised to the hard limit, at most this
FD_RESERVE = 64  # files kept for everything but client connections (model files, logs, TP links)
WARN_EVERY_S = 60.0  # resource warnings (full connection table, failed accept) at most this often


def _anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


def _error(request: web.Request, status: int, message: str, error_type: str,
           param: str | None = None, headers: dict | None = None) -> web.Response:
    body = error_body(status, message, error_type, param, _anthropic(request))
    return web.json_response(body, status=status, headers=headers)


async def _send_and_close(request: web.Request, response: web.Response) -> web.Response:
    """Answer, then close the connection at once: aiohttp would otherwise keep reading (and
    discarding) the unread rest of the body for its lingering time before closing."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    request.protocol.force_close()
    return response


def _printable(text: str, limit: int = 200) -> str:
    """A client-chosen string made safe for one log line."""
    return "".join(c if c.isprintable() and not c.isspace() else f"%{ord(c):02X}" for c in text[:limit])


@web.middleware
async def access_log(request: web.Request, handler):
    """One INFO line per request on the "macspec.access" logger, after the response (for SSE:
    after the stream ends). Token counts, method and acceptance come from the dict a route
    handler puts at request[state.USAGE]: {"prompt_tokens": int, "completion_tokens": int,
    "method": str, "acceptance": float | None}; absent keys print as "-"."""
    request[REQUEST_ID] = uuid.uuid4().hex[:16]
    start = time.perf_counter()
    status = 499  # unless a response comes back: the client went away (or the task was cancelled)
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    except ConnectionResetError:
        raise
    except Exception:
        status = 500
        raise
    finally:
        if access_logger.isEnabledFor(logging.INFO):
            usage = request.get(USAGE) or request.get("macspec_usage") or {}
            if not isinstance(usage, dict):
                usage = {}
            status = usage.get("status", status)  # a stream the client left: 499, not its 200

            def field(key: str, fmt: str = "{}") -> str:
                value = usage.get(key)
                return "-" if value is None else _printable(fmt.format(value), 40)

            acceptance = usage.get("acceptance")
            access_logger.info(
                "%s %s %s %d prompt_tokens=%s completion_tokens=%s ms=%.1f method=%s acceptance=%s",
                request[REQUEST_ID], request.method, _printable(request.path), status,
                field("prompt_tokens"), field("completion_tokens"),
                (time.perf_counter() - start) * 1e3, field("method"),
                field("acceptance", "{:.3f}" if isinstance(acceptance, (int, float)) else "{}"))


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    if REQUEST_ID in request:
        response.headers["X-Request-Id"] = request[REQUEST_ID]


def _host_name(value: str) -> str:
    """The host part of a Host header (or a configured name), lower case, without the port."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[:end + 1] if end != -1 else value
    if value.count(":") > 1:  # a bare IPv6 address
        return f"[{value}]"
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit():
        value = name
    return value.rstrip(".") or value


def allowed_host_names(bind_host: str, extra: list[str]) -> frozenset[str] | None:
    """Host header names a loopback-bound server answers; None (no check) when not loopback.
    A web page can make a browser send requests to 127.0.0.1 under its own name (DNS
    rebinding): checking the name keeps such pages out."""
    if not is_loopback(bind_host):
        return None
    return frozenset(_host_name(h) for h in (*LOOPBACK_NAMES, bind_host, *extra))


def _is_json(content_type: str) -> bool:
    content_type = content_type.lower()
    return content_type == JSON_TYPE or (content_type.startswith("application/")
                                         and content_type.endswith("+json"))


def request_guard(allowed_hosts: frozenset[str] | None, body_timeout_s: float):
    """Host check (loopback binds), JSON content type on POST routes, and the body read with
    a deadline (the handlers' own read() then returns it at once)."""

    @web.middleware
    async def guard(request: web.Request, handler):
        host = request.headers.get(hdrs.HOST)
        if allowed_hosts is not None and host is not None and _host_name(host) not in allowed_hosts:
            return _error(request, 403, f"Host {host[:100]!r} is not allowed: this server listens on a "
                          f"loopback address and answers to {', '.join(sorted(allowed_hosts))} "
                          "(server.allowed_hosts adds names)", "forbidden_host")
        if request.method == "POST" and request.match_info.http_exception is None:
            if not _is_json(request.content_type):
                given = request.headers.get(hdrs.CONTENT_TYPE, "")
                return _error(request, 415, f"Content-Type must be {JSON_TYPE} (got "
                              f"{given[:100]!r}); send the body as JSON", "unsupported_media_type")
            try:
                await asyncio.wait_for(request.read(), body_timeout_s)
            except asyncio.TimeoutError:
                response = _error(request, 408, f"the request body did not arrive within "
                                  f"{body_timeout_s:g} s", "request_timeout")
                return await _send_and_close(request, response)
        return await handler(request)

    return guard


@web.middleware
async def errors_as_json(request: web.Request, handler):
    try:
        return await handler(request)
    except MacspecError as err:
        headers = {"Retry-After": RETRY_AFTER_S} if err.http_status == 429 else None
        if err.http_status >= 500:
            logger.warning("request failed: %s", err)
        return _error(request, err.http_status, str(err), err.error_type, err.param, headers)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = {413: "the request body is too large", 404: f"no route {request.path}",
                   405: f"{request.method} is not allowed on {request.path}"}.get(exc.status, exc.reason)
        response = _error(request, exc.status, message, exc.reason.lower().replace(" ", "_"))
        if exc.status == 413:  # the rest of the body is not worth reading
            return await _send_and_close(request, response)
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception as exc:  # a bug: log it, answer 500, keep serving
        logger.exception("unhandled error on %s", request.path)
        return _error(request, 500, f"internal error: {exc!r}", "server_error")


def auth_middleware(api_key: str | None):
    @web.middleware
    async def check_key(request: web.Request, handler):
        if api_key and request.path not in OPEN_PATHS:
            given = request.headers.get("x-api-key", "")
            scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
            if scheme.lower() == "bearer":  # auth schemes are case-insensitive (RFC 9110 11.1)
                given = token.strip()
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return _error(request, 401, "invalid or missing API key (Authorization: Bearer ...)",
                              "invalid_api_key")
        return await handler(request)

    return check_key


async def health(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    engine: EngineService = state.engine
    if state.stopping:
        reason = "shutting down" + (f": {engine.fatal_reason}" if engine.fatal_reason else "")
    else:
        reason = None if engine.alive else "the engine thread is not running"
        reason = reason or engine.degraded_reason
    if reason:
        return web.json_response({"status": "degraded", "reason": reason}, status=503)
    return web.json_response({"status": "ok"})


async def status(request: web.Request) -> web.Response:
    state: ServerState = request.app[STATE]
    profile = state.profile
    body = {"version": __version__, "profile": profile.name, "model": state.model_id,
            "method": state.runtime.method, "uptime_s": round(asyncio.get_running_loop().time()
                                                             - request.app[STARTED], 1),
            "engine": state.engine.status()}
    if "grammar" in vars(state):  # built by the first structured-output request
        grammar = state.grammar
        body["grammar"] = {"masks": grammar.masks_computed,
                           "mask_us": round(grammar.mask_seconds * 1e6 / max(1, grammar.masks_computed), 1)}
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    body = metrics_text(request.app[STATE].engine)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(engine: EngineService, profile: Profile, api_key: str | None = None,
               host: str | None = None, max_connections: int | None = None) -> web.Application:
    """`host`: the bind address (default the profile's); a loopback one turns on the Host check.
    `max_connections`: the connection cap (default server.max_connections, else no cap)."""
    server = profile.server
    allowed = allowed_host_names(server.host if host is None else host, server.allowed_hosts)
    app = web.Application(client_max_size=server.max_body_kb * 1024,
                          middlewares=[access_log, mark_busy, errors_as_json,
                                       request_guard(allowed, server.body_timeout_s),
                                       auth_middleware(api_key)])
    app[STATE] = ServerState(engine, profile)
    app[CONNECTIONS] = ConnectionTable(max_connections or server.max_connections or 2**31)
    app.on_response_prepare.append(_add_request_id)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_post("/v1/messages", anthropic_api.messages)
    app.router.add_post("/v1/messages/count_tokens", anthropic_api.count_tokens)
    responses_api.add_routes(app, server.responses_store)
    app.router.add_get("/health", health)
    app.router.add_get("/api/hello", health)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/metrics", metrics)

    async def on_startup(app):
        app[STARTED] = asyncio.get_running_loop().time()

    app.on_startup.append(on_startup)
    return app


class Every:
    """Rate limit for a warning that can repeat in a storm: ready() at most once per interval."""

    def __init__(self, interval_s: float = WARN_EVERY_S):
        self.interval_s = interval_s
        self.last = float("-inf")
        self.suppressed = 0

    def ready(self) -> bool:
        now = time.monotonic()
        if now - self.last < self.interval_s:
            self.suppressed += 1
            return False
        self.last = now
        return True

    def take_suppressed(self) -> int:
        count, self.suppressed = self.suppressed, 0
        return count


def raise_open_file_limit(bound: int = FILE_LIMIT_BOUND) -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (at most `bound`); the soft limit now."""
    try:
        import resource
    except ImportError:  # pragma: no cover (not POSIX)
        return 512
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    infinity = resource.RLIM_INFINITY
    want = bound if hard == infinity else min(hard, bound)
    if soft != infinity and soft < want:
        for target in (want, min(want, 10240)):  # macOS refuses more than kern.maxfilesperproc
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError):
                continue
            logger.debug("open-file limit raised from %d to %d", soft, target)
            soft = target
            break
    return bound if soft == infinity else soft


def connection_limits(file_limit: int, configured: int | None) -> tuple[int, int]:
    """(most open client connections, listen backlog) that keep the process under its file limit:
    one accept burst takes up to `backlog` sockets before any can be refused."""
    backlog = max(8, min(128, file_limit // 8))
    cap = max(1, file_limit - backlog - FD_RESERVE)
    return (cap if configured is None else min(cap, configured)), backlog


OVERLOADED = json.dumps(error_body(503, "too many open connections; retry later", "server_overloaded",
                                   None, False)).encode()


class _Refuse(asyncio.Protocol):
    """A connection over the cap: a 503 and close, before reading anything."""

    def connection_made(self, transport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                        b"Retry-After: " + RETRY_AFTER_S.encode() + b"\r\nConnection: close\r\n"
                        + f"Content-Length: {len(OVERLOADED)}\r\n\r\n".encode() + OVERLOADED)
        transport.close()


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, counted in the table while it is open."""

    def __init__(self, table: "ConnectionTable", inner):
        self.table, self.inner, self.created = table, inner, time.monotonic()
        self.made = False

    def connection_made(self, transport) -> None:
        self.made = True
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    def connection_lost(self, exc) -> None:
        self.table.open.pop(self, None)
        self.inner.connection_lost(exc)


class _ParseErrorsAsJson(RequestHandler):
    """aiohttp answers an unparsable request (a header over its 8 KB line limit, say) with
    text/plain 400 and logs a traceback; answer with the API's JSON error shape and one line."""

    def handle_error(self, request, status=500, exc=None, message=None):
        if not isinstance(exc, HttpProcessingError) or request.writer.output_size > 0:
            return super().handle_error(request, status, exc, message)
        if isinstance(exc, LineTooLong):
            status, kind = 431, "request_header_fields_too_large"
            text = "the request line or a header is longer than the server accepts (8190 bytes)"
        else:
            status, kind = 400, "invalid_request_error"
            text = "the request could not be parsed: " + " ".join(str(exc.message).split())[:160]
        logger.warning("request from %s answered %d: %s", request.remote, status, text)
        response = web.json_response(error_body(status, text, kind, None, anthropic=False), status=status)
        response.force_close()
        return response


class ConnectionTable:
    """The listening socket's protocol factory. Up to `cap` connections get aiohttp's handler;
    past it the oldest idle one (no request in progress: keep-alive, or headers still
    arriving) is closed to make room, and when every one is busy the newcomer gets a 503."""

    def __init__(self, cap: int):
        self.cap = cap
        self.server: web.Server | None = None  # aiohttp's factory, set when the runner is up
        self.open: dict[_Counted, None] = {}  # oldest first
        self.busy: set = set()  # aiohttp protocols with a request in progress
        self.evicted = self.refused = 0
        self._warn = Every()

    def __call__(self) -> asyncio.Protocol:
        if len(self.open) >= self.cap:
            self._sweep()
        if len(self.open) >= self.cap:
            victim = next((c for c in self.open if c.made and c.inner not in self.busy), None)
            if victim is None:
                self.refused += 1
                self._warning("refusing connections")
                return _Refuse()
            self.open.pop(victim)
            victim.inner.force_close()
            self.evicted += 1
            self._warning("closing idle connections to make room")
        counted = _Counted(self, _ParseErrorsAsJson(self.server, loop=self.server._loop, **self.server._kwargs))
        self.open[counted] = None
        return counted

    def _sweep(self) -> None:
        """Forget entries whose transport never came (a failed accept) or is already gone."""
        now = time.monotonic()
        for c in list(self.open):
            if (not c.made and now - c.created > 5.0) or (c.made and c.inner.transport is None):
                self.open.pop(c, None)

    def _warning(self, what: str) -> None:
        if self._warn.ready():
            logger.warning("%d client connections open (server.max_connections / open-file limit): "
                           "%s (%d refused, %d idle closed so far; logged at most once a minute)",
                           len(self.open), what, self.refused, self.evicted)


CONNECTIONS = web.AppKey("connections", ConnectionTable)


@web.middleware
async def mark_busy(request: web.Request, handler):
    """A connection with a request in progress is never closed to make room for another."""
    busy = request.app[CONNECTIONS].busy
    protocol = request.protocol
    busy.add(protocol)
    try:
        return await handler(request)
    finally:
        busy.discard(protocol)


class GuardedSite(web.BaseSite):
    """A TCP site whose connections go through the app's ConnectionTable."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, backlog: int):
        super().__init__(runner, backlog=backlog)
        self.host, self.port = host, port

    @property
    def name(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> None:
        await super().start()
        table = self._runner.app[CONNECTIONS]
        table.server = self._runner.server
        self._server = await asyncio.get_running_loop().create_server(
            table, self.host, self.port, backlog=self._backlog)


def _open_file_limit() -> int | None:
    try:
        import resource

        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # pragma: no cover
        return None


def _quiet_accept_errors(loop: asyncio.AbstractEventLoop):
    """asyncio reports every failed accept() (out of file descriptors) with a traceback and
    retries each second: log that once a minute instead. Returns the previous handler."""
    previous = loop.get_exception_handler()
    every = Every()

    def handler(loop, context) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            if every.ready():
                missed = every.take_suppressed()
                logger.warning("cannot accept connections: %s (open-file limit %s); retrying each "
                               "second, logged at most once a minute%s", context.get("exception"),
                               _open_file_limit(), f" ({missed} failures since the last warning)"
                               if missed else "")
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
    return previous


async def serve_forever(engine: EngineService, profile: Profile, host: str, port: int,
                        api_key: str | None, on_ready=None, stop: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set); `on_ready(port)` once the socket listens.
    At the end /health answers 503 "shutting down" while the engine stops (off the loop)."""
    loop = asyncio.get_running_loop()
    file_limit = raise_open_file_limit()
    cap, backlog = connection_limits(file_limit, profile.server.max_connections)
    previous_handler = _quiet_accept_errors(loop)
    try:
        app = create_app(engine, profile, api_key, host, cap)
        idle_s = profile.server.idle_timeout_s
        # keepalive_timeout runs from the connection's start (or its last response) until a
        # request's headers are complete: it times out idle keep-alive and slow headers alike.
        # Lingering (draining an unread body after an early answer) is bounded the same way.
        runner = web.AppRunner(app, access_log=None, handle_signals=False,
                               keepalive_timeout=idle_s, lingering_time=min(10.0, idle_s))
        await runner.setup()
        site = GuardedSite(runner, host, port, backlog)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]
        logger.info("serving %s on http://%s:%d (profile %s; up to %d connections)",
                    profile.model.path, host, bound, profile.name, cap)
        if on_ready:
            on_ready(bound)
        if stop is None:
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
        watch = asyncio.create_task(_watch_engine(engine, stop))
        await stop.wait()
        watch.cancel()
        logger.info("shutting down")
        app[STATE].stopping = True
        try:  # TP teardown takes seconds: stop the engine off the loop, which keeps answering
            await loop.run_in_executor(None, engine.stop)
        finally:
            await runner.cleanup()
    finally:
        loop.set_exception_handler(previous_handler)


async def _watch_engine(engine: EngineService, stop: asyncio.Event) -> None:
    while engine.alive:
        await asyncio.sleep(1.0)
    logger.error("the engine thread ended; stopping the server")
    stop.set()
