"""The plain helpers of `cluster.collectives` (no JAX, no namespaces): the slope in units of
D, the counts the gloo source predicts, and the delay sweep's summary."""

import pytest

from tree_attention_edu.cluster import collectives


def test_slope_counts_delays_per_call():
    k, c = collectives.slope([0.0, 0.005, 0.010], [0.004, 0.064, 0.124])
    assert k == pytest.approx(12.0) and c == pytest.approx(0.004)
    with pytest.raises(ValueError, match="2 or more distinct delays"):
        collectives.slope([0.005, 0.005], [0.1, 0.2])


def test_predicted_terms_follow_the_lockstep_ring():
    """4(p-1) for a ring all-reduce, 2(p-1) for a ring all-gather, 2 for one message; none
    on one node."""
    four = collectives.predicted_terms(4, 2)
    assert four["all-reduce"] == 12 and four["all-gather"] == 6
    assert four["collective-permute"] == four["all-to-all"] == 2
    assert collectives.predicted_terms(8, 4)["all-reduce"] == 28
    assert set(collectives.predicted_terms(4, 4).values()) == {0}
    assert set(collectives.ALGORITHMS) <= set(collectives.KINDS)


def test_delay_sweep_reads_time_against_delay():
    def report(d_ms, t_s):
        method = {"median_s": t_s, "predicted_s": t_s / 2, "collectives": {}}
        return {
            "config": {"link_delay_ms": d_ms, "command": f"run {d_ms}"},
            "links": {"inter": {"alpha_s": 0.0}},
            "methods": {"butterfly": method},
        }

    got = collectives.delay_sweep([report(10.0, 0.025), report(0.0, 0.005)])
    assert got["delays_ms"] == [0.0, 10.0] and got["commands"] == ["run 0.0", "run 10.0"]
    fly = got["methods"]["butterfly"]
    assert fly["delays_per_step"] == pytest.approx(2.0)
    assert fly["rel_err"] == pytest.approx([-0.5, -0.5])


def test_delay_sweep_measures_by_the_mean_where_every_report_keeps_it():
    """Reports that keep `mean_s` (their `rel_err` is against it) are read by the mean; a
    set where one report lacks it falls back to every report's median, and says so."""

    def report(d_ms, median_s, mean_s=None):
        method = {"median_s": median_s, "predicted_s": 0.01, "collectives": {}}
        if mean_s is not None:
            method["mean_s"] = mean_s
        return {
            "config": {"link_delay_ms": d_ms, "command": f"run {d_ms}"},
            "links": {"inter": {"alpha_s": 0.0}},
            "methods": {"tree": method},
        }

    both = collectives.delay_sweep([report(0.0, 0.02, 0.008), report(10.0, 0.05, 0.04)])
    tree = both["methods"]["tree"]
    assert both["measured_as"] == "mean_s" and tree["mean_s"] == [0.008, 0.04]
    assert tree["median_s"] == [0.02, 0.05]  # kept beside it
    assert tree["rel_err"] == pytest.approx([0.25, -0.75])
    assert tree["delays_per_step"] == pytest.approx(3.2)
    mixed = collectives.delay_sweep([report(0.0, 0.02, 0.008), report(10.0, 0.05)])
    tree = mixed["methods"]["tree"]
    assert mixed["measured_as"] == "median_s" and tree["median_s"] == [0.02, 0.05]
    assert "mean_s" not in tree and tree["rel_err"] == pytest.approx([-0.5, -0.8])


def test_delay_sweep_reads_the_methods_every_report_holds():
    """A method one report lacks is left out (not a KeyError), and does not decide which
    time the others are measured by."""

    def report(d_ms, names):
        return {
            "config": {"link_delay_ms": d_ms, "command": f"run {d_ms}"},
            "links": {"inter": {"alpha_s": 0.0}},
            "methods": {
                n: {"median_s": 0.02, "mean_s": 0.01, "predicted_s": 0.01, "collectives": {}}
                for n in names
            },
        }

    # the extra method at the smallest delay, the report the sweep reads its names from
    extra = report(0.0, ["tree", "ring"])
    del extra["methods"]["ring"]["mean_s"]
    got = collectives.delay_sweep([report(10.0, ["tree"]), extra])
    assert list(got["methods"]) == ["tree"] and got["measured_as"] == "mean_s"
    for bad, words in (
        ([extra], "2 or more reports"),
        ([report(0.0, ["tree"]), report(10.0, ["ring"])], "no method"),
    ):
        with pytest.raises(ValueError, match=words):
            collectives.delay_sweep(bad)
