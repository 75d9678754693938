"""The generation loop: stopping, streaming, limits."""
import pytest

from minillm.generate import Generation, generate, make_runner, stream
from minillm.sampling import SamplingParams


def test_stream_pieces_add_up_to_the_text(model, tokenizer):
    ids = tokenizer.encode("The three primary colors are")
    result = Generation(prompt_tokens=len(ids))
    pieces = list(stream(model, tokenizer, ids, SamplingParams(max_tokens=12), result=result))
    assert "".join(pieces) == result.text == tokenizer.decode(result.token_ids)
    assert len(result.token_ids) == 12 and result.finish_reason == "length"
    assert result.ttft_s > 0 and len(result.token_times_s) == 12


def test_stop_string_ends_generation_and_is_not_emitted(model, tokenizer):
    ids = tokenizer.encode("1, 2, 3, 4, 5, 6, 7,")
    free = generate(model, tokenizer, ids, SamplingParams(max_tokens=12))
    assert " 9," in free.text, free.text  # the model counts on
    result = Generation(prompt_tokens=len(ids))
    pieces = list(stream(model, tokenizer, ids, SamplingParams(max_tokens=12, stop=[" 9,"]), result=result))
    assert result.finish_reason == "stop"
    assert result.text == free.text[:free.text.index(" 9,")]
    assert "".join(pieces) == result.text


def test_sampling_with_seed_is_reproducible(model, tokenizer):
    ids = tokenizer.encode("My favourite animal is")
    p = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7)
    assert generate(model, tokenizer, ids, p).token_ids == generate(model, tokenizer, ids, p).token_ids


def test_generation_stops_at_the_context_length(model, tokenizer):
    ids = tokenizer.encode("word " * 10)
    short = type(model.cfg)(**{**{f: getattr(model.cfg, f) for f in model.cfg.__dataclass_fields__},
                               "max_seq_len": len(ids) + 3})
    original = model.cfg
    model.cfg = short
    try:
        out = generate(model, tokenizer, ids, SamplingParams(max_tokens=50))
    finally:
        model.cfg = original
    assert len(out.token_ids) <= 3 and out.finish_reason in ("length", "stop")


def test_bad_prompts_are_clear_errors(model, tokenizer):
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, tokenizer, [], SamplingParams())
    with pytest.raises(ValueError, match="shorten it"):
        generate(model, tokenizer, [1] * model.cfg.max_seq_len, SamplingParams())
    with pytest.raises(ValueError, match="unknown stage 'warp'; choose one of: naive, kv, flash, paged"):
        make_runner(model, "warp")
