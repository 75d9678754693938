"""The scheduler's bookkeeping under random traffic (hypothesis), with a cheap fake model.

The fake model's next token is a fixed function of the tokens so far, so every request's
right output is known in advance. It also checks the pool: each step it reads every request's
earlier tokens back through its block table (the K of slot s holds value(token, position)), and
writes the new ones. Prompts are drawn from a few shared prefixes, so the prefix cache hits,
evicts and is shared. After every step: the token and sequence budgets hold, no block is leaked
or both free and in use, reference counts equal holders, every block reachable by a content
address holds exactly the K/V of the tokens that address names, emitted tokens never change
(preemption recomputes the same ones), admission is first come, first served (preempted requests
wait in front of new ones); at the end every request has finished and the pool is whole again.
"""
from types import SimpleNamespace

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minillm.config import ModelConfig
from minillm.engine import LLMEngine
from minillm.engine.request import Status
from minillm.kv.prefix_cache import chain_hashes
from minillm.sampling import SamplingParams

TINY = ModelConfig(n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, head_dim=2, ffn_dim=8, vocab_size=64,
                   max_seq_len=4096)


PREFIXES = [[3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25], [3, 5, 7, 9, 2, 4], [40, 41, 42, 43, 44, 45, 46, 47]]


def value(token: int, position: int) -> float:
    return float(token * 4096 + position + 1)


def next_token(tokens: list[int]) -> int:
    return (sum(tokens) * 7 + len(tokens)) % 60 + 2


def expected_output(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(next_token(toks))
    return toks[len(prompt):]


class FakeRunner:
    """Stands in for ModelRunner: checks what the pool holds, writes markers, returns logits."""

    def __init__(self, pool):
        self.pool = pool

    def execute(self, batch):
        k = self.pool.k[0].view(-1)                                  # (slots * n_kv * hd,), n_kv * hd = 2
        rows = []
        for req, n in zip(batch.requests, batch.num_new_tokens):
            start, toks = req.num_computed_tokens, req.all_token_ids
            assert 1 <= n and start + n <= req.num_tokens
            assert self.pool.lengths[req.request_id] == start + n, "blocks for the step were not reserved"
            if start:
                old = self.pool.slots(req.request_id, 0, start)
                assert k[old * 2].tolist() == [value(t, p) for p, t in enumerate(toks[:start])], \
                    "the pool lost a request's K/V"
            new = self.pool.slots(req.request_id, start, start + n)
            k[new * 2] = torch.tensor([value(t, start + i) for i, t in enumerate(toks[start:start + n])])
            if start + n == req.num_tokens:
                logits = torch.zeros(TINY.vocab_size)
                logits[next_token(toks)] = 1.0
                rows.append(logits)
        return torch.stack(rows) if rows else torch.zeros(0, TINY.vocab_size)


class EngineMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 24), block_size=st.sampled_from([1, 2, 4]), budget=st.integers(1, 40),
                max_seqs=st.integers(1, 6), policy=st.sampled_from(["continuous", "static"]),
                chunked=st.booleans(), caching=st.booleans())
    def start(self, num_blocks, block_size, budget, max_seqs, policy, chunked, caching):
        model = SimpleNamespace(cfg=TINY, dtype=torch.float32, device=torch.device("cpu"))
        opts = dict(num_blocks=num_blocks, block_size=block_size, max_num_batched_tokens=budget, verbose=False,
                    max_num_seqs=max_seqs, policy=policy, enable_chunked_prefill=chunked,
                    enable_prefix_caching=caching)
        if not chunked:
            opts["max_model_len"] = budget
        self.engine = LLMEngine(model, self.tokenizer, **opts)
        self.engine.runner = FakeRunner(self.engine.pool)
        self.budget, self.max_seqs = budget, max_seqs
        self.next_id = 0
        self.expected: dict[int, list[int]] = {}    # accepted request -> its whole right output
        self.emitted: dict[int, list[int]] = {}     # what the engine said so far
        self.finished: dict[int, str] = {}
        self.admitted: set[int] = set()            # left the queue at least once
        self.names: dict[bytes, tuple[int, tuple]] = {}   # content address -> (first position, tokens)

    tokenizer = None   # set in the test function (the real one: tokens below 64 decode fine)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), cut=st.integers(0, 12),
          tail=st.lists(st.integers(2, 63), max_size=18), max_tokens=st.integers(1, 10))
    def add(self, prefix, cut, tail, max_tokens):
        prompt = PREFIXES[prefix][:cut] + tail or [2]
        rid, self.next_id = self.next_id, self.next_id + 1
        e = self.engine
        try:
            e.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        except ValueError:
            assert len(prompt) >= e.max_len, "a prompt that fits was refused"
            return
        n = min(max_tokens, e.max_len - len(prompt))
        self.expected[rid] = expected_output(prompt, n)

    @rule()
    def step(self):
        self._step()

    @precondition(lambda self: self.expected.keys() - self.finished.keys())
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.expected.keys() - self.finished.keys())))
        assert self.engine.abort_request(rid)
        self.finished[rid] = "abort"

    def _step(self):
        e = self.engine
        never_admitted = [r.request_id for r in e.scheduler.waiting if r.request_id not in self.admitted]
        for r in e.requests.values():       # what every address this step can register names
            toks = r.all_token_ids
            for j, h in enumerate(chain_hashes(toks, e.pool.block_size)):
                self.names[h] = (j * e.pool.block_size, tuple(toks[j * e.pool.block_size:(j + 1) * e.pool.block_size]))
        outs = e.step()
        s = e.stats()
        assert s["tokens_last_step"] <= self.budget and s["running"] <= self.max_seqs
        still_waiting = {r.request_id for r in e.scheduler.waiting}
        now = [rid for rid in never_admitted if rid not in still_waiting]
        assert now == never_admitted[:len(now)], "a request was admitted before one that arrived earlier"
        self.admitted.update(now)
        for o in outs:
            before = self.emitted.get(o.request_id, [])
            assert o.token_ids[:len(before)] == before, "emitted tokens changed"
            self.emitted[o.request_id] = o.token_ids
            if o.finished:
                if o.finish_reason != "abort":
                    assert o.token_ids == self.expected[o.request_id] and o.finish_reason == "length"
                self.finished[o.request_id] = o.finish_reason
        for rid, toks in self.emitted.items():
            assert toks == self.expected[rid][:len(toks)], "a wrong token was emitted"
        bs = e.pool.block_size
        k = e.pool.k[0].view(-1)
        for address, block in getattr(e.pool, "cached", {}).items():
            start, toks = self.names[address]
            got = k[(block * bs + torch.arange(bs)) * 2].tolist()
            assert got == [value(t, start + i) for i, t in enumerate(toks)], "a cached block holds other K/V"

    @invariant()
    def pool_is_consistent(self):
        e = getattr(self, "engine", None)
        if e is None:
            return
        pool, sched = e.pool, e.scheduler
        held = {r.request_id for r in sched.running}
        assert set(pool.tables) == held, "blocks held by a request that is not running"
        assert all(r.status is Status.WAITING for r in sched.waiting)
        holders = [0] * pool.num_blocks
        for table in pool.tables.values():
            for b in table:
                holders[b] += 1
        assert holders == pool.refcount, "reference counts differ from the number of holders"
        used = {b for b, n in enumerate(holders) if n}
        free, parked = set(pool.free), set(getattr(pool, "evictable", ()))
        assert len(free) == len(pool.free) and not free & parked, "a block freed twice"
        assert not (free | parked) & used, "a block is both free and in use"
        assert len(used) + pool.num_free_blocks == pool.num_blocks, "a block leaked"

    @invariant()
    def preempted_requests_wait_in_front(self):
        e = getattr(self, "engine", None)
        if e is None:
            return
        seen_new = False
        for r in e.scheduler.waiting:
            seen_new = seen_new or r.request_id not in self.admitted
            assert not (seen_new and r.request_id in self.admitted), "a preempted request queued behind a new one"

    def teardown(self):
        e = getattr(self, "engine", None)
        if e is None:
            return
        for _ in range(5000):
            if not e.has_unfinished_requests():
                break
            self._step()
        assert not e.has_unfinished_requests(), "some request never finished"
        event(f"preempted: {e.stats()['num_preemptions'] > 0}")
        event(f"aborted: {'abort' in self.finished.values()}")
        assert set(self.finished) == set(self.expected)
        assert e.pool.num_free_blocks == e.pool.num_blocks and not e.pool.tables


def test_engine_bookkeeping_under_random_traffic(tokenizer):
    EngineMachine.tokenizer = tokenizer
    EngineMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
    EngineMachine.TestCase().runTest()


def test_simulate_shows_the_static_bubble():
    from minillm.course.simulate import predicted_seconds, simulate

    prompts, outputs = [3, 3, 3, 3], [10, 2, 2, 2]
    runs = {p: simulate(prompts, outputs, policy=p, max_num_seqs=2) for p in ("static", "continuous")}
    for steps in runs.values():
        served = {}
        for s in steps:
            for rid, n in s.tokens.items():
                served[rid] = served.get(rid, 0) + n
        assert served == {str(i): p + o - 1 for i, (p, o) in enumerate(zip(prompts, outputs))}
    # static: request 0's batch lasts 10 steps, then the second batch 2; continuous overlaps them
    assert len(runs["static"]) == 12 and len(runs["continuous"]) == 10
    # priced: 4 steps of 2 or more tokens at 1.5 s, 8 single-token steps at 1 s
    assert predicted_seconds(runs["static"], [1, 2], [1.0, 1.5]) == 4 * 1.5 + 8 * 1.0


def test_drafts_are_set_once_before_the_rows_are_planned():
    """The speculator's one hand-off: request i computes its sampled token and up to its room in drafts,
    and only before anything has read the batch's rows."""
    from types import SimpleNamespace

    import pytest

    from minillm.engine.request import Request
    from minillm.engine.scheduler import ScheduledBatch
    from minillm.sampling import SamplingParams

    batch = ScheduledBatch()
    req = Request("a", [1, 2, 3], SamplingParams(), output=SimpleNamespace(token_ids=[7]), num_computed_tokens=3)
    batch.add(req, 1 + 3, spec=3)
    with pytest.raises(ValueError, match="room for 3 drafts, not 4"):
        batch.set_drafts(0, 4)
    batch.set_drafts(0, 1)
    assert batch.num_new_tokens == [2]
    batch.logit_rows
    with pytest.raises(RuntimeError, match="already planned"):
        batch.set_drafts(0, 0)


def test_priced_steps_splits_a_replay_into_decode_and_prompt_steps(tokenizer):
    """Notebook 07 prices the steps the engine really ran: each timeline entry says its tokens and its
    requests, so a step that carries prompt tokens is told from one that only decodes."""
    import pytest

    from minillm.course.bench_serve import WorkItem, replay_engine
    from minillm.course.simulate import priced_steps
    from minillm.model import Transformer

    timeline = [(1.0, 2, 0, 10, 2), (1.5, 2, 0, 2, 2), (1.75, 1, 0, 2, 2), (2.0, 0, 0, 0, 0)]
    got = priced_steps(timeline, [1, 10], [0.1, 1.0])
    assert got["with a prompt"] == {"steps": 1, "measured_s": 1.0, "priced_s": 1.0}
    assert got["decode only"]["steps"] == 2 and got["decode only"]["measured_s"] == pytest.approx(0.75)
    assert got["decode only"]["priced_s"] == pytest.approx(0.4)

    cfg = ModelConfig(n_layers=1, d_model=32, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64, vocab_size=tokenizer.vocab_size)
    engine = LLMEngine(Transformer(cfg).eval(), tokenizer, max_num_seqs=2, kv_cache_memory=1 << 20, verbose=False)
    items = [WorkItem(str(i), [5, 6, 7, 8][: 2 + i], 3 + i, 0.0) for i in range(3)]
    rep = replay_engine(engine, items, progress=False)
    kinds = priced_steps(rep.timeline, [1, 10], [0.1, 1.0])
    assert sum(k["steps"] for k in kinds.values()) == sum(1 for x in rep.timeline if x[3])
    assert kinds["with a prompt"]["steps"] >= 2          # two admissions at least: the first two, then the third
    assert all(x[3] == x[4] or x[3] > x[4] for x in rep.timeline)   # tokens >= requests in every step
