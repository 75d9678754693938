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

from ..kv import KVCache

HELDOUT = Path(__file__).resolve().parents[2] / "data" / "heldout.txt"


def heldout_ids(tokenizer, path: str | Path = HELDOUT, max_tokens: int | None = None) -> list[int]:
    """The held-out text's token ids (its first max_tokens)."""
    ids = tokenizer.encode(Path(path).read_text())
    return ids[:max_tokens] if max_tokens else ids


@torch.inference_mode()
def next_token_logprobs(model, ids: list[int], kv_cache_dtype: str | None = None) -> torch.Tensor:
    """(T, vocab) float32 log-softmax of the model's prediction after each token of `ids`, one pass.
    kv_cache_dtype: attention reads K/V back from a cache stored that way (as every decode step would)."""
    x = torch.tensor([ids], device=model.device)
    cache = None
    if kv_cache_dtype:
        cache = KVCache(model.cfg, 1, len(ids), model.dtype, model.device, kv_cache_dtype)
        cache.begin(len(ids))
    logits = model(x, cache=cache)[0].float().cpu()                          # (T, vocab), our own copy
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
