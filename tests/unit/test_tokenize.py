"""Router tokenization: builtin, a real tokenizer.json with a jinja chat template, the
chunk cache on a growing chat, prompt forms, and the backend ``/tokenize`` over HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from router.core import bytetok
from router.core.hashing import block_hashes, seed_hash
from router.tokenize import BackendTokenizer, HFTokenizer, ModelTokenizer, load_tokenizer, split_chunks

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if loop.index0 > 0 and m['role'] == messages[loop.index0 - 1]['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"the quick brown fox {i} jumps over the lazy dog\nsystem user assistant" for i in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": TEMPLATE}))
    return d


def test_builtin_matches_the_simulated_engine() -> None:
    mt = load_tokenizer("builtin")
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hé"}]}]
    assert mt.chat_ids(msgs) == bytetok.encode(bytetok.render_chat(msgs, True))
    assert mt.chat_ids(msgs, add_generation_prompt=False) == bytetok.encode(bytetok.render_chat(msgs, False))
    assert mt.prompt_ids("abc") == [97, 98, 99]


def test_prompt_forms() -> None:
    mt = load_tokenizer("builtin")
    assert mt.prompt_ids(["ab", "cd"]) == [97, 98]
    assert mt.prompt_ids([5, 6, 7]) == [5, 6, 7]
    assert mt.prompt_ids([[5, 6], [7]]) == [5, 6]
    for bad in (None, "", [], {}, [1, "a"], [True, 2], 3, [["a"]]):
        assert mt.prompt_ids(bad) is None, bad
    for bad in (None, [], "hi", [1, 2], [{"role": "user"}, "x"]):
        assert mt.chat_ids(bad) is None, bad


def test_tokenizer_json_and_chat_template_like_transformers(model_dir: Path) -> None:
    hf = HFTokenizer(model_dir)
    mt = ModelTokenizer(hf)
    msgs = [{"role": "user", "content": " hello fox "}, {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "jump"}]
    text = hf.render_chat(msgs, True)
    assert text == "<s><|user|>\nhello fox</s>\n<|assistant|>\nhi</s>\n<|user|>\njump</s>\n<|assistant|>\n"
    assert hf.render_chat(msgs[:1], False).endswith("hello fox</s>\n")
    assert mt.chat_ids(msgs) == hf.tok.encode(text, add_special_tokens=False).ids
    # completions get the tokenizer's special tokens (BOS here), as vLLM adds them
    assert mt.prompt_ids("the lazy dog") == hf.tok.encode("the lazy dog").ids
    assert mt.prompt_ids("the lazy dog")[0] == 1
    # a template that raises leaves the prompt unreadable (routed on load), never raises
    assert mt.chat_ids([{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]) is None
    assert load_tokenizer(str(model_dir / "tokenizer.json")).tok.template is not None
    with pytest.raises(FileNotFoundError):
        HFTokenizer(model_dir / "missing")


def test_chunks_depend_only_on_the_text_before_them() -> None:
    text = "".join(f"line {i} " + "x" * (i % 37) + "\n" for i in range(400))
    chunks = split_chunks(text, 256)
    assert "".join(chunks) == text and len(chunks) > 10
    assert all(len(c) <= 4 * 256 for c in chunks)
    longer = split_chunks(text + "more\n" * 100, 256)
    assert longer[: len(chunks) - 1] == chunks[:-1]
    assert split_chunks("y" * 3000, 256) == ["y" * 1024, "y" * 1024, "y" * 952]


def test_growing_chat_only_tokenizes_and_hashes_its_new_turn(model_dir: Path) -> None:
    hf = HFTokenizer(model_dir)
    mt = ModelTokenizer(hf, cache_entries=256, chunk_chars=128)
    seed, bs = seed_hash("m"), 4
    history = [{"role": "system", "content": "the quick brown fox\n" * 40}]
    for turn in range(6):
        history.append({"role": "user", "content": f"question {turn} jumps over the dog\n" * 8})
        before = mt.encoded_chars
        n, hashes = mt.chat_blocks(history, True, None, bs, seed)
        encoded = mt.encoded_chars - before
        total = len(hf.render_chat(history, True))
        # the same ids as encoding the pieces without any cache, hashed in one go
        ids = mt.chat_ids(history)
        assert (n, hashes) == (len(ids), block_hashes(ids, bs, seed))
        if turn:
            assert encoded < 0.3 * total, (turn, encoded, total)
        assert mt.chat_blocks(history, True, None, bs, seed) == (n, hashes)
        history.append({"role": "assistant", "content": f"answer {turn}"})
    assert len(mt.cache) <= 256
    small = ModelTokenizer(hf, cache_entries=4, chunk_chars=16)
    small.text_blocks("".join(f"line {i} of text\n" for i in range(100)), bs, seed)
    assert len(small.cache) == 4


def test_blocks_are_exact_for_builtin_and_carry_salt_and_specials(model_dir: Path) -> None:
    mt = load_tokenizer("builtin", chunk_chars=64)
    msgs = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "u" * 100}]
    ids = bytetok.encode(bytetok.render_chat(msgs, True))
    assert mt.chat_blocks(msgs, True, None, 16, 7) == (len(ids), block_hashes(ids, 16, 7))
    assert mt.prompt_blocks([1, 2, 3, 4], 2, 7) == (4, block_hashes([1, 2, 3, 4], 2, 7))
    assert mt.prompt_blocks(None, 2, 7) is None and mt.chat_blocks([], True, None, 2, 7) is None
    hf = ModelTokenizer(HFTokenizer(model_dir), chunk_chars=32)
    text = "the lazy dog jumps\n" * 20
    n, hashes = hf.prompt_blocks(text, 4, 9)
    ids = hf.prompt_ids(text)
    assert ids[0] == 1 and (n, hashes) == (len(ids), block_hashes(ids, 4, 9))
    assert hf.prompt_blocks(text, 4, 10)[1][0] != hashes[0]  # another seed (salt): other hashes


async def test_backend_tokenize_over_http_is_cached() -> None:
    from aiohttp import web

    seen: list[dict] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append(body)
        if body.get("prompt") == "fail":
            return web.json_response({"error": {"message": "no"}}, status=400)
        text = body.get("prompt") or bytetok.render_chat(body["messages"], body.get("add_generation_prompt", True))
        ids = bytetok.encode(text)
        return web.json_response({"count": len(ids), "max_model_len": 4096, "tokens": ids})

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    bt = BackendTokenizer([f"http://127.0.0.1:{port}"], timeout_s=5)
    try:
        payload = {"model": "m", "prompt": "hello"}
        assert await bt.tokens(payload) == list(b"hello")
        assert await bt.tokens(dict(payload)) == list(b"hello")
        assert len(seen) == 1
        msgs = {"model": "m", "messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True}
        assert await bt.tokens(msgs) == bytetok.encode(bytetok.render_chat(msgs["messages"]))
        assert await bt.tokens({"model": "m", "prompt": "fail"}) is None
        dead = BackendTokenizer(["http://127.0.0.1:9"], timeout_s=1)
        assert await dead.tokens(payload) is None
        await dead.close()
    finally:
        await bt.close()
        await runner.cleanup()


def test_piece_ids_equal_whole_text_ids_for_a_byte_level_bpe(model_dir: Path) -> None:
    """Cuts fall on pre-token boundaries, so exact (KV-event) tracking sees the engine's ids."""
    hf = HFTokenizer(model_dir)
    mt = ModelTokenizer(hf, chunk_chars=48)
    body = "".join(f"the quick fox {i}\n  jumps over\n\nthe lazy dog {i} " for i in range(30))
    msgs = [{"role": "system", "content": body}, {"role": "user", "content": "fox\ndog " * 20},
            {"role": "assistant", "content": "over the dog"}, {"role": "user", "content": body[:300]}]
    text = hf.render_chat(msgs, True)
    assert len(mt._pieces(text, [])) > 20
    assert mt.chat_ids(msgs) == hf.tok.encode(text, add_special_tokens=False).ids
    assert mt.prompt_ids(body) == hf.tok.encode(body).ids
