"""The HTTP front: an OpenAI-compatible FastAPI app over the scheduler.

`POST /v1/completions`, `POST /v1/chat/completions` (both with `stream`: server-sent events
ending with `data: [DONE]`), `GET /v1/models` and `/v1/models/{id}`, `GET /health` (200 once the
weights are loaded and the programs compiled, 503 before), `GET /metrics` (Prometheus text),
and vLLM's `POST /tokenize` and `/detokenize` (answered during start-up too).

Requests are checked by `Protocol` before they reach the scheduler, on a worker thread (a long
prompt's tokenization never stalls the streams the event loop serves): a bad one gets a 400
naming its field (404 for a model not served, 413 for a body larger than any prompt the server
takes) and never touches the pool. A full queue answers 429, a server still starting (or
stopping) 503. A request for `n` choices of each of its prompts (completions take a batch of
prompts) runs every choice as a request of the scheduler (queued all together or, without room
for all, refused), its response or stream holding each choice under its `index`. A client that
disconnects has its request cancelled. Anything unexpected fails only the request it happened
in, with a 500, and is logged. Every error is an OpenAI error object, unknown paths and methods
included.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from k3text.serving.metrics import Metrics
from k3text.serving.protocol import Parsed, Protocol, RequestError, error_body
from k3text.serving.scheduler import Delta, Finished, QueueFull, Scheduler, Unavailable
from k3text.serving.scheduler import Request as Job

log = logging.getLogger("k3text.serve")

_POLL_SECONDS = 0.25  # how often a waiting non-streaming request checks its client is there
# A request body may hold this many bytes per prompt token the server takes (a prompt as JSON
# text, escaped, or as ids), and never less than the floor: what is larger is refused unread.
_BODY_BYTES_PER_TOKEN = 64
_BODY_BYTES_FLOOR = 16 * 2**20


class _TooLarge(Exception):
    pass


class ServerState:
    """What the app serves; `scheduler` is set once loading and compiling are done."""

    def __init__(self, protocol: Protocol, metrics: Metrics, max_model_len: int):
        self.protocol = protocol
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.max_body_bytes = max(_BODY_BYTES_FLOOR, _BODY_BYTES_PER_TOKEN
                                  * protocol.cfg.max_prefill_predict_length)
        self.scheduler: Scheduler | None = None
        self.created = int(time.time())


def _error(message: str, status: int, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, allow_nan=False)}\n\n"


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, or `_TooLarge` as soon as it passes `limit` bytes (declared or sent)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _TooLarge
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise _TooLarge
        parts.append(part)
    return b"".join(parts)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="k3text", docs_url=None, redoc_url=None)
    protocol = state.protocol

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error serving %s", request.url.path, exc_info=exc)
        return _error("internal server error", 500, "internal_error")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's own (an unknown path, a wrong method) as OpenAI error objects.
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(error_body(message, "invalid_request_error", None, exc.status_code),
                            status_code=exc.status_code, headers=exc.headers)

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

    def model_card() -> dict[str, Any]:
        return {"id": protocol.model_name, "object": "model", "created": state.created,
                "owned_by": "k3text", "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        if model != protocol.model_name:
            e = protocol.unknown_model(model)
            return JSONResponse(e.body(), status_code=e.status)
        return JSONResponse(model_card())

    def load_json(raw: bytes) -> Any:
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:  # bad JSON, bad UTF-8, huge ints, deep nests
            raise RequestError(f"the request body is not valid JSON ({e})") from None

    def too_large() -> JSONResponse:
        return _error(f"the request body is larger than {state.max_body_bytes:,} bytes, the "
                      f"most this server reads for one request (room for a prompt of "
                      f"max_prefill_predict_length={protocol.cfg.max_prefill_predict_length} "
                      f"tokens); send a large batch of prompts as several requests", 413,
                      "invalid_request_error")

    def warn_ignored(ignored: tuple[str, ...]) -> None:
        if ignored:  # a client's names: a few, cut short, so no request floods the log
            names = [name[:40] for name in ignored[:8]]
            more = len(ignored) - len(names)
            log.warning("request fields this server does not read, ignored: %s%s",
                        ", ".join(names), f" and {more} more" if more else "")

    async def answer(request: Request,
                     handle: Callable[[Any], tuple[dict[str, Any], tuple[str, ...]]],
                     ) -> Response:
        """`/tokenize` and `/detokenize`: `handle(body)` (the response and the fields nothing
        read) on a worker thread, as the generation endpoints parse theirs; they need no
        scheduler, so they answer during start-up too."""
        try:
            raw = await _read_body(request, state.max_body_bytes)
        except _TooLarge:
            return too_large()
        try:
            out, ignored = await asyncio.to_thread(lambda: handle(load_json(raw)))
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        warn_ignored(ignored)
        return JSONResponse(out)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        def handle(body: Any) -> tuple[dict[str, Any], tuple[str, ...]]:
            out, ignored = protocol.tokenize(body)
            return {**out, "max_model_len": state.max_model_len}, ignored
        return await answer(request, handle)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await answer(request, protocol.detokenize)

    def parse(raw: bytes, chat: bool) -> Parsed:
        body = load_json(raw)
        return protocol.chat(body) if chat else protocol.completion(body)

    async def serve(request: Request, chat: bool) -> Response:
        scheduler = state.scheduler
        if scheduler is None:
            return _error("the server is starting (loading weights, compiling)", 503,
                          "unavailable")
        try:
            raw = await _read_body(request, state.max_body_bytes)
        except _TooLarge:
            return too_large()
        try:
            parsed = await asyncio.to_thread(parse, raw, chat)
        except RequestError as e:
            return JSONResponse(e.body(), status_code=e.status)
        warn_ignored(parsed.ignored)
        loop = asyncio.get_running_loop()
        # (choice index, event): every choice's events in one queue, in the order they came.
        events: asyncio.Queue[tuple[int, Delta | Finished]] = asyncio.Queue()

        def sink(index: int) -> Callable[[Delta | Finished], None]:
            return lambda event: loop.call_soon_threadsafe(events.put_nowait, (index, event))

        jobs = [Job(ids, params, sink(index))
                for index, (_, ids, params) in enumerate(parsed.choices())]
        try:
            scheduler.submit(*jobs)
        except QueueFull as e:
            return _error(str(e), 429, "rate_limit_exceeded")
        except Unavailable as e:
            return _error(str(e), 503, "unavailable")
        rid = protocol.new_id(chat)
        if parsed.stream:
            return StreamingResponse(_stream(rid, parsed, jobs, events, scheduler),
                                     media_type="text/event-stream")
        return await _collect(request, rid, parsed, jobs, events, scheduler)

    def cancel_unfinished(jobs: list[Job], scheduler: Scheduler) -> None:
        for job in jobs:
            if not job.done:
                scheduler.cancel(job)

    async def _collect(request: Request, rid: str, parsed: Parsed, jobs: list[Job],
                       events: asyncio.Queue, scheduler: Scheduler) -> Response:
        deltas: list[list[Delta]] = [[] for _ in jobs]
        finished: list[Finished | None] = [None] * len(jobs)
        loop = asyncio.get_running_loop()
        check_at = loop.time() + _POLL_SECONDS
        try:
            while True:
                # Checked on a clock, not only when no tokens come: a request whose tokens
                # keep arriving would otherwise never notice its client has gone.
                if loop.time() >= check_at:
                    if await request.is_disconnected():
                        cancel_unfinished(jobs, scheduler)
                        return Response(status_code=499)
                    check_at = loop.time() + _POLL_SECONDS
                try:
                    index, event = await asyncio.wait_for(events.get(),
                                                          check_at - loop.time())
                except TimeoutError:
                    continue
                if isinstance(event, Delta):
                    deltas[index].append(event)
                    continue
                if event.reason in ("error", "cancelled"):
                    return _failed(event)  # the other choices are cancelled below
                finished[index] = event
                if all(f is not None for f in finished):
                    return JSONResponse(protocol.response(
                        rid, parsed, list(zip(deltas, finished, strict=True))))
        finally:
            cancel_unfinished(jobs, scheduler)

    def _failed(finished: Finished) -> Response:
        if finished.reason == "error":
            return _error(finished.error or "internal error", 500, "internal_error")
        return _error("the request was cancelled (the server is stopping)", 503, "unavailable")

    async def _stream(rid: str, parsed: Parsed, jobs: list[Job], events: asyncio.Queue,
                      scheduler: Scheduler) -> AsyncIterator[str]:
        # Per choice: characters streamed, for the completions log-probabilities' text_offset.
        offsets = [0] * len(jobs)
        started = [False] * len(jobs)  # a choice's first chunk carries its prompt's ids
        finished: list[Finished] = []
        try:
            if parsed.chat:
                for index in range(len(jobs)):
                    yield _sse(protocol.role_chunk(rid, parsed, index))
            while True:
                index, event = await events.get()
                if isinstance(event, Delta):
                    first = not started[index]
                    if parsed.echo_only and not first:
                        continue  # the prompt alone: what was run after it is not sent
                    if event.ids or event.text or (first and parsed.echo):
                        yield _sse(protocol.chunk(rid, parsed, event, None, offsets[index],
                                                  index, first=first))
                        offsets[index] += protocol.text_length(parsed, event, index, first)
                        started[index] = True
                    continue
                if event.reason in ("error", "cancelled"):  # the other choices end with it
                    yield _sse(error_body(event.error or "internal error", "internal_error",
                                          None, 500) if event.reason == "error" else
                               error_body("the request was cancelled (the server is stopping)",
                                          "unavailable", None, 503))
                    yield "data: [DONE]\n\n"
                    return
                yield _sse(protocol.chunk(rid, parsed, None, event.reason, index=index,
                                          first=not started[index],
                                          stop_reason=event.stop_reason))
                finished.append(event)
                if len(finished) == len(jobs):
                    if parsed.include_usage:
                        yield _sse(protocol.usage_chunk(rid, parsed, finished))
                    yield "data: [DONE]\n\n"
                    return
        finally:  # the client went away (the response task is cancelled), or we are done
            cancel_unfinished(jobs, scheduler)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    return app

