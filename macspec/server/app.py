"""The aiohttp application: routes, auth, errors as JSON, and the serve entry point."""

from __future__ import annotations

import asyncio
import hmac
import logging
import signal

from aiohttp import web

from .. import __version__
from ..config import Profile
from ..engine.engine import Engine
from ..errors import MacspecError
from . import anthropic_api, openai_api
from .metrics import metrics_text
from .state import STARTED, STATE, ServerState, error_body

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health",)  # supervisors probe health without the key
RETRY_AFTER_S = "1"


def _anthropic(request: web.Request) -> bool:
    return request.path.startswith("/v1/messages")


def _error(request: web.Request, status: int, message: str, error_type: str,
           param: str | None = None, headers: dict | None = None) -> web.Response:
    body = error_body(status, message, error_type, param, _anthropic(request))
    return web.json_response(body, status=status, headers=headers)


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
        return _error(request, exc.status, message, exc.reason.lower().replace(" ", "_"))
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
            header = request.headers.get("Authorization", "")
            if header.startswith("Bearer "):
                given = header[len("Bearer "):]
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return _error(request, 401, "invalid or missing API key (Authorization: Bearer ...)",
                              "invalid_api_key")
        return await handler(request)

    return check_key


async def health(request: web.Request) -> web.Response:
    engine: Engine = request.app[STATE].engine
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
    return web.json_response(body)


async def metrics(request: web.Request) -> web.Response:
    body = metrics_text(request.app[STATE].engine)
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


def create_app(engine: Engine, profile: Profile, api_key: str | None = None) -> web.Application:
    app = web.Application(client_max_size=profile.server.max_body_kb * 1024,
                          middlewares=[errors_as_json, auth_middleware(api_key)])
    app[STATE] = ServerState(engine, profile)
    app.router.add_post("/v1/chat/completions", openai_api.chat_completions)
    app.router.add_post("/v1/completions", openai_api.completions)
    app.router.add_get("/v1/models", openai_api.models)
    app.router.add_post("/v1/messages", anthropic_api.messages)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/status", status)
    app.router.add_get("/metrics", metrics)

    async def on_startup(app):
        app[STARTED] = asyncio.get_running_loop().time()

    app.on_startup.append(on_startup)
    return app


async def serve_forever(engine: Engine, profile: Profile, host: str, port: int,
                        api_key: str | None, on_ready=None, stop: asyncio.Event | None = None) -> None:
    """Run until SIGINT/SIGTERM (or `stop` is set); `on_ready(port)` once the socket listens."""
    app = create_app(engine, profile, api_key)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    logger.info("serving %s on http://%s:%d (profile %s)", profile.model.path, host, bound, profile.name)
    if on_ready:
        on_ready(bound)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    watch = asyncio.create_task(_watch_engine(engine, stop))
    await stop.wait()
    watch.cancel()
    logger.info("shutting down")
    engine.stop()
    await runner.cleanup()


async def _watch_engine(engine: Engine, stop: asyncio.Event) -> None:
    while engine.alive:
        await asyncio.sleep(1.0)
    logger.error("the engine thread ended; stopping the server")
    stop.set()
