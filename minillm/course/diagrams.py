"""Pictures that carry what prose would labour over: the shapes of prefill and decode (notebook 01), one
Q4_1 block byte by byte (12), how a token budget packs a step (08). Each draws on a matplotlib axis."""
from __future__ import annotations


def _box(ax, x, y, w, h, color, text="", fontsize=8, **kw):
    import matplotlib.pyplot as plt

    ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=color, edgecolor="black", linewidth=0.6, **kw))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize)


def draw_prefill_decode(ax, T: int = 4, d: int = 7, out: int = 9) -> None:
    """Activations (T × d) times a weight (d × out), drawn to one scale (in the model d = 576 and out is
    576 to 1,536, far more than a short prompt's T rows): prefill multiplies a block of T rows, decode one
    row, against the same weight, read once either way."""
    top = d                                            # every box hangs from the same top edge
    for x0, rows, title in ((0, T, f"prefill: T = {T} rows"), (2 * (d + out) + 7, 1, "decode: 1 row")):
        _box(ax, x0, top - rows, d, rows, "tab:orange", f"x ({rows} × d)")
        ax.text(x0 + d + 0.5, top - rows / 2, "×", fontsize=14, va="center")
        _box(ax, x0 + d + 1.6, 0, out, d, "lightgray", "W\n(d × out)")
        ax.text(x0 + d + out + 2.2, top - rows / 2, "=", fontsize=14, va="center")
        _box(ax, x0 + d + out + 3.2, top - rows, out, rows, "tab:blue", f"{rows} × out")
        ax.text(x0 + (2 * d + 2 * out + 3.2) / 2, top + 0.7, title, ha="center", fontsize=9)
    ax.text(2 * (d + out) + 6, -1.2, "the same weight W is read from memory once per pass: prefill does T rows of arithmetic "
            "with it, decode one", ha="center", fontsize=8)
    ax.set(xlim=(-0.5, 4 * (d + out) + 13), ylim=(-2, top + 1.5))
    ax.set_axis_off()


def draw_q4_1_block(ax) -> None:
    """A Q4_1 block: float16 scale d and minimum m, then 16 bytes holding 32 four-bit codes (byte j's low
    nibble is weight j, its high nibble weight j + 16); weight = code × d + m."""
    _box(ax, 0, 2, 2, 1, "tab:green", "d\nfloat16")
    _box(ax, 2, 2, 2, 1, "tab:olive", "m\nfloat16")
    for j in range(16):
        _box(ax, 4 + j, 2.5, 1, 0.5, "tab:blue", f"lo {j}", fontsize=6)
        _box(ax, 4 + j, 2, 1, 0.5, "tab:purple", f"hi {j + 16}", fontsize=6)
    ax.text(12, 3.3, "16 bytes: byte j = (code of weight j + 16) << 4 | (code of weight j)", ha="center", fontsize=8)
    for j in range(16):
        ax.annotate("", xy=(j * 0.75 + 0.4, 0.9), xytext=(4.5 + j, 2.5), arrowprops=dict(arrowstyle="-", lw=0.3, color="tab:blue"))
        ax.annotate("", xy=(12 + j * 0.75 + 0.4, 0.9), xytext=(4.5 + j, 2.0), arrowprops=dict(arrowstyle="-", lw=0.3, color="tab:purple"))
    for i in range(32):
        _box(ax, i * 0.75, 0.3, 0.75, 0.6, "tab:blue" if i < 16 else "tab:purple", str(i), fontsize=5)
    ax.text(12, -0.2, "32 weights of a row, in order: w_i = code_i × d + m   (20 bytes for 32 weights: 5 bits each)",
            ha="center", fontsize=8)
    ax.set(xlim=(-0.5, 24.5), ylim=(-0.6, 3.7))
    ax.set_axis_off()


def draw_budget_packing(ax, steps, budget: int, long_id: str, first_step: int = 0) -> None:
    """One bar per step: each request's tokens stacked against the budget, decodes (one token each) in blue
    at the bottom, the long prompt's chunk in orange, other prompts in grey. steps: course.simulate's SimStep
    list (.tokens: request id -> tokens computed); the bars are numbered from first_step."""
    colors = {"decode": "tab:blue", "long": "tab:orange", "prompt": "lightgray"}
    for i, step in enumerate(steps):
        bottom, per_kind = 0, dict.fromkeys(colors, 0)
        for rid, n in step.tokens.items():
            per_kind["long" if rid == long_id else "decode" if n == 1 else "prompt"] += n
        for kind in ("decode", "prompt", "long"):      # one segment per kind: 16 thin ones would read as a paler colour
            if per_kind[kind]:
                ax.bar(first_step + i, per_kind[kind], bottom=bottom, color=colors[kind])
                bottom += per_kind[kind]
    ax.axhline(budget, color="black", ls=":", lw=1)
    ax.set(xlabel="step", ylabel="tokens computed in the step", ylim=(0, budget * 1.35))
    names = {"decode": "decodes: one token each", "long": "a chunk of the long prompt", "prompt": "other prompts"}
    shown = [k for k in colors if any((rid == long_id) == (k == "long") and (n == 1) == (k == "decode")
                                      for step in steps for rid, n in step.tokens.items())]   # kinds in this window
    handles = [ax.bar(first_step, 0, color=colors[k]) for k in shown]
    ax.legend(handles=handles + [ax.axhline(budget, color="black", ls=":", lw=1)],
              labels=[names[k] for k in shown] + ["the budget"], fontsize=8, loc="upper center", ncol=4)


def draw_request_timeline(ax, queue_s: float, token_s: list[float], title: str = "") -> None:
    """One request, from the moment it is sent (0): waiting in the queue, its prefill up to the first token
    (TTFT), the gaps between later tokens (ITL), and the end-to-end latency. token_s: when each token came."""
    first, last = token_s[0], token_s[-1]
    ax.barh(0, queue_s, color="lightgrey", height=0.5)
    ax.barh(0, first - queue_s, left=queue_s, color="tab:orange", height=0.5)
    ax.vlines(token_s, -0.25, 0.25, color="tab:blue", lw=0.8)
    for y, a, b, label in ((0.75, 0, first, "TTFT"), (1.25, 0, last, "end-to-end")):
        ax.annotate("", xy=(a, y), xytext=(b, y), arrowprops=dict(arrowstyle="<->", lw=0.8))
        ax.text((a + b) / 2, y + 0.08, label, ha="center", fontsize=8)
    if len(token_s) > 2:
        widest = max(range(1, len(token_s)), key=lambda i: token_s[i] - token_s[i - 1])   # the longest gap
        a, b = token_s[widest - 1], token_s[widest]
        ax.fill_betweenx([-0.25, 0.25], a, b, color="tab:red", alpha=0.6, lw=0)   # too narrow for an arrow
        ax.annotate(f"its longest ITL gap: {(b - a) * 1e3:.0f} ms", xy=((a + b) / 2, -0.27), xytext=((a + b) / 2, -0.8),
                    ha="center", fontsize=8, arrowprops=dict(arrowstyle="->", lw=0.8, color="tab:red"))
    ax.text(queue_s / 2, 0, "queued" if queue_s > 0.08 * last else "", ha="center", va="center", fontsize=7)
    ax.set(yticks=[], ylim=(-1, 1.6), xlabel="seconds since the request was sent", title=title)
