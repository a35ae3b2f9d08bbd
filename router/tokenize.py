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

Modules: this one keeps the caching :class:`ModelTokenizer` and :func:`load_tokenizer`; the
builtin and ``tokenizers`` kinds with chat-template rendering are in
:mod:`router.tokenize_kinds`, the ``backend`` kind in :mod:`router.tokenize_backend`, the
text cuts in :mod:`router.tokenize_cuts`, the LRU and id helpers in
:mod:`router.tokenize_util`; their names are re-exported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from router.core.hashing import block_hashes
from router.tokenize_backend import BackendTokenizer
from router.tokenize_cuts import cuts_from as _cuts_from
from router.tokenize_cuts import message_contents as _contents
from router.tokenize_cuts import message_cuts, split_chunks
from router.tokenize_kinds import BuiltinTokenizer, HFTokenizer, compile_chat_template, content_text
from router.tokenize_util import LRU, Ids
from router.tokenize_util import is_ids as _is_ids

__all__ = ["LRU", "BackendTokenizer", "BuiltinTokenizer", "HFTokenizer", "Ids", "ModelTokenizer",
           "compile_chat_template", "content_text", "load_tokenizer", "message_cuts", "split_chunks"]


class _State:
    """The hashing state after one piece of a text (cached per piece-prefix key). States
    link to the state before them, so a cached state yields all hashes of its prefix.

    The hashes are kept in segments: append-only lists shared along a linear chain of
    states. A state's hashes are its segment's first ``count - base.count`` items after
    those of ``base`` (the state its segment starts after; None: the text's beginning). The
    first child of a state whose segment ends at it extends that segment; a later child (a
    branch: another continuation of the same prefix) starts a new one after it. So
    resuming from a cached state costs a slice per branch point on its path, not a walk
    over every piece before it, and no branch copies its prefix. A segment lives as long as any
    state on it: hashes of an evicted state past the last live one stay in memory until the
    whole segment goes (at most one dead tail per segment)."""

    __slots__ = ("n", "hashes", "tail", "parent", "key", "count", "seg", "base")

    def __init__(self, n: int, hashes: list[int], tail: Ids, parent: _State | None, key: int) -> None:
        self.n = n            # tokens from the start of the text through this piece
        self.hashes = hashes  # block hashes completed by this piece
        self.tail = tail      # tokens of the trailing partial block
        self.parent = parent
        self.key = key        # rolling hash of every piece through this one (the cache key)
        self.count = len(hashes) + (parent.count if parent is not None else 0)  # hashes through here
        self.base: _State | None
        if parent is None:
            self.seg, self.base = list(hashes), None
        elif len(parent.seg) == parent.count - (parent.base.count if parent.base is not None else 0):
            parent.seg.extend(hashes)  # the chain goes on: share the parent's segment
            self.seg, self.base = parent.seg, parent.base
        else:
            self.seg, self.base = list(hashes), parent  # a branch: a new segment after the parent

    def all_hashes(self) -> list[int]:
        parts = []
        st: _State | None = self
        while st is not None:
            base = st.base
            parts.append(st.seg[:st.count - (base.count if base is not None else 0)])
            st = base
        out = parts.pop()
        while parts:
            out += parts.pop()
        return out


class _Mark:
    """A chat prefix seen before: the rendered text through message ``i``'s content ends at
    ``end`` and hashes (xxh3-128 of its UTF-8) to ``digest``; ``state`` is its hashing state."""

    __slots__ = ("end", "digest", "state")

    def __init__(self, end: int, digest: int, state: _State) -> None:
        self.end, self.digest, self.state = end, digest, state


def _text_digest(text: str, end: int) -> int:
    return xxhash.xxh3_128_intdigest(text[:end].encode("utf-8", "surrogatepass"))


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
