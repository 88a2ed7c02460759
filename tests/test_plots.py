"""Figures keep the course's colours: red is ring, blue is tree, and nothing else is either."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from matplotlib.colors import same_color, to_rgba

from tree_attention_edu import plots

RED_OR_BLUE = (plots.RING_COLOR, plots.TREE_COLOR, "r", "b")


def _is_red_or_blue(color) -> bool:
    return any(same_color(to_rgba(color), to_rgba(c)) for c in RED_OR_BLUE)


@pytest.fixture
def ax():
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_the_two_colours_are_red_and_blue():
    r, g, b, _ = to_rgba(plots.RING_COLOR)
    assert r > 0.8 and g < 0.3 and b < 0.3
    r, g, b, _ = to_rgba(plots.TREE_COLOR)
    assert b > 0.6 and r < 0.3
    assert not any(_is_red_or_blue(c) for c in (plots.NEUTRAL_COLOR, *plots.OTHER_COLORS))


@pytest.mark.parametrize(
    ("name", "want"),
    [
        ("ring", plots.RING_COLOR),
        ("Ring Attention, measured", plots.RING_COLOR),
        ("tree", plots.TREE_COLOR),
        ("tree: N/p - 1 + ceil(log2 p)", plots.TREE_COLOR),
        ("single device", plots.NEUTRAL_COLOR),
        ("ring vs tree", plots.NEUTRAL_COLOR),
    ],
)
def test_method_color(name, want):
    assert plots.method_color(name) == want


def test_two_level_schedule_draws_no_ring_red(ax):
    """Both levels are the tree's Allreduce: level 1 blue, level 2 neutral, never red."""
    inner = ((0, 1, 2, 3), (4, 5, 6, 7))
    outer = ((0, 4), (1, 5), (2, 6), (3, 7))
    plots.two_level_schedule(inner, outer, ax=ax)
    arrows = [
        a.arrow_patch.get_edgecolor()
        for a in ax.texts
        if hasattr(a, "arrow_patch") and a.arrow_patch is not None
    ]
    assert len(arrows) == 2 * 3 + 4  # 3 links per node, 1 per node pair
    assert sum(same_color(c, plots.TREE_COLOR) for c in arrows) == 6
    assert sum(same_color(c, plots.NEUTRAL_COLOR) for c in arrows) == 4
    assert not any(same_color(c, plots.RING_COLOR) for c in arrows)
    legend = {
        t.get_text(): h.get_color()
        for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles, strict=True)
    }
    assert same_color(legend["level 1: inside a node (NVLink)"], plots.TREE_COLOR)
    assert not _is_red_or_blue(legend["level 2: across nodes (InfiniBand)"])


def test_cache_partition_uses_neither_red_nor_blue(ax):
    plots.cache_partition([10, 40], capacity=64, p=8, ax=ax)
    colors = [
        c
        for patch in ax.patches
        for c in (patch.get_facecolor(), patch.get_edgecolor())
        if c[3] > 0
    ]  # visible fills and outlines
    assert colors and not any(_is_red_or_blue(c) for c in colors)
    patterns = [plots.color(m) for m in ("allgather", "reduce_scatter", "all_to_all", "one_pass")]
    assert not any(same_color(c, m) for c in colors for m in patterns)


def test_scaling_colours_series_by_method(ax):
    plots.scaling(
        [1, 2, 4],
        {
            "ring": [1, 2, 4],
            "tree": [1, 1, 1],
            "single": [2, 2, 2],
            "ideal": [1, 0.5, 0.25],
            "given": [3, 3, 3],
        },
        xlabel="p",
        ylabel="t",
        title="",
        styles={"given": "k:"},
        ax=ax,
    )
    color = {line.get_label(): line.get_color() for line in ax.get_lines()}
    assert same_color(color["ring"], plots.RING_COLOR)
    assert same_color(color["tree"], plots.TREE_COLOR)
    assert not _is_red_or_blue(color["single"]) and not _is_red_or_blue(color["ideal"])
    assert color["single"] != color["ideal"]  # the others take distinct colours in turn
    assert same_color(color["given"], "k")  # an explicit colour in the style wins


def test_message_patterns_bars(tmp_path):
    fig = plots.message_patterns(
        {"ring": 10**6, "tree": 8320, "xla_auto": 8320}, p=8, path=str(tmp_path / "m.png")
    )
    bars = fig.axes[2].patches
    assert [
        same_color(b.get_facecolor(), c)
        for b, c in zip(bars, (plots.RING_COLOR, plots.TREE_COLOR, "0.5"), strict=True)
    ] == [True] * 3
    assert (tmp_path / "m.png").stat().st_size > 0
    plt.close(fig)


@pytest.mark.parametrize(
    ("n", "label"),
    [
        (64, "64 B"),
        (8320, "8.32 kB"),
        (14560, "14.6 kB"),
        (234_881_024, "235 MB"),
        (3_758_096_384, "3.76 GB"),
        (1000, "1 kB"),
    ],
)
def test_bytes_label(n, label):
    assert plots.bytes_label(n) == label


@pytest.mark.parametrize(
    ("n", "label"),
    [(512, "512"), (4096, "4k"), (65536, "64k"), (2**20, "1M"), (3 * 2**30, "3G"), (1000, "1000")],
)
def test_count_label(n, label):
    assert plots.count_label(n) == label


def test_readable_log_axes(ax):
    tks = [2**n for n in range(12, 21, 2)]
    ax.plot(tks, [t * 1000 for t in tks])
    plots.pow2_axis(ax, tks)
    plots.bytes_axis(ax)
    ax.figure.canvas.draw()
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4k", "16k", "64k", "256k", "1M"]
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert "1 GB" in labels and "10 MB" in labels and not any("10^" in t for t in labels)
    assert ax.get_yscale() == "log" and ax.get_xscale() == "log"


def test_plain_log_axis(ax):
    ax.plot([1, 2, 3], [0.5, 30, 2000])
    plots.plain_log_axis(ax)
    ax.figure.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert {"1", "10", "100", "1000"} <= set(labels)
    assert not any("10^" in t or "$" in t for t in labels)


def test_crossover_map_draws_the_winners(tmp_path):
    data = {
        "ps": [8, 16, 64],
        "batch_heads": [16, 4096],
        "patterns": ["allreduce", "allgather", "reduce_scatter"],
        "winner": [
            ["allgather", "allgather", "allreduce"],
            ["allreduce", "reduce_scatter", "reduce_scatter"],
        ],
        "speedup": [[1.2, 1.4, 1.0], [1.0, 1.1, 1.3]],
        "topology": "DGX H100",
    }
    fig = plots.crossover_map(data, path=str(tmp_path / "c.png"))
    ax = fig.axes[0]
    assert (tmp_path / "c.png").stat().st_size > 0
    assert ax.images[0].get_array().shape == (2, 3)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["8", "16", "64"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["16", "4k"]
    legend = {
        t.get_text(): h.get_facecolor()
        for t, h in zip(ax.get_legend().get_texts(), ax.get_legend().legend_handles, strict=True)
    }
    assert same_color(legend["allreduce"], plots.TREE_COLOR)  # the paper's tree stays blue
    assert not _is_red_or_blue(legend["allgather"]) and not _is_red_or_blue(
        legend["reduce_scatter"]
    )
    assert "1.40×" in {t.get_text() for t in ax.texts}
    plt.close(fig)


def test_crossover_map_greys_out_close_calls(tmp_path):
    """A cell whose winner beats the runner-up by less than `min_gain` is drawn grey, and
    the margins are the runner-up's time over the winner's, minus one."""
    data = {
        "ps": [8, 16],
        "batch_heads": [16],
        "patterns": ["allreduce", "allgather", "all_to_all"],
        "winner": [["allgather", "all_to_all"]],
        "seconds": {
            "allreduce": [[2.0, 1.015]],
            "allgather": [[1.0, 3.0]],
            "all_to_all": [[1.5, 1.0]],
        },
        "speedup": [[2.0, 1.015]],
    }
    margins = plots.winner_margins(data)
    assert margins[0][0] == pytest.approx(0.5) and margins[0][1] == pytest.approx(0.015)
    fig = plots.crossover_map(data, min_gain=0.02)
    ax = fig.axes[0]
    cells = ax.images[0].get_array()
    cmap = ax.images[0].get_cmap()
    norm = ax.images[0].norm
    colors = [cmap(norm(cells[0][j])) for j in range(2)]
    assert same_color(colors[0], plots.PATTERN_COLORS["allgather"])  # won by 50%
    assert same_color(colors[1], plots.BASELINE_COLOR)  # won by 1.5%: grey
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["allgather", "won by < 2%"]
    assert {t.get_text() for t in ax.texts} == {"2.00×", "1.01×\nall_to_all"}  # named
    plt.close(fig)
    fig = plots.crossover_map(data)  # without min_gain every cell keeps its winner's colour
    image = fig.axes[0].images[0]
    assert same_color(
        image.get_cmap()(image.norm(image.get_array()[0][1])), plots.PATTERN_COLORS["all_to_all"]
    )
    plt.close(fig)


def test_pattern_colours_keep_the_course_rules():
    assert plots.PATTERN_COLORS["allreduce"] == plots.TREE_COLOR
    assert plots.PATTERN_COLORS["ring"] == plots.RING_COLOR
    others = [c for n, c in plots.PATTERN_COLORS.items() if n not in ("allreduce", "ring")]
    assert not any(_is_red_or_blue(c) for c in others) and len(set(others)) == len(others)
