"""Figures shared by the CLI, the notebooks and the docs. They take plain data, not JAX arrays.

Colours keep one meaning across the whole course (`COLORS`, `color`): red is Ring Attention
(pass-KV), blue is Tree Attention (its Allreduce merge), pink the pass-Q ring; green,
orange, purple, brown and cyan are the other merge patterns (allgather, reduce_scatter,
all_to_all, one_pass, butterfly) and nothing else; black is the exact reference (attention itself,
float64, a closed form) and grey a baseline or a bound (one device, a roofline, the paper's
formula). A figure that needs more series varies line style or marker, never a colour's
meaning.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import matplotlib.pyplot as plt
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

RING_COLOR, TREE_COLOR = "#d62728", "#1f77b4"
NEUTRAL_COLOR = "0.3"  # dark grey: neither ring nor tree (a slow link, a baseline)
OTHER_COLORS = ("0.3", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")  # grey, green, orange,
# purple, brown: series that are neither ring nor tree
_FMT_COLORS = set("bgrcmykw")


def method_color(name: str, fallback: str = NEUTRAL_COLOR) -> str:
    """The course colour of a series named after a method: ring red, tree blue, else
    `fallback`. A name that mentions both ("ring vs tree") gets the fallback."""
    ring, tree = "ring" in name.lower(), "tree" in name.lower()
    return RING_COLOR if ring and not tree else TREE_COLOR if tree and not ring else fallback


def bytes_label(n: float) -> str:
    """`n` bytes in decimal units: 512 B, 8.32 kB, 235 MB, 3.76 GB (3 significant digits)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.3g} B"


def count_label(n: int) -> str:
    """A power-of-two count the way sequence lengths are spoken: 512, 4k, 64k, 1M (k = 1024)."""
    for unit, size in (("G", 2**30), ("M", 2**20), ("k", 2**10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


Axis = Literal["x", "y"]
"""Which axis of a matplotlib `Axes` a helper formats."""


def bytes_axis(ax, which: Axis = "y") -> None:
    """Log-scale `which` axis ("x" or "y") of byte counts, with one readable tick per power
    of ten (1 kB, 10 kB, 100 kB, 1 MB, ...) and no minor labels."""
    axis = {"x": ax.xaxis, "y": ax.yaxis}[which]
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis.set_major_locator(LogLocator(base=10, numticks=30))
    axis.set_major_formatter(FuncFormatter(lambda n, _: bytes_label(n)))
    axis.set_minor_formatter(NullFormatter())


def plain_log_axis(ax, which: Axis = "y") -> None:
    """Log-scale `which` axis with one tick per power of ten, labelled as plain numbers
    (0.1, 1, 10, 100, 1000) rather than as powers."""
    axis = {"x": ax.xaxis, "y": ax.yaxis}[which]
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    axis.set_major_locator(LogLocator(base=10, numticks=30))
    axis.set_major_formatter(FuncFormatter(lambda n, _: f"{n:g}"))
    axis.set_minor_formatter(NullFormatter())


def pow2_axis(ax, values: Sequence[int], which: Axis = "x") -> None:
    """Log-2 scale `which` axis with a tick at each of `values`, labelled 4k, 64k, 1M."""
    axis = {"x": ax.xaxis, "y": ax.yaxis}[which]
    (ax.set_xscale if which == "x" else ax.set_yscale)("log", base=2)
    axis.set_major_locator(FixedLocator([float(v) for v in values]))
    axis.set_major_formatter(FuncFormatter(lambda n, _: count_label(round(n))))
    axis.set_minor_locator(NullLocator())


def _ring(ax, p: int) -> None:
    angles = [math.pi / 2 - 2 * math.pi * i / p for i in range(p)]
    xy = [(math.cos(a), math.sin(a)) for a in angles]
    for i, (x, y) in enumerate(xy):
        nx, ny = xy[(i + 1) % p]
        ax.annotate(
            "",
            (nx * 0.85, ny * 0.85),
            (x * 0.85, y * 0.85),
            arrowprops=dict(arrowstyle="-|>", lw=3, color=RING_COLOR),
        )
        ax.add_patch(plt.Circle((x, y), 0.17, color="0.85", zorder=3))
        ax.text(x, y, str(i), ha="center", va="center", zorder=4)
    ax.text(
        0,
        0,
        f"p−1 = {p - 1} steps\neach sends a\nwhole K/V shard",
        ha="center",
        va="center",
        fontsize=9,
    )
    ax.set_title("Ring Attention: K/V blocks travel")
    ax.set_xlim(-1.4, 1.4)
    ax.set_ylim(-1.4, 1.4)
    ax.set_aspect("equal")
    ax.axis("off")


def reduction_tree(ax, p: int, branching: int = 2, title: str | None = None) -> None:
    """Draw a `branching`-ary reduction tree over `p` leaves (devices or chunks)."""
    level = [(float(i), 0.0) for i in range(p)]
    for i, (x, y) in enumerate(level):
        ax.add_patch(plt.Circle((x, y), 0.25, color="0.85", zorder=3))
        ax.text(x, y, str(i), ha="center", va="center", zorder=4)
    depth = 0
    while len(level) > 1:
        depth += 1
        nxt = []
        for j in range(0, len(level), branching):
            group = level[j : j + branching]
            parent = (sum(x for x, _ in group) / len(group), float(depth))
            for x, y in group:
                ax.annotate(
                    "", parent, (x, y), arrowprops=dict(arrowstyle="-|>", lw=1.2, color=TREE_COLOR)
                )
            ax.add_patch(plt.Circle(parent, 0.18, color=TREE_COLOR, zorder=3))
            nxt.append(parent)
        level = nxt
    ax.set_title(title or f"Tree reduction: {depth} levels for p = {p}")
    ax.set_xlim(-0.8, p - 0.2)
    ax.set_ylim(-0.8, depth + 0.8)
    ax.set_ylabel("combine level")
    ax.set_xticks([])
    ax.set_aspect("equal")


def message_patterns(bytes_per_method: Mapping[str, int], p: int = 8, path: str | None = None):
    """Ring versus tree message flow, and the measured bytes per device (log scale)."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw=dict(width_ratios=[1, 1.3, 1.2]))
    _ring(axes[0], p)
    reduction_tree(
        axes[1], p, title="Tree Attention: only (out, lse) meet\nAllreduce(max), Allreduce(sum)"
    )
    names = list(bytes_per_method)
    vals = [max(bytes_per_method[n], 1) for n in names]
    colors = [method_color(n, "0.5") for n in names]
    bars = axes[2].bar(names, vals, color=colors)
    axes[2].set_yscale("log")
    axes[2].set_ylim(top=max(vals) * 20)
    axes[2].set_ylabel("bytes sent per device (compiled program)")
    axes[2].set_title("Measured communication volume")
    for b, v in zip(bars, vals, strict=True):
        axes[2].text(b.get_x() + b.get_width() / 2, v * 1.3, f"{v:,}", ha="center", fontsize=8)
    axes[2].tick_params(axis="x", rotation=20)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def scaling(
    xs: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = True,
    logy: bool = True,
    ax=None,
    styles: Mapping[str, str] | None = None,
):
    """Line plot of several named series against `xs`.

    A series whose name mentions "ring" is red and "tree" blue; the others take
    `OTHER_COLORS` in turn. A colour letter in `styles` (e.g. "k:") wins.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 4))
    others = itertools.cycle(OTHER_COLORS)
    for name, ys in series.items():
        fmt = (styles or {}).get(name, "o-")
        given = bool(_FMT_COLORS & set(fmt)) or "C" in fmt
        color = {} if given else {"color": method_color(name, "") or next(others)}
        ax.plot(xs, ys, fmt, label=name, **color)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    return ax


def two_level_schedule(inner: Sequence[Sequence[int]], outer: Sequence[Sequence[int]], ax=None):
    """Draw a hierarchical Allreduce from its replica groups (as read by `collective_stats`).

    `inner` groups are drawn as nodes (boxes) whose members reduce over fast links; `outer`
    groups connect one member of each node over the slow links. Both levels are the tree's
    Allreduce: level 1 is drawn in the tree's blue, level 2 (the slow links) dotted in
    `NEUTRAL_COLOR`, never in the ring's red.
    """
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    pos = {}
    for n, group in enumerate(inner):
        y = 1.6 * (len(inner) - 1 - n)
        ax.add_patch(
            plt.Rectangle(
                (-0.6, y - 0.45), len(group) + 0.2, 0.9, fill=False, ec="0.4", lw=1.2, ls="--"
            )
        )
        ax.text(-0.75, y, f"node {n}", ha="right", va="center")
        for i, dev in enumerate(group):
            pos[dev] = (float(i), y)
            ax.add_patch(plt.Circle((i, y), 0.22, color="0.85", zorder=3))
            ax.text(i, y, str(dev), ha="center", va="center", zorder=4)
        for a, b in itertools.pairwise(group):
            ax.annotate(
                "",
                pos[b],
                pos[a],
                arrowprops=dict(arrowstyle="<->", color=TREE_COLOR, lw=2, shrinkA=9, shrinkB=9),
            )
    for group in outer:
        for a, b in itertools.pairwise(group):
            ax.annotate(
                "",
                pos[b],
                pos[a],
                arrowprops=dict(
                    arrowstyle="<->", color=NEUTRAL_COLOR, lw=1.8, ls=":", shrinkA=9, shrinkB=9
                ),
            )
    ax.plot([], [], color=TREE_COLOR, lw=2, label="level 1: inside a node (NVLink)")
    ax.plot([], [], color=NEUTRAL_COLOR, lw=1.8, ls=":", label="level 2: across nodes (InfiniBand)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=2, frameon=False)
    ax.set_xlim(-1.8, max(len(g) for g in inner))
    ax.set_ylim(-0.9, 1.6 * (len(inner) - 1) + 0.7)
    ax.set_aspect("equal")
    ax.axis("off")
    return ax


def cache_partition(lengths: Sequence[int], capacity: int, p: int, ax=None):
    """The KV-cache partitioning rule: one row per sequence, `capacity` slots cut into `p`
    contiguous device shards. Filled slots are grey, the slot the next token is appended to
    is outlined with a dark dashed line, and its owning device is labelled (no red or blue:
    this figure is neither ring nor tree; no pattern colour either: they mean merges)."""
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(lengths) + 1.2))
    shard = capacity // p
    for b, n in enumerate(lengths):
        y = len(lengths) - 1 - b
        ax.add_patch(
            plt.Rectangle((0, y + 0.1), min(n, capacity), 0.8, color=NEUTRAL_COLOR, alpha=0.6)
        )
        if n < capacity:
            ax.add_patch(
                plt.Rectangle((n, y + 0.1), 1, 0.8, fill=False, ec=OTHER_COLORS[0], lw=2, ls="--")
            )
            ax.annotate(
                f"next: pos {n} -> device {n // shard}", (n + 1.5, y + 0.5), va="center", fontsize=8
            )
    for d in range(p + 1):
        ax.axvline(d * shard, color="k", lw=1 if 0 < d < p else 2)
    for d in range(p):
        ax.text((d + 0.5) * shard, len(lengths) + 0.15, f"dev {d}", ha="center", fontsize=8)
    ax.set_xlim(0, capacity)
    ax.set_ylim(0, len(lengths) + 0.6)
    ax.set_yticks(
        [len(lengths) - 0.5 - b for b in range(len(lengths))],
        [f"seq {b} (len {n})" for b, n in enumerate(lengths)],
    )
    ax.set_xlabel(f"cache position (capacity {capacity}, {shard} slots per device)")
    return ax


PATTERN_COLORS = {
    "allreduce": TREE_COLOR,  # the paper's tree decoding (Algorithm 3)
    "allgather": OTHER_COLORS[1],
    "reduce_scatter": OTHER_COLORS[2],
    "all_to_all": OTHER_COLORS[3],
    "one_pass": OTHER_COLORS[4],
    "butterfly": "#17becf",  # cyan: recursive doubling
    "ring": RING_COLOR,
    "ring_pass_q": "#e377c2",  # pink: a ring, but not Ring Attention's pass-KV
}
"""The colour of each merge pattern and ring: "allreduce" is the paper's tree (blue), the
pass-KV ring red, every other pattern a colour that is neither."""
REFERENCE_COLOR = "black"
"""The exact answer: attention itself, a float64 reference, a closed form."""
BASELINE_COLOR = "0.55"
"""A baseline or a bound: one device, a roofline, the paper's formula, a serial count."""
COLORS = {
    **PATTERN_COLORS,
    "tree": TREE_COLOR,
    "tree_2level": TREE_COLOR,
    "tree_energy": TREE_COLOR,
    "reference": REFERENCE_COLOR,
    "single": BASELINE_COLOR,
    "single_kernel": BASELINE_COLOR,
    "baseline": BASELINE_COLOR,
}
"""Every named series of the course and its one colour (see the module docstring)."""


def color(name: str) -> str:
    """The course colour of a named series (`COLORS`); a name not listed is a method name
    (`method_color`: ring red, tree blue) or else grey."""
    return COLORS.get(name, method_color(name, BASELINE_COLOR))


def winner_margins(data: Mapping) -> list[list[float]]:
    """How decisively each cell of `costmodel.crossover_map`'s data is won: the runner-up's
    predicted time over the winner's, minus one (0.05: the winner is 5% faster than the best
    other pattern; inf where only one pattern competes). Same layout as `data["winner"]`."""
    seconds, winner = data["seconds"], data["winner"]
    margins = []
    for i, row in enumerate(winner):
        out = []
        for j, w in enumerate(row):
            others = [seconds[m][i][j] for m in seconds if m != w]
            out.append(min(others) / seconds[w][i][j] - 1 if others else math.inf)
        margins.append(out)
    return margins


def crossover_map(
    data: Mapping, ax=None, path: str | None = None, annotate: bool = True, min_gain: float = 0.0
):
    """Which merge pattern wins where: `costmodel.crossover_map`'s plain dict, drawn as a
    grid of device count (x) against batch × heads (y), each cell in its winner's colour
    (`PATTERN_COLORS`) and labelled with the winner's speedup over "allreduce".

    `min_gain`: cells whose winner beats the runner-up by less than this fraction
    (`winner_margins`; e.g. 0.02 for 2%) are drawn in `BASELINE_COLOR` (grey), labelled
    with the winner's name: there the choice of pattern barely matters, and a model error
    of that size would flip it.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    ps, bhs, winner = list(data["ps"]), list(data["batch_heads"]), data["winner"]
    names = list(data.get("patterns") or sorted({w for row in winner for w in row}))
    if ax is None:
        _, ax = plt.subplots(figsize=(1.1 * len(ps) + 3.2, 0.55 * len(bhs) + 1.8))
    margins = winner_margins(data) if min_gain > 0 else None
    close = [
        [margins is not None and margins[i][j] < min_gain for j in range(len(row))]
        for i, row in enumerate(winner)
    ]
    index = [
        [len(names) if close[i][j] else names.index(w) for j, w in enumerate(row)]
        for i, row in enumerate(winner)
    ]
    cmap = ListedColormap([PATTERN_COLORS.get(n, NEUTRAL_COLOR) for n in names] + [BASELINE_COLOR])
    ax.imshow(
        index,
        cmap=cmap,
        vmin=-0.5,
        vmax=len(names) + 0.5,
        origin="lower",
        aspect="auto",
        alpha=0.85,
    )
    if annotate and "speedup" in data:
        for i, row in enumerate(data["speedup"]):
            for j, s in enumerate(row):
                # A grey cell still names its (narrow) winner.
                label = f"{s:.2f}×\n{winner[i][j]}" if close[i][j] else f"{s:.2f}×"
                ax.text(
                    j, i, label, ha="center", va="center", fontsize=7 - close[i][j], color="white"
                )
    ax.set_xticks(range(len(ps)), [str(p) for p in ps])
    ax.set_yticks(range(len(bhs)), [count_label(b) for b in bhs])
    ax.set_xlabel("devices p")
    ax.set_ylabel("batch × query heads")
    title = "Fastest merge (cell: speedup over allreduce)"
    if data.get("topology"):
        title += f"\n{data['topology']}"
    ax.set_title(title, fontsize=10)
    shown = [
        n
        for n in names
        if any(
            w == n and not c
            for row, crow in zip(winner, close, strict=True)
            for w, c in zip(row, crow, strict=True)
        )
    ]
    handles = [Patch(color=PATTERN_COLORS.get(n, NEUTRAL_COLOR), label=n) for n in shown]
    if any(any(row) for row in close):
        handles.append(Patch(color=BASELINE_COLOR, label=f"won by < {min_gain:.0%}"))
    ax.legend(
        handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False, fontsize=8
    )
    if path:
        ax.figure.tight_layout()
        ax.figure.savefig(path, dpi=110)
    return ax.figure
