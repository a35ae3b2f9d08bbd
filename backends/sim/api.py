"""The OpenAI request/response shapes of the simulated engine, as vLLM produces them.

Pure: parses and validates a request body (a decoded JSON value) into a :class:`GenRequest`
or raises :class:`ApiError` (status 400/404 with an OpenAI-style error body), and builds the
response objects and stream chunks. The HTTP server only moves bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from backends.sim.tokenizer import SimTokenizer

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed",
               413: "RequestTooLarge", 500: "InternalServerError", 503: "ServiceUnavailable"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "BadRequestError"),
                      "param": param, "code": status}}


@dataclass(slots=True)
class GenRequest:
    """A validated generation request: one token list per prompt (chat: exactly one)."""

    chat: bool
    model: str
    prompts: list[list[int]]
    max_tokens: int
    stream: bool
    include_usage: bool
    seed: int | None
    cache_salt: str | None


def _int_field(body: Mapping[str, Any], name: str) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"`{name}` must be an integer", name)
    return v


def _token_list(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def check_messages(msgs: Any) -> list[Mapping[str, Any]]:
    """Validate chat ``messages`` as vLLM does: a non-empty list of objects, each with a string
    ``role`` and a ``content`` that is a string, a list of content parts, or null (an
    assistant message with tool calls); anything else is a 400 naming the message."""
    if not isinstance(msgs, list) or not msgs or not all(isinstance(m, Mapping) for m in msgs):
        raise ApiError(400, "`messages` must be a non-empty list of message objects", "messages")
    for i, m in enumerate(msgs):
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ApiError(400, f"messages[{i}]: `role` is required and must be a string", "messages")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise ApiError(400, f"messages[{i}]: `content` must be a string or a list of content parts, "
                                f"got {type(content).__name__}", "messages")
        if isinstance(content, list) and not all(isinstance(part, Mapping | str) for part in content):
            raise ApiError(400, f"messages[{i}]: each content part must be an object or a string", "messages")
    return msgs


def check_model(body: Mapping[str, Any], served: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None:
        return served[0]
    if not isinstance(model, str):
        raise ApiError(400, "`model` must be a string", "model")
    if model not in served:
        raise ApiError(404, f"The model `{model}` does not exist.", "model")
    return model


def parse_generation(body: Any, *, chat: bool, tok: SimTokenizer, served: tuple[str, ...],
                     max_model_len: int, default_max_tokens: int = 0) -> GenRequest:
    """Validate a ``/v1/completions`` (``chat=False``) or ``/v1/chat/completions`` body.
    ``default_max_tokens`` 0 means vLLM's defaults: 16 for completions, the rest of the
    context for chat."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "request body must be a JSON object")
    model = check_model(body, served)
    prompts: list[list[int]]
    if chat:
        msgs = check_messages(body.get("messages"))
        add_gen = body.get("add_generation_prompt", True)
        prompts = [tok.encode(tok.render_chat(msgs, bool(add_gen)))]
    else:
        if "prompt" not in body:
            raise ApiError(400, "`prompt` is required", "prompt")
        p = body["prompt"]
        if isinstance(p, str):
            prompts = [tok.encode(p)]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            prompts = [tok.encode(x) for x in p]
        elif isinstance(p, list) and p and _token_list(p):
            prompts = [list(p)]
        elif isinstance(p, list) and p and all(_token_list(x) for x in p):
            prompts = [list(x) for x in p]
        else:
            raise ApiError(400, "`prompt` must be a string, a list of strings, a list of token ids "
                                "or a list of lists of token ids", "prompt")
    for ids in prompts:
        if not ids:
            raise ApiError(400, "the prompt must not be empty", "messages" if chat else "prompt")
        if any(t < 0 or t >= 1 << 31 for t in ids):
            raise ApiError(400, "token ids must be in [0, 2**31)", "prompt")
    n = _int_field(body, "n")
    if n is not None and n != 1:
        raise ApiError(400, "the simulator supports only n = 1", "n")
    max_tokens = _int_field(body, "max_completion_tokens") if chat else None
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens")
    longest = max(len(ids) for ids in prompts)
    if longest >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                            f"your request has {longest} input tokens. Please reduce the length of "
                            "the input.", "messages" if chat else "prompt")
    if max_tokens is None:
        if default_max_tokens > 0:
            max_tokens = min(default_max_tokens, max_model_len - longest)
        else:
            max_tokens = max_model_len - longest if chat else 16
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if longest + max_tokens > max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                            f"you requested {longest + max_tokens} tokens ({longest} in the messages, "
                            f"{max_tokens} in the completion). Please reduce the length of the "
                            "messages or completion.", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "`stream` must be a boolean", "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, Mapping):
        raise ApiError(400, "`stream_options` must be an object", "stream_options")
    include_usage = bool(opts.get("include_usage")) if opts else False
    seed = _int_field(body, "seed")
    salt = body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ApiError(400, "`cache_salt` must be a string", "cache_salt")
    return GenRequest(chat, model, prompts, max_tokens, stream, include_usage, seed, salt)


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion, "completion_tokens": completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def completion_response(rid: str, created: int, model: str, texts: list[str], reasons: list[str | None],
                        use: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": i, "text": t, "logprobs": None, "finish_reason": fr, "stop_reason": None,
                         "prompt_logprobs": None} for i, (t, fr) in enumerate(zip(texts, reasons, strict=True))],
            "usage": use}


def chat_response(rid: str, created: int, model: str, text: str, reason: str | None,
                  use: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                         "logprobs": None, "finish_reason": reason, "stop_reason": None}],
            "usage": use}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str,
                     reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": reason,
                         "stop_reason": None}]}


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any], reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, use: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": use}
