"""The tokenizer kinds a :class:`router.tokenize.ModelTokenizer` wraps, each with
``encode(text, add_special_tokens)`` and ``render_chat(messages, add_generation_prompt, extra)``:

* :class:`BuiltinTokenizer`: :mod:`router.core.bytetok`, one token per UTF-8 byte and its
  fixed chat template;
* :class:`HFTokenizer`: a ``tokenizers`` ``tokenizer.json``, its special tokens, and its chat
  template (``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``)
  compiled by :func:`compile_chat_template` the way ``transformers`` does and rendered with
  jinja2.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from router.core import bytetok
from router.tokenize_util import Ids


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
        self._fast = getattr(self.tok, "encode_batch_fast", None)  # tokenizers >= 0.21
        with_sp = self.tok.encode("a", add_special_tokens=True).ids
        without = self.tok.encode("a", add_special_tokens=False).ids
        k = len(without)
        pos = next((i for i in range(len(with_sp) - k + 1) if with_sp[i:i + k] == without), 0)
        self.special_prefix, self.special_suffix = with_sp[:pos], with_sp[pos + k:]

    def encode(self, text: str, add_special_tokens: bool = False) -> Ids:
        fast = self._fast
        if fast is not None:  # same ids, without computing offsets (~25 % less per call)
            return fast([text], add_special_tokens=add_special_tokens)[0].ids
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
