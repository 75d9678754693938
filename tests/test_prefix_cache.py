"""Prefix caching: blocks found by content give the same tokens as computing them again, on the
real model; and the caching pool's bookkeeping under random traffic (hypothesis)."""
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from minillm import LLM
from minillm.config import ModelConfig
from minillm.engine import LLMEngine
from minillm.kv.prefix_cache import PrefixCachingPool, chain_hashes, hash_block
from minillm.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
SYSTEM = ("You are a careful assistant for a small bakery. Answer questions about opening hours, bread, cakes, "
          "prices and orders. Opening hours are 7 to 18 on weekdays and 8 to 13 on Saturdays; closed on Sundays. "
          "Sourdough costs 4 euros, a baguette 1.20, croissants 1.10 each. Cakes must be ordered two days ahead. ")


def run(engine, prompts, params=GREEDY, wait_first=True):
    """The first prompt alone until its prompt is computed (so its blocks are cached), then the rest."""
    finals = {}
    engine.add_request(0, prompts[0], params)
    if wait_first:
        while engine.requests[0].num_computed_tokens < len(prompts[0]):
            finals.update({o.request_id: o for o in engine.step() if o.finished})
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(i, p, params)
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    return [finals[i] for i in range(len(prompts))]


def on_and_off(model, tokenizer, prompts, wait_first=True, **options):
    on = LLMEngine(model, tokenizer, enable_prefix_caching=True, verbose=False, **options)
    off = LLMEngine(model, tokenizer, enable_prefix_caching=False, verbose=False, **options)
    a, b = run(on, prompts, wait_first=wait_first), run(off, prompts, wait_first=wait_first)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.token_ids == y.token_ids, f"request {i}: caching changed the tokens"
    return a, on


def test_shared_system_prompt_is_computed_once(backend_model, tokenizer):
    questions = ["When do you open on Saturday?", "How much is a baguette?", "Can I order a cake for tomorrow?"]
    prompts = [tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
               for q in questions]
    shared = next(i for i, (a, b) in enumerate(zip(prompts[0], prompts[1])) if a != b)
    outs, engine = on_and_off(backend_model, tokenizer, prompts, kv_cache_memory=64 << 20)
    assert outs[0].num_cached_tokens == 0
    for o in outs[1:]:
        assert o.num_cached_tokens == shared // 16 * 16 > 80        # every full block of the shared prefix
    s = engine.stats()
    assert s["prefix_cache_hits"] == 2 * (shared // 16 * 16)
    assert s["prefix_cache_queries"] == sum(map(len, prompts))


def test_identical_prompts_and_whole_prompt_cached(model, tokenizer):
    p = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)[:48]     # exactly 3 blocks
    outs, _ = on_and_off(model, tokenizer, [p, p, list(p)], kv_cache_memory=64 << 20)
    # every block is cached, but the last one is computed again: its last token's logits are needed
    assert [o.num_cached_tokens for o in outs] == [0, 32, 32]
    q = p + tokenizer.encode(" And then")
    outs, _ = on_and_off(model, tokenizer, [q, q], kv_cache_memory=64 << 20)
    assert outs[1].num_cached_tokens == len(q) // 16 * 16


@pytest.mark.parametrize("diverge_at", [16, 21, 32])
def test_prompts_diverging_inside_a_block_or_at_its_boundary(model, tokenizer, diverge_at):
    base = tokenizer.encode("Once upon a time, in a land far away, there lived a king who loved to count: " * 3)[:60]
    other = base[:diverge_at] + [t + 1 for t in base[diverge_at:]]
    outs, _ = on_and_off(model, tokenizer, [base, other], kv_cache_memory=64 << 20)
    assert outs[1].num_cached_tokens == diverge_at // 16 * 16


def test_two_requests_sharing_a_new_prefix_in_one_step(model, tokenizer):
    prefix = tokenizer.encode(SYSTEM)[:40]
    prompts = [prefix + tokenizer.encode(" Question one?"), prefix + tokenizer.encode(" Question two!")]
    outs, engine = on_and_off(model, tokenizer, prompts, wait_first=False, kv_cache_memory=64 << 20)
    assert [o.num_cached_tokens for o in outs] == [0, 0]           # both computed it; one copy is kept
    later, _ = on_and_off(model, tokenizer, prompts + [prefix + [5]], kv_cache_memory=64 << 20)
    assert later[2].num_cached_tokens == 32


def test_chunked_prefill_and_preemption_with_shared_prefixes(backend_model, tokenizer):
    prefix = tokenizer.encode(SYSTEM)[:50]
    prompts = [prefix + tokenizer.encode(s) for s in (" First", " Second one", " Third", " A fourth, longer one")]
    outs, engine = on_and_off(backend_model, tokenizer, prompts, block_size=4, num_blocks=24, max_num_batched_tokens=16)
    assert engine.stats()["num_preemptions"] > 0 and engine.stats()["prefix_cache_hits"] > 0
    assert engine.stats()["kv_blocks_used"] == 0


def test_eviction_under_memory_pressure_then_recompute(model, tokenizer):
    a = tokenizer.encode(SYSTEM)[:64]
    fillers = [[1000 + i] * 60 for i in range(3)]
    engine = LLMEngine(model, tokenizer, block_size=16, num_blocks=12, verbose=False)
    first = run(engine, [a])[0]
    assert engine.stats()["kv_blocks_used"] == 0 and len(engine.pool.evictable) == 4    # a's 4 blocks stay cached
    assert run(engine, [a])[0].num_cached_tokens == 48
    run(engine, fillers, wait_first=False)                            # need 3 x 5 blocks of 12: evicts
    assert engine.stats()["prefix_cache_evictions"] > 0
    again = run(engine, [a])[0]
    assert again.num_cached_tokens < 48 and again.token_ids == first.token_ids


def test_multi_turn_chat_finds_its_history(model, tokenizer):
    llm = LLM(model, tokenizer, kv_cache_memory=64 << 20, verbose=False)
    off = LLM(model, tokenizer, kv_cache_memory=64 << 20, verbose=False, enable_prefix_caching=False)
    chat = [{"role": "user", "content": "Name three rivers in Europe."}]
    params = SamplingParams(max_tokens=40)
    first = llm.chat(chat, params)[0]
    history = chat + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Which is longest?"}]
    second, second_off = llm.chat(history, params)[0], off.chat(history, params)[0]
    assert second.token_ids == second_off.token_ids
    turn1 = len(tokenizer.apply_chat_template(chat))
    assert second.num_cached_tokens >= turn1 // 16 * 16 + 16, "the answer's blocks were not found"
    assert second_off.num_cached_tokens == 0


def test_salt_keeps_caches_apart(model, tokenizer):
    p = tokenizer.encode(SYSTEM)[:40]
    engine = LLMEngine(model, tokenizer, kv_cache_memory=64 << 20, verbose=False)
    engine.add_request("alice", p, GREEDY, cache_salt="alice")
    while engine.has_unfinished_requests():
        engine.step()
    for rid, salt, hit in (("bob", "bob", 0), ("alice2", "alice", 32)):
        engine.add_request(rid, p, GREEDY, cache_salt=salt)
        outs = []
        while engine.has_unfinished_requests():
            outs += engine.step()
        assert outs[-1].num_cached_tokens == hit


def test_hash_chain_names_the_whole_prefix():
    a = chain_hashes(list(range(40)), 16)
    b = chain_hashes([99] + list(range(1, 40)), 16)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]            # same block 1 tokens, other history
    assert chain_hashes(list(range(40)), 16, known=a[:1]) == a
    assert hash_block(None, range(16), "salt") != hash_block(None, range(16)) and len(a[0]) == 16


# ---------------------------------------------------------------- the pool, under random traffic
TINY = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, head_dim=1, ffn_dim=8, vocab_size=64)
PREFIXES = [[3, 5, 7, 9, 11, 13, 15, 17, 19, 21], [3, 5, 7, 9, 2, 4, 6], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
BS = 4


def value(token, position):
    return float(token * 4096 + position + 1)


class CachingPoolMachine(RuleBasedStateMachine):
    """Sequences of tokens from a few shared prefixes; admit = look up + share + write the rest;
    K of slot s is value(token, position), so reads check the data; full blocks get registered."""

    def __init__(self):
        super().__init__()
        self.pool = PrefixCachingPool(TINY, num_blocks=14, block_size=BS)
        self.tokens: dict[int, list[int]] = {}          # live sequence -> its tokens
        self.hashed: dict[int, int] = {}                # live sequence -> blocks registered
        self.names: dict[bytes, tuple[int, tuple]] = {}   # every address ever made -> (first position, tokens)
        self.next_id = 0

    def _write(self, seq, start):
        toks = self.tokens[seq]
        slots = self.pool.slots(seq, start, len(toks))
        self.pool.k[0].view(-1)[slots] = torch.tensor([value(t, p) for p, t in enumerate(toks) if p >= start])

    def _register(self, seq):
        toks = self.tokens[seq]
        hashes = chain_hashes(toks, BS)
        for j in range(self.hashed[seq], len(hashes)):
            self.names[hashes[j]] = (j * BS, tuple(toks[j * BS:(j + 1) * BS]))
            self.pool.register(self.pool.tables[seq][j], hashes[j], toks[j * BS:(j + 1) * BS])
        self.hashed[seq] = len(hashes)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), cut=st.integers(0, 10),
          tail=st.lists(st.integers(1, 63), max_size=6))
    def admit(self, prefix, cut, tail):
        toks = PREFIXES[prefix][:cut] + tail or [1]
        seq, self.next_id = self.next_id, self.next_id + 1
        hashes = chain_hashes(toks, BS)[:(len(toks) - 1) // BS]
        hit = self.pool.lookup(hashes, toks)
        need = self.pool.blocks_for(len(toks)) - len(hit) + self.pool.blocks_to_reuse(hit)
        if need > self.pool.num_free_blocks:
            return
        self.pool.allocate(seq, 0)
        self.pool.share(seq, hit)
        self.pool.grow(seq, len(toks) - len(hit) * BS)
        self.tokens[seq], self.hashed[seq] = toks, len(hit)
        self._write(seq, len(hit) * BS)
        self._register(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), more=st.lists(st.integers(1, 63), min_size=1, max_size=5))
    def append(self, data, more):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if not self.pool.can_append(seq, len(more)):
            return
        start = len(self.tokens[seq])
        self.pool.grow(seq, len(more))
        self.tokens[seq] = self.tokens[seq] + more
        self._write(seq, start)
        self._register(seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        self.pool.fork(parent, child)
        self.tokens[child], self.hashed[child] = list(self.tokens[parent]), self.hashed[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.pool.free_seq(seq)
        del self.tokens[seq], self.hashed[seq]

    @invariant()
    def bookkeeping(self):
        p = self.pool
        holders = [0] * p.num_blocks
        for table in p.tables.values():
            for b in table:
                holders[b] += 1
        assert holders == p.refcount, "reference counts differ from the number of holders"
        used = {b for b in range(p.num_blocks) if holders[b]}
        free, parked = set(p.free), set(p.evictable)
        assert len(free) == len(p.free) and not free & parked, "a block is free twice"
        assert not (free | parked) & used, "a block is both free and in use"
        assert len(free) + len(parked) + len(used) == p.num_blocks, "a block leaked"
        assert all(b in p.block_key for b in parked) and not any(b in p.block_key for b in free)
        assert {b: a for a, b in p.cached.items()} == {b: k[0] for b, k in p.block_key.items()}

    @invariant()
    def every_cached_block_holds_what_its_address_names(self):
        k = self.pool.k[0].view(-1)
        for address, block in self.pool.cached.items():
            start, toks = self.names[address]
            got = k[block * BS:(block + 1) * BS].tolist()
            assert got == [value(t, start + i) for i, t in enumerate(toks)], "a cached block holds other K/V"

    @invariant()
    def every_sequence_reads_its_own_tokens(self):
        k = self.pool.k[0].view(-1)
        for seq, toks in self.tokens.items():
            got = k[self.pool.slots(seq, 0, len(toks))].tolist()
            assert got == [value(t, p) for p, t in enumerate(toks)]

    def teardown(self):
        for seq in list(self.tokens):
            self.pool.free_seq(seq)
        assert self.pool.num_free_blocks == self.pool.num_blocks and not any(self.pool.refcount)


TestCachingPool = CachingPoolMachine.TestCase
TestCachingPool.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
