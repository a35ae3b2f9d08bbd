"""Block hashing: chaining, full blocks only, seeding, resumption."""

import xxhash

from router.core.hashing import block_hashes, pack_tokens, seed_hash


def test_full_blocks_only():
    seed = seed_hash("m")
    assert block_hashes(list(range(15)), 16, seed) == []
    assert len(block_hashes(list(range(16)), 16, seed)) == 1
    assert len(block_hashes(list(range(47)), 16, seed)) == 2


def test_chain_formula():
    seed = seed_hash("m")
    toks = list(range(32))
    h1 = xxhash.xxh3_64_intdigest(pack_tokens(toks[:16]), seed)
    h2 = xxhash.xxh3_64_intdigest(pack_tokens(toks[16:]), h1)
    assert block_hashes(toks, 16, seed) == [h1, h2]


def test_prefix_property_and_divergence():
    seed = seed_hash("m")
    a = block_hashes(list(range(64)), 16, seed)
    b = block_hashes(list(range(48)) + [999] * 16, 16, seed)
    assert a[:3] == b[:3] and a[3] != b[3]
    # a change in block 0 changes every later hash (chained)
    c = block_hashes([7] + list(range(1, 64)), 16, seed)
    assert all(x != y for x, y in zip(a, c, strict=True))


def test_seed_separates_model_lora_salt():
    toks = list(range(16))
    seeds = {seed_hash("m"), seed_hash("m2"), seed_hash("m", "lora"), seed_hash("m", None, "salt")}
    assert len(seeds) == 4
    assert len({block_hashes(toks, 16, s)[0] for s in seeds}) == 4


def test_resume_equals_full():
    seed = seed_hash("m")
    toks = list(range(100))
    full = block_hashes(toks, 16, seed)
    rest = block_hashes(toks, 16, seed, start_block=3, parent=full[2])
    assert full[:3] + rest == full


def test_bytetok_roundtrip_and_chat_prefix():
    from router.core import bytetok

    assert bytetok.decode(bytetok.encode("héllo")) == "héllo"
    a = [{"role": "system", "content": "s"}, {"role": "user", "content": "u1"}]
    b = a + [{"role": "assistant", "content": "x"}, {"role": "user", "content": "u2"}]
    ra = bytetok.render_chat(a, add_generation_prompt=False)
    assert bytetok.render_chat(b).startswith(ra)
