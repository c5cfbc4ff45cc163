"""The FastAPI app of an OpenAI-compatible server over one `dsr1.serving.Engine`.

`create_app(engine, config)` closes over everything it serves (the runner thread, the metrics
registry, the tokenizer), so several apps can live in one process. Its lifespan starts the
engine's thread and stops it (cancelling whatever is left). Routes:

- `POST /v1/chat/completions`, `POST /v1/completions`: `completions.CompletionService`.
- `POST /v1/messages`, `POST /v1/messages/count_tokens` (Anthropic's Messages API): `messages`.
- `POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}` (OpenAI's Responses API): `responses`.
- `GET /v1/models`, `GET /v1/models/{id}`: the one model served.
- `POST /tokenize`, `POST /detokenize` (vLLM's): a prompt's or chat's token ids, and ids' text.
- `GET /tokenizer_info` (vLLM's): the special tokens, the context and the chat template, which
  lm-evaluation-harness's `tokenizer_backend=remote` reads so that it tokenizes with `/tokenize`.
- `GET /version`: dsr1's version.
- `GET /health`: 200 while serving; 503 while draining, after an engine failure, or while the
  engine has had work and finished no step for `ServerConfig.stall_timeout` seconds (no key needed,
  for load balancers).
- `GET /metrics`: Prometheus text (`metrics.Metrics`), vLLM's `vllm:*` names and dsr1's own.

With `ServerConfig.api_key` set, every route but `/health` and `/version` needs
`Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic's header). With
`ServerConfig.allowed_origins`, browsers on those origins may call the API (CORS, preflights included).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI
from fastapi import Request as HTTPRequest
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..generation.tokenizer import BOS, EOS, Tokenizer, load_tokenizer
from ..serving import Engine
from ..train.bpe import chat_template
from .completions import CompletionService, read_body
from .errors import APIError, install_error_handlers
from .messages import MessagesService, install_messages
from .metrics import HTTPMetricsMiddleware, Metrics
from .options import ServerConfig
from .prepare import Limits, check_token_ids, plan_tokenize
from .protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest, parse_request
from .responses import ResponsesService, install_responses
from .runner import EngineRunner

__all__ = ["create_app"]


def create_app(engine: Engine, config: ServerConfig) -> FastAPI:
    """The server's app for `engine` (its tokenizer is loaded now if it has none yet). The engine
    must not be stepped by anyone else while the app runs. `app.state.runner` is the engine's
    thread (`drain`, `cancel_all`), `app.state.metrics` the metrics."""
    if engine.tokenizer is None:
        engine.tokenizer = load_tokenizer()
    runner = EngineRunner(engine, capacity=engine.config.slots + config.max_waiting)
    metrics = Metrics(lambda: runner.stats, lambda: runner.in_flight, model_name=config.model_name)
    # A request can hold at most max_seq_len tokens, and no more than the page pool (less its scratch page).
    pool_tokens = (engine.config.num_pages - 1) * engine.config.page_size
    limits = Limits(config.model_name, min(engine.config.max_seq_len, pool_tokens), engine.model.cfg.vocab_size,
                    config.default_max_tokens, max_token_bytes(engine.tokenizer), config.max_reasoning_tokens)
    service = CompletionService(runner, engine.tokenizer, limits, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runner.start()
        try:
            yield
        finally:
            runner.stop()

    app = FastAPI(title="dsr1", description="OpenAI-compatible DeepSeek-V3/R1 server", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runner, app.state.metrics, app.state.engine = runner, metrics, engine
    install_error_handlers(app)
    guarded = [Depends(_bearer_check(config.api_key))]
    _install_openai(app, service, engine, limits, config, guarded)
    _install_status(app, runner, metrics, limits, config, guarded)
    install_messages(app, MessagesService(runner, engine.tokenizer, limits, metrics), guarded)
    install_responses(app, ResponsesService(runner, engine.tokenizer, limits, metrics), guarded)
    routes = {route.path for route in app.routes}
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics, endpoints=lambda: routes)
    if config.allowed_origins:
        # Outermost, so that preflights are answered before the key check (browsers send them without it).
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], allow_credentials="*" not in config.allowed_origins)
    return app


def _install_openai(app: FastAPI, service: CompletionService, engine: Engine, limits: Limits, config: ServerConfig,
                    guarded: list) -> None:
    """OpenAI's endpoints (and vLLM's tokenizer ones) on `app`."""
    card = ModelCard(id=config.model_name, created=int(time.time()), max_model_len=limits.context)

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat_completions(request: HTTPRequest) -> Response:
        return await service.chat(request)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: HTTPRequest) -> Response:
        return await service.complete(request)

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> JSONResponse:
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def model(model_id: str) -> JSONResponse:
        if model_id != card.id:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return JSONResponse(card.model_dump())

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize(request: HTTPRequest) -> JSONResponse:
        body = parse_request(await read_body(request), TokenizeRequest)
        tokens = await run_in_threadpool(plan_tokenize, body, engine.tokenizer, limits)
        strs = [engine.tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in tokens] \
            if body.return_token_strs else None
        return JSONResponse({"count": len(tokens), "max_model_len": limits.context, "tokens": tokens,
                             "token_strs": strs})

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize(request: HTTPRequest) -> JSONResponse:
        body = parse_request(await read_body(request), DetokenizeRequest)
        if body.model is not None and body.model != config.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist", param="model", code="model_not_found")
        check_token_ids(body.tokens, "tokens", limits)
        return JSONResponse({"prompt": await run_in_threadpool(engine.tokenizer.decode, body.tokens)})


def _install_status(app: FastAPI, runner: EngineRunner, metrics: Metrics, limits: Limits, config: ServerConfig,
                    guarded: list) -> None:
    """The server's own endpoints: its tokenizer's card, version, health and metrics."""
    @app.get("/tokenizer_info", dependencies=guarded)
    async def tokenizer_info() -> JSONResponse:
        return JSONResponse(tokenizer_card(limits.context))

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/health")
    async def health() -> JSONResponse:
        stats = runner.stats
        if runner.error is not None:
            return JSONResponse({"status": "failed", "error": repr(runner.error)}, status_code=503)
        if runner.stalled(config.stall_timeout):
            return JSONResponse({"status": "stalled", "error": f"the engine has had work and finished no step for "
                                                               f"more than {config.stall_timeout} s"}, status_code=503)
        status = "draining" if runner.draining else "ok"
        return JSONResponse({"status": status, "running": stats.running, "waiting": stats.waiting,
                             "in_flight": runner.in_flight}, status_code=503 if runner.draining else 200)

    @app.get("/metrics", dependencies=guarded)
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


def tokenizer_card(context: int) -> dict[str, Any]:
    """vLLM's `/tokenizer_info` for R1's tokenizer: its special tokens as text (`/tokenize` turns
    them into ids), the context, and the official chat template."""
    return {"tokenizer_class": "LlamaTokenizerFast", "bos_token": BOS, "eos_token": EOS, "pad_token": EOS,
            "model_max_length": context,
            "chat_template": chat_template()}


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """The most UTF-8 bytes one token of the vocabulary stands for (an upper bound: byte-level
    pieces count their characters' bytes), for refusing a prompt by its size before tokenizing it."""
    return max(len(piece.encode()) for piece in tokenizer.backend.get_vocab(with_added_tokens=True))


def _bearer_check(api_key: str | None):
    """A dependency that requires `Authorization: Bearer <api_key>` or `x-api-key: <api_key>`
    (nothing when the key is None)."""

    async def check(request: HTTPRequest) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        given = [token.strip()] if scheme.lower() == "bearer" else []
        given += [request.headers["x-api-key"]] if "x-api-key" in request.headers else []
        # compare_digest: the comparison's time does not tell how much of a guess was right.
        if not any(secrets.compare_digest(key.encode(), api_key.encode()) for key in given):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>' or "
                                "'x-api-key: <key>'", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check
