"""The FastAPI app of ``python -m infer.serve``: OpenAI-compatible completions and chat completions (whole or
streamed as server-sent events), ``/v1/models``, ``/health`` and ``/metrics``, in front of a running
:class:`infer.engine.Engine`.

The app stays thin: it parses a request (:mod:`infer.openai_api`), submits it to the engine, whose loop runs in its
own thread, and awaits the request's chunks, detokenizing them as they come (:mod:`infer.detokenize`). A request
whose client goes away, or whose text reached a stop string, is cancelled, which frees its slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from infer.detokenize import IncrementalDetokenizer
from infer.engine import EngineDead, QueueFull, RequestHandle
from infer.openai_api import (DEFAULT_MAX_TOKENS, APIError, ChatCompletionRequest, CompletionRequest, Responses,
                              check_token_ids, models_body, usage, validation_error)
from infer.serve_metrics import ServeMetrics

log = logging.getLogger("infer.serve")


@dataclasses.dataclass
class Served:
    """What the app serves: a started engine, the tokenizer's ``encode`` / ``decode`` and the limits."""

    engine: object
    tokenizer: object
    decode: Callable[[Sequence[int]], str]
    model_name: str
    max_context: int
    vocab_size: int


class Generation:
    """One submitted request: ``pieces()`` yields ``(text, finish_reason)`` for every engine chunk that carries text
    and for the last; ``completion_tokens`` counts the tokens taken. ``close()`` (idempotent) cancels the request
    unless it has ended and records its latencies; ``pieces()`` closes it when it stops, for any reason."""

    def __init__(self, handle: RequestHandle, detokenizer: IncrementalDetokenizer, metrics: ServeMetrics):
        self.handle, self.detokenizer, self.metrics = handle, detokenizer, metrics
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._closed = False

    async def pieces(self):
        last = None
        try:
            async for chunk in self.handle:
                if chunk.token_ids:  # the gap between the engine's hand-overs, not between our reads
                    if last is not None:
                        self.metrics.inter_token_latency.observe(chunk.emitted_at - last)
                    last = chunk.emitted_at
                self.completion_tokens += len(chunk.token_ids)
                text = self.detokenizer.push(chunk.token_ids)
                if self.detokenizer.stopped:
                    self.finish_reason = "stop"
                elif chunk.finish_reason in ("error", "abort"):
                    self.finish_reason = "error"
                    raise APIError(500, f"the engine ended the request ({chunk.finish_reason}): "
                                        f"{self.handle.error or 'no reason given'}")
                elif chunk.finish_reason is not None:
                    text += self.detokenizer.finish()
                    self.finish_reason = "stop" if self.detokenizer.stopped else chunk.finish_reason
                if text or self.finish_reason:
                    yield text, self.finish_reason
                if self.finish_reason:
                    return
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.handle.done:
            self.handle.cancel()
        self.metrics.request_ended(self.handle.timings, self.finish_reason or "abort")


class EventStream(StreamingResponse):
    """Server-sent events that close their request however the response ends, even before its first event."""

    def __init__(self, generation: Generation, events):
        super().__init__(events, media_type="text/event-stream")
        self.generation = generation

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


def _event(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


async def _client_gone(request: Request) -> None:
    """Returns once the client has disconnected (the request's body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(served: Served) -> FastAPI:
    """The app for ``served``; its ``state.metrics`` holds the Prometheus registry."""
    app = FastAPI(title="longspec-jax", description="OpenAI-compatible completions with LongSpec decoding")
    metrics = app.state.metrics = ServeMetrics(served.engine)

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, e: RequestValidationError):
        error = validation_error(list(e.errors()))
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http_error(request, e: HTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("request failed")
        return JSONResponse(APIError(500, f"internal error: {type(e).__name__}: {e}").body(), status_code=500)

    def submit(prompt_ids: list[int], body, default_max_tokens: int | None) -> Generation:
        check_token_ids(prompt_ids, served.vocab_size, "prompt")
        params = body.params(len(prompt_ids), served.max_context, served.vocab_size, default_max_tokens)
        try:
            handle = served.engine.submit(prompt_ids, params)
        except QueueFull as e:
            raise APIError(429, f"the server is busy: its queue is full ({e}); retry later") from None
        except EngineDead as e:
            raise APIError(503, f"the engine has stopped: {e}") from None
        except ValueError as e:  # the engine's RequestError names the field
            raise APIError(400, str(e), getattr(e, "param", None)) from None
        return Generation(handle, IncrementalDetokenizer(served.decode, prompt_ids, body.stop_strings), metrics)

    async def respond(request: Request, body, generation: Generation, prompt_len: int, chat: bool):
        responses = Responses(chat, served.model_name)
        if body.stream:
            return EventStream(generation, _stream(generation, responses, body.include_usage, prompt_len))
        collect = asyncio.ensure_future(_collect(generation))
        gone = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            collect.cancel()  # no effect once done
            generation.close()  # the client is gone (or the request ended): the slot is freed
        if not collect.done():
            return Response(status_code=499)  # nobody reads it
        return responses.whole(collect.result(), generation.finish_reason,
                               usage(prompt_len, generation.completion_tokens))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check()
        prompt_ids = list(body.prompt) if isinstance(body.prompt, list) else list(served.tokenizer.encode(body.prompt))
        if not prompt_ids:
            raise APIError(400, "the prompt encodes to 0 tokens", "prompt")
        generation = submit(prompt_ids, body, DEFAULT_MAX_TOKENS)
        return await respond(request, body, generation, len(prompt_ids), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check()
        if not getattr(served.tokenizer, "chat_template", None):
            raise APIError(400, f"model {served.model_name} has no chat template (its tokenizer has no "
                                "chat_template): use /v1/completions", "messages")
        try:
            text = served.tokenizer.apply_chat_template([m.as_template_input() for m in body.messages],
                                                        tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (roles, order) raise from inside jinja
            raise APIError(400, f"the chat template rejected the messages: {e}", "messages") from None
        prompt_ids = list(served.tokenizer.encode(text, add_special_tokens=False))
        generation = submit(prompt_ids, body, None)
        return await respond(request, body, generation, len(prompt_ids), chat=True)

    @app.get("/v1/models")
    async def models():
        return models_body(served.model_name, served.max_context)

    @app.get("/health")
    async def health():
        if not served.engine.alive:
            raise APIError(503, "the engine's loop has stopped")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app


async def _collect(generation: Generation) -> str:
    async with contextlib.aclosing(generation.pieces()) as pieces:
        return "".join([piece async for piece, _ in pieces])


async def _stream(generation: Generation, responses: Responses, include_usage: bool, prompt_len: int):
    """The SSE events of a streamed response, ending with ``[DONE]``; an error midway is sent as an error event."""
    try:
        if responses.chat:
            yield _event(responses.chunk(None, None, include_usage, role=True))
        async with contextlib.aclosing(generation.pieces()) as pieces:
            async for text, finish in pieces:
                yield _event(responses.chunk(text, finish, include_usage))
        if include_usage:
            yield _event(responses.usage_chunk(usage(prompt_len, generation.completion_tokens)))
    except APIError as e:
        yield _event(e.body())
    except Exception as e:
        log.exception("streamed request failed")
        yield _event(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
    yield "data: [DONE]\n\n"
