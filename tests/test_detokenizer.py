"""One stop rule for every way of generating: end token, stop strings, length, held-back text."""
import subprocess
import sys

from minillm.detokenizer import IncrementalDetokenizer
from minillm.sampling import SamplingParams


def feed(tokenizer, ids, **params):
    """Push ids until the sequence ends; (detokenizer, the pieces take() released after each push)."""
    d = IncrementalDetokenizer(tokenizer, SamplingParams(**params), params.get("max_tokens", 16))
    pieces = []
    for t in ids:
        d.push(t)
        pieces.append(d.take())
        if d.done:
            break
    return d, pieces


def test_length_and_end_token(tokenizer):
    ids = tokenizer.encode("one two three four")
    d, pieces = feed(tokenizer, ids, max_tokens=3)
    assert d.finish_reason == "length" and d.token_ids == ids[:3] and "".join(pieces) == tokenizer.decode(ids[:3])
    eos = next(iter(tokenizer.stop_ids))
    d, _ = feed(tokenizer, ids[:2] + [eos] + ids[2:])
    assert d.finish_reason == "stop" and d.token_ids == ids[:2]          # the end token is not kept
    d, _ = feed(tokenizer, ids[:2] + [eos] + ids[2:], ignore_eos=True)
    assert d.finish_reason is None and d.token_ids == ids[:2] + [eos] + ids[2:]


def test_stop_string_cuts_the_text_and_is_never_shown(tokenizer):
    ids = tokenizer.encode("1, 2, 3, 4, 5, 6")
    d, pieces = feed(tokenizer, ids, stop=[", 4"])
    assert d.finish_reason == "stop" and d.text == "1, 2, 3"
    assert tokenizer.decode(d.token_ids).startswith("1, 2, 3, 4")       # the completing token is kept
    assert "".join(pieces) == d.text and ", 4" not in "".join(pieces)


def test_held_back_text_is_released_when_it_is_not_a_stop(tokenizer):
    ids = tokenizer.encode("a, b, c")
    d, pieces = feed(tokenizer, ids, stop=[", x"], max_tokens=len(ids))
    assert d.finish_reason == "length" and "".join(pieces) == d.text == "a, b, c"


def test_taking_everything_releases_the_held_tail(tokenizer):
    ids = tokenizer.encode("a, b,")
    d, pieces = feed(tokenizer, ids, stop=[", x"])
    assert not d.done and "".join(pieces) + d.take(everything=True) == "a, b,"


def test_a_static_batch_ends_each_sequence_at_its_stop_string(model, tokenizer):
    """Static batching uses the same rule: tokens after a stop string are not kept (they were, once)."""
    from minillm.generate import generate, generate_batch

    prompts = [tokenizer.encode("1, 2, 3, 4, 5, 6, 7,"), tokenizer.encode("The capital of France is")]
    params = SamplingParams(max_tokens=8, stop=[" 9,"])
    batch = generate_batch(model, tokenizer, prompts, params, stage="kv")
    alone = [generate(model, tokenizer, p, params, stage="kv") for p in prompts]
    assert batch[0].finish_reason == "stop" and " 9," not in batch[0].text
    assert [(o.token_ids, o.text, o.finish_reason) for o in batch] == \
        [(o.token_ids, o.text, o.finish_reason) for o in alone]


def test_import_minillm_loads_no_engine_and_configures_no_logging():
    code = ("import logging, sys, minillm\n"
            "assert not [m for m in sys.modules if m.startswith(('minillm.engine', 'minillm.server'))]\n"
            "assert not logging.getLogger('minillm').handlers and not logging.getLogger().handlers\n"
            "assert minillm.LLM.__module__ == 'minillm.engine.llm'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_the_engine_imports_alone():
    """No import cycle: each package imports first in a fresh interpreter."""
    for mod in ("minillm.engine", "minillm.server", "minillm.generate", "minillm.speculative"):
        r = subprocess.run([sys.executable, "-c", f"import {mod}"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, f"{mod}: {r.stderr}"


def test_engine_outputs_are_deltas_that_add_up(model, tokenizer):
    """Each step's output carries what is new; the whole answer is built only when asked for."""
    from minillm.engine import LLMEngine

    engine = LLMEngine(model, tokenizer, kv_cache_memory=16 << 20, verbose=False)
    engine.add_request("count", tokenizer.encode("1, 2, 3, 4, 5, 6, 7,"), SamplingParams(max_tokens=10, stop=[" 9,"]))
    engine.add_request("free", tokenizer.encode("The capital of France is"), SamplingParams(max_tokens=6))
    seen = {"count": [], "free": []}
    while engine.has_unfinished_requests():
        for o in engine.step():
            seen[o.request_id].append(o)
    for outs in seen.values():
        last = outs[-1]
        assert last.finished and sum((o.new_token_ids for o in outs), []) == last.token_ids
        assert "".join(o.new_text for o in outs) == last.text
        assert all(o.text == last.text[:len(o.text)] and len(o.token_ids) == i + 1 for i, o in enumerate(outs))
    assert seen["count"][-1].finish_reason == "stop" and " 9," not in seen["count"][-1].text
