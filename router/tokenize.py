"""Per-model tokenization in the router: prompt or chat messages → token ids, cached.

Three kinds, chosen by ``models.<name>.tokenizer`` in the config:

* ``builtin`` (default): :mod:`router.core.bytetok`, one token per UTF-8 byte and its fixed
  chat template — identical to the simulated engine's, so block hashes match exactly.
* a path to a ``tokenizer.json`` or to a model directory holding one: loaded with
  ``tokenizers``; the chat template comes from ``chat_template.jinja``,
  ``chat_template.json`` or ``tokenizer_config.json`` (``chat_template`` string, or the
  ``default`` entry of a list), rendered with jinja2 the way ``transformers`` renders it
  (sandboxed, ``trim_blocks``/``lstrip_blocks``, loop controls, ``raise_exception``,
  ``strftime_now``, a ``tojson`` filter; variables ``messages``, ``add_generation_prompt``,
  ``tools``, the special tokens ``bos_token``/``eos_token``/..., and the request's
  ``chat_template_kwargs``). Completion prompts get the tokenizer's special tokens
  (``add_special_tokens=True``, as vLLM does); rendered chats do not (the template has them).
* ``backend``: ask a replica's ``POST /tokenize`` (vLLM's API), one call per distinct
  prompt, answers kept in a bounded LRU.

Caching: text is cut into chunks at content-defined boundaries (the first newline after
``chunk_chars`` characters, or a hard cut at 4 × that), and each chunk's ids are kept in a
bounded LRU keyed by the chunk's text. Boundaries depend only on the text before them, so
a growing multi-turn chat re-uses every chunk of its history and only encodes its new
turn. Ids of a chunked text can differ from encoding the whole text at a chunk seam (BPE
merges across a newline are rare): routing only needs the same prefix to give the same
ids every time. ``chunk_chars: 0`` encodes whole texts (engine-exact ids, no chunk cache).

Prompt forms: a string, a list of strings (the first is routed on), a list of token ids,
or a list of lists of ids. Anything unreadable gives ``None`` (never raises): the request
is then routed on load alone.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from router.core import bytetok

Ids = list[int]


class LRU:
    """A bounded least-recently-used map (keys → values); ``hits``/``misses`` counted."""

    def __init__(self, size: int) -> None:
        self.size = max(1, size)
        self._d: OrderedDict[Any, Any] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Any:
        v = self._d.get(key)
        if v is None:
            self.misses += 1
            return None
        self.hits += 1
        self._d.move_to_end(key)
        return v

    def put(self, key: Any, value: Any) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        if len(self._d) > self.size:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


def split_chunks(text: str, chunk_chars: int) -> list[str]:
    """Content-defined chunks: cut after the first newline at or beyond ``chunk_chars``
    characters since the last cut (hard cut at ``4 × chunk_chars``)."""
    if chunk_chars <= 0 or len(text) <= chunk_chars:
        return [text]
    out = []
    start, n, hard = 0, len(text), 4 * chunk_chars
    while n - start > chunk_chars:
        nl = text.find("\n", start + chunk_chars, start + hard)
        cut = nl + 1 if nl >= 0 else start + hard
        if cut >= n:
            break
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)


def content_text(content: Any) -> str:
    return bytetok.content_text(content)


class BuiltinTokenizer:
    """The byte-level tokenizer (no files, no special tokens)."""

    kind = "builtin"

    def encode(self, text: str, add_special_tokens: bool = False) -> Ids:
        return bytetok.encode(text)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                    extra: Mapping[str, Any] | None = None) -> str:
        return bytetok.render_chat(messages, add_generation_prompt)


def _token_str(v: Any) -> str | None:
    if isinstance(v, Mapping):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> Any:
    """A jinja2 template compiled the way ``transformers`` compiles chat templates."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def _load_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        t = json.loads(json_file.read_text()).get("chat_template")
        if isinstance(t, str):
            return t
    t = config.get("chat_template")
    if isinstance(t, list):
        named = {e.get("name"): e.get("template") for e in t if isinstance(e, Mapping)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) else None


class HFTokenizer:
    """A ``tokenizers`` tokenizer from a ``tokenizer.json`` (+ chat template from its directory)."""

    kind = "file"

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"no tokenizer.json at {path}")
        self.tok = Tokenizer.from_file(str(file))
        directory = file.parent
        cfg_file = directory / "tokenizer_config.json"
        cfg: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.special = {k: s for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                        if (s := _token_str(cfg.get(k))) is not None}
        source = _load_template(directory, cfg)
        self.template = compile_chat_template(source) if source else None
        with_sp = self.tok.encode("a", add_special_tokens=True).ids
        without = self.tok.encode("a", add_special_tokens=False).ids
        k = len(without)
        pos = next((i for i in range(len(with_sp) - k + 1) if with_sp[i:i + k] == without), 0)
        self.special_prefix, self.special_suffix = with_sp[:pos], with_sp[pos + k:]

    def encode(self, text: str, add_special_tokens: bool = False) -> Ids:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
                    extra: Mapping[str, Any] | None = None) -> str:
        if self.template is None:
            return bytetok.render_chat(messages, add_generation_prompt)
        msgs = [{**m, "content": content_text(m.get("content"))} if not isinstance(m.get("content"), str)
                and m.get("content") is not None else m for m in messages]
        kw: dict[str, Any] = {**self.special, "tools": None, "documents": None}
        kw.update(extra or {})
        kw["messages"], kw["add_generation_prompt"] = msgs, add_generation_prompt
        return str(self.template.render(**kw))


class ModelTokenizer:
    """Tokenizes one model's prompts with the chunk cache described in the module docstring."""

    def __init__(self, tok: BuiltinTokenizer | HFTokenizer, cache_entries: int = 8192,
                 chunk_chars: int = 1024) -> None:
        self.tok = tok
        self.chunk_chars = chunk_chars if tok.kind != "builtin" else 0
        self.cache = LRU(cache_entries)

    def encode_text(self, text: str, add_special_tokens: bool = False) -> Ids:
        if self.chunk_chars <= 0:
            return self.tok.encode(text, add_special_tokens)
        out: Ids = []
        cache, encode = self.cache, self.tok.encode
        for chunk in split_chunks(text, self.chunk_chars):
            ids = cache.get(chunk)
            if ids is None:
                ids = encode(chunk, False)
                cache.put(chunk, ids)
            out += ids
        if add_special_tokens and isinstance(self.tok, HFTokenizer):
            return self.tok.special_prefix + out + self.tok.special_suffix
        return out

    def prompt_ids(self, prompt: Any) -> Ids | None:
        """Ids of a completions ``prompt`` (the first one of a batch); None if unreadable."""
        if isinstance(prompt, str):
            return self.encode_text(prompt, True) if prompt else None
        if _is_ids(prompt):
            return prompt
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
                return self.encode_text(first, True) if first else None
            if _is_ids(first):
                return first
        return None

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True,
                 extra: Mapping[str, Any] | None = None) -> Ids | None:
        """Ids of chat ``messages`` rendered with the model's template; None if unreadable
        (not a list of objects, or the template raised)."""
        if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
            return None
        try:
            text = self.tok.render_chat(messages, add_generation_prompt, extra)
        except Exception:
            return None
        return self.encode_text(text, False)


def load_tokenizer(spec: str, cache_entries: int = 8192, chunk_chars: int = 1024) -> ModelTokenizer | None:
    """``builtin`` → byte-level; a path → ``tokenizers``; ``backend`` → None (ask a replica)."""
    if spec == "backend":
        return None
    if spec == "builtin":
        return ModelTokenizer(BuiltinTokenizer(), cache_entries, 0)
    return ModelTokenizer(HFTokenizer(spec), cache_entries, chunk_chars)


class BackendTokenizer:
    """``POST /tokenize`` on a replica (vLLM's API), answers cached in a bounded LRU."""

    def __init__(self, urls: Sequence[str], api_key: str | None = None, timeout_s: float = 2.0,
                 cache_entries: int = 4096) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.cache = LRU(cache_entries)
        self.calls = 0
        self.failures = 0
        self._session: Any = None
        self._next = 0

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def tokens(self, payload: Mapping[str, Any]) -> Ids | None:
        import aiohttp
        import orjson

        try:
            key = orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)
        except TypeError:
            return None
        hit = self.cache.get(key)
        if hit is not None:
            return hit
        if not self.urls:
            return None
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        headers = {"content-type": "application/json"}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        for attempt in range(min(2, len(self.urls))):
            url = self.urls[(self._next + attempt) % len(self.urls)]
            self.calls += 1
            try:
                async with self._session.post(f"{url}/tokenize", data=key, headers=headers) as resp:
                    if resp.status != 200:
                        self.failures += 1
                        continue
                    data = await resp.json(loads=orjson.loads)
                ids = data.get("tokens") if isinstance(data, Mapping) else None
                if _is_ids(ids):
                    self._next += 1
                    self.cache.put(key, ids)
                    return ids
                self.failures += 1
            except Exception:
                self.failures += 1
        return None
