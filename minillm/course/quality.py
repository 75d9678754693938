"""How far a quantized model moves from its float32 original, on text neither was tuned on.

    reference = next_token_logprobs(model_fp32, ids)        # (T, vocab) log-probabilities, once
    compare(reference, next_token_logprobs(model_q, ids), ids)
        -> {"kl": mean KL(p_fp32 || p_q), "top1": agreement of argmaxes, "ppl": perplexity of the text
            under the quantized model, "ppl_ref": under float32}

KL divergence says how much the whole next-token distribution moved (0 = not at all); top-1 agreement
is what greedy decoding sees; perplexity, exp(mean negative log-likelihood of the real next tokens),
says whether the model got worse at the text or only different.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..attention import sdpa_attention
from ..kv import CachedAttention, KVCache
from ..quant.linear import eight_bit_sums_overflow

HELDOUT = Path(__file__).resolve().parents[2] / "data" / "heldout.txt"

# How far each format may move from float32: mean KL on the held-out text. Measured (first 256 tokens):
# bfloat16 0.001, int8 0.006, w8a8 0.018 (0.059 with 7-bit activations, on x86 CPUs without AVX512-VNNI),
# q4_file 0.003, q4 0.31 (groups of 64 re-quantized from weights that sit on the file's grid of 32: a real
# loss, measured, not a fault). The bounds leave room for other CPUs' rounding; a format past its bound is
# broken on this machine, and the benchmarks refuse to report its speed.
KL_BOUND = {"float16": 0.005, "bfloat16": 0.005, "int8": 0.02, "w8a8": 0.12 if eight_bit_sums_overflow() else 0.05,
            "q4": 0.5, "q4_file": 0.01}


def heldout_ids(tokenizer, path: str | Path = HELDOUT, max_tokens: int | None = None) -> list[int]:
    """The held-out text's token ids (its first max_tokens)."""
    ids = tokenizer.encode(Path(path).read_text())
    return ids[:max_tokens] if max_tokens else ids


@torch.inference_mode()
def next_token_logprobs(model, ids: list[int], kv_cache_dtype: str | None = None) -> torch.Tensor:
    """(T, vocab) float32 log-softmax of the model's prediction after each token of `ids`, one pass.
    kv_cache_dtype: attention reads K/V back from a cache stored that way (as every decode step would)."""
    x = torch.tensor([ids], device=model.device)
    attn = None
    if kv_cache_dtype:
        cache = KVCache(model.cfg, 1, len(ids), model.dtype, model.device, kv_cache_dtype)
        positions, mask = cache.begin(len(ids))
        attn = CachedAttention(cache, sdpa_attention, mask)
    logits = model(x, attn=attn)[0].float().cpu()                            # (T, vocab), our own copy
    return logits.sub_(logits.logsumexp(dim=-1, keepdim=True))               # log-softmax in place


def compare(ref: torch.Tensor, other: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """ref, other: (T, vocab) log-probabilities for the same ids."""
    kl = torch.cat([(r.exp() * (r - o)).sum(-1)                          # (T,) KL(p_ref || p_other),
                    for r, o in zip(ref.split(64), other.split(64))])    # 64 rows at a time: less memory
    targets = torch.tensor(ids[1:])                                      # the token that came next
    nll = -other[:-1].gather(1, targets[:, None]).squeeze(1)             # (T - 1,)
    nll_ref = -ref[:-1].gather(1, targets[:, None]).squeeze(1)
    return {"kl": kl.mean().item(), "kl_max": kl.max().item(),
            "top1": (ref.argmax(-1) == other.argmax(-1)).float().mean().item(),
            "ppl": nll.mean().exp().item(), "ppl_ref": nll_ref.mean().exp().item()}


# How far a quantized KV cache may move the model (float32 weights), measured on the same text: int8 0.0006,
# int4 0.043 (groups of 32 with a minimum; 0.27 with one symmetric scale per head).
KV_KL_BOUND = {"int8": 0.005, "int4": 0.12}


def precision_name(model, kv: str | None = None) -> str | None:
    """The lossy precision of the model with a KV cache stored as `kv`, as a name ("q4_file", "bfloat16",
    "int8 + kv int4"); None for float32."""
    weights = model.quant or {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(model.dtype)
    parts = [weights] if weights else []
    if kv:
        parts.append(f"kv {kv}")
    return " + ".join(parts) or None


def kl_bound(model, kv: str | None = None) -> float | None:
    """The mean KL from float32 that the model's precision, with a KV cache stored as `kv`, is allowed
    (weights and KV cache added); None when nothing is lossy."""
    weights = model.quant or {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(model.dtype)
    if weights is None and kv is None:
        return None
    return KL_BOUND.get(weights, 0.0) + KV_KL_BOUND.get(kv, 0.0)


@torch.inference_mode()
def check_quality(model, reference, prompts: list[list[int]], kv: str | None = None) -> dict:
    """Before a benchmark reports a speed: the mean KL of `model`'s next-token distributions (K/V read
    back from a cache stored as `kv`) from the float32 `reference`'s, over every position of `prompts`,
    against the bound for its precision.
    {"format", "kl", "bound", "within_bound", "tokens"}; a format past its bound computes something
    else on this machine, and its speed means nothing."""
    kls = [compare(next_token_logprobs(reference, p), next_token_logprobs(model, p, kv), p)["kl"] * len(p)
           for p in prompts]
    tokens = sum(len(p) for p in prompts)
    kl, bound = sum(kls) / tokens, kl_bound(model, kv)
    return {"format": precision_name(model, kv), "kl": kl, "bound": bound, "tokens": tokens,
            "within_bound": bound is None or kl <= bound}


def refusal(quality: dict) -> str:
    """The one-line reason a benchmark gives for not reporting a format's speed."""
    return (f"{quality['format']} moves the model's next-token distribution by a mean KL of {quality['kl']:.3f} "
            f"from float32 on this run's prompts ({quality['tokens']} tokens), past its bound of "
            f"{quality['bound']:g}: on this CPU ({torch.backends.cpu.get_cpu_capability()}) it is not computing "
            f"what the model computes, so its speed is not reported")
