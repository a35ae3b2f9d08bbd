"""The chat message-prefix cache (marks) of ``router.tokenize.ModelTokenizer``: a warm cache
gives exactly what a cold one computes — on growing, branching and edited chats, with
templates that render history differently once more messages follow, with contents that
move between messages without changing the text, and across seeds and block sizes — and a
growing chat resumes from its last message instead of re-reading its history."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from router.core import bytetok
from router.core.hashing import block_hashes, seed_hash
from router.tokenize import HFTokenizer, ModelTokenizer, load_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# the last message renders differently from the same message once another follows it, and
# assistant turns before the last user turn lose their "thinking" (as Qwen3's template does)
LAST_DIFFERS = (
    "{% set ns = namespace(last_user=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}{% if loop.last %} (latest){% endif %}\n"
    "{% if m['role'] == 'assistant' and loop.index0 > ns.last_user %}<think>{{ m.get('thinking', '') }}"
    "</think>{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ suffix | default('') }}")
GLUED = "{% for m in messages %}{{ m['content'] }}{% endfor %}<|im_end|>"

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "cache", "router", "block", "\n"]


def _train(directory: Path, template: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(2)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return directory


@pytest.fixture(scope="module")
def bpe_dirs(tmp_path_factory) -> dict[str, Path]:
    out = {}
    for name, template in (("chatml", CHATML), ("last_differs", LAST_DIFFERS), ("glued", GLUED)):
        out[name] = _train(tmp_path_factory.mktemp(name), template)
    return out


def _text(rng: random.Random, n: int) -> str:
    """Words in lines of at most 8 (so no piece needs a hard cut inside a word)."""
    words = [rng.choice(WORDS[:-1]) for _ in range(n)]
    return "".join(w + ("\n" if i % 8 == 7 or rng.random() < 0.1 else " ") for i, w in enumerate(words)).strip(" ")


def _cold(mt: ModelTokenizer, msgs: list, add_gen: bool = True, extra: dict | None = None, bs: int = 4,
          seed: int = 11) -> tuple[int, list[int]] | None:
    """The result of a fresh cache with the same settings."""
    return ModelTokenizer(mt.tok, chunk_chars=mt.chunk_chars).chat_blocks(msgs, add_gen, extra, bs, seed)


def test_growing_chat_resumes_from_its_last_message_and_equals_full_encoding(bpe_dirs) -> None:
    hf = HFTokenizer(bpe_dirs["chatml"])
    mt = ModelTokenizer(hf, chunk_chars=64)
    rng = random.Random(3)
    msgs = [{"role": "system", "content": _text(rng, 200)}]
    for turn in range(8):
        msgs.append({"role": "user", "content": _text(rng, 30)})
        hits, before = mt.marks.hits, mt.encoded_chars
        n, hashes = mt.chat_blocks(msgs, True, None, 4, 11)
        text = hf.render_chat(msgs, True)
        ids = hf.tok.encode(text, add_special_tokens=False).ids  # one render, one whole-text encode
        assert (n, hashes) == (len(ids), block_hashes(ids, 4, 11))
        assert (n, hashes) == _cold(mt, msgs)
        if turn:
            assert mt.marks.hits == hits + 1  # resumed from the previous turn's last message
            new_turn = len(text) - text.rindex("<|im_end|>\n<|im_start|>assistant\n", 0, len(text) - 1)
            assert mt.encoded_chars - before <= len(msgs[-1]["content"]) + 2 * new_turn + 64
        msgs.append({"role": "assistant", "content": _text(rng, 20)})


def test_history_rendered_differently_misses_instead_of_being_wrong(bpe_dirs) -> None:
    hf = HFTokenizer(bpe_dirs["last_differs"])
    mt = ModelTokenizer(hf, chunk_chars=64)
    rng = random.Random(4)
    msgs = [{"role": "system", "content": _text(rng, 60)}]
    for _ in range(6):
        msgs.append({"role": "user", "content": _text(rng, 12)})
        assert mt.chat_blocks(msgs, True, None, 4, 11) == _cold(mt, msgs)
        msgs.append({"role": "assistant", "content": _text(rng, 8), "thinking": _text(rng, 6)})
        assert mt.chat_blocks(msgs, False, None, 4, 11) == _cold(mt, msgs, False)
    # the last message was marked while it rendered "(latest)": it must not be reused
    assert mt.marks.hits > 0 and mt.marks.misses > 0
    # template variables change the history's text: the same messages, another result
    extra = {"suffix": "<|im_end|>"}
    assert mt.chat_blocks(msgs, True, extra, 4, 11) == _cold(mt, msgs, True, extra)


def test_content_moving_between_messages_keeps_the_cold_result(bpe_dirs) -> None:
    hf = HFTokenizer(bpe_dirs["glued"])
    mt = ModelTokenizer(hf, chunk_chars=8)
    a = [{"role": "user", "content": "the quick brown"}, {"role": "user", "content": " fox jumps over"}]
    b = [{"role": "user", "content": "the quick"}, {"role": "user", "content": " brown fox jumps over"}]
    assert hf.render_chat(a, False) == hf.render_chat(b, False)
    for msgs in (a, b, a, b + [{"role": "user", "content": " the dog"}], a):
        assert mt.chat_blocks(msgs, False, None, 2, 5) == _cold(mt, msgs, False, None, 2, 5)
    # the same last message after a different split inside a word: another piece seam
    c = [{"role": "user", "content": "the qui"}, {"role": "user", "content": "ck brown"},
         {"role": "user", "content": " fox"}]
    d = [{"role": "user", "content": "the quick"}, {"role": "user", "content": " brown"},
         {"role": "user", "content": " fox"}]
    assert hf.render_chat(c, False) == hf.render_chat(d, False) and _cold(mt, c, False) != _cold(mt, d, False)
    for msgs in (c, d, c):
        assert mt.chat_blocks(msgs, False, None, 4, 11) == _cold(mt, msgs, False)


def test_seeds_and_block_sizes_never_share_marks(bpe_dirs) -> None:
    hf = HFTokenizer(bpe_dirs["chatml"])
    mt = ModelTokenizer(hf, chunk_chars=64)
    rng = random.Random(5)
    msgs = [{"role": "system", "content": _text(rng, 80)}, {"role": "user", "content": _text(rng, 10)}]
    for seed, bs in ((1, 4), (2, 4), (1, 8), (seed_hash("m", None, "salt"), 16)):
        assert mt.chat_blocks(msgs, True, None, bs, seed) == _cold(mt, msgs, True, None, bs, seed)
        longer = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": _text(rng, 5)}]
        assert mt.chat_blocks(longer, True, None, bs, seed) == _cold(mt, longer, True, None, bs, seed)


def test_random_branching_editing_chats_equal_a_cold_cache(bpe_dirs) -> None:
    """Warm results equal cold ones whatever the history of the cache: conversations grow,
    branch from an earlier point, regenerate, edit an earlier message, drop the system prompt."""
    hf = HFTokenizer(bpe_dirs["chatml"])
    mt = ModelTokenizer(hf, cache_entries=64, chunk_chars=32)  # small: evictions happen too
    rng = random.Random(6)
    convs: list[list[dict]] = [[{"role": "system", "content": _text(rng, 50)}]]
    for _ in range(150):
        base = [dict(m) for m in rng.choice(convs)]
        op = rng.random()
        if op < 0.5 or len(base) < 3:
            base.append({"role": rng.choice(["user", "assistant"]), "content": _text(rng, rng.randrange(1, 25))})
        elif op < 0.7:
            base = base[: rng.randrange(1, len(base))]
        elif op < 0.9:
            i = rng.randrange(len(base))
            base[i]["content"] = _text(rng, rng.randrange(1, 25))
        else:
            base = base[1:]
        add_gen = rng.random() < 0.8
        assert mt.chat_blocks(base, add_gen, None, 4, 11) == _cold(mt, base, add_gen), base
        convs.append(base)
    assert len(mt.marks) <= 64 and len(mt.cache) <= 64
    assert mt.marks.hits > 20


def test_builtin_warm_equals_the_simulated_engine_bytes() -> None:
    mt = load_tokenizer("builtin", chunk_chars=32)
    rng = random.Random(7)
    msgs = [{"role": "system", "content": _text(rng, 40)}]
    for _ in range(5):
        msgs.append({"role": "user", "content": [{"type": "text", "text": _text(rng, 9)}]})
        ids = bytetok.encode(bytetok.render_chat(msgs, True))
        assert mt.chat_blocks(msgs, True, None, 16, 3) == (len(ids), block_hashes(ids, 16, 3))
        msgs.append({"role": "assistant", "content": _text(rng, 7)})
    assert mt.marks.hits >= 4
