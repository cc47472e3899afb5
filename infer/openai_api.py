"""The OpenAI wire format of ``python -m infer.serve``: request bodies parsed and checked into
:class:`infer.engine.RequestParams`, error bodies, and the response and stream-chunk bodies.

Requests are pydantic models in strict mode (a field of the wrong type is an error, not coerced). Fields the
server does not implement are refused when they ask for something (``echo``, ``logprobs``, penalties, ...) and
ignored otherwise; two vLLM extensions are kept: ``ignore_eos`` and ``stop_token_ids``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from infer.engine import RequestParams

DEFAULT_MAX_TOKENS = 16  # /v1/completions, as OpenAI's; chat fills the context by default
ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 429: "RateLimitError", 500: "InternalServerError",
               503: "ServiceUnavailableError"}
# Options this server does not implement, with the value that asks for nothing (any other value is refused).
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "logprobs": None,
               "top_logprobs": None, "best_of": 1, "echo": False, "suffix": None, "tools": None, "functions": None,
               "tool_choice": None, "response_format": None}


class APIError(Exception):
    """An error answered with an OpenAI error body: HTTP ``status``, ``message``, the offending ``param``."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "APIError"),
                          "param": self.param, "code": self.status}}


def validation_error(errors: list[dict]) -> APIError:
    """A 400 from pydantic's (or fastapi's) error list: every problem in the message, the first field as param."""
    def say(e: dict) -> str:
        if e["type"] == "json_invalid":
            reason = e.get("ctx", {}).get("error", e["msg"])
            return f"the body is not valid JSON: {reason} (at character {e['loc'][-1]})"
        where = ".".join(str(part) for part in e["loc"] if part != "body") or "body"
        return f"{where}: {e['msg'].removeprefix('Value error, ')}"

    fields = [e["loc"][1] for e in errors if len(e["loc"]) > 1 and isinstance(e["loc"][1], str)]
    return APIError(400, "; ".join(say(e) for e in errors) or "invalid request", fields[0] if fields else None)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool | None = False


class _Sampling(BaseModel):
    """The fields both endpoints share."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n not in (None, 1):
            raise ValueError(f"only n=1 is supported (one choice per request), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop):
        if any(s == "" for s in ([stop] if isinstance(stop, str) else stop or ())):
            raise ValueError("stop strings must not be empty")
        return stop

    def check(self) -> None:
        """A 400 for what the types cannot say: an unsupported option asked for, stream options without a stream."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and value not in (UNSUPPORTED[name], None, False, {}, []):
                raise APIError(400, f"{name} is not supported by this server (got {value!r})", name)
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def params(self, prompt_len: int, max_context: int, vocab_size: int,
               default_max_tokens: int | None) -> RequestParams:
        """The engine's parameters for a prompt of ``prompt_len`` tokens; a 400 where prompt and output do not fit
        ``max_context`` or a stop token id is not in the vocabulary. ``default_max_tokens`` None: what fits."""
        room = max_context - prompt_len
        if room <= 0:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server's context holds {max_context} "
                                "(prompt and output), leaving no room to generate", "prompt")
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"max_tokens {max_tokens} and the prompt's {prompt_len} tokens exceed this server's "
                                f"context of {max_context} tokens (at most {room} new tokens)", "max_tokens")
        stop_ids = tuple(self.stop_token_ids or ())
        check_token_ids(stop_ids, vocab_size, "stop_token_ids")
        return RequestParams(max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
                             top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                             stop_token_ids=stop_ids, ignore_eos=bool(self.ignore_eos))


def check_token_ids(ids, vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"token ids must be in [0, {vocab_size}), got {bad[:5]}", param)


class CompletionRequest(_Sampling):
    prompt: str | list[int]

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, prompt):
        if len(prompt) == 0:
            raise ValueError("the prompt is empty")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    class Part(BaseModel):
        model_config = ConfigDict(strict=True)
        type: Literal["text"]
        text: str

    role: str
    content: str | list[Part] | None = None

    def as_template_input(self) -> dict:
        text = self.content if not isinstance(self.content, list) else "".join(p.text for p in self.content)
        return {**(self.model_extra or {}), "role": self.role, "content": text or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _max_completion_tokens(self):
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


# ------------------------------------------------------------------------------------------------ responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Responses:
    """The bodies of one request's response: a completion or a chat completion, whole or as stream chunks."""

    def __init__(self, chat: bool, model: str):
        self.chat, self.model = chat, model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish_reason: str, token_usage: dict) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            return {**self._head("chat.completion"), "choices": [choice], "usage": token_usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": token_usage}

    def chunk(self, text: str | None, finish_reason: str | None, include_usage: bool, role: bool = False) -> dict:
        """One stream chunk with ``text``; ``role`` True: the chat stream's opening delta."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        return {**body, "usage": None} if include_usage else body

    def usage_chunk(self, token_usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": token_usage}


def models_body(model: str, max_context: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": int(time.time()),
                                        "owned_by": "longspec-jax", "max_model_len": max_context}]}
