"""One owner of the block pool: in the engine, only the KV-cache manager changes it."""
import inspect

import pytest

from minillm.engine import LLMEngine
from minillm.kv import BlockPool
from minillm.kv.prefix_cache import PrefixCachingPool
from minillm.sampling import SamplingParams

from test_paged_torch import tiny_model

MUTATORS = ["allocate", "append_slots", "grow", "fork", "truncate", "free_seq", "share", "register"]


@pytest.fixture
def watched(monkeypatch):
    """Every call of a pool mutator, with the file of its caller."""
    calls = []
    for cls in (BlockPool, PrefixCachingPool):
        for name in MUTATORS:
            if name not in vars(cls):
                continue
            original = vars(cls)[name]

            def wrapper(self, *args, _original=original, _name=name, **kwargs):
                caller = inspect.stack()[1]
                if not caller.filename.endswith(("kv/paged.py", "kv/prefix_cache.py")):   # the pool's own calls
                    calls.append((_name, caller.filename))
                return _original(self, *args, **kwargs)
            monkeypatch.setattr(cls, name, wrapper)
    return calls


@pytest.mark.parametrize("caching", [True, False])
def test_only_the_kv_cache_manager_changes_the_pool(tokenizer, watched, caching):
    """Admission with cached prefixes, chunked prompts, preemption, forks (n > 1), drafts accepted and
    rolled back, aborts: every change to the pool comes from kv/manager.py."""
    engine = LLMEngine(tiny_model(), tokenizer, block_size=4, num_blocks=14, max_num_batched_tokens=10,
                       enable_prefix_caching=caching, adaptive_speculation=False,
    speculative="ngram", num_speculative_tokens=3, verbose=False)
    shared = [7, 8, 9, 10, 11, 12, 13, 14, 15]
    engine.add_request("a", shared + [20, 21, 22, 7, 8, 9, 10], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.add_request("b", shared + [30], SamplingParams(max_tokens=10, temperature=1.0, seed=1, ignore_eos=True),
                       n=3)
    engine.add_request("c", shared * 2, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("d", [40, 41, 42], SamplingParams(max_tokens=30, ignore_eos=True))
    finished, steps = set(), 0
    while engine.has_unfinished_requests() and steps < 500:
        finished |= {o.request_id for o in engine.step() if o.finished}
        steps += 1
        if steps == 6:
            engine.abort_request("d")
    assert finished == {"a", "b", "b/1", "b/2", "c", "d"}
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_drafts"] > 0, "the run did not reach every path"
    assert {name for name, _ in watched} >= {"allocate", "grow", "fork", "truncate", "free_seq"}
    assert {f for _, f in watched} == {str(inspect.getsourcefile(__import__("minillm.kv.manager").kv.manager))}
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_engine_config_or_its_fields_as_keywords(tokenizer):
    from minillm.engine import EngineConfig

    model = tiny_model()
    a = LLMEngine(model, tokenizer, EngineConfig(block_size=4, num_blocks=9, max_num_seqs=3), verbose=False)
    b = LLMEngine(model, tokenizer, block_size=4, num_blocks=9, max_num_seqs=3, verbose=False)
    assert a.config == b.config and a.pool.num_blocks == 9 and a.scheduler.max_num_seqs == 3
    with pytest.raises(TypeError):
        LLMEngine(model, tokenizer, max_num_seq=3)                     # a misspelt option is an error


def test_no_runtime_module_but_the_manager_calls_a_pool_mutator():
    """Read the runtime package (all but the course tooling in course/, which replays traces on pools of
    its own): pool mutators are called in kv/manager.py, and in the pool classes themselves, only."""
    import re
    from pathlib import Path

    root = Path(inspect.getsourcefile(BlockPool)).parents[1]                   # minillm/
    call = re.compile(r"\.(%s)\(" % "|".join(MUTATORS))
    owners = {root / "kv" / f for f in ("manager.py", "paged.py", "prefix_cache.py")}
    found = {}
    for path in root.rglob("*.py"):
        if path in owners or "course" in path.relative_to(root).parts:
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if call.search(line) and not re.search(r"\b(kv|self\.kv|engine\.kv|runner\.kv|self\.cache|cache|"
                                                   r"runner|target|r|d)\.(%s)\(" % "|".join(MUTATORS), line):
                found[f"{path.relative_to(root)}:{n}"] = line.strip()
    assert not found, found
