"""Stage 6: speculative decoding. A cheap proposer drafts k tokens, the model scores them all in
one pass, and an exact rejection rule keeps as many as the model's own distribution allows.

    verify.py      the rule (`verify`), the target's distributions, the expected gain
    proposers.py   n-gram prompt lookup, a layer-skipping draft, a separate draft model
    decode.py      the single-stream loop (`generate(..., speculative="ngram")`)

The engine (stage 5) runs the same rule for many requests at once (`engine/`).
"""
from .proposers import (CascadeProposer, DraftModelProposer, LayerSkipProposer, NgramProposer, Proposer, lookup_ngram,
                        make_proposer, quantized_copy)
from .verify import expected_tokens_per_step, predicted_speedup, target_probs, verify, verify_greedy

__all__ = ["CascadeProposer", "DraftModelProposer", "LayerSkipProposer", "NgramProposer", "Proposer", "expected_tokens_per_step",
           "lookup_ngram", "make_proposer", "predicted_speedup", "quantized_copy", "target_probs", "verify", "verify_greedy"]
