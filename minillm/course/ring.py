"""The ring all-reduce, step by step (notebook 13): which chunk each rank sends, and a picture of it.

w ranks in a ring, each talking only to its right neighbour; every rank's vector is cut into w chunks.

    at step s (1 .. 2(w-1)) rank r sends chunk r - s + 1 (mod w): the one it changed in the step before
    reduce-scatter, steps 1 .. w-1: the receiver adds the chunk to its own copy; after w - 1 steps rank r
        holds the full sum of chunk r + 1.
    all-gather, steps w .. 2(w-1): the receiver replaces its copy with the summed chunk. After w - 1
        steps every rank holds every summed chunk.

Each step every rank sends one chunk, P/w values: 2 (w - 1) steps send 2 (w - 1)/w x P per rank,
close to 2P however many ranks there are, and every link carries the same load at the same time.
"""
from __future__ import annotations


def ring_steps(world: int) -> list[tuple[list[list[frozenset]], list[int] | None]]:
    """The state before each step and after the last: (holds, sends). holds[r][c] is the set of ranks whose
    chunk c rank r's copy sums; sends[r] is the chunk rank r sends to rank r + 1 in that step (None after
    the last step)."""
    holds = [[frozenset([r]) for _ in range(world)] for r in range(world)]
    states = []
    for step in range(2 * (world - 1)):
        reduce = step < world - 1
        sends = [(r - step) % world for r in range(world)]         # the chunk it last changed (its own at first)
        states.append(([list(row) for row in holds], sends))
        new = [list(row) for row in holds]
        for r in range(world):
            left, c = (r - 1) % world, sends[(r - 1) % world]
            new[r][c] = holds[r][c] | holds[left][c] if reduce else holds[left][c]
        holds = new
    states.append(([list(row) for row in holds], None))
    return states


def draw_ring_all_reduce(ax, world: int = 3) -> None:
    """One panel per step: columns are ranks, rows are chunks, each box lists the ranks whose values that
    copy sums (darker: more of them); a red outline marks the chunk a rank sends to its right neighbour."""
    import matplotlib.pyplot as plt

    states = ring_steps(world)
    col, row, gap = 1.5, 0.9, 1.4                                  # column pitch, row height, between panels
    width = world * col
    for k, (holds, sends) in enumerate(states):
        x0 = k * (width + gap)
        if sends is None:
            title = "done: every rank\nholds every sum"
        else:
            phase = "reduce-scatter" if k < world - 1 else "all-gather"
            title = f"step {k + 1}\n{phase}"
        ax.text(x0 + width / 2 - 0.25, world * row + 0.55, title, ha="center", va="bottom", fontsize=9)
        for r in range(world):
            ax.text(x0 + r * col + 0.5, world * row + 0.1, f"rank {r}", ha="center", va="bottom", fontsize=7)
            for c in range(world):
                y = (world - 1 - c) * row
                n = len(holds[r][c])
                shade = plt.cm.Blues(0.15 + 0.7 * (n - 1) / max(world - 1, 1))
                sent = sends is not None and sends[r] == c
                ax.add_patch(plt.Rectangle((x0 + r * col, y + 0.05), 1.0, row - 0.1, facecolor=shade,
                                           edgecolor="tab:red" if sent else "white", linewidth=2 if sent else 0.5))
                label = "Σ" if n == world > 3 else "+".join(map(str, sorted(holds[r][c])))   # Σ: too long to list
                ax.text(x0 + r * col + 0.5, y + row / 2, label, ha="center",
                        va="center", fontsize=7, color="white" if n > world / 2 + 0.5 else "black")
                if sent:                                           # to the right neighbour (the last: to rank 0)
                    ax.annotate("", xy=(x0 + r * col + (col if r < world - 1 else 1.3), y + row / 2),
                                xytext=(x0 + r * col + 1.0, y + row / 2),
                                arrowprops=dict(arrowstyle="->", color="tab:red", lw=1.2))
                    if r == world - 1:
                        ax.text(x0 + r * col + 1.32, y + row / 2, "0", color="tab:red", fontsize=7, va="center")
        if k == 0:
            for c in range(world):
                ax.text(x0 - 0.15, (world - 1 - c) * row + row / 2, f"chunk {c}", ha="right", va="center", fontsize=7)
    ax.text(len(states) * (width + gap) / 2, -0.35, f"each box: the ranks whose values one rank's copy of a chunk "
            f"sums{' (Σ: all of them)' if world > 3 else ''}; red: the chunk each rank sends to its right neighbour "
            f"(rank {world - 1} sends to rank 0). Every step moves one chunk per rank: 2 (w − 1) = {2 * (world - 1)} steps.",
            ha="center", va="top", fontsize=8)
    ax.set(xlim=(-1.3, len(states) * (width + gap)), ylim=(-0.9, world * row + 1.4))
    ax.set_axis_off()
