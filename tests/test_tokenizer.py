"""The tiktoken tokenizer against a faithful reference on a varied corpus.

The reference is Hugging Face `tokenizers` built from the same vocabulary and merges
with SmolLM2's original pre-tokenizer (each digit alone, then GPT-2 byte-level).
(transformers' own GGUF tokenizer drops the digit split, so it is not faithful.)
"""
from pathlib import Path

import pytest

CORPUS = Path(__file__).parent / "data" / "tokenizer_corpus.txt"


@pytest.fixture(scope="module")
def reference():
    tk = pytest.importorskip("tokenizers")
    from minillm.weights import find_model, gguf_reader

    r = gguf_reader(find_model().resolve())
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    types = r.fields["tokenizer.ggml.token_type"].contents()
    ref = tk.Tokenizer(tk.models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ", 1)) for m in merges]))
    ref.pre_tokenizer = tk.pre_tokenizers.Sequence([
        tk.pre_tokenizers.Digits(individual_digits=True),
        tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    ref.decoder = tk.decoders.ByteLevel()
    ref.add_special_tokens([tk.AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    return ref


def test_corpus_is_big_and_varied():
    text = CORPUS.read_text(encoding="utf-8")
    assert len(text.encode()) >= 20_000
    for needle in ["def ", "123456789", "     ", "中文", "Русский", "🚀", "<|im_start|>", "\t"]:
        assert needle in text


def test_ids_match_reference_on_corpus(tokenizer, reference):
    text = CORPUS.read_text(encoding="utf-8")
    mismatched = []
    for line in text.splitlines(keepends=True):
        ours, ref = tokenizer.encode(line), reference.encode(line).ids
        if ours != ref:
            mismatched.append((line[:60], ours[:12], ref[:12]))
    assert not mismatched, f"{len(mismatched)} lines differ, first: {mismatched[:3]}"
    assert tokenizer.encode(text) == reference.encode(text).ids  # whole text at once too


@pytest.mark.parametrize("text", [
    "12345", "a1b2", " 42", "x  7", "3.14159", "  \n  9", "٣٤ ५", "hello   world", "it's", "I'LL",
    "\u00a0\u2003 spaces", "🙂🙃", "<|im_end|>x<|endoftext|>", "<|im_start |>", "",
])
def test_tricky_strings_match_reference(tokenizer, reference, text):
    assert tokenizer.encode(text) == reference.encode(text).ids


def test_decode_round_trips_corpus(tokenizer):
    text = CORPUS.read_text(encoding="utf-8")
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_digits_are_split_one_by_one(tokenizer):
    pieces = [tokenizer.id_to_piece(i) for i in tokenizer.encode("year 2026")]
    assert pieces == ["year", "Ġ", "2", "0", "2", "6"]


def test_special_tokens_single_ids(tokenizer):
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("<|im_end|>") == [2]
    assert tokenizer.encode("<|endoftext|>") == [0]
    assert len(tokenizer.encode("<|im_end|>", allow_special=False)) > 1
    assert {0, 2} <= tokenizer.stop_ids


def test_out_of_range_ids_are_a_clear_error(tokenizer):
    with pytest.raises(ValueError, match="token ids must be in"):
        tokenizer.decode([tokenizer.vocab_size])


def test_stream_decoder_never_emits_half_a_character(tokenizer):
    text = "naïve €5 → 🚀🇫🇷 中文 done"
    ids = tokenizer.encode(text)
    dec = tokenizer.stream_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # at least one multi-byte character really is split across tokens here
    assert any(p == "" for p in pieces[:-1])


def test_chat_template_matches_the_gguf_jinja_template(tokenizer):
    jinja2 = pytest.importorskip("jinja2")
    from minillm.weights import find_model, gguf_reader

    template = gguf_reader(find_model().resolve()).fields["tokenizer.chat_template"].contents()
    for messages in (
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}],
    ):
        for gen in (True, False):
            expected = jinja2.Template(template).render(messages=messages, add_generation_prompt=gen)
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=gen, tokenize=False) == expected
            assert tokenizer.apply_chat_template(messages, add_generation_prompt=gen) == tokenizer.encode(expected)


def test_chat_template_rejects_bad_messages(tokenizer):
    with pytest.raises(ValueError, match="role"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "x"}])
