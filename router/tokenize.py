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

Caching (:class:`ModelTokenizer`): a rendered text is cut into pieces — after each chat
message's content, and inside long stretches after the first newline (before a word) past
``chunk_chars`` characters (hard cut at 4 × that) — and a bounded LRU keeps, per piece and everything
before it, the block hashes the piece completed. Cuts depend only on the text before them,
so a growing multi-turn chat re-uses its whole history and tokenizes and hashes only its
new turn. A chat also finds its longest known message prefix directly (a second LRU, keyed
by message index and contents, checked against a digest of the freshly rendered prefix
text), so the history is not even located, cut or keyed again. Pieces are encoded separately: exact for ``builtin`` (bytes); for a byte-level
BPE the cuts fall on pre-token boundaries (a newline before a word; a message's end,
where templates put a special token), so the ids equal whole-text encoding in the usual
case (tested), while a template gluing text to a message's end could differ at that seam
— harmless for routing, which only needs the same prefix to give the same hashes.

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

import xxhash

from router.core import bytetok
from router.core.hashing import block_hashes

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
    """Content-defined chunks: cut after the first newline followed by a non-space character
    at or beyond ``chunk_chars`` characters since the last cut (hard cut at
    ``4 × chunk_chars``). A newline before a word is a pre-token boundary of byte-level BPEs
    (GPT-2 / Llama 3 split patterns), so such cuts do not change the ids."""
    if chunk_chars <= 0 or len(text) <= chunk_chars:
        return [text]
    out = []
    start, n, hard = 0, len(text), 4 * chunk_chars
    while n - start > chunk_chars:
        limit = min(n - 1, start + hard)
        nl = text.find("\n", start + chunk_chars, limit)
        while nl >= 0 and text[nl + 1] in " \t\r\n":
            nl = text.find("\n", nl + 1, limit)
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
        # the template's globals, flattened once (jinja merges its ChainMap on every render)
        self._globals = dict(self.template.globals) if self.template is not None else {}
        if self.template is not None:
            from jinja2.runtime import new_context

            self._new_context = new_context
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
        msgs = messages
        for m in messages:
            c = m.get("content")
            if c is not None and not isinstance(c, str):  # content parts → their text
                msgs = [{**m, "content": content_text(m.get("content"))} if not isinstance(m.get("content"), str)
                        and m.get("content") is not None else m for m in messages]
                break
        kw: dict[str, Any] = {**self.special, "tools": None, "documents": None}
        kw.update(extra or {})
        kw["messages"], kw["add_generation_prompt"] = msgs, add_generation_prompt
        # what Template.render(**kw) does, minus merging the globals' ChainMap each time
        t = self.template
        ctx = self._new_context(t.environment, t.name, t.blocks, kw, False, self._globals)
        return str(t.environment.concat(t.root_render_func(ctx)))  # type: ignore[attr-defined]


class _State:
    """The hashing state after one piece of a text (cached per piece-prefix key). States
    link to the state before them, so a cached state yields all hashes of its prefix."""

    __slots__ = ("n", "hashes", "tail", "parent", "key", "count")

    def __init__(self, n: int, hashes: list[int], tail: Ids, parent: _State | None, key: int) -> None:
        self.n = n            # tokens from the start of the text through this piece
        self.hashes = hashes  # block hashes completed by this piece
        self.tail = tail      # tokens of the trailing partial block
        self.parent = parent
        self.key = key        # rolling hash of every piece through this one (the cache key)
        self.count = len(hashes) + (parent.count if parent is not None else 0)  # hashes through here

    def all_hashes(self) -> list[int]:
        parts = []
        st: _State | None = self
        while st is not None:
            if st.hashes:
                parts.append(st.hashes)
            st = st.parent
        out: list[int] = []
        for p in reversed(parts):
            out += p
        return out


class _Mark:
    """A chat prefix seen before: the rendered text through message ``i``'s content ends at
    ``end`` and hashes (xxh3-128 of its UTF-8) to ``digest``; ``state`` is its hashing state."""

    __slots__ = ("end", "digest", "state")

    def __init__(self, end: int, digest: int, state: _State) -> None:
        self.end, self.digest, self.state = end, digest, state


def _text_digest(text: str, end: int) -> int:
    return xxhash.xxh3_128_intdigest(text[:end].encode("utf-8", "surrogatepass"))


def _contents(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    out = [m.get("content") for m in messages]
    if set(map(type, out)) != {str}:  # content parts (or none) → their text
        out = [c if type(c) is str else content_text(c) for c in out]
    return out


def _cuts_from(text: str, contents: Sequence[str], first: int, pos: int) -> list[tuple[int, int]]:
    """(message index, position right after its content) for ``contents[first:]``, found in
    order from ``pos``; messages with empty or unfound content get no cut."""
    cuts = []
    for i in range(first, len(contents)):
        c = contents[i]
        if c:
            j = text.find(c, pos, pos + len(c) + 1024)  # template glue between contents is short
            if j < 0:
                j = text.find(c, pos)
            if j >= 0:
                pos = j + len(c)
                cuts.append((i, pos))
    return cuts


def message_cuts(text: str, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Positions in a rendered chat right after each message's content (found in order)."""
    return [c for _, c in _cuts_from(text, _contents(messages), 0, 0)]


class ModelTokenizer:
    """Tokenizes and block-hashes one model's prompts with bounded caches.

    A text is cut into pieces: after each chat message's content, and inside long stretches
    at content-defined boundaries (:func:`split_chunks`). Each piece is keyed by a rolling
    hash of every piece up to it (and the seed and block size), and the piece cache keeps,
    per key, the block hashes that piece completed and the partial block it left. A request
    whose leading pieces are cached resumes from there.

    Chats have a second cache, of marks: per message prefix (keyed by the message index
    and a chain hash of the contents through it, with the seed and block size), where its
    rendered text ends, an xxh3-128 digest of that text and the hashing state there. A chat
    finds its longest marked prefix from the end (usually one probe), checks it against its
    own full rendering (one digest of the prefix text: a template that renders history
    differently misses instead of being wrong), and only then locates, cuts, keys,
    tokenizes and hashes the text after it — a growing chat pays for its new turn only, and
    the result is the one a cold cache computes. Pieces are encoded separately (exact for
    ``builtin``; for BPE a merge across a piece seam can differ from encoding the whole text
    — routing only needs the same prefix to give the same hashes every time).
    """

    def __init__(self, tok: BuiltinTokenizer | HFTokenizer, cache_entries: int = 8192,
                 chunk_chars: int = 1024) -> None:
        self.tok = tok
        self.chunk_chars = chunk_chars
        self.cache = LRU(cache_entries)
        self.marks = LRU(cache_entries)  # chat message prefixes → _Mark
        self.short = LRU(1024)  # ids of short pieces by text: template glue between messages
        self.encoded_chars = 0  # characters actually sent to the tokenizer (cache misses)

    def _pieces(self, text: str, cuts: Sequence[int] = (), start: int = 0) -> list[str]:
        """Pieces of ``text[start:]``, cut at ``cuts`` (ascending, all ≥ ``start``) and inside
        stretches longer than ``chunk_chars``."""
        out: list[str] = []
        prev, cc = start, self.chunk_chars
        for cut in cuts:
            if cut - prev > cc:
                out += split_chunks(text[prev:cut], cc)
            elif cut > prev:
                out.append(text[prev:cut])
            prev = max(prev, cut)
        if prev < len(text):
            out += split_chunks(text[prev:], cc)
        return out

    def _specials(self, add_special_tokens: bool) -> tuple[Ids, Ids]:
        if add_special_tokens and isinstance(self.tok, HFTokenizer):
            return self.tok.special_prefix, self.tok.special_suffix
        return [], []

    def encode_text(self, text: str, add_special_tokens: bool = False, cuts: Sequence[int] = ()) -> Ids:
        """Token ids of ``text`` encoded piece by piece (the ids the hashes are made of)."""
        pre, post = self._specials(add_special_tokens)
        out: Ids = list(pre)
        for piece in self._pieces(text, cuts):
            out += self.tok.encode(piece, False)
        return out + post

    def text_blocks(self, text: str, block_size: int, seed: int, add_special_tokens: bool = False,
                    cuts: Sequence[int] = ()) -> tuple[int, list[int]]:
        """(number of tokens, chained block hashes) of ``text``, resuming from the cache."""
        pre, post = self._specials(add_special_tokens)
        n, hashes, _ = self._advance(self._pieces(text, cuts), None, block_size, seed, pre, post)
        return n, hashes

    def _advance(self, pieces: Sequence[str], start: _State | None, block_size: int, seed: int,
                 pre: Sequence[int] = (), post: Sequence[int] = ()) -> tuple[int, list[int], list[_State | None]]:
        """Tokens, all block hashes, and the state after each piece, of ``pieces`` following
        the state ``start`` (None: the text's beginning, after the ``pre`` special tokens)."""
        cache, digest = self.cache, xxhash.xxh3_64_intdigest
        key = start.key if start is not None else digest(b"%d:%d" % (block_size, len(pre)), seed)
        keys = []
        for piece in pieces:
            key = digest(piece.encode("utf-8", "surrogatepass"), key)
            keys.append(key)
        states: list[_State | None] = [None] * len(pieces)
        i = len(pieces)
        st: _State | None = start
        while i > 0:  # the longest cached prefix, searched from the end (usually 1–2 probes)
            found = cache.get(keys[i - 1])
            if found is not None:
                st = found
                break
            i -= 1
        back = st
        for j in range(i - 1, -1, -1):  # the cached states of the leading pieces
            assert back is not None
            states[j] = back
            back = back.parent
        if st is not None:
            hashes, n, tail = st.all_hashes(), st.n, st.tail
        else:
            hashes, n, tail = [], len(pre), list(pre)
        short, encode = self.short, self.tok.encode
        for j in range(i, len(pieces)):
            piece = pieces[j]
            ids = short.get(piece) if len(piece) <= 64 else None
            if ids is None:
                ids = encode(piece, False)
                self.encoded_chars += len(piece)
                if len(piece) <= 64:
                    short.put(piece, ids)
            buf = tail + ids if tail else ids
            full = len(buf) // block_size * block_size
            new = block_hashes(buf, block_size, seed, parent=hashes[-1] if hashes else None) if full else []
            hashes += new
            n += len(ids)
            tail = buf[full:]
            st = states[j] = _State(n, new, tail, st, keys[j])
            cache.put(keys[j], st)
        if post:
            buf = tail + list(post)
            hashes += block_hashes(buf, block_size, seed, parent=hashes[-1] if hashes else None)
            n += len(post)
        return n, hashes, states

    def _chat_text_blocks(self, text: str, messages: Sequence[Mapping[str, Any]], block_size: int,
                          seed: int) -> tuple[int, list[int]]:
        contents = _contents(messages)
        marks = self.marks
        first, start, mark = 0, 0, None
        for i in range(len(contents) - 1, -1, -1):  # the longest marked prefix, from the end
            if not contents[i]:
                continue
            # keyed by all contents through message i (their cuts depend on nothing else)
            mk = marks.get((seed, block_size, i, hash(tuple(contents[:i + 1]))))
            if mk is not None and mk.end <= len(text) and _text_digest(text, mk.end) == mk.digest:
                first, start, mark = i + 1, mk.end, mk
                break
        cuts = _cuts_from(text, contents, first, start)
        pieces = self._pieces(text, [c for _, c in cuts], start)
        n, hashes, states = self._advance(pieces, mark.state if mark else None, block_size, seed)
        ends, pos = {}, start
        for piece, st in zip(pieces, states, strict=True):
            pos += len(piece)
            ends[pos] = st
        for i, cut in cuts:
            st = ends.get(cut)
            if st is not None:
                key = (seed, block_size, i, hash(tuple(contents[:i + 1])))
                marks.put(key, _Mark(cut, _text_digest(text, cut), st))
        return n, hashes

    # -- request bodies ---------------------------------------------------------------
    def _render(self, messages: Any, add_generation_prompt: bool,
                extra: Mapping[str, Any] | None) -> str | None:
        if type(messages) is not list or not messages:
            return None
        for m in messages:
            if type(m) is not dict and not isinstance(m, Mapping):
                return None
        try:
            return self.tok.render_chat(messages, add_generation_prompt, extra)
        except Exception:
            return None

    @staticmethod
    def _prompt(prompt: Any) -> str | Ids | None:
        if isinstance(prompt, str):
            return prompt or None
        if _is_ids(prompt):
            return prompt
        if isinstance(prompt, list) and prompt:
            first = prompt[0]
            if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
                return first or None
            if _is_ids(first):
                return first
        return None

    def prompt_ids(self, prompt: Any) -> Ids | None:
        """Ids of a completions ``prompt`` (the first one of a batch); None if unreadable."""
        p = self._prompt(prompt)
        return self.encode_text(p, True) if isinstance(p, str) else p

    def chat_ids(self, messages: Any, add_generation_prompt: bool = True,
                 extra: Mapping[str, Any] | None = None) -> Ids | None:
        """Ids of chat ``messages`` rendered with the model's template; None if unreadable
        (not a list of objects, or the template raised)."""
        text = self._render(messages, add_generation_prompt, extra)
        return None if text is None else self.encode_text(text, False, message_cuts(text, messages))

    def prompt_blocks(self, prompt: Any, block_size: int, seed: int) -> tuple[int, list[int]] | None:
        """(tokens, block hashes) of a completions ``prompt``; None if unreadable."""
        p = self._prompt(prompt)
        if p is None:
            return None
        if isinstance(p, str):
            return self.text_blocks(p, block_size, seed, True)
        return len(p), block_hashes(p, block_size, seed)

    def chat_blocks(self, messages: Any, add_generation_prompt: bool, extra: Mapping[str, Any] | None,
                    block_size: int, seed: int) -> tuple[int, list[int]] | None:
        """(tokens, block hashes) of chat ``messages``; None if unreadable."""
        text = self._render(messages, add_generation_prompt, extra)
        if text is None:
            return None
        return self._chat_text_blocks(text, messages, block_size, seed)


def load_tokenizer(spec: str, cache_entries: int = 8192, chunk_chars: int = 1024) -> ModelTokenizer | None:
    """``builtin`` → byte-level; a path → ``tokenizers``; ``backend`` → None (ask a replica)."""
    if spec == "backend":
        return None
    if spec == "builtin":
        return ModelTokenizer(BuiltinTokenizer(), cache_entries, chunk_chars)
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
