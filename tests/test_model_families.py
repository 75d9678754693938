"""The models people bring, as tiny random-weight folders that transformers writes from each family's config:
the ones minillm accepts give transformers' logits and greedy tokens; the rest are refused in one line."""
import json

import pytest
import torch

import minillm
from minillm.engine import LLMEngine
from minillm.generate import generate
from minillm.quant import quantize_model
from minillm.sampling import SamplingParams
from minillm.tokenizer import Tokenizer, byte_to_unicode

transformers = pytest.importorskip("transformers")

SHAPE = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False)
# head_dim 16, theta 5000: wavelengths 6, 20, 63, 199, ... tokens; with an original context of 64 and
# low/high frequency factors 1/4, llama3 keeps the first, blends the next two and divides the rest
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def tiny(tmp_path, cls=transformers.LlamaConfig, model_cls=transformers.LlamaForCausalLM, **extra):
    torch.manual_seed(0)
    cfg = cls(**SHAPE, **extra)
    ref = model_cls(cfg).eval()
    with torch.no_grad():                      # random norms, so a wrong norm wiring cannot hide
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    return ref, minillm.load_model(tmp_path)


def same_as_transformers(ref, ours, length=48, tok=None):
    """tok: a tokenizer of the model's vocabulary (default: the 97 single bytes of SHAPE's)."""
    ids = torch.randint(0, ref.config.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)
    prompt = ids[0, :20].tolist()
    with torch.no_grad():
        theirs = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              min_new_tokens=24)[0, 20:].tolist()
    tok = tok or Tokenizer([byte_to_unicode()[b] for b in range(97)], [])    # 97 single bytes: ids decode to text
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    for stage in ("naive", "kv", "paged"):
        assert generate(ours, tok, prompt, params, stage=stage).token_ids == theirs, stage
    # the engine: chunked prefill (8 tokens a step), prefix caching (the prompt twice), n-gram speculation
    engine = LLMEngine(ours, tok, block_size=4, num_blocks=64, max_num_batched_tokens=8, adaptive_speculation=False,
                       speculative="ngram",
                       num_speculative_tokens=3, verbose=False)
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done == {"a": theirs, "b": theirs}


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "dynamic", "factor": 2.0}], ids=["llama3", "linear", "dynamic"])
def test_llama_with_rope_scaling_matches_transformers(tmp_path, scaling):
    ref, ours = tiny(tmp_path, rope_theta=5000.0, rope_scaling=scaling)
    if scaling["rope_type"] == "dynamic":     # the same frequencies as no scaling up to max_position_embeddings
        assert ours.cfg.rope_scaling is None and ours.cfg.max_seq_len == 256
    else:
        assert dict(ours.cfg.rope_scaling)["rope_type"] == scaling["rope_type"]
    same_as_transformers(ref, ours)


def test_mistral_with_a_sliding_window_runs_within_it(tmp_path):
    ref, ours = tiny(tmp_path, transformers.MistralConfig, transformers.MistralForCausalLM, sliding_window=64)
    assert ours.cfg.max_seq_len == 64               # within the window, attention is the full causal one
    same_as_transformers(ref, ours, length=64)


def test_qwen2_with_qkv_bias_matches_transformers(tmp_path):
    ref, ours = tiny(tmp_path, transformers.Qwen2Config, transformers.Qwen2ForCausalLM, rope_theta=10000.0)
    assert ours.cfg.qkv_bias and ours.layers[0].attn.wqkv.bias is not None
    same_as_transformers(ref, ours)


def test_qwen3_with_qk_norms_and_a_wide_head_matches_transformers(tmp_path):
    ref, ours = tiny(tmp_path, transformers.Qwen3Config, transformers.Qwen3ForCausalLM, head_dim=32,
                     rope_theta=10000.0)
    assert ours.cfg.qk_norm and ours.cfg.head_dim * ours.cfg.n_heads != ours.cfg.d_model
    same_as_transformers(ref, ours)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_the_native_backend_keeps_what_its_c_block_does_not_compute(tmp_path, family):
    """The C block computes Llama's attention only: a block with a QKV bias or q/k norms keeps PyTorch's, and the
    logits stay the plain model's."""
    from minillm.backends import apply_backend

    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[family]
    ref, ours = tiny(tmp_path, *cls)
    fast = apply_backend(ours, "native")
    assert all(type(b).__name__ == "Block" for b in fast.layers)
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(fast(ids), ref(ids).logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast(ids[:, :1]), ref(ids[:, :1]).logits, rtol=1e-5, atol=1e-5)
    if family == "qwen2":
        with pytest.raises(ValueError, match="bias"):
            quantize_model(ours, "int8")


@pytest.mark.parametrize("config, words", [
    ({"model_type": "smollm3"}, ["smollm3", "no RoPE", "qwen3"]),
    ({"model_type": "mixtral"}, ["mixtral", "supported"]),
    ({"model_type": "llama", "attention_bias": True}, ["attention_bias"]),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, ["longrope", "llama3"]),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, ["yarn"]),
])
def test_the_rest_is_refused_in_one_line(tmp_path, config, words):
    shape = {"num_attention_heads": 4, "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 96,
             "vocab_size": 97}
    (tmp_path / "config.json").write_text(json.dumps(shape | config))
    (tmp_path / "model.safetensors").write_bytes(b"")     # never read: refused from config.json alone
    with pytest.raises(ValueError) as e:
        minillm.load_model(tmp_path)
    assert "\n" not in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
