"""Notebook 02's explorer: sliders for temperature, top-k, top-p, min-p and the seed; a chart of the
filtered next-token distribution beside the untouched one, and a seeded continuation from the kv stage
(stage 2), so a move of a slider answers in a second or two on a laptop CPU."""
from __future__ import annotations

import html
import time

import torch

from ..generate import generate
from ..sampling import SamplingParams, filtered_probs


def describe(params: SamplingParams) -> str:
    """'T 0.85 · top-k off · top-p 0.70 · min-p 0.05': the settings, rounded as the sliders show them
    ('T 0 (greedy)' at temperature 0, where the filters do not matter: the best token is taken)."""
    def knob(name, value, off, fmt):
        return f"{name} off" if value == off else f"{name} {value:{fmt}}"
    if params.greedy:
        return "T 0 (greedy)"
    return " · ".join([f"T {params.temperature:.2f}", knob("top-k", params.top_k, 0, "d"),
                       knob("top-p", params.top_p, 1.0, ".2f"), knob("min-p", params.min_p, 0.0, ".2f")])


def draw_distribution(ax, logits: torch.Tensor, params: SamplingParams, tokenizer, n: int = 20,
                      ymax: float = 1.0) -> int:
    """Bars for the n most likely tokens: grey the model's own distribution (T = 1, no filter), blue the
    one a token is drawn from under `params`. The y-axis is fixed at [0, ymax] so two settings compare.
    logits: (vocab,). Returns how many tokens the filters keep."""
    base = torch.softmax(logits.float(), -1)                   # (vocab,)
    p = filtered_probs(logits[None].float(), params)[0]        # (vocab,)
    idx = base.topk(n).indices
    ax.bar(range(n), base[idx], color="lightgray", label="the model (T = 1, no filter)")
    ax.bar(range(n), p[idx], width=0.5, color="tab:blue", label="drawn from (after T and the filters)")
    ax.set_xticks(range(n), [repr(tokenizer.decode([i])) for i in idx.tolist()], rotation=90, fontsize=7)
    ax.set_ylim(0, ymax)
    ax.set_ylabel("probability")
    kept = int((p > 0).sum())
    ax.set_title(f"{describe(params)}: {kept:,} tokens kept", fontsize=9)
    return kept


class SamplingExplorer:
    """Sliders -> chart + continuation. `.widget` is what the notebook displays; `.update()` redraws
    (the sliders call it); `.kept`, `.text` and `.params` hold what the last redraw showed."""

    def __init__(self, model, tokenizer, prompt_ids: list[int], max_tokens: int = 40, logits=None):
        import ipywidgets as w

        from ..stages import KVCacheRunner

        self.model, self.tokenizer, self.prompt_ids, self.max_tokens = model, tokenizer, prompt_ids, max_tokens
        self.logits = logits if logits is not None else KVCacheRunner(model).prefill(prompt_ids)   # (vocab,)
        wide = {"description_width": "90px"}
        layout = w.Layout(width="340px")
        self.sliders = {
            "temperature": w.FloatSlider(value=0.8, min=0.0, max=2.0, step=0.05, description="temperature"),
            "top_k": w.IntSlider(value=0, min=0, max=100, description="top-k (0: off)"),
            "top_p": w.FloatSlider(value=0.9, min=0.05, max=1.0, step=0.05, description="top-p"),
            "min_p": w.FloatSlider(value=0.0, min=0.0, max=0.5, step=0.01, description="min-p"),
            "seed": w.IntSlider(value=0, min=0, max=20, description="seed"),
        }
        for s in self.sliders.values():
            s.style, s.layout, s.continuous_update = wide, layout, False
            s.observe(lambda change: self.update(), names="value")
        self.status = w.HTML()
        self.chart = w.Output(layout=w.Layout(min_height="330px"))
        self.continuation = w.HTML(layout=w.Layout(width="100%"))
        names = list(self.sliders.values())
        self.widget = w.VBox([w.HBox([w.VBox(names[:3]), w.VBox(names[3:])]), self.status, self.chart,
                              self.continuation])
        self.kept = self.text = self.params = None
        self.update()

    def current_params(self) -> SamplingParams:
        v = {k: s.value for k, s in self.sliders.items()}
        return SamplingParams(temperature=round(v["temperature"], 2), top_k=v["top_k"], top_p=round(v["top_p"], 2),
                              min_p=round(v["min_p"], 2), seed=v["seed"], max_tokens=self.max_tokens)

    def update(self) -> None:
        import matplotlib.pyplot as plt
        from IPython.display import clear_output

        self.status.value = "<i>generating…</i>"
        t0 = time.perf_counter()
        self.params = params = self.current_params()
        with self.chart:
            clear_output(wait=True)
            fig, ax = plt.subplots(figsize=(10, 3.3))
            self.kept = draw_distribution(ax, self.logits, params, self.tokenizer)
            ax.legend(fontsize=8, loc="upper right")
            fig.tight_layout()
            plt.show()
        self.text = generate(self.model, self.tokenizer, self.prompt_ids, params, stage="kv").text
        prompt = self.tokenizer.decode(self.prompt_ids)
        self.continuation.value = (f"<div style='white-space: pre-wrap; font-family: monospace'>"
                                   f"{html.escape(prompt)}<b>{html.escape(self.text)}</b></div>")
        self.status.value = f"{describe(params)} · seed {params.seed} · drawn in {time.perf_counter() - t0:.2f} s"
