"""Model files as people download them, made here without a hub: small byte-level BPE tokenizers trained
with Hugging Face `tokenizers` the way each family's tokenizer.json describes its own (pre-tokenizer,
normalizer, special tokens, BOS), chat templates written in each family's style, and GGUF files written
with `gguf`'s writer under llama.cpp's names, from a transformers model."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from minillm import pretokenize

CORPUS = Path(__file__).parent.parent / "data" / "tokenizer_corpus.txt"

LLAMA3_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{{- "Cutting Knowledge Date: December 2023\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN2_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen, a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN3_TEMPLATE = """{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == "user" %}{%- set ns.last_query = index %}{%- break %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if message.role == "assistant" and '</think>' in content %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
    {%- endif %}
    {%- if message.role == "assistant" and loop.index0 > ns.last_query %}
        {{- '<|im_start|>' + message.role + '\\n<think>\\n\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

# family -> (GGUF pre-tokenizer name, special tokens, BOS, EOS, BOS added to a text, chat template)
FAMILIES = {
    "llama3": ("llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                             "<|eot_id|>"], "<|begin_of_text|>", "<|eot_id|>", True, LLAMA3_TEMPLATE),
    "qwen2": ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", False, QWEN2_TEMPLATE),
    "qwen3": ("qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>", False, QWEN3_TEMPLATE),
    "smollm": ("smollm", ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_start|>", "<|im_end|>", False, None),
    "gpt2": ("gpt-2", ["<|endoftext|>"], "<|endoftext|>", "<|endoftext|>", False, None),
}
USER_DEFINED = ["<tool_call>", "</tool_call>"]     # added tokens that are not special (Qwen has these)


def train_tokenizer(family: str, vocab_size: int = 700):
    """A `tokenizers.Tokenizer` trained on the test corpus, built as that family's tokenizer.json is."""
    import tokenizers as tk

    pre_name, specials, bos, _, add_bos, _ = FAMILIES[family]
    byte_level = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok = tk.Tokenizer(tk.models.BPE(ignore_merges=family in ("llama3",)))
    if family in ("llama3", "qwen2", "qwen3"):
        pattern = pretokenize.BY_GGUF_NAME[pre_name].pattern
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence([
            tk.pre_tokenizers.Split(tk.Regex(pattern), behavior="isolated", invert=False), byte_level])
    elif family == "smollm":
        tok.pre_tokenizer = tk.pre_tokenizers.Sequence([tk.pre_tokenizers.Digits(individual_digits=True),
                                                        tk.pre_tokenizers.ByteLevel(add_prefix_space=False)])
    else:
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    if family in ("qwen2", "qwen3"):
        tok.normalizer = tk.normalizers.NFC()
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                     initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(CORPUS)], trainer)
    if family.startswith("qwen"):
        tok.add_tokens([tk.AddedToken(t, special=False, normalized=False) for t in USER_DEFINED])
    if add_bos:
        tok.post_processor = tk.processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                              special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def save_tokenizer_folder(tok, family: str, folder: Path) -> Path:
    """tokenizer.json, tokenizer_config.json (special tokens, chat template) and generation_config.json."""
    _, _, bos, eos, _, template = FAMILIES[family]
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
              "clean_up_tokenization_spaces": False, **({"chat_template": template} if template else {})}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.token_to_id(eos)]}))
    return folder


def gguf_vocabulary(tok) -> tuple[list[str], list[str], list[int]]:
    """(tokens in id order, merges as 'a b', GGUF token types) of a trained tokenizer."""
    spec = json.loads(tok.to_str())
    added = {a["content"]: a for a in spec["added_tokens"]}
    ids = {**spec["model"]["vocab"], **{t: a["id"] for t, a in added.items()}}
    tokens = [t for t, _ in sorted(ids.items(), key=lambda kv: kv[1])]
    assert len(tokens) == max(ids.values()) + 1
    types = [(3 if added[t]["special"] else 4) if t in added else 1 for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    return tokens, merges, types


def _llama_cpp_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter's Q/K row order for "llama" (adjacent RoPE pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def write_gguf(path: Path, arch: str, model, tok=None, family: str | None = None, matrix_type=None,
               rope_freqs: np.ndarray | None = None, pre: str | None = None, rope_linear: float | None = None) -> Path:
    """A GGUF file of a transformers model (its weights under llama.cpp's names, 2-D weights in `matrix_type`:
    a GGMLQuantizationType, default F32) and of a trained tokenizer, with llama.cpp's metadata keys.
    RoPE scaling as llama.cpp's converter writes it: llama3 as rope_freqs (one divisor per frequency),
    linear as rope_linear (its factor, in the metadata)."""
    import gguf
    from gguf import GGMLQuantizationType as T

    cfg = model.config
    matrix_type = matrix_type or T.F32
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_name(f"tiny-{arch}")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    w.add_rope_freq_base(float(theta))
    w.add_vocab_size(cfg.vocab_size)
    if tok is not None:
        pre_name, _, bos, eos, add_bos, template = FAMILIES[family]
        tokens, merges, types = gguf_vocabulary(tok)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre or pre_name)
        w.add_token_list(tokens)
        w.add_token_merges(merges)
        w.add_token_types(types)
        if bos:
            w.add_bos_token_id(tok.token_to_id(bos))
        w.add_eos_token_id(tok.token_to_id(eos))
        w.add_add_bos_token(add_bos)
        if template:
            w.add_chat_template(template)
    if rope_linear is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_linear)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, p in model.state_dict().items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        a = p.detach().float().numpy()
        if name.startswith("model.layers."):
            _, _, i, part = name.rsplit(".", 1)[0].split(".", 3)
            gname = f"blk.{i}.{_NAMES[part]}.{name.rsplit('.', 1)[1]}"
            if arch == "llama" and part in ("self_attn.q_proj", "self_attn.k_proj"):
                a = _llama_cpp_rope_rows(a, cfg.num_attention_heads if "q_proj" in part else cfg.num_key_value_heads)
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}[name]
        if a.ndim == 2 and matrix_type != T.F32:
            w.add_tensor(gname, _encode(a, matrix_type), raw_dtype=matrix_type)
        else:
            w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _encode(a: np.ndarray, kind) -> np.ndarray:
    """The bytes of `a` in a GGUF type: quantized by gguf.quants where it can; for the K-quants (which it
    only dequantizes) random codes under fixed float16 scales, a valid block whatever the codes."""
    import gguf
    from gguf import GGMLQuantizationType as T

    if kind not in (T.Q4_K, T.Q5_K, T.Q6_K):
        return gguf.quants.quantize(a, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = np.random.default_rng(0).integers(0, 256, (a.shape[0], a.shape[1] // block, size), dtype=np.uint8)
    half = lambda x: np.frombuffer(np.float16(x).tobytes(), np.uint8)  # noqa: E731
    if kind == T.Q6_K:
        raw[..., -2:] = half(0.002)                                     # d last; int8 scales before it
    else:
        raw[..., 0:2], raw[..., 2:4] = half(0.003), half(0.001)         # d, dmin first
    return raw.reshape(a.shape[0], -1)
