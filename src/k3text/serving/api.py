"""The HTTP front: an OpenAI-compatible FastAPI app over the scheduler.

`POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`: server-sent events
ending with `data: [DONE]`), `GET /v1/models`, `GET /health` (200 once the weights are loaded
and the programs compiled, 503 before), `GET /metrics` (Prometheus text).

Requests are checked by `Protocol` before they reach the scheduler: a bad one gets a 400 naming
its field and never touches the pool. A full queue answers 429, a server still starting (or
stopping) 503. A client that disconnects has its request cancelled. Anything unexpected fails
only the request it happened in, with a 500, and is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from k3text.serving.metrics import Metrics
from k3text.serving.protocol import Parsed, Protocol, RequestError, error_body
from k3text.serving.scheduler import Delta, Finished, QueueFull, Scheduler, Unavailable
from k3text.serving.scheduler import Request as Job

log = logging.getLogger("k3text.serve")

_POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks its client is there


class ServerState:
    """What the app serves; `scheduler` is set once loading and compiling are done."""

    def __init__(self, protocol: Protocol, metrics: Metrics, max_model_len: int):
        self.protocol = protocol
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.scheduler: Scheduler | None = None
        self.created = int(time.time())


def _error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, allow_nan=False)}\n\n"


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="k3text", docs_url=None, redoc_url=None)
    protocol = state.protocol

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s", request.url.path, exc_info=exc)
        return _error("internal server error", 500, "internal_error")

    @app.get("/health")
    async def health() -> Response:
        if state.scheduler is None:
            return _error("the server is starting (loading weights, compiling)", 503,
                          "unavailable")
        if not state.scheduler.healthy():
            return _error("the scheduler has stopped", 503, "unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": protocol.model_name, "object": "model", "created": state.created,
             "owned_by": "k3text", "max_model_len": state.max_model_len}]}

    async def serve(request: Request, chat: bool) -> Response:
        scheduler = state.scheduler
        if scheduler is None:
            return _error("the server is starting (loading weights, compiling)", 503,
                          "unavailable")
        try:
            body = json.loads(await request.body())
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, huge ints, deep nests
            return _error(f"the request body is not valid JSON ({e})", 400,
                          "invalid_request_error")
        try:
            parsed = protocol.chat(body) if chat else protocol.completion(body)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Delta | Finished] = asyncio.Queue()
        job = Job(parsed.prompt_ids, parsed.params,
                  lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
        try:
            scheduler.submit(job)
        except QueueFull as e:
            return _error(str(e), 429, "rate_limit_exceeded")
        except Unavailable as e:
            return _error(str(e), 503, "unavailable")
        rid = protocol.new_id(chat)
        if parsed.stream:
            return StreamingResponse(_stream(rid, parsed, job, events, scheduler),
                                     media_type="text/event-stream")
        return await _collect(request, rid, parsed, job, events, scheduler)

    async def _collect(request: Request, rid: str, parsed: Parsed, job: Job,
                       events: asyncio.Queue, scheduler: Scheduler) -> Response:
        deltas: list[Delta] = []
        try:
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), _POLL_SECONDS)
                except TimeoutError:
                    if await request.is_disconnected():
                        scheduler.cancel(job)
                        return Response(status_code=499)
                    continue
                if isinstance(event, Delta):
                    deltas.append(event)
                    continue
                return _final(rid, parsed, deltas, event)
        finally:
            if not job.done:
                scheduler.cancel(job)

    def _final(rid: str, parsed: Parsed, deltas: list[Delta], finished: Finished) -> Response:
        if finished.reason == "error":
            return _error(finished.error or "internal error", 500, "internal_error")
        if finished.reason == "cancelled":
            return _error("the request was cancelled (the server is stopping)", 503,
                          "unavailable")
        return JSONResponse(protocol.response(rid, parsed, deltas, finished))

    async def _stream(rid: str, parsed: Parsed, job: Job, events: asyncio.Queue,
                      scheduler: Scheduler) -> AsyncIterator[str]:
        first = True
        try:
            while True:
                event = await events.get()
                if isinstance(event, Delta):
                    if event.ids or event.text:
                        yield _sse(protocol.chunk(rid, parsed, event, None, first))
                        first = False
                    continue
                if event.reason == "error":
                    yield _sse(error_body(event.error or "internal error", "internal_error",
                                          None, 500))
                elif event.reason == "cancelled":
                    yield _sse(error_body("the request was cancelled (the server is stopping)",
                                          "unavailable", None, 503))
                else:
                    yield _sse(protocol.chunk(rid, parsed, None, event.reason))
                    if parsed.include_usage:
                        yield _sse(protocol.usage_chunk(rid, parsed, event))
                yield "data: [DONE]\n\n"
                return
        finally:  # the client went away (the response task is cancelled), or we are done
            if not job.done:
                scheduler.cancel(job)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    return app

