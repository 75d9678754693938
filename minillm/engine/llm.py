"""LLM: the engine for a script or a notebook: give it prompts, get the answers back in order.

    llm = minillm.LLM()                                   # the course model; or a path, or a loaded model
    outs = llm.generate(["The capital of France is", "1, 2, 3,"], SamplingParams(max_tokens=16))
    outs = llm.chat([{"role": "user", "content": "Hi!"}])

All prompts go into one `LLMEngine` at once, which batches them continuously.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from ..sampling import SamplingParams
from .llm_engine import LLMEngine
from .request import RequestOutput


class LLM:
    def __init__(self, model=None, tokenizer=None, device=None, backend: str = "auto", pack_weights: bool | None = None,
                 **engine_options):
        """model: None (the course model), a .gguf path or Hugging Face folder, or a loaded Transformer.
        device: where a model loaded from a path runs (default: the GPU when there is one); a loaded
        Transformer runs where it is.
        backend: "auto" (the fastest measured), "torch" or "native" (`minillm.backends`), applied to a copy
            of the model's modules: a model given here stays as it was. `self.model` is the prepared one;
            `describe(llm.model)` says which kernels it got.
        pack_weights: with the native backend, a second copy of the float weights in oneDNN's layout for big
            steps, where it measures faster (True), or not (False); None: a model already prepared for the
            backend runs as it was prepared (`apply_backend(model, "native", pack_weights=True)` stays packed),
            a plain one unpacked.
        engine_options: LLMEngine's (max_num_seqs, max_num_batched_tokens, kv_cache_memory, policy, ...)."""
        from ..loading import load_model, load_tokenizer
        from ..backends import apply_backend

        if model is None or isinstance(model, (str, Path)):
            tokenizer = tokenizer or load_tokenizer(model)
            model = load_model(model, device=device)
        elif device is not None and torch.device(device).type != model.device.type:
            raise ValueError(f"the model is on {model.device}, not {device}: move it (model.to(device)) or leave "
                             "device out")
        self.model = apply_backend(model, backend, pack_weights=pack_weights)
        self.tokenizer = tokenizer or load_tokenizer()
        self.engine = LLMEngine(self.model, self.tokenizer, **engine_options)
        self._counter = 0

    def _next_id(self) -> str:
        self._counter += 1
        return f"llm-{self._counter}"

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of token ids, or a list of either. One SamplingParams for all,
        or one per prompt. Returns one finished RequestOutput per prompt, in input order; a prompt
        the engine refuses comes back with finish_reason "error" and the reason, the others run."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; give one, or one per prompt")
        results: dict[str, RequestOutput] = {}
        order = []
        for prompt, p in zip(prompts, params):
            rid = self._next_id()
            order.append(rid)
            ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else prompt
            try:
                self.engine.add_request(rid, ids, p)
            except ValueError as e:
                results[rid] = RequestOutput.failed(rid, ids if isinstance(ids, list) else [], "error", str(e))
        bar = tqdm(total=len(prompts), desc="generate", unit="req", disable=None if use_tqdm else True)
        bar.update(len(results))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished and out.request_id in order:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def chat(self, conversations, params=None, use_tqdm: bool = True) -> list[RequestOutput]:
        """conversations: one conversation (a list of {"role", "content"} messages) or a list of them."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = []
        for conv in conversations:
            try:
                prompts.append(self.tokenizer.apply_chat_template(conv))
            except ValueError as e:
                prompts.append(e)
        outs = self.generate([p if isinstance(p, list) else [] for p in prompts], params, use_tqdm)
        for i, p in enumerate(prompts):
            if isinstance(p, ValueError):
                outs[i] = RequestOutput.failed(outs[i].request_id, [], "error", str(p))
        return outs

    def stream(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """One request, yielding its RequestOutput after every new token (new_text: what to show now; the last
        is finished)."""
        rid = self._next_id()
        self.engine.add_request(rid, prompt_ids, params)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)

