"""The files people download, made here without a hub (tests/helpers/model_files.py): each family's tokenizer
(tokenizer.json or GGUF) gives Hugging Face `tokenizers`' ids, its chat template renders as transformers
renders it, its GGUF file (llama with llama3 RoPE as rope_freqs, qwen2, qwen3) gives transformers' logits and
greedy tokens at every stage, in the engine and through the server, and every GGUF weight type loads as
`gguf.quants` dequantizes it. What minillm does not read is refused in one line."""
import json
import shutil

import numpy as np
import pytest
import torch

import minillm
from helpers.live_server import live_server
from helpers.model_files import CORPUS, FAMILIES, USER_DEFINED, save_tokenizer_folder, train_tokenizer, write_gguf
from minillm.engine import LLMEngine
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer
from test_model_families import LLAMA3, same_as_transformers

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

TRICKY = ["12345678 90", "don'T I'LL we'Re", "e\u0301 caf\u00e9 \u212b", "a\r\nb\n\n\tc  ", "  \u00a0x", "!!!abc,,,def",
          "<|im_end|>x<|eot_id|>", "<tool_call>{}</tool_call>", "中文 Русский 🚀", "$100.00 ... '''", ""]
CHATS = [[{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "<think>hm</think>\n\nHello!"}, {"role": "user", "content": "Bye ✓"}]]


@pytest.fixture(scope="module")
def trained():
    return {family: train_tokenizer(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def folders(trained, tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {f: save_tokenizer_folder(tok, f, root / f) for f, tok in trained.items()}


@pytest.fixture(scope="module")
def gguf_tokenizers(trained, tmp_path_factory):
    """Each family's tokenizer in a GGUF file (with a one-layer model of its vocabulary, as files come)."""
    root, out = tmp_path_factory.mktemp("gguf_tokenizers"), {}
    for family, tok in trained.items():
        cfg = transformers.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=32,
                                       num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
        out[family] = write_gguf(root / f"{family}.gguf", "llama", transformers.LlamaForCausalLM(cfg), tok, family)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_familys_ids_equal_tokenizers_from_gguf_and_tokenizer_json(trained, folders, gguf_tokenizers, family):
    ref = trained[family]
    text = CORPUS.read_text(encoding="utf-8")
    for ours in (Tokenizer.from_hf_folder(folders[family]), minillm.load_tokenizer(gguf_tokenizers[family])):
        bad = [line[:40] for line in [*text.splitlines(keepends=True), *TRICKY]
               if ours.encode(line) != ref.encode(line, add_special_tokens=False).ids]
        assert not bad, f"{len(bad)} lines differ: {bad[:3]}"
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids
        # a text prompt starts with BOS where the family's tokenizer adds it (Llama 3), as tokenizer(text) does
        assert ours.encode_prompt("Hello 123") == ref.encode("Hello 123").ids
        assert ours.add_bos == (family == "llama3")
        assert ours.decode(ref.encode(text, add_special_tokens=False).ids) == ref.decode(
            ref.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)
    if family.startswith("qwen"):               # added tokens that are not special are matched whole too
        assert [ours.encode(t) for t in USER_DEFINED] == [[ref.token_to_id(t)] for t in USER_DEFINED]


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_chat_templates_render_as_transformers_renders_them(folders, gguf_tokenizers, family):
    hf = transformers.AutoTokenizer.from_pretrained(folders[family])
    for ours in (Tokenizer.from_hf_folder(folders[family]), minillm.load_tokenizer(gguf_tokenizers[family])):
        for chat in CHATS:
            for gen in (True, False):
                text = hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False)
                assert ours.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False) == text
                assert ours.apply_chat_template(chat, add_generation_prompt=gen) == \
                    hf.apply_chat_template(chat, add_generation_prompt=gen, tokenize=True, return_dict=False)
        assert ours.stop_ids >= {ours.special_tokens[FAMILIES[family][3]]}
    if family == "llama3":                      # the template's own refusal, as one line
        with pytest.raises(ValueError, match="alternate"):
            ours.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_a_model_without_a_chat_template_says_so(folders):
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_hf_folder(folders["gpt2"]).apply_chat_template(CHATS[0])


def _tiny(family, vocab_size, hidden=64, layers=2, **extra):
    cls = {"llama3": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3"}[family]
    torch.manual_seed(0)
    shape = dict(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=96 if hidden == 64 else hidden,
                 num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                 rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=5000.0)
    cfg = getattr(transformers, f"{cls}Config")(**shape, **extra)
    ref = getattr(transformers, f"{cls}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return ref


@pytest.fixture(scope="module")
def gguf_models(trained, tmp_path_factory):
    """family -> (transformers model, its GGUF file with the family's tokenizer)."""
    root, out = tmp_path_factory.mktemp("gguf_models"), {}
    for family, extra in (("llama3", {"rope_scaling": LLAMA3}), ("qwen2", {}), ("qwen3", {"head_dim": 32})):
        tok = trained[family]
        ref = _tiny(family, tok.get_vocab_size(), **extra)
        arch, freqs = {"llama3": "llama"}.get(family, family), None
        if family == "llama3":     # llama.cpp's converter stores llama3 scaling as one divisor per frequency
            base = 1.0 / 5000.0 ** (np.arange(0, 16, 2) / 16)
            freqs = base / ref.model.rotary_emb.inv_freq.numpy()
        out[family] = ref, write_gguf(root / f"{family}.gguf", arch, ref, tok, family, rope_freqs=freqs)
    return out


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_gguf_files_of_each_architecture_give_transformers_tokens(gguf_models, family):
    ref, path = gguf_models[family]
    ours, tok = minillm.load_model(path), minillm.load_tokenizer(path)
    assert (ours.cfg.qkv_bias, ours.cfg.qk_norm) == (family == "qwen2", family == "qwen3")
    assert ours.cfg.rope_scaling is None or dict(ours.cfg.rope_scaling)["rope_type"] == "freq_factors"
    same_as_transformers(ref, ours, tok=tok)


def test_gguf_linear_rope_scaling_from_the_metadata(trained, tmp_path):
    tok = trained["llama3"]
    ref = _tiny("llama3", tok.get_vocab_size(), rope_scaling={"rope_type": "linear", "factor": 4.0})
    path = write_gguf(tmp_path / "linear.gguf", "llama", ref, tok, "llama3", rope_linear=4.0)
    ours = minillm.load_model(path)
    assert dict(ours.cfg.rope_scaling) == {"rope_type": "linear", "factor": 4.0}
    same_as_transformers(ref, ours, tok=minillm.load_tokenizer(path))


def test_serve_answers_each_family_with_its_template_and_tokens(gguf_models):
    openai = pytest.importorskip("openai")
    models = {f: (minillm.load_model(p), minillm.load_tokenizer(p)) for f, (_, p) in gguf_models.items()}
    chat = [{"role": "user", "content": "Hi there"}]
    for family, (model, tok) in models.items():
        with live_server(model, tok, family, max_model_len=256) as (url, _, _):
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
            ids = tok.apply_chat_template(chat)
            engine = LLMEngine(model, tok, kv_cache_memory=16 << 20, verbose=False)
            engine.add_request("r", ids, SamplingParams(max_tokens=12))
            ref = []
            while engine.has_unfinished_requests():
                ref += [o for o in engine.step() if o.finished]
            got = client.chat.completions.create(model=family, messages=chat, max_tokens=12, temperature=0)
            assert got.usage.prompt_tokens == len(ids)
            assert got.choices[0].message.content == ref[0].text
            # a completion's text prompt starts with BOS where the family adds one
            n = client.completions.create(model=family, prompt="Hello 123", max_tokens=1).usage.prompt_tokens
            assert n == len(tok.encode_prompt("Hello 123")) == len(tok.encode("Hello 123")) + (family == "llama3")


TYPES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"]


@pytest.mark.parametrize("kind", TYPES)
def test_every_weight_type_loads_as_gguf_dequantizes_it(tmp_path, kind):
    """2-D weights stored in `kind` (K-quants need rows of 256): minillm's weights are gguf.quants' dequantized
    values (Q/K rows back in rotate-half order); the model runs; only Q4_1 has the file's-own-blocks path."""
    from minillm.weights import gguf_reader, load_state, unpermute_rope_rows

    ref = _tiny("llama3", 97, hidden=256, layers=1)
    path = write_gguf(tmp_path / f"{kind}.gguf", "llama", ref, matrix_type=gguf.GGMLQuantizationType[kind])
    cfg, state, _ = load_state(path)
    for t in gguf_reader(path.resolve()).tensors:
        want = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        want = want.reshape([int(d) for d in reversed(t.shape)])
        if t.name.endswith(("attn_q.weight", "attn_k.weight")):
            want = unpermute_rope_rows(want, 4 if "attn_q" in t.name else 2)
        name = {"token_embd.weight": "tok_emb.weight", "output.weight": "lm_head.weight"}.get(t.name)
        if name:
            assert torch.equal(state[name], want)
    layer = "layers.0.attn.wq.weight"
    q = next(t for t in gguf_reader(path.resolve()).tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type.name == kind
    want = torch.from_numpy(np.array(gguf.quants.dequantize(q.data, q.tensor_type), dtype=np.float32)).reshape(256, 256)
    assert torch.equal(state[layer], unpermute_rope_rows(want, 4))
    model = minillm.load_model(path)
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]]))).all()
    if kind == "Q4_1":
        fast = minillm.load_model(path, quant="q4_file")
        with torch.no_grad():
            torch.testing.assert_close(fast(torch.tensor([[5]])), model(torch.tensor([[5]])), rtol=0.05, atol=0.05)
    else:
        with pytest.raises(ValueError, match="Q4_1"):
            minillm.load_model(path, quant="q4_file")


def test_what_minillm_does_not_read_is_refused_in_one_line(trained, folders, gguf_tokenizers, tmp_path):
    cases = []
    # an unknown pre-tokenizer in a GGUF file, never guessed
    ref = _tiny("qwen2", trained["qwen2"].get_vocab_size(), layers=1)
    cases.append((lambda: minillm.load_tokenizer(write_gguf(tmp_path / "p.gguf", "qwen2", ref, trained["qwen2"], "qwen2",
                                                            pre="deepseek-llm")), ["deepseek-llm", "qwen2"]))
    # tokenizer.json with another pre-tokenizer (SentencePiece's Metaspace) or a BPE with byte fallback
    meta = shutil.copytree(folders["qwen2"], tmp_path / "metaspace")
    spec = json.loads((meta / "tokenizer.json").read_text())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    (meta / "tokenizer.json").write_text(json.dumps(spec))
    cases.append((lambda: Tokenizer.from_hf_folder(meta), ["Metaspace", "not supported"]))
    fallback = shutil.copytree(folders["qwen2"], tmp_path / "fallback")
    spec = json.loads((fallback / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = True
    (fallback / "tokenizer.json").write_text(json.dumps(spec))
    cases.append((lambda: Tokenizer.from_hf_folder(fallback), ["byte-level BPE"]))
    # a GGUF architecture it does not compute, and a llama file with experts
    moe = tmp_path / "moe.gguf"
    w = gguf.GGUFWriter(str(moe), "qwen3moe")
    w.add_block_count(1)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    cases.append((lambda: minillm.load_model(moe), ["qwen3moe", "mixture of experts", "llama, qwen2, qwen3"]))
    for call, words in cases:
        with pytest.raises(ValueError) as e:
            call()
        assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_a_downloaded_folder_serves_from_the_command_line(trained, tmp_path):
    """A Qwen3 folder as the hub ships one: bfloat16 safetensors in shards with an index, the tokenizer files, a
    vocabulary padded past the tokenizer's; `python -m minillm serve --model NAME=FOLDER` answers with the
    tokens transformers gives for those weights, on the model's own chat template."""
    openai = pytest.importorskip("openai")
    from minillm.course.launch_server import ServerProcess

    tok = trained["qwen3"]
    ref = _tiny("qwen3", tok.get_vocab_size() + 6, head_dim=32).to(torch.bfloat16)
    ref.save_pretrained(tmp_path, max_shard_size="100KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    save_tokenizer_folder(tok, "qwen3", tmp_path)
    ours = Tokenizer.from_hf_folder(tmp_path)
    assert ours.vocab_size == ref.config.vocab_size and ours.decode([ref.config.vocab_size - 1]) == ""
    from minillm.structured import _Vocabulary     # a grammar never offers an unused id as text
    assert len(ours.unused_ids) == 6 and ours.unused_ids <= set(_Vocabulary(ours).special_token_ids)
    chat = [{"role": "user", "content": "Hi there"}]
    ids = ours.apply_chat_template(chat)
    with torch.no_grad():
        want = ref.float().generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                                    do_sample=False)[0, len(ids):].tolist()
    with ServerProcess.minillm(["--model", f"qwen={tmp_path}", "--threads", "1", "--max-model-len", "256"]) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        got = client.completions.create(model="qwen", prompt=ids, max_tokens=8, temperature=0, logprobs=0)
        chat_answer = client.chat.completions.create(model="qwen", messages=chat, max_tokens=8, temperature=0)
    assert got.usage.completion_tokens == 8 and got.choices[0].text == ours.decode(want)
    assert chat_answer.usage.prompt_tokens == len(ids) and chat_answer.choices[0].message.content == ours.decode(want)
