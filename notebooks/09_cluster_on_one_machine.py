# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 9. A cluster on one machine
#
# **Prerequisites:** notebook 4 (meshes, collectives, the 2-level `("node", "gpu")` mesh),
# notebook 5 (ring against tree), notebook 6 (the alpha-beta cost model) and notebook 8 (the
# merge patterns). **Time:** about 40 minutes to read and do Exercises 1 to 3 (Exercises 4
# and 5, in §9.11, are homework); it runs in seconds, because it reads recorded runs (one cell reruns a small
# cluster live where root is available).
#
# Every notebook so far ran 8 simulated devices in one process, where a collective is a
# memory copy and the `("node", "gpu")` mesh is only labels. The paper's topology argument
# is about a *slow link*: the tree beats the ring because it is "reducing inter-node
# communication requirements" (the caption of its Figure 2). This notebook builds a cluster on one Linux machine, with
# real processes, real sockets and a link whose rate we set, and tests that claim.
#
# **Where this runs.** The recorded runs come from `tree-attention-edu cluster`, and from
# two scripts that drive it or its parts (`scripts/latency_sweep.py`,
# `scripts/latency_collectives.py`), on a machine with two cores (their exact commands are
# printed below, and in `results/cluster/README.md`). Building namespaces needs root; apart from §9.9's optional
# live cell, this notebook only reads the JSON those runs wrote, so it runs anywhere, and
# its outputs are checked by nbval.
#
# **Learning objectives.** After this notebook you can
#
# * say what a network namespace, a veth pair, a bridge and a token-bucket filter are, and
#   how they make nodes and a shaped link on one machine;
# * say how `jax.distributed` and gloo turn processes in different namespaces into one set
#   of devices, and read each process's own account of what it holds;
# * fit each level's α and β from all-reduces of growing size, and check β against the
#   rate the link was set to;
# * compare every decode method on the same cache, measured against the cost model, with
#   the bytes each sends inside and across nodes;
# * test "2-level beats flat on a slow link", watch the ring slow down when the link rate
#   halves, and ask where tree overtakes ring;
# * add a delay to a link, count the one-way delays each collective pays on gloo's
#   transport, and read from a recorded sweep why an Allreduce there is no tree and the
#   butterfly merge is.

# %%
import tree_attention_edu as tae

tae.simulate_devices(8)  # before JAX initialises (this notebook runs no JAX program itself)

import jax

# The course runs on 8 simulated CPU devices, also on a machine with a GPU.
jax.config.update("jax_platforms", "cpu")
import json
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Markdown, display

from tree_attention_edu import plots
from tree_attention_edu.cluster import collectives, methods, netns, run
from tree_attention_edu.perf import benchmark, calibrate

assert jax.device_count() == 8, jax.devices()

# %% [markdown]
# ## 9.1 Nodes, links and process groups
#
# A **network namespace** is a private copy of Linux's network stack: its own interfaces,
# addresses, routes and ports. A process started with `ip netns exec NS cmd` lives in
# namespace `NS`: it sees only that namespace's interfaces. One namespace per node makes a
# node.
#
# A **veth pair** is a virtual cable: two interfaces, and what enters one leaves the other.
# Each node gets one, whose other end is a port of a **bridge** (a virtual switch) in one
# more namespace. A **token-bucket filter** (`tc qdisc ... tbf rate R`) on an interface's
# way out lets bytes leave at rate R, after a first burst of one bucket; put on both ends of
# each cable, it makes a link of rate R in each direction. This kernel has no `netem`, so
# no qdisc can add latency: in §9.2 to §9.7 each link's α is whatever the kernel and gloo
# give; §9.8 adds a delay in user space.
#
# `netns.plan` lists every command a run executes, without running any:

# %%
net, commands = netns.plan(2, 1e9, run_id="RUN", hostname="myhost")
for cmd in commands:
    print(" ".join(cmd))
print("\n/etc/netns/" + net.node(1) + "/hosts:\n" + netns.hosts_file(net, 1))
# Nothing is made outside the run's own namespaces: every command names one of them.
for cmd in commands:
    assert any(ns in cmd for ns in net.namespaces), cmd
assert all(a.startswith("198.18.") for a in net.addresses)  # RFC 2544's benchmarking range
print(f"tbf: {' '.join(netns.tbf_args(1e9))}  (bucket: max({netns.MIN_BURST:,} B, "
      f"{netns.BURST_S * 1e3:g} ms at the rate); queue: {netns.QUEUE_S * 1e3:g} ms at the rate")

# %% [markdown]
# The hosts file matters: `ip netns exec` mounts `/etc/netns/NODE/hosts` over `/etc/hosts`,
# so inside node 1 this machine's name means node 1's own address, and gloo, which finds its
# interface from the host name, talks over `uplink0`.
#
# **Process groups.** The launcher starts `nodes × processes_per_node` workers, each with
# `ip netns exec`. Each calls `jax.distributed.initialize` with the coordinator in node 0,
# and asks for `devices_per_process` CPU devices: together they see one list of devices,
# ordered by process, so that each node's devices are neighbours. A collective over a set
# of devices (a *clique*) gets a gloo context with a TCP connection between every pair of
# its devices (also between two devices of one process: through the node's loopback).
# XLA:CPU asks gloo for a **ring** all-reduce, whatever the size.
#
# Each worker dies with the launcher (Linux's parent-death signal, and a watchdog thread),
# and the launcher removes everything it made on every way out; after a `kill -9` of the
# launcher, the next start removes what it left (`tests/test_cluster.py` checks every
# signal, with zero left behind).
#
# ## 9.2 The recorded runs
#
# Two runs, named nodes × processes per node × devices per process, each measured at two
# link rates, the second half the first, on the same problem (their settings are printed
# below): `2x1x2` puts the lightest load on the two cores, `2x2x2` runs two processes in
# each node.

# %%
ROOT = next(p for p in (Path.cwd(), *Path.cwd().parents) if (p / "results" / "cluster").is_dir())
runs = {name: json.loads((ROOT / "results" / "cluster" / f"{name}.json").read_text())
        for name in ("2x1x2", "2x2x2")}
for name, rep in runs.items():
    c = rep["config"]
    assert c["devices"] == c["nodes"] * c["processes_per_node"] * c["devices_per_process"]
    assert [x["set_Bps"] * 8 / 1e9 for x in rep["rates"]] == list(c["link_gbit"])
    pr = c["problem"]
    print(f"{name}: {c['devices']} devices in {c['processes']} processes; links at "
          f"{' then '.join(f'{g:g}' for g in c['link_gbit'])} Gbit/s; Tk = {c['seq_len']:,}, "
          f"batch {pr['batch']}, one query, {pr['q_heads']} heads of {pr['head_dim']}, "
          f"{pr['dtype']}; {c['repeats']} interleaved rounds\n    {c['command']}")
rep = runs["2x2x2"]

# %% [markdown]
# What each process printed, in its own words (the run with 4 processes; the first three
# lines of each: its node and its devices, where they sit in the mesh, and what it times):

# %%
for _, lines in sorted(rep["process_lines"].items(), key=lambda kv: int(kv[0])):
    for line in lines[:3]:
        print(line)
assert len(rep["process_lines"]) == rep["config"]["processes"]

# %% [markdown]
# ## 9.3 Each level's α and β
#
# Each level is measured the way the tree uses it: an all-reduce over the mesh's `"gpu"`
# axis (inside each node) or over `"node"` (across nodes), every device taking part, for
# messages from a few hundred bytes to a few MB per device, interleaved with the methods'
# own calls so that whatever else the machine does hits both alike. gloo's ring takes $2(g-1)$ steps over $g$
# ranks, each moving $n/g$ bytes; across nodes, the $k$ devices of a node share its
# uplink, so a step puts $k\,n/g$ bytes on the link. Per step,
# $t = \alpha + \text{bytes}/\beta$: α is the **mean** over the small messages, β the inverse
# slope over the large ones (the link's own rate, comparable with the rate set where the
# $k\,n/g$ count holds; the text after the figure gives runs where the fit came out above
# the rate set, and why that count is the likely cause). Notebook 6
# (Exercise 2) and `calibrate.fit_link` differ in both: α is the **median** of the small
# messages, and β the median of $n/(t - \alpha)$ over the large ones, not a slope. The
# reason for the difference in α, and its size here, follow the figure.

# %%
def level_rows(rep):
    for r in rep["rates"]:
        inter, intra = r["links"]["inter"], r["links"]["intra"]
        yield r["set_Bps"], inter, intra


print(f"{'run':<7}{'set':>10}{'inter alpha':>13}{'inter beta':>13}{'of set':>8}"
      f"{'intra alpha':>13}{'intra beta':>13}")
for name, r in runs.items():
    for set_Bps, inter, intra in level_rows(r):
        ratio = inter["beta_Bps"] / set_Bps
        print(f"{name:<7}{set_Bps * 8 / 1e9:>7.2g} Gb{inter['alpha_s'] * 1e6:>10.0f} us"
              f"{inter['beta_Bps'] / 1e6:>8.1f} MB/s{ratio:>8.0%}{intra['alpha_s'] * 1e6:>10.0f} us"
              f"{intra['beta_Bps'] / 1e6:>8.0f} MB/s")
        assert 0.8 <= ratio < 1.0, (name, set_Bps, ratio)  # within 20% of the rate set, below

# %%
fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
for ax, level in zip(axes, ("inter", "intra"), strict=True):
    for (set_Bps, inter, intra), color, ls in zip(level_rows(rep), ("0.1", "0.6"), ("-", "--"),
                                                   strict=True):
        fit = inter if level == "inter" else intra
        pts = np.array(fit["points"])
        ax.scatter(pts[:, 0], pts[:, 1] * 1e3, s=8, color=color, alpha=0.5)
        xs = np.geomspace(pts[:, 0].min(), pts[:, 0].max(), 50)
        ax.plot(xs, (fit["alpha_s"] + xs / fit["beta_Bps"]) * 1e3, ls, color=color,
                label=f"link set to {set_Bps * 8 / 1e9:g} Gbit/s")
    ax.set_xscale("log")
    ax.set_yscale("log")
    plots.bytes_axis(ax, "x")
    ax.set_xlabel("bytes per step (on the link, for inter)")
    ax.set_ylabel("ms per step")
    ax.set_title(f"{level}-node level ({rep['config']['devices']} devices)")
    ax.legend(fontsize=8)
plt.tight_layout()
plt.show()
intra_drop = [slow[2]["beta_Bps"] / fast[2]["beta_Bps"]
              for r in runs.values()
              for fast, slow in [sorted(level_rows(r), key=lambda x: -x[0])]]
assert 1.2 < intra_drop[0] < 1.5 and 0.9 < intra_drop[1] < 1.1  # a third higher; equal
big4 = {}  # the 4-device run's large intra-node steps, per size: their spread
for x in runs["2x1x2"]["rates"]:
    for n_, t_ in x["links"]["intra"]["points"]:
        if n_ > calibrate.SMALL_MESSAGE:
            big4.setdefault((x["set_Bps"], n_), []).append(t_)
spread4 = max(max(v) / min(v) for v in big4.values())
print(f"2x1x2, intra-node steps above 16 KiB: the widest spread at one size and rate is "
      f"{spread4:.1f}x (slowest over fastest)")
assert spread4 > 3
inter_drop = [slow[1]["beta_Bps"] / fast[1]["beta_Bps"]
              for r in runs.values()
              for fast, slow in [sorted(level_rows(r), key=lambda x: -x[0])]]
print("beta at the slower rate over the faster, per run: inter-node "
      + ", ".join(f"{x:.2f}" for x in inter_drop) + "; intra-node "
      + ", ".join(f"{x:.2f}" for x in intra_drop))
assert all(0.4 < x < 0.6 for x in inter_drop)  # the rate set halved: β about halves

# %% [markdown]
# *Figure: each dot is one timed all-reduce, per ring step; each line is the fit
# $\alpha + \text{bytes}/\beta$. Across nodes (left) the two rates give two parallel
# slopes, a factor 2 apart (the ratios printed above): the link is the bottleneck, as set.
# Inside a node (right, the 8-device run) the tbf shapes nothing, and the two rates'
# fitted β are about equal; in the 4-device run (not plotted) the slower rate's came out
# about a third higher (the intra-node ratios printed above). The tbf cannot cause that;
# the likely reason is the spread of the fit's own points on this machine: in that run
# the large intra-node steps of one size took from one time to several times it (the
# widest spread is printed above). The small messages spread widely too (the
# percentiles are printed below).*
#
# That spread is probably this machine, not the network (a plain veth round trip takes
# 0.012 ms in `results/cluster/README.md`'s probe table, printed again in §9.8). Its two cores run the workers' device
# threads and gloo's threads; the likely reason, not measured here: a step whose peer is
# awake is fast, a step that must wake it waits for the scheduler, milliseconds (the 90th
# percentile below).
# §9.5 and Exercise 4 take 2 ms as a round figure for that wait: an assumption read off
# these percentiles, not a constant of the kernel. A decode adds many steps, so α here is
# their mean, what a sum of many steps pays; the median, notebook 6's α, is a typical single
# step, and with this spread the two differ (both are printed below). In these two
# records the inter-node β is within ±20% of the rate set (asserted above), every fit
# below it, by 3% to 10% (the table's "of set"). That is one run per layout: the README's
# six re-runs of the 8-device layout, with the same fit (but later code, whose rounds time
# other calls and in another order), put it above the rate set, from 108% to 193% of it,
# four of the six runs more than 20% above (`results/cluster/README.md`, "Re-runs of the
# inter-node fit"; not printed here), which a link shaped to that rate cannot carry. The
# model-check runs of §9.4 (another six, then nine) fitted it above and below the
# rate set (printed there). The fit counts the
# bytes of a node's 4 devices as crossing its link at once, which holds only if their
# rings overlap in time. With 2 processes per node they need not (a likely reason, not
# measured; nor was the effect of the changed rounds); if they do not, fewer bytes cross
# in a step than the fit counts, so each step looks fast for its bytes and β comes out
# too high. The 4-device layout, one process per node, stayed below the rate set in its
# re-runs, which had the same changes.

# %%
small = np.array([t for _, inter, intra in level_rows(rep) for f in (inter, intra)
                  for n_, t in f["points"] if n_ <= 16384])
print(f"small-message steps, {rep['config']['devices']} devices: 10th percentile "
      f"{np.percentile(small, 10) * 1e3:.2f} ms, median {np.median(small) * 1e3:.2f} ms, "
      f"90th percentile {np.percentile(small, 90) * 1e3:.2f} ms; mean {np.mean(small) * 1e3:.2f} "
      f"ms, {np.mean(small) / np.median(small):.1f}x the median (all pooled over both levels "
      f"and both rates; this notebook's alpha is the mean per level and rate, notebook 6's the "
      f"median)")
assert 1e-3 < np.percentile(small, 90) < 4e-3  # the slow steps: milliseconds, about 2 ms
worst = max(abs(inter["beta_Bps"] / s_ - 1) for r in runs.values()
            for s_, inter, _ in level_rows(r))
display(Markdown(f"The fitted inter-node β is within {worst:.0%} of the rate set, in both "
                 f"records and at both rates."))

# %% [markdown]
# **Exercise 1 (code).** Fit β yourself. `points` is a list of `(bytes, seconds)` pairs, one
# per timed ring step (as in `rep["rates"][0]["links"]["inter"]["points"]`). Return β in
# bytes per second: the inverse slope of the least-squares line $t = a + \text{bytes}/\beta$
# through the messages larger than 16 KiB (the small ones measure α, not β). The test cell
# compares your β with the recorded fit and with the rate set on the link, then with a
# least-squares fit to points it builds itself.

# %%
def fit_beta(points: list) -> float:
    """Bytes per second: 1 / slope of a least-squares line through the points > 16 KiB."""
    # TODO: which points measure β (the text above says), and what line through them?
    # np.polyfit fits one.
    return float(np.mean([n / t for n, t in points]))  # wrong on purpose: replace it


stub_fit_beta = fit_beta


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "fit_beta", "locked": false, "schema_version": 3, "solution": true, "task": false}
def fit_beta(points: list) -> float:  # replaces the stub
    """Bytes per second: 1 / slope of a least-squares line through the points > 16 KiB."""
    big = np.array([(n, t) for n, t in points if n > 16 * 1024], float)
    slope, _ = np.polyfit(big[:, 0], big[:, 1], 1)
    return float(1 / slope)


# %% nbgrader={"grade": true, "grade_id": "test_fit_beta", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_fit_beta(fn):
    """Raises AssertionError unless fn refits the recorded β, within ±20% of the rate set,
    and the least-squares β on points the test builds itself."""
    for r in runs.values():
        for x in r["rates"]:
            mine = fn(x["links"]["inter"]["points"])
            np.testing.assert_allclose(mine, x["links"]["inter"]["beta_Bps"], rtol=1e-6)
            assert 0.8 <= mine / x["set_Bps"] <= 1.2
    # Points built here, in no record: small messages far off the line, large ones on
    # t = a + bytes/β with 2% noise, shuffled; the least-squares β through the large ones.
    rng = np.random.default_rng(3)
    small_n = [256, 1024, 4096, 8192] * 3
    large_n = [2 ** e for e in range(15, 23)] * 3
    points = ([[b, 2e-3 * (1 + rng.random())] for b in small_n]
              + [[b, (1e-3 + b / 3e7) * (1 + 0.02 * rng.normal())] for b in large_n])
    points = [points[i] for i in rng.permutation(len(points))]
    large = np.array([pt for pt in points if pt[0] > 16 * 1024], float)
    beta_ls = 1 / np.polyfit(large[:, 0], large[:, 1], 1)[0]
    np.testing.assert_allclose(fn(points), beta_ls, rtol=1e-6)


try:
    check_fit_beta(stub_fit_beta)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
check_fit_beta(fit_beta)
print("your beta == the recorded fit, within ±20% of the rate set, for "
      "both records and rates; and on points the test built itself")

# %% [markdown]
# ## 9.4 Every method on the same cache
#
# Every method decodes the same cache (checked against a float64 numpy reference inside
# each worker), timed in interleaved rounds (all but `reduce_scatter`, below): the median
# over rounds, the slowest process's (the records below; the three runs of `check/mean/`
# also record the mean over every process's rounds, and check the prediction against it:
# §9.4, "Which time a prediction is checked against"):
#
# * `tree`: the **flat** tree, on a 1-D mesh `("x",)` over all devices: its Allreduces run
#   as gloo rings over every device (three: one per operand, §9.8), so every step of such a
#   ring waits for the ring's inter-node hops;
# * `tree_2level`: the course's 2-level schedule (the idea behind the paper's §5.3 topology
#   argument) on the `("node", "gpu")` mesh: Allreduce over `"gpu"` inside each node, then
#   over `"node"` with the already-reduced states;
# * the other merge patterns of notebook 8, on the 2-level mesh (their all-gathers and
#   all-to-alls span both axes at once); `reduce_scatter` is timed on its own after every
#   other method, outside the interleaved rounds, because after a gloo reduce-scatter,
#   transfers between two devices of one process crawl (the run's note on it is printed
#   below the tables). It is timed back at the first rate only: the slower rate's table,
#   and §9.6's slowdowns, have no `reduce_scatter`;
# * the two rings: `ring` (pass-KV) and `ring_pass_q`.
#
# Bytes are per device and per call, read from the compiled program's collectives and their
# replica groups, and split by where each message goes under gloo's algorithms
# (`cluster.methods.level_bytes`); "link" is what leaves the busiest node.

# %%
print(run.summary(rep))
for r in runs.values():  # reduce_scatter: at the first rate only, as its note says
    assert "reduce_scatter" in r["rates"][0]["methods"]
    assert all("reduce_scatter" not in x["methods"] for x in r["rates"][1:])
print(f"\nreduce_scatter's note: {rep['methods']['reduce_scatter']['note']}")

# %% [markdown]
# The bytes are exact, so they can be checked against closed forms. With $n$ the bytes
# of one device's states ($B\,T_q\,H_q$ maxima, then $B\,T_q\,H_q(D_v+1)$ sums, in
# float32), $k$ devices per node and $p$ in all:
#
# * 2-level tree: rings of $k$ inside nodes and of 2 across, so $2\frac{k-1}{k}n$ inside
#   and $n$ across per device;
# * flat tree: rings of $p$ (one per operand, §9.8) whose bytes add up to
#   $2\frac{p-1}{p}n$ per device, of which the node's last device sends its share across;
# * ring: $p-1$ steps of a K and a V block of $T_k/p$ keys, sent across by one device per
#   node, then an all-reduce that broadcasts one device's output $o$ ($B\,T_q\,H_q D_v$
#   float32 numbers), so that every device holds a bit-identical copy: one ring of $p$,
#   $2\frac{p-1}{p}o$ per device.

# %%
c = rep["config"]
prob = c["problem"]
B, Hq, Hkv, D = prob["batch"], prob["q_heads"], prob["kv_heads"], prob["head_dim"]
p, k_dev, nodes = c["devices"], c["processes_per_node"] * c["devices_per_process"], c["nodes"]
n = B * Hq * 4 + B * Hq * (D + 1) * 4
m = rep["methods"]
assert m["tree_2level"]["bytes_intra"] == 2 * (k_dev - 1) / k_dev * n
assert m["tree_2level"]["bytes_inter"] == n
per_device = 2 * (p - 1) / p * n
assert np.isclose(m["tree"]["bytes_inter"] + m["tree"]["bytes_intra"], per_device)
assert np.isclose(m["tree"]["bytes_inter"], per_device * nodes / p)
block = B * (c["seq_len"] // p) * Hkv * D * 4
o = B * Hq * D * 4
for r in runs.values():  # the rings: a K and a V permute per step, then the broadcast
    assert r["methods"]["ring"]["collectives"] == {
        "collective-permute": 2 * (r["config"]["devices"] - 1), "all-reduce": 1}
print("the recorded ring's collectives: " + ", ".join(
    f"{name} {r['methods']['ring']['collectives']}" for name, r in runs.items()))
assert m["ring"]["link_bytes"] == (p - 1) * 2 * block + 2 * (p - 1) / p * o
assert max(r["max_abs_err"] for r in m.values()) < 2e-5  # float32 against float64
print(f"n = {n:,} B; ring block = {block:,} B; o = {o:,} B; the ring puts "
      f"{m['ring']['link_bytes'] / m['tree_2level']['link_bytes']:,.0f}x the 2-level tree's "
      f"bytes on the link")

# %% [markdown]
# **Measured against predicted.** In these records (the model since is at the end of this
# section) the cost model (`costmodel.predict_*`) gets, per run and per rate, the two
# levels' α and β above, `ring_only=True` (gloo's rings), `uplinks=1`
# (the devices of a node share its link), the local decode rate measured with every device
# busy, the local copy rate (the ring's loop copies each K/V block before sending it, as
# XLA:CPU compiles it), and the per-call overhead (with `sync_s`, what a collective costs
# right after the kernel beyond its own α, measured in the same rounds). The flat tree is
# priced as three rings over all devices (one per operand of its Allreduces, §9.8), each
# step at the α and β of a step of that ring, measured on it: all-reduces over all $p$
# devices at the same sizes as the levels', in the same rounds (the record's
# `links["flat"]`; `Topology.flat_ring`). The levels' fits cannot stand in for it: its step
# fits below the larger of the two levels' α in every run and rate (printed below). A
# likely part of the reason, not measured: a level's ring spreads each call's fixed cost
# over its $2(g-1)$ steps, the ring over all devices over $2(p-1)$. Not the whole of it:
# in the 8-device run the ring inside a node, over 4 devices, fits a lower step still. An
# earlier version of the model priced each step at the larger of the two levels' α; from
# these records' own fits, that rule over-predicts the flat tree in every row, each time
# by more than the measured ring's step misses it (both printed below). One fitted β of
# that ring, the 8-device run's at 1 Gbit/s, is above the rate set (printed below): its
# large steps were 128–512 kB, and the 128 kB one sits at the tbf bucket, which lets that
# much through unshaped. The runs now time this ring with larger messages; refitted
# without its 128 kB points, no prediction here moves by more than 0.2%
# (`results/cluster/README.md`), since the states are a few kB.

# %%
def prediction_rows(runs):
    for name, r in runs.items():
        for rate in r["rates"]:
            for method, rec in rate["methods"].items():
                yield name, rate["set_Bps"], method, rec["median_s"], rec["predicted_s"]


for name, r in runs.items():
    for rate in r["rates"]:
        lk = rate["links"]
        k_node = r["config"]["processes_per_node"] * r["config"]["devices_per_process"]
        print(f"{name} at {rate['set_Bps'] * 8 / 1e9:g} Gbit/s: alpha per step of the ring over "
              f"all {r['config']['devices']} devices {lk['flat']['alpha_s'] * 1e3:.2f} ms; of "
              f"the levels' rings, across (2 devices) {lk['inter']['alpha_s'] * 1e3:.2f} ms, "
              f"inside a node ({k_node} devices) "
              f"{lk['intra']['alpha_s'] * 1e3:.2f} ms; sync_s {rate['local']['sync_s'] * 1e3:.2f} ms; "
              f"the ring's beta {lk['flat']['beta_Bps'] / 1e6:.1f} MB/s ("
              f"{lk['flat']['beta_Bps'] / rate['set_Bps']:.0%} of the rate set)")
        assert lk["flat"]["alpha_s"] < max(lk["inter"]["alpha_s"], lk["intra"]["alpha_s"])
over_set = [(name, rate["set_Bps"]) for name, r in runs.items() for rate in r["rates"]
            if rate["links"]["flat"]["beta_Bps"] > rate["set_Bps"]]
assert over_set == [("2x2x2", 1e9 / 8)]  # the one ring beta above its rate (text below)
r8 = {x["set_Bps"]: x for x in runs["2x2x2"]["rates"]}
worst8 = {b: min(m["rel_err"] for n_, m in x["methods"].items() if n_ not in ("ring", "tree"))
          for b, x in r8.items()}
assert r8[1e9 / 8]["local"]["sync_s"] == 0 and worst8[1e9 / 8] < worst8[0.5e9 / 8]


def flat_tree_predicted(r, rate, measured_ring=True):
    """The model's flat tree for a recorded run and rate, from the record's fits: with the
    ring over all devices as measured, or (False) at the earlier rule, the larger level α."""
    c = r["config"]
    layout = {k: c[k] for k in ("nodes", "processes_per_node", "devices_per_process", "devices")}
    links = {k: v for k, v in rate["links"].items() if measured_ring or k != "flat"}
    _, flat = methods.topologies(SimpleNamespace(s=SimpleNamespace(**layout)), links,
                                 rate["local"])
    problem = benchmark.Problem(seq_len=c["seq_len"], **c["problem"])
    return calibrate.predict("tree", c["seq_len"], flat, problem).total_s


old_rule, new_rule = [], []
for r in runs.values():
    for rate in r["rates"]:
        tree = rate["methods"]["tree"]
        assert np.isclose(flat_tree_predicted(r, rate), tree["predicted_s"])  # as recorded
        new_rule.append(tree["rel_err"])
        old_rule.append(flat_tree_predicted(r, rate, measured_ring=False) / tree["median_s"] - 1)
print("the flat tree's error, each run and rate: priced at the measured ring's step "
      + ", ".join(f"{e:+.0%}" for e in new_rule) + "; at the larger level α instead "
      + ", ".join(f"{e:+.0%}" for e in old_rule))
assert min(old_rule) > 0 and all(abs(n_) < abs(o) for n_, o in zip(new_rule, old_rule))
print()
rows = list(prediction_rows(runs))
within = [(n_, s, mt) for n_, s, mt, ms, ps in rows if abs(ps / ms - 1) <= calibrate.BAND]
print(f"{'run':<7}{'set':>7}  {'method':<15}{'measured ms':>12}{'predicted ms':>13}{'error':>8}")
for name, set_Bps, method, ms, ps in rows:
    print(f"{name:<7}{set_Bps * 8 / 1e9:>5.2g} G  {method:<15}{ms * 1e3:>12.1f}{ps * 1e3:>13.1f}"
          f"{ps / ms - 1:>+8.0%}")
rings = [(ms, ps) for _, _, mt, ms, ps in rows if mt == "ring"]
print(f"\nwithin ±{calibrate.BAND:.0%}: {len(within)} of {len(rows)}; the pass-KV ring in "
      f"every case: {all(abs(ps / ms - 1) <= calibrate.BAND for ms, ps in rings)}")
ring_err = max(abs(ps / ms - 1) for ms, ps in rings)
others = [ps / ms - 1 for _, _, mt, ms, ps in rows if mt != "ring"]
flat_err = [ps / ms - 1 for _, _, mt, ms, ps in rows if mt == "tree"]
flat_worst = max(abs(e) for e in flat_err)
assert ring_err < 0.10 and flat_worst < 0.2  # the ring within 10%; the flat tree within 20%
eight = [(mt, ps / ms - 1) for n_, _, mt, ms, ps in rows
         if n_ == "2x2x2" and mt not in ("ring", "tree")]
assert all(e < 0 for _, e in eight)  # the 8-device run: every other method under-predicted
display(Markdown(
    f"The pass-KV ring is predicted within {ring_err:.0%} in both records and at every rate, "
    f"and the flat tree within {flat_worst:.0%} in all {len(flat_err)} of its rows. The "
    f"other methods' errors range from {min(others):+.0%} to {max(others):+.0%}; in the "
    f"8-device run every one of them is under-predicted at every rate it was timed at, by "
    f"{-max(e for _, e in eight):.0%} to {-min(e for _, e in eight):.0%}."))

# %% [markdown]
# Why the errors look as they do. The bandwidth-bound ring is predicted mostly from the
# link's β, within ±20% of the rate set in these records (§9.3 says when it was not).
# The latency-bound methods, which send a few kB, depend on α
# and on the local kernel: collective steps whose cost on this machine spreads widely
# (§9.3; a scheduler waking a sleeping peer is the likely reason), and a kernel that
# shares two cores with every other device. Every input of the model was timed in the same
# interleaved rounds as every method but `reduce_scatter` (timed after them), so that both
# saw the same load. The flat tree, priced
# at its own ring's measured step, is predicted within 20% (the ring within 10%) in these
# records, not in every later run (`results/cluster/README.md`, "Re-runs of the
# inter-node fit", and the runs below). The 8-device
# record's under-prediction of everything else is not explained by these records. A
# hypothesis: its 4 processes of 2 devices each share the machine's cores, and a
# collective issued after a kernel must wait until all of them reach it, which the
# levels' fits (calls after a program with no kernel) do not include; it would leave open
# why the flat tree, a collective after a kernel too, is predicted well in that run. The
# one term these records price such a wait with, `sync_s` (printed above: the median over
# process 0's rounds of "kernel, then a 4-byte all-reduce" less the two timed alone,
# floored at 0), is a constant added once per decode; it reads 0 in the 8-device run at
# 1 Gbit/s, where the under-prediction is worst, and 2.47 ms at 0.5 Gbit/s. These records
# cannot say more; the next subsection measures the wait, and later runs price it. On a
# cluster of real GPUs with their own cores, α is expected to be the network's, and these
# terms the microseconds of notebook 6 (notebook 6's model; no GPU cluster was measured
# here).
#
# ### The wait after the kernel, measured, and a model that prices it (issue 30)
#
# The project's issue 30 asks the cost model for every (method, rate) pair of the 8-device
# layout (a *cell*: 9 methods at 1 Gbit/s and 8 at 0.5 Gbit/s, the reduce-scatter being
# timed at the first rate only) within ±30%, in each of three runs. The 8-device record
# above misses it (its table). This subsection measures the wait the paragraph above
# supposes, prices it, and checks the result in new runs.
#
# One exploratory run (`results/cluster/check/waits-by-length.json`; made with programs
# added to the run for it, a patch not kept, described in the file; its command is printed
# below), in its own interleaved rounds, timed the kernel alone at five lengths ("K"), the
# same kernel followed by a 4-byte all-reduce over all devices ("KS"), and that all-reduce
# alone ("S"). KS less S, round by round, is what the kernel costs a collective issued
# after it: the kernel, the wait for the last device of every process, and whatever the
# 4-byte all-reduce costs more after the kernel than alone. The per-call overhead cancels
# in KS less S; the "K" column includes it, so "beyond K" is the wait less one overhead
# (the file has no overhead of its own; the six runs below measured theirs). Why the
# wait is so long (peers to wake, or 8 devices' kernels contending for the machine's
# cores) is not measured.

# %%
import itertools
import statistics

waits = json.loads((ROOT / "results" / "cluster" / "check" / "waits-by-length.json").read_text())
wr = waits["round_s_by_process"]
print(waits["command"])
assert "--processes-per-node 2 --devices-per-process 2" in waits["command"]
assert "--nodes 2" in waits["command"] and "--link-gbit 1 " in waits["command"]


def pooled_median(name):
    return statistics.median(t for proc in wr[name] for t in proc)


def paired_median(a, b):
    return statistics.median(x - y for pa, pb in zip(wr[a], wr[b], strict=True)
                             for x, y in zip(pa, pb, strict=True))


wait_lens = [2048, 4096, 8192, 12288, 16384]
alone = [pooled_median(f"x K {tk}") for tk in wait_lens]
waited = [paired_median(f"x KS {tk}", "x S 4") for tk in wait_lens]
gap = [w - a for a, w in zip(alone, waited, strict=True)]
ref = wait_lens.index(12288)  # 3/4 of the decoded 16,384, where the runs measure it
# Read at 12,288 and scaled: all of KS - S in proportion to the length (a rate), or the
# kernel (with its overhead) in proportion plus the wait beyond it as it was at 12,288 (a
# constant). The last two columns are each reading's miss against KS - S.
as_rate = [waited[ref] * tk / wait_lens[ref] for tk in wait_lens]
as_const = [alone[ref] * tk / wait_lens[ref] + gap[ref] for tk in wait_lens]
print(f"{'Tk':>7}{'K ms':>8}{'KS - S ms':>11}{'beyond K ms':>13}   miss read at 12,288: "
      f"rate  constant")
for row in zip(wait_lens, alone, waited, gap, as_rate, as_const, strict=True):
    tk, a, w, g, r_, c_ = row
    print(f"{tk:>7,}{a * 1e3:>8.2f}{w * 1e3:>11.2f}{g * 1e3:>13.2f}   {r_ / w - 1:>+25.0%}"
          f"{c_ / w - 1:>+10.0%}")
rate_miss = [r_ / w - 1 for r_, w in zip(as_rate, waited, strict=True)]
const_miss = [c_ / w - 1 for c_, w in zip(as_const, waited, strict=True)]
small_ar = {b: pooled_median(f"x S {b}") for b in (4, 64, 256, 2048)}
print("an all-reduce over all devices alone, by bytes per device: "
      + ", ".join(f"{b} B {t * 1e3:.1f} ms" for b, t in small_ar.items()))
runs_overhead = [x["links"]["overhead_s"] for sub in ("", "design") for f in sorted(
    (ROOT / "results" / "cluster" / "check" / sub).glob("2x2x2-run*.json"))
    for x in json.loads(f.read_text())["rates"]]
o_max = max(runs_overhead)
growth = (gap[-1] + o_max) / (gap[0] + o_max)
print(f"the wait at 16,384 against 2,048, with the largest per-call overhead of the six runs "
      f"below, at either rate ({o_max * 1e3:.2f} ms), added back to both: {growth:.1f} times")
assert {len(rounds) for v in wr.values() for rounds in v} == {15}  # rounds per process
assert all(w > a for a, w in zip(alone, waited, strict=True))  # always waited for longer
assert all(y > x - 1e-4 for x, y in itertools.pairwise(gap)) and growth > 3
assert abs(gap[1] - gap[0]) < 1e-5  # the same wait at 2,048 and 4,096, to 0.01 ms
assert max(map(abs, rate_miss)) < 0.25 < 1 < min(abs(x) for x in const_miss[:2])
assert 0 < const_miss[-1] < rate_miss[-1]  # at 16,384 alone, the constant misses less
assert all(small_ar[4] < t / 5 for b, t in small_ar.items() if b > 4)

# %% [markdown]
# The wait beyond the kernel never shrinks as the length grows (within 0.1 ms), and it is
# more than three times longer at 16,384 keys than at 2,048, even with the largest
# overhead of the later runs added back to both (printed; a larger overhead would lower
# the ratio). Read at 12,288 keys, as a rate it misses the other lengths by at most 25%; as a constant, by more than 100% at the two shortest, though at
# 16,384 alone the constant misses by less than the rate (both printed), and 16,384 read
# from 12,288 is the one step the runs below use. The model takes the rate, which errs
# less across the lengths measured, 2,048 to 16,384 keys (a choice for that range, not
# one these runs test); below 2,048 keys, where four of §9.7's six lengths lie, neither
# was measured, and the same wait at 2,048 and 4,096 (to 0.01 ms) hints at a fixed part that a rate
# does not have. The runs below
# decode one length, so they cannot show how the wait scales; at that length the next cell
# compares the two readings. (A first exploratory run, not kept, timed other programs at
# 16,384 keys only.) The 4-byte
# all-reduce is more than five times faster than the larger ones printed (gloo's ring
# cuts a buffer into two segments per rank and skips the empty ones, so one word over 8
# devices sends one segment of 16; `results/cluster/README.md` has runs of few words), so how the wait divides between
# the kernel and the first collective after it is not measured: the model charges it all
# to the kernel.
#
# Since these records the runs price three things differently (`cluster.levels`), each
# measured in the run's own rounds, none at the decoded length or on a method's program:
#
# * **the waited-for kernel**: the local decode as a rate, a shard's bytes over the median,
#   over every process's rounds, of "kernel, then the 4-byte all-reduce" less "that
#   all-reduce alone", at `levels.cal_len` (3/4 of the decoded length, where no method is
#   timed; `levels.waited_kernel_s`), capped at the kernel's rate timed alone. `sync_s` is 0.
# * **the all-gather and the all-to-all timed alone** over all devices at the sizes printed
#   below: α the mean of the small calls' times (per call; the mean is the levels' rule of
#   §9.3, chosen there for steps summed many times, taken here for one rule), β the inverse
#   slope through the large ones, priced as measured (`levels.KINDS`, `Topology.measured`)
#   instead of by the formulas' step counts. For the `allgather` and `all_to_all` merges,
#   which issue one of these after the kernel, this is close to timing their own collective
#   alone, at other sizes. The reduce-scatter is not among them: it slows later transfers,
#   and is timed last (the next subsection times it there).
# * **the chain**: a step of the ring over all devices as back-to-back all-reduces pay it,
#   from a program of `levels.CHAIN` dependent all-reduces: its time less the lone
#   all-reduce's of the same size and round, over the added all-reduces' steps, averaged
#   (`levels.fit_chain`; the lone step is kept if that average is not above 0). It prices
#   the flat tree's all-reduces, which follow one another (one per operand, §9.8), and the
#   pass-KV ring's last (which follows permutes). The 2-level tree's and `one_pass`'s
#   rings follow one another too, level by level, but are priced at each level's lone
#   all-reduce: no chain was measured per level.
#
# Three runs made with a first version of these terms (`check/design/`; the commit is named
# in `results/cluster/README.md`; begun as the check of that version, their commands name
# the check runs' paths, and they became design runs when it changed) took the kinds' (the all-gather's and the all-to-all's
# timed alone) α and β as medians and the kernel alone
# from process 0. Code reviews after those runs found both inconsistent (with the levels'
# rule; with the waited-for kernel, read from every process), and they were changed; the
# next cell re-reads the design runs by the new rule for the kinds, which gained cells
# there: the change was made knowing that. The next three runs, one after the other
# (`check/2x2x2-run{1,2,3}.json`), check the model as it stands; in them, each change
# taken back alone leaves every count as it is (printed below). Two more changes are
# inert at 8 devices (sizes rounded to a multiple of 4·p bytes; the chain's fallback,
# never taken). Every record's predictions are recomputed below from its own fits, and
# so are the model of this notebook's records (the kernel alone plus `sync_s`, both from
# process 0's rounds, the formulas for the all-gather and all-to-all, the ring's step
# from lone all-reduces) and variants: one term taken back, the wait read otherwise (as a
# rate or a constant, from every process, process 0 or the slowest; a constant read by
# the records' rule carries one per-call overhead less, and adding it back moves no count,
# asserted below), the two changes taken back.

# %%
from tree_attention_edu.cluster import levels

CHECK = ROOT / "results" / "cluster" / "check"
check = {i: json.loads((CHECK / f"2x2x2-run{i}.json").read_text()) for i in (1, 2, 3)}
design = {i: json.loads((CHECK / "design" / f"2x2x2-run{i}.json").read_text()) for i in (1, 2, 3)}
print(f"sizes of the all-gather and all-to-all timed alone, bytes per device: "
      f"{', '.join(f'{n:,}' for n in levels.kind_sizes(8))}; the chain: {levels.CHAIN} "
      f"all-reduces")
assert levels.kind_sizes(8) == list(levels.KIND_SIZES)  # the rounding: inert at 8 devices
for r in (*check.values(), *design.values()):
    assert r["config"]["devices"] == 8 and r["config"]["repeats"] == 9
    for x in r["rates"]:
        assert x["local"]["seq_len"] == 3 * r["config"]["seq_len"] // 4
        assert x["local"]["mem_Bps"] < x["local"]["kernel_alone_Bps"]  # the cap never binds
        assert x["links"]["flat"]["chain"]["alpha_s"] > 0  # the chain's fallback not taken
rate_problem = check[1]["config"]["problem"]
assert all(r["config"]["problem"] == rate_problem for r in (*check.values(), *design.values()))


def predicted_by(r, name, links, local):
    """The cost model's time for method `name` in run `r`, from these links and local fits."""
    c = r["config"]
    layout = {k: c[k] for k in ("nodes", "processes_per_node", "devices_per_process", "devices")}
    two, flat = methods.topologies(SimpleNamespace(s=SimpleNamespace(**layout)), links, local)
    problem = benchmark.Problem(seq_len=c["seq_len"], **c["problem"])
    return calibrate.predict(methods.PACKAGE_METHOD[name], c["seq_len"],
                             flat if name == "tree" else two, problem).total_s


def by_medians(points):
    """α and β by `calibrate.fit_link` (medians): the kinds' first rule."""
    link = calibrate.fit_link(points)
    return link.alpha_s, link.beta_Bps


def model_inputs(rate, wait="waited", kinds="as recorded", chain=True, cap="every process",
                 add_overhead=False):
    """A rate's links and local fits, with terms taken back or read otherwise.

    `wait`: "waited" (as recorded: a rate, from every process's rounds), "rate, process 0"
    (the same from process 0's rounds and kernel only), or the kernel's rate timed alone
    plus a constant `sync_s` (the median over rounds of "kernel, then the 4-byte
    all-reduce" less the two timed alone, at least 0): "process 0" (this notebook's
    records' rule: process 0's kernel and rounds), "every process" or "slowest" (the
    kernel over every process's rounds; the rounds pooled, or each process's median, the
    largest). `kinds`: "as recorded", "none" (the formulas), "levels' rule" (refitted from
    the recorded points by `levels.alpha_beta`) or "medians" (by `calibrate.fit_link`, the
    first version's rule). `cap`: the kernel alone that caps the waited-for rate, from
    "every process" (as recorded) or "process 0" (the first version's). The records'
    rule for `sync_s` subtracts the per-call overhead once more than "both" holds it;
    `add_overhead` adds it back."""
    links, local = dict(rate["links"]), dict(rate["local"])
    rb = rate["round_s_by_process"]
    shard = benchmark.Problem(seq_len=local["seq_len"], **rate_problem).kv_bytes / 8
    overhead = rate["links"]["overhead_s"]

    def kernel_rate(procs):
        return shard / (statistics.median(t for i in procs for t in rb["local kernel"][i])
                        - overhead)

    every = range(len(rb["local both"]))
    if cap == "process 0":
        local["mem_Bps"] = min(kernel_rate([0]), shard / local["waited_kernel_s"])
    if wait == "rate, process 0":
        waited0 = statistics.median(b - t for b, t in zip(rb["local both"][0],
                                                          rb["local tiny"][0], strict=True))
        local["mem_Bps"] = min(kernel_rate([0]), shard / waited0)
    elif wait != "waited":
        names = ("both", "kernel", "tiny")
        per = [[b - k - t for b, k, t in zip(*(rb[f"local {n}"][i] for n in names))]
               for i in every]
        sync = {"process 0": statistics.median(per[0]),
                "every process": statistics.median(x for p_ in per for x in p_),
                "slowest": max(statistics.median(p_) for p_ in per)}[wait]
        sync += overhead if add_overhead else 0.0
        local |= {"mem_Bps": kernel_rate([0] if wait == "process 0" else every),
                  "sync_s": max(sync, 0.0)}
    if kinds == "none":
        del links["kinds"]
    elif kinds != "as recorded":
        fit = levels.alpha_beta if kinds == "levels' rule" else by_medians
        links["kinds"] = {k: dict(zip(("alpha_s", "beta_Bps"), fit(f["points"]), strict=True))
                          for k, f in links["kinds"].items()}
    if not chain:
        links["flat"] = links["flat"] | {"alpha_s": links["flat"]["alpha_alone_s"]}
    return links, local


variants = {"the model": {},
            "this notebook's records' model": dict(wait="process 0", kinds="none", chain=False),
            "wait by the records' rule": dict(wait="process 0"),
            "kinds timed alone taken back": dict(kinds="none"),
            "chain taken back": dict(chain=False),
            "wait: rate, process 0": dict(wait="rate, process 0"),
            "wait: constant, every process": dict(wait="every process"),
            "wait: constant, the slowest": dict(wait="slowest"),
            "cap from process 0": dict(cap="process 0"),
            "kinds by medians": dict(kinds="medians")}
band = calibrate.BAND


def errors(runs, variant):
    """(method, Gbit/s) -> the relative error in each run."""
    out = {}
    for r in runs.values():
        for rate in r["rates"]:
            links, local = model_inputs(rate, **variant)
            for name, m in rate["methods"].items():
                pred = predicted_by(r, name, links, local)
                if not variant:
                    assert np.isclose(pred, m["predicted_s"])  # the record's, recomputed
                out.setdefault((name, rate["set_Bps"] * 8 / 1e9), []).append(
                    pred / m["median_s"] - 1)
    return out


def within(errs):
    return [sum(abs(e[j]) <= band for e in errs.values()) for j in range(3)]


errs = {v: errors(check, terms) for v, terms in variants.items()}
now, before = errs["the model"], errs["this notebook's records' model"]
print(f"\n{'method':<15}{'Gbit/s':>7}   the model: run 1   run 2   run 3 | the records' "
      f"model: run 1   run 2   run 3")
for (name, gbit), e_now in now.items():
    print(f"{name:<15}{gbit:>7g}" + "".join(f"{e:>+{18 if j == 0 else 8}.1%}"
                                            for j, e in enumerate(e_now))
          + " |" + "".join(f"{e:>+{25 if j == 0 else 8}.1%}"
                           for j, e in enumerate(before[name, gbit])))
cells = len(now)
counts = {v: within(e) for v, e in errs.items()}
print(f"\nwithin ±{band:.0%}, of {cells} cells, in runs 1, 2, 3 (and over the three):")
moves = {}  # variant -> (cells the model has and it lacks, cells it has and the model lacks)
for v, c in counts.items():
    gained = sum(abs(a[j]) > band >= abs(b[j]) for k, a in now.items()
                 for b in [errs[v][k]] for j in range(3))
    lost = sum(abs(a[j]) <= band < abs(b[j]) for k, a in now.items()
               for b in [errs[v][k]] for j in range(3))
    moves[v] = lost, gained
    print(f"  {v:<34}{c!s:<14}{sum(c):>3}  " + (f"against the model: {lost} cells out, "
                                                f"{gained} in" if v != "the model" else ""))
shift = max(abs(a - b) for k, e in now.items() for a, b in zip(e, errs["cap from process 0"][k]))
print(f"the cap from process 0's kernel moves a prediction's error by at most "
      f"{shift * 100:.1f} points")
design_as = within(errors(design, {}))  # recomputed below for the flat tree
design_rule = within(errors(design, dict(kinds="levels' rule")))
design_before = within(errors(design, variants["this notebook's records' model"]))
print(f"the design runs (check/design/): as recorded {design_as}; their kinds re-read by "
      f"the levels' rule {design_rule}; the records' model from their rounds {design_before}")
outside = {cell: sum(abs(e) > band for e in e_now) for cell, e_now in now.items()}
outside = {cell: k for cell, k in outside.items() if k}
print("outside the band, in how many runs:",
      ", ".join(f"{name} at {g:g} Gbit/s {k}" for (name, g), k in outside.items()))
flat_ratio = [rate["links"]["flat"]["alpha_s"] / rate["links"]["flat"]["alpha_alone_s"]
              for r in check.values() for rate in r["rates"]]
print(f"the chain's step against a lone all-reduce's: {min(flat_ratio):.2f} to "
      f"{max(flat_ratio):.2f} times")
beta_of_set = [rate["links"]["inter"]["beta_Bps"] / rate["set_Bps"]
               for r in (*check.values(), *design.values()) for rate in r["rates"]]
print(f"the inter-node beta, six runs at both rates: {min(beta_of_set):.0%} to "
      f"{max(beta_of_set):.0%} of the rate set")
total = {v: sum(c) for v, c in counts.items()}
grid = {("rate", "every process"): total["the model"],
        ("rate", "process 0"): total["wait: rate, process 0"],
        ("constant", "every process"): total["wait: constant, every process"],
        ("constant", "process 0"): total["wait by the records' rule"]}
mine, theirs = counts["the model"], counts["this notebook's records' model"]
assert all(a > b for a, b in zip(mine, theirs, strict=True))  # more cells in every run
assert all(a > b for a, b in zip(design_as, design_before, strict=True))  # and before
assert sum(design_rule) > sum(design_as)  # the kinds' change gained cells there
assert counts["kinds by medians"] == mine  # and changes no count in the check runs
assert counts["cap from process 0"] == mine and 0 < shift < band / 5
for name in ("kinds timed alone taken back", "chain taken back", "wait by the records' rule"):
    assert total[name] < total["the model"]  # each costs cells over the three runs
# A rate against a constant: 3 to 5 cells; every process against process 0: 0 to 2
by_form = [grid["rate", w] - grid["constant", w] for w in ("every process", "process 0")]
by_source = [grid[f, "every process"] - grid[f, "process 0"] for f in ("rate", "constant")]
assert 3 <= min(by_form) <= max(by_form) <= 5 and 0 <= min(by_source) <= max(by_source) <= 2
assert all(min(moves[v]) > 0 for v in ("wait: rate, process 0", "wait: constant, every process"))
const_pair = [sum(abs(a[j]) <= band < abs(b[j]) for k, a in errs["wait: constant, every process"].items()
                  for b in [errs["wait by the records' rule"][k]] for j in range(3)),
              sum(abs(b[j]) <= band < abs(a[j]) for k, a in errs["wait: constant, every process"].items()
                  for b in [errs["wait by the records' rule"][k]] for j in range(3))]
assert min(const_pair) > 0  # every process against process 0, as constants: both ways too
for v in ("wait by the records' rule", "wait: constant, every process",
          "wait: constant, the slowest"):  # the overhead added back moves no count
    assert within(errors(check, variants[v] | dict(add_overhead=True))) == counts[v]
wrong_beta = [(rate["links"]["inter"]["beta_Bps"] > rate["set_Bps"],
               abs(rate["methods"]["ring"]["rel_err"]))
              for r in (*check.values(), *design.values()) for rate in r["rates"]]
assert any(w for w, _ in wrong_beta) and all(e <= band for w, e in wrong_beta if w)
rs = now["reduce_scatter", 1.0]
assert outside.pop(("reduce_scatter", 1.0)) == 3 and all(e < -band for e in rs)
assert min(flat_ratio) < 1 < max(flat_ratio)
design_now, design_old = errors(design, {}), errors(design, variants["this notebook's records' model"])
assert all(e > 0 for errs_ in (now, before, design_now, design_old) for e in errs_["tree", 0.5])
assert total["wait: constant, the slowest"] == total["the model"]  # a tie
display(Markdown(
    f"The model puts {', '.join(map(str, mine))} of the {cells} cells within ±{band:.0%} in "
    f"the three runs; this notebook's records' model, from the same rounds, "
    f"{', '.join(map(str, theirs))}: more in every run, as in the design runs "
    f"({', '.join(map(str, design_as))} against {', '.join(map(str, design_before))}). "
    f"Over the three runs, the kinds timed alone are worth {total['the model'] - total['kinds timed alone taken back']} "
    f"cells and the chain {total['the model'] - total['chain taken back']}. The wait, read "
    f"as a rate from every process or from process 0, and as a constant from every "
    f"process or from process 0 (this notebook's records' rule), gives "
    f"{grid['rate', 'every process']}, {grid['rate', 'process 0']}, "
    f"{grid['constant', 'every process']} and {grid['constant', 'process 0']} cells: the "
    f"rate gains {min(by_form)} to {max(by_form)} over these two constants, every process "
    f"{min(by_source)} to {max(by_source)} over process 0, with cells moving both ways; "
    f"but a constant read from the slowest process's rounds gives "
    f"{total['wait: constant, the slowest']}, as many as the rate. These runs do not "
    f"settle rate against constant; only the exploratory run, across lengths, favours the "
    f"rate. "
    f"The kinds' change of rule moves no count here, and the cap's moves a prediction's "
    f"error by at most {shift * 100:.1f} points. The chain's step was {min(flat_ratio):.2f} to "
    f"{max(flat_ratio):.2f} times a lone all-reduce's: not always cheaper. Issue 30's "
    f"target, every cell in each run, is not met. The reduce-scatter, timed last in rounds "
    f"of its own (its note: a reduce-scatter slows later transfers) and priced from the "
    f"first rounds' fits (those of the interleaved rounds that time every other method), "
    f"is under-predicted in every run "
    f"({', '.join(f'{e:+.0%}' for e in rs)}), for a reason these runs do not show (the next "
    f"subsection measures what a reduce-scatter costs after an all-gather, and prices "
    f"that). The other cells "
    f"outside the band: "
    + ", ".join(f"{name} at {g:g} Gbit/s in {k} of 3 runs ("
                + ", ".join(f"{e:+.0%}" for e in now[name, g] if abs(e) > band) + ")"
                for (name, g), k in outside.items())
    + "; why is not known. The flat tree, which this notebook's records' model predicted "
    f"well in those records, is over-predicted at 0.5 Gbit/s in all six later runs, by "
    f"the model each run recorded and by the records' model alike (both priced its two "
    f"rings of 8 elements over all devices as full rings, which one exploratory run in the "
    f"subsection 'Rings of few elements' of §9.4 found over-priced, at a lone call's α: a likely part of the "
    f"reason). The inter-node β of the six runs was "
    f"{min(beta_of_set):.0%} to {max(beta_of_set):.0%} of the rate set, above it in "
    f"{sum(b > 1 for b in beta_of_set)} of {len(beta_of_set)} fits; the pass-KV ring was "
    f"priced within the band from every fit above it."))


# %% [markdown]
# ### The reduce-scatter after another collective (issue 30, continued)
#
# The `reduce_scatter` merge (an all-gather of the lse pairs, then a reduce-scatter of the
# rescaled outputs, §9.4's table) is the one cell outside ±30% in all three runs above,
# under-predicted each time.
# It is timed last, in rounds of its own, because a gloo reduce-scatter slows later
# transfers (its note), and those runs priced it from the *first rounds' fits* (the fits
# of the interleaved rounds that time every other method, before any reduce-scatter runs,
# where none can be timed): its reduce-scatter by the formula from the levels' fits,
# its all-gather as timed alone before any reduce-scatter ran.
#
# An exploratory run (`results/cluster/check/rs-after/pairs.json`, made with programs
# added for it, a patch not kept; its command is printed below: one rate, two methods)
# timed in the reduce-scatter's own rounds, at two small sizes, each collective alone and
# three pairs, each a program whose second collective takes the first's result: an
# all-gather then a reduce-scatter (the merge's order), two reduce-scatters, two
# all-gathers. The record keeps every process's rounds of every program (its
# `diag`). What the second collective of a pair adds is the pair's time less its first
# collective's alone, round by round, process by process; the next cell prints the
# means.

# %%
RS_DIR = CHECK / "rs-after"
pairs = json.loads((RS_DIR / "pairs.json").read_text())
diag = pairs["rates"][0]["methods"]["reduce_scatter"]["diag"]
print(f"command: {pairs['config']['command']}; {pairs['config']['repeats']} rounds, "
      f"{len(diag['agrs 1024'])} processes")
print(f"\n{'bytes':>6}{'all-gather':>12}{'reduce-scatter':>16}   what the second adds:"
      f"{'AG, then RS':>13}{'RS, then RS':>13}{'AG, then AG':>13}   (ms, means)")
pair_adds = {}
for size in levels.kind_sizes(8)[:2]:
    ag_alone, rs_alone = (np.array(diag[f"{k} {size}"]) for k in ("all_gather", "psum_scatter"))
    pair_add = {p_: float(np.mean(np.array(diag[f"{p_} {size}"]) - first))
           for p_, first in (("agrs", ag_alone), ("rsrs", rs_alone), ("agag", ag_alone))}
    pair_adds[size] = (float(ag_alone.mean()), float(rs_alone.mean()), pair_add)
    print(f"{size:>6,}{ag_alone.mean() * 1e3:>12.2f}{rs_alone.mean() * 1e3:>16.2f}" + " " * 24
          + "".join(f"{pair_add[k] * 1e3:>13.2f}" for k in ("agrs", "rsrs", "agag")))
    assert size <= calibrate.SMALL_MESSAGE
    assert pair_add["rsrs"] > pair_add["agrs"] > 1.5 * rs_alone.mean()
    assert pair_add["agag"] < ag_alone.mean()
rs_lo = min(a["agrs"] / r for _, r, a in pair_adds.values())
rs_hi = max(a["agrs"] / r for _, r, a in pair_adds.values())
display(Markdown(
    f"After an all-gather, a reduce-scatter added {rs_lo:.2f} to {rs_hi:.2f} times its time "
    f"alone "
    f"(more still after another reduce-scatter); an all-gather after another added less "
    f"than its time alone. Why a reduce-scatter costs more after another collective is not "
    f"measured (XLA:CPU builds gloo's halving-doubling reduce-scatter anew for every call, "
    f"`cluster.collectives.SOURCES`, and a peer that arrives late could delay that: a "
    f"hypothesis). A price from the lone reduce-scatter misses it."))

# %% [markdown]
# So the runs now time, in the reduce-scatter's own rounds, interleaved with it
# (`levels.last_calls`), its two collectives alone at the kinds' sizes
# (`levels.LAST_KINDS`) and, at the small ones, the pair in the merge's order ("after").
# `levels.fit_last` takes the reduce-scatter's α as the mean over those sizes and every
# process's rounds of the pair less the all-gather alone (*the pair's α*: the chain's rule
# for a difference of two calls, with its fallback to the lone α where that mean is not
# above 0; every process's rounds, pooled as for the waited-for kernel, another such
# difference, though summarised by the mean where the kernel's wait takes the median),
# keeps the lone α beside it, and takes β and the all-gather from the lone
# calls; the merge is priced with these in place of the first
# rounds' all-gather and the formula (the record's `kinds_last`). Nothing is measured at
# the merge's own sizes or on its program; every other cell is priced as above. But
# the pair is the merge's two collectives in its order, at 1 kB and 4 kB per device, which
# bracket its reduce-scatter's 2 kB (its all-gather is smaller): this cell is now close to
# a timing of its own collectives, and its agreement is weak evidence for the model as a
# whole.
#
# Six design runs came first (`rs-after/design/`): run 1 with the lone calls only, runs 2
# and 3 with the pair read from process 0's rounds, and runs 4 to 6, made as the check of
# that rule; the pair was then read from every process's rounds, so those three became
# design runs too. Three check runs followed, one after the other
# (`rs-after/2x2x2-run{1,2,3}.json`). The next cell recomputes every prediction from the
# records, and compares the model with two variants: the lone reduce-scatter from its
# own rounds (the pair taken back), and the first rounds' fits (the model of the runs
# above).

# %%
rs_check = {i: json.loads((RS_DIR / f"2x2x2-run{i}.json").read_text()) for i in (1, 2, 3)}
rs_design = {i: json.loads((RS_DIR / "design" / f"2x2x2-run{i}.json").read_text())
             for i in range(1, 7)}


def pair_from_process_0(m):
    """The pair's α from process 0's rounds alone (`levels.fit_last`'s rule otherwise),
    from a record that keeps every process's last rounds (the check runs)."""
    lr = m["last_round_s_by_process"]
    diffs = [a - b for size in levels.kind_sizes(8) if size <= calibrate.SMALL_MESSAGE
             for a, b in zip(lr[f"after {size}"][0], lr[f"all_gather {size}"][0], strict=True)]
    return float(np.mean(diffs))


def last_errors(runs, last="the model"):
    """(method, Gbit/s) -> the relative error in each run. `last`: "the model" (as
    recorded), "the pair from process 0" (its α from process 0's rounds only), "the pair
    taken back" (the lone reduce-scatter from its own rounds) or "the first rounds'
    fits"."""
    out = {}
    for r in runs.values():
        for rate in r["rates"]:
            links, local = model_inputs(rate)
            for name, m in rate["methods"].items():
                kl = {k: dict(f) for k, f in m.get("kinds_last", {}).items()}
                if last == "the pair taken back" and "alpha_alone_s" in kl.get("reduce-scatter", {}):
                    kl["reduce-scatter"]["alpha_s"] = kl["reduce-scatter"]["alpha_alone_s"]
                elif last == "the pair from process 0" and "last_round_s_by_process" in m:
                    alpha0 = pair_from_process_0(m)
                    assert alpha0 > 0  # resolved, as pooled
                    kl["reduce-scatter"]["alpha_s"] = alpha0
                elif last == "the first rounds' fits":
                    kl = {}
                pred = predicted_by(r, name, links | {"kinds": links["kinds"] | kl}, local)
                if last == "the model":
                    assert np.isclose(pred, m["predicted_s"])  # the record's, recomputed
                out.setdefault((name, rate["set_Bps"] * 8 / 1e9), []).append(
                    pred / m["median_s"] - 1)
    return out


def in_band(errs):
    return [sum(abs(e[j]) <= band for e in errs.values()) for j in range(len(next(iter(errs.values()))))]


last_now = last_errors(rs_check)
print(f"{'method':<15}{'Gbit/s':>7}   run 1   run 2   run 3")
for (name, gbit), e_now in last_now.items():
    print(f"{name:<15}{gbit:>7g}" + "".join(f"{e:>+8.1%}" for e in e_now))
LAST_VARIANTS = ("the model", "the pair from process 0", "the pair taken back",
                 "the first rounds' fits")
last_counts = {variant: in_band(last_errors(rs_check, variant)) for variant in LAST_VARIANTS}
print(f"\nwithin ±{band:.0%}, of {len(last_now)} cells, in check runs 1, 2, 3:")
for variant, count in last_counts.items():
    print(f"  {variant:<26}{count}")
rs_rows = {variant: last_errors(rs_check, variant)["reduce_scatter", 1.0]
           for variant in LAST_VARIANTS}
for variant, rs_errs in rs_rows.items():
    print(f"reduce_scatter, {variant}: " + ", ".join(f"{x:+.0%}" for x in rs_errs))
design_counts = in_band(last_errors(rs_design))
design_rs = last_errors(rs_design)["reduce_scatter", 1.0]
print(f"design runs 1 to 6: {design_counts} of {len(last_now)}; their reduce_scatter: "
      + ", ".join(f"{x:+.0%}" for x in design_rs))
rs_alpha = [r["rates"][0]["methods"]["reduce_scatter"]["kinds_last"]["reduce-scatter"]
            for r in rs_check.values()]
print("the reduce-scatter's alpha, the pair's and alone, ms: " + "; ".join(
    f"{a['alpha_s'] * 1e3:.1f} and {a['alpha_alone_s'] * 1e3:.1f}" for a in rs_alpha))
rs_ratio = [a["alpha_s"] / a["alpha_alone_s"] for a in rs_alpha]
first_fits = rs_rows["the first rounds' fits"]
rs_medians = [r["rates"][0]["methods"]["reduce_scatter"]["median_s"]
              for r in (*rs_check.values(), *rs_design.values())]
last_out = {cell: [j + 1 for j, e in enumerate(errs_) if abs(e) > band]
            for cell, errs_ in last_now.items()}
last_out = {cell: runs_ for cell, runs_ in last_out.items() if runs_}
model_counts = last_counts["the model"]
assert all(abs(e) <= band for e in rs_rows["the model"])  # the reduce-scatter: every run
assert all(e < 0 for e in rs_rows["the first rounds' fits"])  # as in the runs above
assert sum(abs(e) > band for e in rs_rows["the pair taken back"]) > 0
for variant in ("the pair taken back", "the first rounds' fits"):
    assert all(a >= b for a, b in zip(model_counts, last_counts[variant], strict=True))
    assert sum(model_counts) > sum(last_counts[variant])
assert min(rs_ratio) > 1 and sum(len(r_) for r_ in last_out.values()) == 1
assert last_counts["the pair from process 0"] == model_counts  # pooling: no count moves
assert any(abs(e) <= band for e in first_fits)  # the first rounds' fits: not always outside
pair_p0 = [e for r, e in zip(rs_design.values(), design_rs, strict=True)
           if "after" in r["rates"][0]["methods"]["reduce_scatter"]["kinds_last"]["reduce-scatter"]]
print("the reduce-scatter with the pair from process 0 (design runs 2 to 6): "
      + ", ".join(f"{e:+.1%}" for e in pair_p0))
assert len(pair_p0) == 5 and sum(abs(e) <= band for e in pair_p0) == 4
# Every other cell is priced as in the runs above: the last rounds move no other prediction
other = [k for k in last_now if k != ("reduce_scatter", 1.0)]
same = last_errors(rs_check, "the first rounds' fits")
assert all(np.allclose(last_now[k], same[k]) for k in other)  # the new terms: RS only
miss_before = [sum(abs(now[k][j]) > band for k in other) for j in range(3)]
miss_after = [sum(abs(last_now[k][j]) > band for k in other) for j in range(3)]
print(f"the other {len(other)} cells outside the band: the runs above {miss_before}, these "
      f"{miss_after}")
assert sum(miss_after) < sum(miss_before)
beta_nine = [rate["links"]["inter"]["beta_Bps"] / rate["set_Bps"]
             for r in (*rs_design.values(), *rs_check.values()) for rate in r["rates"]]
print(f"the inter-node beta, these nine runs at both rates: {min(beta_nine):.0%} to "
      f"{max(beta_nine):.0%} of the rate set, above it in {sum(b > 1 for b in beta_nine)} "
      f"of {len(beta_nine)} fits")
assert all(abs(b - 1) <= 0.2 for b in beta_nine)  # within ±20%, as issue 22's band
assert sum(b > 1 for b in beta_nine) > len(beta_nine) / 2
six_flat = now["tree", 0.5] + errors(design, {})["tree", 0.5]  # the six later runs
rs_six = [r["rates"][0]["methods"]["reduce_scatter"]["median_s"]
          for r in (*check.values(), *design.values())]
rs_now = [r["rates"][0]["methods"]["reduce_scatter"]["median_s"] for r in rs_check.values()]
assert np.mean(rs_now) < np.mean(rs_six)  # the merge's own times, lower on average
gain_first = sum(model_counts) - sum(last_counts["the first rounds' fits"])
gain_alone = sum(model_counts) - sum(last_counts["the pair taken back"])
assert gain_first > gain_alone > 0
flat_slow = last_errors(rs_design)["tree", 0.5] + last_now["tree", 0.5]  # the nine runs
print("the flat tree at 0.5 Gbit/s in the nine runs: " + ", ".join(f"{e:+.0%}" for e in flat_slow)
      + f"; in the six above: {min(six_flat):+.0%} to {max(six_flat):+.0%}")
assert len(flat_slow) == 9 and sum(e > 0 for e in flat_slow) == 7
assert max(map(abs, flat_slow)) <= band and sum(e > band for e in six_flat) == 2
assert np.mean(flat_slow) < np.mean(six_flat)
display(Markdown(
    f"The model puts {', '.join(map(str, model_counts))} of the {len(last_now)} cells within "
    f"±{band:.0%} in the three check runs. The reduce-scatter is inside the band in each "
    f"({', '.join(f'{e:+.0%}' for e in rs_rows['the model'])}); the lone reduce-scatter "
    f"from its own rounds gives {', '.join(f'{e:+.0%}' for e in rs_rows['the pair taken back'])}, "
    f"and the first rounds' fits, the model of the runs above, "
    f"{', '.join(f'{e:+.0%}' for e in first_fits)}: "
    f"under-predicted in each, as there (here not always outside the band; the merge's "
    f"own rounds now hold the added programs, and its median, {min(rs_six) * 1e3:.1f} to "
    f"{max(rs_six) * 1e3:.1f} ms in the six runs above, was {min(rs_now) * 1e3:.1f} to "
    f"{max(rs_now) * 1e3:.1f} ms in the three check runs, lower on average). The pair's α "
    f"was {min(rs_ratio):.1f} to {max(rs_ratio):.1f} times the lone one (process 0's lone "
    f"α, less the per-call overhead; the exploratory run's ratio above compares with every "
    f"process's lone means: another baseline). Read from process 0's rounds alone, the pair "
    f"gives the same counts here (the reduce-scatter "
    f"{', '.join(f'{e:+.0%}' for e in rs_rows['the pair from process 0'])}): in these runs "
    f"pooling moved no count. With the pair from process 0's rounds (design runs 2 to 6) "
    f"the reduce-scatter was inside the band in {sum(abs(e) <= band for e in pair_p0)} of "
    f"{len(pair_p0)}; with it from every process's (these runs), in all three. The rule "
    f"now used was checked in these three runs only; design runs 4 to 6 checked the "
    f"process-0 reading ({', '.join(map(str, design_counts[3:]))} cells, the last "
    f"reduce-scatter inside by {(band - design_rs[5]) * 100:.1f} percentage points: "
    f"{design_rs[5]:+.1%} against ±{band:.0%}). In these runs the "
    f"pair is worth {gain_first} cells over the first rounds' fits and {gain_alone} over the "
    f"lone reduce-scatter from its own rounds. Every other "
    f"cell is priced exactly as in the runs above (asserted), which left "
    f"{', '.join(map(str, miss_before))} of those {len(other)} cells outside; these runs left "
    f"{', '.join(map(str, miss_after))}. The new terms leave those cells' predictions "
    f"unchanged in these runs (asserted), so the fewer misses are in the measurements: "
    f"noise, or a shift between batches not explained (the flat tree's, below). Issue "
    f"30's target, every cell in each run, is "
    f"still not met: outside the band, "
    + "; ".join(f"{name} at {g:g} Gbit/s in run {', '.join(map(str, r_))} ("
                + ", ".join(f"{last_now[name, g][j - 1]:+.1%}" for j in r_) + ")"
                for (name, g), r_ in last_out.items())
    + f". The design runs put {', '.join(map(str, design_counts))} cells inside, each priced as "
    f"recorded (run 1 from the lone calls, the others with the pair's α from process 0's "
    f"rounds, the only ones their records keep, so the rule now used cannot re-read them); in the "
    f"fourth, with the pair read from process 0's rounds, the reduce-scatter was "
    f"over-predicted by {design_rs[3]:+.0%}. That miss prompted a look at the pair's rule, and "
    f"after design runs 4 to 6 the pair was read from every process's rounds, as the "
    f"waited-for kernel is (a difference of two noisy calls). The flat tree at 0.5 Gbit/s, "
    f"over-predicted by {min(six_flat):+.0%} to {max(six_flat):+.0%} in the six runs above "
    f"(outside the band in two), was off by {min(flat_slow):+.0%} to {max(flat_slow):+.0%} in "
    f"these nine (inside in each), priced by the same rule: why the later batch sits lower "
    f"(mean {np.mean(flat_slow):+.0%} against {np.mean(six_flat):+.0%}) is not known. A "
    f"reading of one of these runs is one sample of a spread: the "
    f"same merge's measured median ranged over these {len(rs_medians)} runs (six design, "
    f"three check) from "
    f"{min(rs_medians) * 1e3:.1f} to {max(rs_medians) * 1e3:.1f} ms."))


# %% [markdown]
# ### Rings of few elements (issue 30, continued)
#
# The model of every earlier record priced `one_pass` and the 2-level tree alike. On this
# cluster each runs six
# gloo rings, three per level, each all-reduce over "gpu" and then over "node": the
# 2-level tree its maxima, numerators and denominators, `one_pass` its numerators, denominators and a
# one-element flag (XLA:CPU runs each operand of an all-reduce as a ring of its own). Every ring was priced
# at 2(g−1) steps of its level's α whatever its size, so the two predictions differed only
# by the maxima's few bytes more than the flag's. The next cell compares the two methods
# in every recorded run of this layout before this subsection.

# %%
CLUSTER = ROOT / "results" / "cluster"
FEW_DIR = CHECK / "few"
LATER_SETS = {"few", "mean", "warm", "permute", "shift", "steps", "rounds"}  # from here on
older_runs = [json.loads(p_.read_text()) for p_ in sorted(CLUSTER.glob("**/2x2x2*.json"))
              if not LATER_SETS & set(p_.parts)]  # before this subsection
pairs_2l = [(rate["methods"]["tree_2level"], rate["methods"]["one_pass"])
            for r in older_runs for rate in r["rates"]
            if {"tree_2level", "one_pass"} <= set(rate["methods"])]
ratio_meas = [a["median_s"] / b["median_s"] for a, b in pairs_2l]
ratio_pred = [a["predicted_s"] / b["predicted_s"] for a, b in pairs_2l]
print(f"{len(older_runs)} runs, {len(pairs_2l)} (run, rate) cells with both methods")
print(f"2-level tree / one_pass, measured: median {statistics.median(ratio_meas):.2f} "
      f"({min(ratio_meas):.2f} to {max(ratio_meas):.2f}), above 1 in "
      f"{sum(x > 1 for x in ratio_meas)}; predicted: {min(ratio_pred):.5f} to "
      f"{max(ratio_pred):.5f}")
assert all(abs(x - 1) < 1e-3 for x in ratio_pred)  # a tie, to within the flag's bytes
assert sum(x > 1 for x in ratio_meas) > 0.8 * len(ratio_meas)
assert statistics.median(ratio_meas) > 1.15

# %% [markdown]
# Measured, the 2-level tree was the slower of the two in most cells, by about a fifth
# (the median), where that model saw a tie. gloo's ring all-reduce
# (`gloo/allreduce.cc`, `ring()`) cuts its buffer over g ranks into a multiple of g
# segments of whole elements, at least 2g (exactly 2g at these sizes), and sends or receives a segment only if it holds bytes: a one-element flag
# leaves all but one empty; the 8 maxima, and the 8 denominators, of §9.4's problem (one
# per head) fill the 8 segments of a 4-device level and the 4 of a 2-device one, and half
# of the 16 over all 8 devices, where the flat tree runs its maximum and denominator
# (`costmodel.gloo_segments` counts them by that rule). An earlier exploratory run, the
# lead for this subsection, timed all-reduces of a few words
# (`results/cluster/check/few-words.json`; `results/cluster/README.md` has its table).
#
# An exploratory run (`results/cluster/check/few/explore.json`, with programs added for it
# by a patch not kept; one rate, three methods, four times a run's rounds: its command,
# printed below, wrote it to `/tmp` as `explore3.json`, the third exploratory run, and it
# was moved here)
# timed, at each level and over all devices, lone all-reduces of 1, 2, 8, 64 and 512
# float32 elements per device (`x aW LEVEL` in its rounds), in the same interleaved rounds
# as the methods. The next cell prints each one's mean over every process's rounds, less
# the per-call overhead, with the standard error of the round means, and two prices of it
# by the model from the same record's link fits (refitted from every process's rounds, as
# the runs now fit them): the rule before (every step at α) and the rule that prices the
# held segments (below). That rule's one new number per link (one for each of the three
# rings: "node", "gpu", all devices), `call_s`, is fitted from the 2-element call, so that
# row agrees by construction. (Besides `few-words.json`, two exploratory runs before this
# one, with fewer programs, pointed the same way; they were not kept.)

# %%
from tree_attention_edu.perf import costmodel

explore = json.loads((FEW_DIR / "explore.json").read_text())
ex_rate = explore["rates"][0]
ex_rounds = ex_rate["round_s_by_process"]
ex_ctx = SimpleNamespace(two=SimpleNamespace(shape={"node": 2, "gpu": 4}, size=8),
                         flat=SimpleNamespace(size=8), say=lambda *_: None)
ex_times = levels.pooled(ex_rounds) | {
    f"few {ax} {levels.FEW_BYTES}": levels.pooled(ex_rounds)[f"x a2 {ax}"]
    for ax in levels.LEVELS}
ex_links = levels.fit_links(ex_ctx, ex_times, ex_rate["set_Bps"] * 8)
ex_over = ex_links["overhead_s"]
assert explore["config"]["repeats"] == 4 * check[1]["config"]["repeats"]  # 4 x 9 rounds
print(f"command: {explore['config']['command']}; {explore['config']['repeats']} rounds, "
      f"{len(ex_rounds['tree'])} processes")
print(f"{'ring':<6}{'elements':>9}{'held':>7}{'measured, ms':>15}{'rule before':>16}"
      f"{'held segments':>18}")
few_err, few_gap = {}, {}
for ax, g, key in (("node", 2, "inter"), ("gpu", 4, "intra"), ("flat", 8, "flat")):
    fit = ex_links[key]
    lone_alpha = fit.get("alpha_alone_s", fit["alpha_s"])  # the calls are lone ones
    before = costmodel.Link(lone_alpha, fit["beta_Bps"])
    now_link = costmodel.Link(lone_alpha, fit["beta_Bps"], call_s=fit["call_s"])
    for w in (1, 2, 8, 64, 512):
        x = np.array(ex_rounds[f"x a{w} {ax}"])  # [process][round]
        mean_, se = x.mean() - ex_over, x.mean(axis=0).std(ddof=1) / np.sqrt(x.shape[1])
        held, segs = costmodel.gloo_segments(4 * w, g)
        old_, new_ = (costmodel.gloo_ring_time(4 * w, g, k_) for k_ in (before, now_link))
        few_err[ax, w] = (old_ / mean_ - 1, new_ / mean_ - 1)
        few_gap[ax, w] = (mean_ - new_) / se  # the new rule's miss, in standard errors
        print(f"{ax:<6}{w:>9}{f'{held}/{segs}':>7}{mean_ * 1e3:>9.2f} ± {se * 1e3:.2f}"
              f"{old_ * 1e3:>9.2f} ({old_ / mean_ - 1:+4.0%}){new_ * 1e3:>9.2f} "
              f"({new_ / mean_ - 1:+4.0%})")
    print(f"{'':<6}call_s {fit['call_s'] * 1e3:.2f} ms; 2(g-1)α {2 * (g - 1) * lone_alpha * 1e3:.2f} ms")
one_old = [few_err[ax, 1][0] for ax in levels.LEVELS]
one_new = [few_err[ax, 1][1] for ax in levels.LEVELS]
small_new = [few_err[ax, w][1] for ax in levels.LEVELS for w in (1, 8)]
assert all(e > 0.8 for e in one_old) and all(abs(e) <= 0.35 for e in small_new)
assert all(abs(few_err[ax, 2][1]) < 1e-3 for ax in levels.LEVELS)  # fitted (but its 8 bytes)
assert all(e < 0 for e in one_new)
assert few_err["flat", 8][0] > 0.3 > abs(few_err["flat", 8][1])
display(Markdown(
    f"A one-element all-reduce cost a fraction of a full ring at every level; the rule "
    f"before over-priced it by {min(one_old):.0%} to {max(one_old):.0%}, the rule of held "
    f"segments under-prices it by {-max(one_new):.0%} to {-min(one_new):.0%}. Over all 8 "
    f"devices 8 elements (8 of 16 segments) cost between the one-element and the full "
    f"ring's; the rule before prices them {few_err['flat', 8][0]:+.0%} off, the new one "
    f"{few_err['flat', 8][1]:+.0%}. At 64 and 512 elements every segment holds bytes and the two rules agree."))

# %% [markdown]
# The rule (`costmodel.gloo_ring_time`): a ring of g ranks whose operand holds h of its 2g
# segments costs c + (2(g−1)α − c)·h/2g plus its bytes' time, c its link's `call_s` (at
# least 0 and at most 2(g−1)α), the part of one call paid whole however few segments
# send. A full
# operand costs 2(g−1)α as before. The one-element rows suggest that a ring's α here is
# mostly work per message, not the wire's latency: in gloo's pipelined ring one element
# still makes all 2(g−1) hops one after the other, as the full ring's segments do, but the
# ranks send, receive and wake for one segment instead of all of them (a reading of the
# source and the table, not a measurement of that work).
# Each run now times, at every level and over all devices, an all-reduce of
# `levels.FEW_BYTES` (2 elements: not the flag's one, so that the call that fits c is not
# the call the rule then prices, and no operand's size at the default problem) and fits c
# from it and the lone α (`levels.fit_few`, the mean over the rounds). The runs also fit
# every link from every process's rounds pooled (`levels.pooled`), not process 0's alone:
# each call is one collective, seen from every process.
#
# The same record timed the three merges' collectives in sequence, each in one program
# without the kernel: the 2-level tree's maxima over "gpu" then "node", then its sums
# over "gpu" then "node"; `one_pass`'s sums over "gpu" then "node"; the flat tree's
# maximum then sums over all devices. The next cell compares each with its collectives
# timed alone (less the per-call overhead of the extra programs), and prints the three
# methods' times in that run beside that run's own predictions (the rule before).

# %%
seq_parts = {"q2": ["m8 gpu", "m8 node", "t2 gpu", "t2 node"], "q1": ["t3 gpu", "t3 node"],
             "qf": ["m8 flat", "t2 flat"]}
seq_names = {"q2": "2-level tree", "q1": "one_pass", "qf": "flat tree"}
seq_excess = {}
for key, parts in seq_parts.items():
    whole = np.array(ex_rounds[f"x {key}"]).mean(axis=0)  # per round, over processes
    alone = sum(np.array(ex_rounds[f"x {p_}"]).mean(axis=0) for p_ in parts)
    alone = alone - (len(parts) - 1) * ex_over
    diff = whole - alone
    seq_excess[key] = (diff.mean(), diff.std(ddof=1) / np.sqrt(diff.size))
    print(f"{seq_names[key]:<13} in one program {whole.mean() * 1e3:6.2f} ms; its "
          f"{len(parts)} collectives alone {alone.mean() * 1e3:6.2f} ms; excess "
          f"{diff.mean() * 1e3:+.2f} ± {seq_excess[key][1] * 1e3:.2f} ms")
assert seq_excess["q2"][0] > 2 * seq_excess["q2"][1]  # about two standard errors, one run
assert all(abs(seq_excess[k_][0]) < seq_excess["q2"][0] / 2 for k_ in ("q1", "qf"))
ex_methods = ex_rate["methods"]
ex_err = {k: m["predicted_s"] / m["median_s"] - 1 for k, m in ex_methods.items()}
assert abs(ex_err["tree_2level"]) < 0.03 and ex_err["one_pass"] > 0.2
print("that run's methods, measured / predicted, ms: " + "; ".join(
    f"{k} {m['median_s'] * 1e3:.1f} / {m['predicted_s'] * 1e3:.1f}" for k, m in ex_methods.items()))
display(Markdown(
    f"The 2-level tree's four all-reduces took {seq_excess['q2'][0] * 1e3:.1f} ms more in one "
    f"program than alone (about two standard errors of {seq_excess['q2'][1] * 1e3:.1f} ms, in "
    f"one run, not repeated); "
    f"`one_pass`'s two and the flat tree's two, under half that, not resolved from zero. "
    f"Nothing in the model prices such an excess, and why it arises is not measured; if it "
    f"also occurs in the decode (these programs have no kernel), the model's price of the "
    f"2-level tree misses it, whatever the price of its rings. In this run it did not show "
    f"as a miss: the rule before priced the 2-level tree within "
    f"{abs(ex_err['tree_2level']):.0%}, and its miss of the ratio between the two sat in its "
    f"price of `one_pass` ({ex_err['one_pass']:+.0%}), though a 2-level price that close may "
    f"hide errors that cancel."))

# %% [markdown]
# Three design runs came first (`few/design/`, named for their place: they would have
# shown a need to change the code, and none was made), then three check runs, one after
# the other (`few/2x2x2-run{1,2,3}.json`), all with the command of §9.4 and the same
# model (the design runs from the working tree that the check runs' commit then recorded,
# which differs only in a printed line), so the six are six runs of one model. The next cell recomputes
# every prediction from the records' rounds (the links refitted from every process's
# rounds equal the recorded ones: asserted) and compares the model with three variants:
# `call_s` taken back (every step at α: the pricing before), the links fitted from process
# 0's rounds alone (the fitting before), and both (close to the model of the previous
# subsection; the reduce-scatter priced by its last rounds' fits as recorded in each,
# pooled over every process).

# %%
def run_ctx(r):
    """What `levels`' fits read of a run's context, rebuilt from its record: the meshes'
    shapes, the settings `fit_local` reads, and a silent `say`."""
    c = r["config"]
    gpu = c["processes_per_node"] * c["devices_per_process"]
    s = SimpleNamespace(devices=c["devices"], seq_len=c["seq_len"],
                        problem=lambda n: benchmark.Problem(seq_len=n, **c["problem"]))
    return SimpleNamespace(s=s, two=SimpleNamespace(shape={"node": c["nodes"], "gpu": gpu},
                                                    size=c["devices"]),
                           flat=SimpleNamespace(size=c["devices"]), say=lambda *_: None)


def refit(r, rate, procs=None, call=True):
    """A rate's links refitted from its rounds (`levels.fit_links`): every process's
    pooled, or only `procs`; without `call_s` where `call` is False."""
    ctx = run_ctx(r)
    rounds = rate["round_s_by_process"]
    if procs is not None:
        rounds = {k: [v[i] for i in procs] for k, v in rounds.items()}
    links = levels.fit_links(ctx, levels.pooled(rounds), rate["set_Bps"] * 8)
    if not call:
        links |= {k: {f: v for f, v in links[k].items() if f != "call_s"}
                  for k in ("inter", "intra", "flat")}
    return links


FEW_VARIANTS = {"the model": {}, "call_s taken back": dict(call=False),
                "process 0's fits": dict(procs=[0]),
                "both taken back": dict(procs=[0], call=False)}


def few_errors(runs, variant="the model"):
    """(method, Gbit/s) -> the relative error in each run, priced by `variant`."""
    out = {}
    for r in runs.values():
        for rate in r["rates"]:
            links = refit(r, rate, **FEW_VARIANTS[variant])
            if variant == "the model":
                assert json.loads(json.dumps(links)) == rate["links"]  # as recorded
            for name, m in rate["methods"].items():
                kl = m.get("kinds_last", {})
                pred = predicted_by(r, name, links | {"kinds": links["kinds"] | kl},
                                    rate["local"])
                if variant == "the model":
                    assert np.isclose(pred, m["predicted_s"])  # the record's, recomputed
                out.setdefault((name, rate["set_Bps"] * 8 / 1e9), []).append(
                    pred / m["median_s"] - 1)
    return out


few_check = {i: json.loads((FEW_DIR / f"2x2x2-run{i}.json").read_text()) for i in (1, 2, 3)}
few_design = {i: json.loads((FEW_DIR / "design" / f"2x2x2-run{i}.json").read_text())
              for i in (1, 2, 3)}
few_now = few_errors(few_check)
print(f"{'method':<15}{'Gbit/s':>7}   run 1   run 2   run 3")
for (name, gbit), e_now in few_now.items():
    print(f"{name:<15}{gbit:>7g}" + "".join(f"{e:>+8.1%}" for e in e_now))
few_counts = {v: in_band(few_errors(few_check, v)) for v in FEW_VARIANTS}
few_design_counts = {v: in_band(few_errors(few_design, v)) for v in FEW_VARIANTS}
print(f"\nwithin ±{band:.0%}, of {len(few_now)} cells: check runs 1, 2, 3; design runs 1, 2, 3")
for v in FEW_VARIANTS:
    print(f"  {v:<20}{few_counts[v]}  {few_design_counts[v]}")
six_runs = [*few_design.values(), *few_check.values()]
few_all = {v: few_errors({i: r for i, r in enumerate(six_runs)}, v) for v in FEW_VARIANTS}
print("\nmean error over the six runs, by method and rate (the model; call_s taken back):")
for cell in few_now:
    print(f"  {cell[0]:<15}{cell[1]:>4g}  {np.mean(few_all['the model'][cell]):+6.1%}"
          f"  {np.mean(few_all['call_s taken back'][cell]):+6.1%}")
few_cells = {v: [x for e in few_all[v].values() for x in e] for v in FEW_VARIANTS}
few_mae = {v: float(np.mean(np.abs(x))) for v, x in few_cells.items()}
few_bias = {v: float(np.mean(x)) for v, x in few_cells.items()}
print(f"\nover the six runs' {len(few_cells['the model'])} cells: mean |error| and mean error")
for v in FEW_VARIANTS:
    print(f"  {v:<20}{few_mae[v]:>7.1%}{few_bias[v]:>+8.1%}")


def ordered(variant):
    """Pairs of methods (the ring left out: every model orders it last) that the model
    orders as measured, in each (run, rate) of the six runs, where their medians differ
    by over 5%: `(agreeing, pairs)`."""
    agree = total = 0
    for r in six_runs:
        for rate in r["rates"]:
            links = refit(r, rate, **FEW_VARIANTS[variant])
            meas = {k: m["median_s"] for k, m in rate["methods"].items() if k != "ring"}
            pred = {k: predicted_by(r, k, links | {"kinds": links["kinds"]
                                                    | rate["methods"][k].get("kinds_last", {})},
                                    rate["local"]) for k in meas}
            for a, b in itertools.combinations(sorted(meas), 2):
                if abs(meas[a] / meas[b] - 1) > 0.05:
                    total += 1
                    agree += (pred[a] < pred[b]) == (meas[a] < meas[b])
    return agree, total


few_order = {v: ordered(v) for v in ("the model", "call_s taken back")}
for v, (a, t) in few_order.items():
    print(f"pairs ordered as measured, {v}: {a} of {t}")
two_vs_one = [(rate["methods"]["tree_2level"], rate["methods"]["one_pass"])
              for r in six_runs for rate in r["rates"]]
new_meas = [a["median_s"] / b["median_s"] for a, b in two_vs_one]
new_pred = [a["predicted_s"] / b["predicted_s"] for a, b in two_vs_one]
print(f"2-level tree / one_pass in the six runs: measured {min(new_meas):.2f} to "
      f"{max(new_meas):.2f} (median {statistics.median(new_meas):.2f}), predicted "
      f"{min(new_pred):.2f} to {max(new_pred):.2f}")
slow = [(r["topology_claim"], r["rates"][1]["methods"]) for r in six_runs]
flat_pred = [m["tree"]["predicted_s"] / m["tree_2level"]["predicted_s"] for _, m in slow]
flat_meas = [c["flat_over_two_level"] for c, _ in slow]
verdicts = [c["verdict"] for c, _ in slow]
flat_before = []  # the same ratio priced with call_s taken back
for r in six_runs:
    slow_links = refit(r, r["rates"][1], call=False)
    flat_before.append(predicted_by(r, "tree", slow_links, r["rates"][1]["local"])
                       / predicted_by(r, "tree_2level", slow_links, r["rates"][1]["local"]))
chain_over_lone = [rate["links"]["flat"]["alpha_s"] / rate["links"]["flat"]["alpha_alone_s"]
                   for r in six_runs for rate in r["rates"]]
print("flat / 2-level at 0.5 Gbit/s with call_s taken back: "
      + ", ".join(f"{x:.2f}" for x in flat_before)
      + f"; the flat ring's chain step over its lone step: {min(chain_over_lone):.2f} to "
      f"{max(chain_over_lone):.2f}")
print("flat / 2-level at 0.5 Gbit/s, predicted: " + ", ".join(f"{x:.2f}" for x in flat_pred)
      + "; measured: " + ", ".join(f"{x:.2f}" for x in flat_meas)
      + "; verdicts: " + ", ".join(verdicts))
calls = {k: [rate["links"][k]["call_s"] for r in six_runs for rate in r["rates"]]
         for k in ("inter", "intra", "flat")}
print("call_s in the six runs' fits, ms: " + "; ".join(
    f"{k} " + ", ".join(f"{c * 1e3:.2f}" for c in v) for k, v in calls.items()))
at_floor = {k: sum(c == 0 for c in v) for k, v in calls.items()}
extra = set(few_check[1]["rates"][0]["round_s_by_process"]) - set(
    rs_check[1]["rates"][0]["round_s_by_process"])
assert extra == {f"few {ax} {levels.FEW_BYTES}" for ax in levels.LEVELS}  # three more calls
half_share = []  # the price of the flat tree's 8-element rings over a full ring's α part
for r in six_runs:
    for rate in r["rates"]:
        fl = rate["links"]["flat"]
        ring8 = costmodel.Link(fl["alpha_s"], fl["beta_Bps"], call_s=fl["call_s"])
        half_share.append(costmodel.gloo_ring_time(32, 8, ring8) / (14 * fl["alpha_s"]))
ex_share = [(np.mean(ex_rounds["x a8 flat"]) - ex_over)
            / (np.mean(ex_rounds[f"x {k} flat"]) - ex_over) for k in ("a64", "a512")]
print(f"the flat tree's 8-element rings priced at {min(half_share):.2f} to "
      f"{max(half_share):.2f} of a full ring in the six runs; measured alone, "
      f"{min(ex_share):.2f} to {max(ex_share):.2f} of the 64- and 512-element rings")
assert 0.5 < min(half_share) and max(half_share) < 0.65 and 0.6 < min(ex_share) < max(ex_share) < 0.7
tree_now = [x for g in (1.0, 0.5) for x in few_all["the model"]["tree", g]]
tree_before = [x for g in (1.0, 0.5) for x in few_all["call_s taken back"]["tree", g]]
op_now = [x for g in (1.0, 0.5) for x in few_all["the model"]["one_pass", g]]
op_before = [x for g in (1.0, 0.5) for x in few_all["call_s taken back"]["one_pass", g]]
few_out = {cell: [j + 1 for j, e in enumerate(errs_) if abs(e) > band]
           for cell, errs_ in few_now.items()}
few_out = {cell: runs_ for cell, runs_ in few_out.items() if runs_}
pool_cost = [(j + 1, d0 - d) for j, (d, d0) in enumerate(zip(
    few_design_counts["the model"], few_design_counts["process 0's fits"], strict=True)) if d0 != d]
back_now = few_errors(few_check, "call_s taken back")
moved = [(k, j + 1) for k in few_now for j in range(3)
         if (abs(few_now[k][j]) <= band) != (abs(back_now[k][j]) <= band)]
ag_medians = [r["rates"][0]["methods"]["allgather"]["median_s"] for r in six_runs]
print(f"the one cell the rule moves in the check runs: {moved}, "
      f"{few_now['one_pass', 0.5][2]:+.1%} against {back_now['one_pass', 0.5][2]:+.1%}; the "
      f"all-gather merge's medians at 1 Gbit/s in the six runs, ms: "
      + ", ".join(f"{x * 1e3:.1f}" for x in ag_medians))
pool_design = (few_errors(few_design, "the model")["tree_2level", 1.0][2],
               few_errors(few_design, "process 0's fits")["tree_2level", 1.0][2])
print(f"the 2-level tree at 1 Gbit/s in design run 3: {pool_design[0]:+.1%} pooled, "
      f"{pool_design[1]:+.1%} from process 0's rounds")
assert moved == [(("one_pass", 0.5), 3)]
assert few_counts["the model"] == [16, 17, 17] and list(few_out) == [("allgather", 1.0)]
assert all(few_errors(few_check, v)["allgather", 1.0][0] < -band for v in FEW_VARIANTS)
assert few_errors(few_check, "call_s taken back")["allgather", 1.0] == few_now["allgather", 1.0]
assert sum(few_counts["the model"]) > sum(few_counts["call_s taken back"])
assert sum(few_design_counts["the model"]) == sum(few_design_counts["call_s taken back"])
assert few_counts["the model"] == few_counts["process 0's fits"] and pool_cost == [(3, 1)]
assert few_mae["the model"] > few_mae["call_s taken back"]  # a little worse on average
assert few_bias["the model"] < few_bias["call_s taken back"] < 0
assert few_order["the model"][0] > few_order["call_s taken back"][0]
assert min(new_pred) > 1.1 and statistics.median(new_meas) > 1.1
assert all(e < 0 for e in tree_now) and max(tree_before) > 0
assert max(map(abs, op_now)) < max(map(abs, op_before))
assert sum(x < 1 for x in flat_pred) >= 5 and "flat faster" not in verdicts
assert sum(abs(x - 1) <= 0.06 for x in flat_meas) == 5 and sum(x < 0.9 for x in flat_pred) >= 3
assert sum(x < 1 for x in flat_meas) == 3 and min(flat_meas) > 0.94  # "by about 5% or less"
assert 1.2 < few_gap["flat", 8] < 1.8  # "about one and a half standard errors"
pool_cells = [k for k in few_now if (abs(few_errors(few_design, "the model")[k][2]) <= band)
              != (abs(few_errors(few_design, "process 0's fits")[k][2]) <= band)]
assert pool_cells == [("tree_2level", 1.0)]
assert at_floor["inter"] > len(calls["inter"]) / 2 and at_floor["flat"] == 0
assert all(x > 1 for x in flat_before)  # the pricing before: the 2-level tree faster in all
assert flat_pred[verdicts.index("2-level faster")] < 1 and verdicts.count("2-level faster") == 1
assert 0.7 < min(chain_over_lone) and max(chain_over_lone) < 1
n_six = len(few_cells["the model"])
display(Markdown("\n".join(f"* {line}" for line in [
    f"**Not met.** Issue 30's target is every cell within ±{band:.0%} in each run. The model "
    f"puts {', '.join(map(str, few_counts['the model']))} of the "
    f"{len(few_now)} cells inside in the three check runs (the design runs "
    f"{', '.join(map(str, few_design_counts['the model']))}; outside in design run 3: "
    + ", ".join(f"{k[0]} at {k[1]:g} Gbit/s ({e[2]:+.0%})" for k, e in
                few_errors(few_design).items() if abs(e[2]) > band)
    + f"). The one cell outside in the check runs, the "
    f"all-gather merge at 1 Gbit/s in check run 1 ({few_now['allgather', 1.0][0]:+.0%}), is "
    f"outside under every variant; `call_s` leaves its price unchanged (no all-gather is a "
    f"ring of few elements).",
    f"**What the rule is worth.** With `call_s` taken back the check runs put "
    f"{', '.join(map(str, few_counts['call_s taken back']))} cells inside and the design runs "
    f"{', '.join(map(str, few_design_counts['call_s taken back']))}: one cell of the six "
    f"runs' {n_six}, `one_pass` at 0.5 Gbit/s in check run 3. Over the six runs it moved "
    f"`one_pass`'s errors from the range {min(op_before):+.0%} to {max(op_before):+.0%} to the "
    f"range {min(op_now):+.0%} to {max(op_now):+.0%}, and the flat tree's from "
    f"{min(tree_before):+.0%} to {max(tree_before):+.0%} to {min(tree_now):+.0%} to "
    f"{max(tree_now):+.0%}: the flat tree is now under-predicted in every run. By method "
    f"(the per-method table above), the model's mean error on the flat tree went from "
    f"{np.mean(few_all['call_s taken back']['tree', 1.0]):+.1%} and "
    f"{np.mean(few_all['call_s taken back']['tree', 0.5]):+.1%} (1 and 0.5 Gbit/s) to "
    f"{np.mean(few_all['the model']['tree', 1.0]):+.1%} and "
    f"{np.mean(few_all['the model']['tree', 0.5]):+.1%}, and on `one_pass` at 1 Gbit/s from "
    f"{np.mean(few_all['call_s taken back']['one_pass', 1.0]):+.1%} to "
    f"{np.mean(few_all['the model']['one_pass', 1.0]):+.1%}: the rule acts on these two "
    f"methods only, and makes the flat tree's error larger.",
    f"**On average a little worse.** Over the six runs' {n_six} cells the mean |error| is "
    f"{few_mae['the model']:.1%} against {few_mae['call_s taken back']:.1%} without the rule, "
    f"and the mean error {few_bias['the model']:+.1%} against "
    f"{few_bias['call_s taken back']:+.1%}. A reading, not a measurement: part of that is the "
    f"rule's own under-price of rings of few elements (the exploratory run's table; possibly the flat "
    f"tree's two half-full rings, though that row is one run's, about one and a half "
    f"standard errors from the rule, and the table prices the flat ring at a lone call's "
    f"step where the runs price it at the chain's step, {min(chain_over_lone):.2f} to "
    f"{max(chain_over_lone):.2f} times that), and part a shortfall that the old over-price of small rings had hidden and "
    f"that the model does not explain.",
    f"**It orders the methods better:** {few_order['the model'][0]} of "
    f"{few_order['the model'][1]} pairs of methods as measured, against "
    f"{few_order['call_s taken back'][0]} without it (the ring left out; pairs whose medians "
    f"differ by over 5%). The 2-level tree, a tie with `one_pass` by the model before, now "
    f"takes {min(new_pred):.2f} to {max(new_pred):.2f} times as long by the model; measured, "
    f"{min(new_meas):.2f} to {max(new_meas):.2f} (median {statistics.median(new_meas):.2f}).",
    f"**The \"node\" ring's `call_s` is mostly at its floor.** Its fit was 0 in "
    f"{at_floor['inter']} of its {len(calls['inter'])} fits, the \"gpu\" ring's in "
    f"{at_floor['intra']}, the flat ring's in none (printed above): where it is 0 the rule "
    f"prices a ring at its held share of 2(g−1)α, and a one-element ring lower still than "
    f"the exploratory run's table does. The number rests on one call per ring in each run's rounds, and "
    f"over \"node\" the solve doubles that call's error (it divides by 1 − h/2g = 1/2): it "
    f"is weakly determined.",
    f"**Pooling** the links' rounds moved no count in the check runs; in design run "
    f"{pool_cost[0][0]} it cost one cell (the 2-level tree at 1 Gbit/s).",
    f"**§9.5's topology test reads differently through this model:** at 0.5 Gbit/s it "
    f"predicts the flat tree faster in {sum(x < 1 for x in flat_pred)} of the six runs (flat "
    f"over 2-level {min(flat_pred):.2f} to {max(flat_pred):.2f}), where the medians were "
    f"within 6% of a tie in five ({min(flat_meas):.2f} to {max(flat_meas):.2f} in all six) and the verdicts "
    f"{verdicts.count('no measurable difference')} \"no measurable difference\" and "
    f"{verdicts.count('2-level faster')} \"2-level faster\" (a run where it had predicted "
    f"the flat tree faster). Priced with `call_s` taken back, the same runs give "
    f"{min(flat_before):.2f} to {max(flat_before):.2f}: the 2-level tree faster in all six. "
    f"The rule turns the model's answer to that test around."])))


# %% [markdown]
# ### Which time a prediction is checked against (issue 30, continued)
#
# A cluster call runs on four processes (2 nodes × 2 processes, each with two devices),
# and each process times its own calls: a method's nine rounds give four series of nine
# times, one per process, and "the measured time" has to be one number taken from all of
# them, an *estimator*. Every run above took the **slowest process's median**: each
# process's median over its rounds, then the highest of the four. Each process's timer runs from its own entry into the call to
# its own exit, and a process that enters early waits for the others inside the call, so
# the four series can differ, and the slowest process's median includes such waits (a
# reading of how a collective works, not a measurement: no run records entry times). The
# model's collective terms take another estimator: each link's α and
# `call_s`, and the all-gather's and all-to-all's fits, are **means over every process's
# rounds** of lone collectives (`levels.fit_level`: a decode adds many steps, and their
# sum follows their mean), timed in the same interleaved rounds as the methods (its β are
# least-squares slopes, its per-call overhead and local terms medians: the match is
# partial). So the model predicts a typical process's time per call, averaged over the
# rounds, rather than the highest of the four processes' times: comparing it with the
# same estimator is the reason for the change, not a claim about which time a user
# waits for.
#
# The next cell compares, on the six runs of "Rings of few elements" and with their own
# predictions, the slowest process's median with the mean over every
# process's rounds, and for scale two more: the median of every process's rounds pooled,
# and the median over the rounds of each round's slowest process. Then the first two on
# every earlier record of this layout that holds every process's rounds, each with its
# own model's predictions.

# %%
def rounds_of(rate, name):
    """A method's rounds at one rate, `[process][round]`, as recorded."""
    return np.array(rate["round_s_by_process"][name])


ESTIMATORS = {
    "slowest process's median": lambda x: np.median(x, axis=1).max(),
    "mean over every process's rounds": np.mean,
    "median of every process's rounds": np.median,
    "median of each round's slowest": lambda x: np.median(x.max(axis=0)),
}


def estimator_errors(runs_, estimator):
    """(method, Gbit/s) -> each run's recorded prediction's error against `estimator`."""
    out = {}
    for r in runs_:
        for rate in r["rates"]:
            for name, m in rate["methods"].items():
                x = rounds_of(rate, name)
                if estimator == "slowest process's median":
                    assert ESTIMATORS[estimator](x) == m["median_s"]  # as recorded
                out.setdefault((name, rate["set_Bps"] * 8 / 1e9), []).append(
                    m["predicted_s"] / ESTIMATORS[estimator](x) - 1)
    return out


def summarise(errs_):
    """Counts within the band by run, mean error, mean |error|, worst both ways."""
    x = np.array([e for v in errs_.values() for e in v])
    counts = [int(c) for c in in_band(errs_)]
    return counts, float(x.mean()), float(np.abs(x).mean()), float(x.min()), float(x.max())


est_six = {e: summarise(estimator_errors(six_runs, e)) for e in ESTIMATORS}
print(f"the six runs of `check/few/` (design 1-3, check 1-3), {n_six} cells: within "
      f"±{band:.0%} in each run; mean error; mean |error|; worst")
for e, (counts, bias, mae, lo, hi) in est_six.items():
    print(f"  {e:<34}{counts!s:<20}{bias:>+7.1%}{mae:>7.1%}   {lo:+.0%} to {hi:+.0%}")


def spread_of(rate, n):
    """The slowest process's median over the fastest's."""
    med = np.median(rounds_of(rate, n), axis=1)
    return med.max() / med.min()


spread = [spread_of(rate, n) for r in six_runs for rate in r["rates"] for n in rate["methods"]]
ring_spread = [spread_of(rate, "ring") for r in six_runs for rate in r["rates"]]
op_ = rounds_of(few_design[1]["rates"][1], "one_pass")
print(f"the slowest process's median over the fastest's, in every cell: median "
      f"{statistics.median(spread):.2f}, {min(spread):.2f} to {max(spread):.2f} (the pass-KV "
      f"ring's: at most {max(ring_spread):.2f}); e.g. one_pass at 0.5 Gbit/s in design run 1, "
      "each process's median, ms: " + ", ".join(f"{x * 1e3:.1f}" for x in np.median(op_, axis=1)))
earlier = {p_.relative_to(CLUSTER): json.loads(p_.read_text())
           for p_ in sorted(CLUSTER.glob("**/2x2x2*.json"))
           if not LATER_SETS & set(p_.parts)}
earlier = {k: r for k, r in earlier.items()
           if all("round_s_by_process" in rate for rate in r["rates"])}
est_old = {e: summarise(estimator_errors(earlier.values(), e))
           for e in list(ESTIMATORS)[:2]}
n_old = sum(len(rate["methods"]) for r in earlier.values() for rate in r["rates"])
print(f"\nthe {len(earlier)} earlier records of this layout with every process's rounds "
      f"({n_old} cells, each record's own model): cells within ±{band:.0%}; mean error; "
      "mean |error|")
for e, (counts, bias, mae, _, _) in est_old.items():
    print(f"  {e:<34}{sum(counts):>4}{bias:>+8.1%}{mae:>7.1%}")
slowest, mean_ = est_six["slowest process's median"], est_six["mean over every process's rounds"]
assert sum(slowest[0]) < sum(mean_[0]) == n_six and slowest[1] < mean_[1] < 0
assert all(s[1] < 0 for s in est_six.values())  # every estimator: under-predicted on average
pooled_med = est_six["median of every process's rounds"]
assert abs(pooled_med[1]) <= abs(mean_[1]) and pooled_med[2] <= mean_[2]  # "as well or better"
assert sum(pooled_med[0]) == n_six and max(-pooled_med[3], pooled_med[4]) > 0.29  # the edges
assert sorted(est_six, key=lambda e: est_six[e][1])[:2] == [
    "median of each round's slowest", "slowest process's median"]
assert statistics.median(spread) > 1.1 and 1.6 < max(spread) < 1.7 and max(ring_spread) < 1.05
old_s, old_m = est_old["slowest process's median"], est_old["mean over every process's rounds"]
shift = (mean_[1] - slowest[1], old_m[1] - old_s[1])  # what the estimator alone moves
print(f"the mean error moves by {shift[0] * 100:+.1f} points (the six runs) and "
      f"{shift[1] * 100:+.1f} (the earlier records) from the slowest process's median to the mean")
assert all(0.03 < x < 0.05 for x in shift)  # "about four points" in both
assert sum(old_m[0]) == sum(old_s[0]) - 1  # one cell fewer
assert slowest[1] < old_s[1] < 0 < old_m[1] < 0.03  # "under-predicted less"; "slightly"

# %% [markdown]
# On these six runs the mean over every process's rounds puts every cell inside the band,
# and so does the median of every process's rounds pooled, whose worst cells sit at the
# band's edges, and which scores as well or better on average; the two that pick a
# slowest process, per process or per round, leave the model the most under-predicting.
# The four processes' medians of one method differ by up to about two thirds (the pass-KV
# ring's, within a few percent). On the earlier records (their own models, which changed
# from record to record and under-predicted less on average) the mean puts one cell fewer
# inside, no help there, and takes the mean error from slightly under to slightly over.
# What holds in both sets is the shift: the estimator alone moves the mean error up by
# about four points (printed above).
#
# So the cluster runs now record both, `median_s` (the slowest process's median, as
# before) and `mean_s` (the mean over every process's rounds), and check the prediction
# against the mean (`methods.method_records`). The mean, not the pooled median, because it
# is the estimator the model's collective terms take, not for its score. It was chosen
# after seeing the six runs above (they include the check runs of "Rings of few
# elements", which missed cells: on them the comparison is in-sample); the earlier
# records' comparison was computed after the choice and did not inform it. It is tested
# on three new runs with the same command and model (`check/mean/2x2x2-run{1,2,3}.json`),
# next. A mean carries a slow round whole, where a median drops it.

# %%
MEAN_DIR = CHECK / "mean"
mean_check = {i: json.loads((MEAN_DIR / f"2x2x2-run{i}.json").read_text()) for i in (1, 2, 3)}
for r in mean_check.values():
    assert r["config"]["repeats"] == 9 and r["config"]["seq_len"] == 16384
    for rate in r["rates"]:
        for name, m in rate["methods"].items():
            x = rounds_of(rate, name)
            assert np.isclose(m["mean_s"], x.mean(), rtol=1e-12)
            assert np.isclose(m["rel_err"], m["predicted_s"] / x.mean() - 1, rtol=1e-9)
few_errors(mean_check)  # one model: refitted from their rounds and repriced, as recorded (asserted)
mean_now = estimator_errors(mean_check.values(), "mean over every process's rounds")
slow_now = estimator_errors(mean_check.values(), "slowest process's median")
print(f"{'method':<15}{'Gbit/s':>7}   run 1   run 2   run 3   (against the mean)")
for (name, gbit), e_now in mean_now.items():
    print(f"{name:<15}{gbit:>7g}" + "".join(f"{e:>+8.1%}" for e in e_now))
mean_counts, slow_counts = summarise(mean_now)[0], summarise(slow_now)[0]
mean_out = [(k, j + 1, e[j]) for k, e in mean_now.items() for j in range(3) if abs(e[j]) > band]
print(f"\nwithin ±{band:.0%}, of {len(mean_now)} cells in runs 1, 2, 3: against the mean "
      f"{mean_counts}; against the slowest process's median {slow_counts}")
print("outside against the mean: " + "; ".join(
    f"{k[0]} at {k[1]:g} Gbit/s in run {j} ({e:+.2%})" for k, j, e in mean_out))
new_bias = float(np.mean([e for v in mean_now.values() for e in v]))
per_cell = {k: float(np.mean(v)) for k, v in mean_now.items()}
bf = rounds_of(mean_check[3]["rates"][1], "butterfly")
assert bf.size == 36  # 4 processes x 9 rounds
print(f"mean error over the three runs {new_bias:+.1%}; the flat tree's "
      f"{np.mean(mean_now['tree', 1.0]):+.1%} and {np.mean(mean_now['tree', 0.5]):+.1%} (1 "
      f"and 0.5 Gbit/s); the butterfly at 0.5 Gbit/s in run 3, each round's mean over the "
      "processes, ms: " + ", ".join(f"{x * 1e3:.1f}" for x in bf.mean(axis=0))
      + f" (their median {np.median(bf.mean(axis=0)) * 1e3:.1f})")
nine_runs = [*six_runs, *mean_check.values()]
first_slowest = [int(np.argmax(rounds_of(rate, n).mean(axis=0)) == 0)
                 for r in nine_runs for rate in r["rates"] for n in rate["methods"]]
print(f"cells of the nine runs of this model whose first round (the mean over the processes) "
      f"was their slowest: {sum(first_slowest)} of {len(first_slowest)} (by chance, about "
      f"{len(first_slowest) / 9:.0f})")
assert sum(first_slowest) > 1.5 * len(first_slowest) / 9
gain = (sum(mean_[0]) - sum(slowest[0]), sum(old_m[0]) - sum(old_s[0]),
        sum(mean_counts) - sum(slow_counts))
print(f"cells inside the band, the mean against the slowest process's median: {gain[0]:+d} on "
      f"the six runs that chose it, {gain[1]:+d} on the {len(earlier)} earlier records, "
      f"{gain[2]:+d} on the three new runs")
assert gain == (3, -1, 1)
whole_runs = [(sum(c == 17 for c in a_), sum(c == 17 for c in b_)) for a_, b_ in (
    (slowest[0], mean_[0]), (old_s[0], old_m[0]), (slow_counts, mean_counts))]
print("runs with every cell inside, the slowest process's median -> the mean: "
      + "; ".join(f"{a_} -> {b_}" for a_, b_ in whole_runs)
      + " (the six runs that chose it; the earlier records; the three new runs)")
assert whole_runs == [(4, 6), (5, 4), (1, 2)]
bf_pred = mean_check[3]["rates"][1]["methods"]["butterfly"]["predicted_s"]
bf_err = {"slowest": bf_pred / np.median(bf, axis=1).max() - 1,  # the slowest process's median
          "pooled": bf_pred / np.median(bf) - 1,  # the median of every process's rounds
          "no first": bf_pred / bf[:, 1:].mean() - 1}  # the mean without its first round
print("the butterfly at 0.5 Gbit/s in run 3 against the slowest process's median "
      f"{bf_err['slowest']:+.1%}, the median of every process's rounds {bf_err['pooled']:+.1%}, "
      f"the mean without its first round {bf_err['no first']:+.1%}")
mean_claims = [(r_["topology_claim"]["verdict"],
                r_["rates"][1]["methods"]["tree"]["predicted_s"]
                / r_["rates"][1]["methods"]["tree_2level"]["predicted_s"])
               for r_ in mean_check.values()]
flat_means = [r_["rates"][1]["methods"]["tree"]["mean_s"]
              / r_["rates"][1]["methods"]["tree_2level"]["mean_s"] for r_ in mean_check.values()]
flat_medians = [r_["topology_claim"]["flat_over_two_level"] for r_ in mean_check.values()]
print("§9.5's test at 0.5 Gbit/s in the three new runs, flat / 2-level (above 1: the 2-level "
      "tree faster), by the model; by the means over every process's rounds; by the slowest "
      "process's medians (§9.5's measure); and the verdict (process 0's rounds): " + "; ".join(
          f"{x:.2f}, {y:.2f}, {z:.2f}, {v}"
          for (v, x), y, z in zip(mean_claims, flat_means, flat_medians, strict=True)))
new_shift = [float(np.mean([v[j] for v in mean_now.values()])
                   - np.mean([v[j] for v in slow_now.values()])) for j in range(3)]
print("the shift of the mean error from the slowest process's median to the mean, in each "
      "new run: " + ", ".join(f"{x * 100:+.1f}" for x in new_shift) + " points (mean "
      f"{np.mean(new_shift) * 100:+.1f})")
nine = estimator_errors([*six_runs, *mean_check.values()], "mean over every process's rounds")
cell_sd = statistics.median(float(np.std(v, ddof=1)) for v in nine.values())
print(f"the median over the cells of the standard deviation of a cell's error over these nine "
      f"runs (six of `check/few/` and these three, one model): {cell_sd:.1%}")
assert 0.07 < cell_sd < 0.13  # "about a tenth"
assert min(nine, key=lambda k: np.mean(nine[k]))[0] == "tree"  # the flat tree: the most biased
edge_sd = (band + np.mean(nine["tree", 1.0])) / cell_sd
assert 1.2 < edge_sd < 1.6
assert mean_counts == [17, 17, 16] and slow_counts == [17, 16, 16]
assert [(k, j) for k, j, _ in mean_out] == [(("butterfly", 0.5), 3)]
assert -0.31 < mean_out[0][2] < -band  # outside by a hair
assert all(e < 0 for e in mean_now["tree", 1.0] + mean_now["tree", 0.5])
assert bf.mean(axis=0)[0] == bf.mean(axis=0).max()  # its first round the slowest
by_bias = sorted(nine, key=lambda k: np.mean(nine[k]))
biased, next_ = by_bias[:5], by_bias[5]
near = {k: min(v) for k, v in nine.items() if k not in biased}
closest = min(near, key=near.get)
print("the five cells most under-predicted on average over the nine runs: " + ", ".join(
    f"{k[0]} at {k[1]:g} ({np.mean(nine[k]):+.1%})" for k in biased)
    + f"; next {next_[0]} at {next_[1]:g} ({np.mean(nine[next_]):+.1%}); of the others, the "
    f"lowest single run: {closest[0]} at {closest[1]:g} ({near[closest]:+.1%})")
flat_cells = nine["tree", 1.0] + nine["tree", 0.5]
assert ("butterfly", 0.5) in biased and ("tree", 1.0) in biased and ("tree", 0.5) in biased
assert all(abs(e) <= band for e in flat_cells) and len(flat_cells) == 18
assert [v for v, _ in mean_claims].count("2-level faster") == 2 and mean_claims[1][1] < 1
assert all(y > 1 for y in flat_means) and sum(x < 1 for _, x in mean_claims) == 2
assert [z > 1 for z in flat_medians] == [False, True, False]  # the medians: run 2 only
assert round((1 - flat_medians[0]) * 100) == 14  # §9.5's answer: "the flat tree 14% ahead"
pairs_ = list(zip(mean_claims, flat_means, flat_medians, strict=True))
assert [(x > 1) == (y > 1) for (_, x), y, _ in pairs_] == [True, False, False]  # as the means
assert [(x > 1) == (z > 1) for (_, x), _, z in pairs_] == [False, False, True]  # as the medians
assert 0.01 < np.mean(new_shift) < 0.03 and min(new_shift) < 0.01  # "about two"
assert [round(x * 1000) for x in new_shift] == [42, -1, 15]  # §9.10: "-0.1 to +4.2"
assert round(np.mean(new_shift) * 1000) == 19  # §9.10: "+1.9 on average"
assert 0.35 < np.mean(new_shift) / shift[0] < 0.55  # "about half" of the choosing runs' shift
assert all(np.mean(nine[k]) < -0.1 for k in biased) and np.mean(nine[next_]) > -0.1
assert closest == ("tree_2level", 1.0) and near[closest] < -0.25
assert bf_err["slowest"] < -band and abs(bf_err["pooled"]) <= band >= abs(bf_err["no first"])
assert "flat faster" not in [v for v, _ in mean_claims]
display(Markdown(
    f"**Not met, again.** Against the mean the three new runs put "
    f"{', '.join(map(str, mean_counts))} of the {len(mean_now)} cells within ±{band:.0%} "
    f"(against the slowest process's median, {', '.join(map(str, slow_counts))}). The one "
    f"cell outside is the butterfly merge at 0.5 Gbit/s in run 3, at "
    f"{mean_out[0][2]:+.2%}; against the slowest process's median it is outside too "
    f"({bf_err['slowest']:+.1%}). Its first round was "
    f"its slowest, and a mean carries such a round whole: without that round the mean "
    f"gives {bf_err['no first']:+.1%}, and the pooled median of all {bf.size} times, that "
    f"round included, {bf_err['pooled']:+.1%}. Over the "
    f"nine runs of this model a cell's first round was its slowest in "
    f"{sum(first_slowest)} of {len(first_slowest)} cells, where chance would give about "
    f"{len(first_slowest) / 9:.0f}. The flat tree stays under-predicted in each of the three "
    f"new runs and at both rates, the shortfall of the subsection before; over all cells the mean error is "
    f"{new_bias:+.1%}.\n\n"
    f"The change of estimator changes what is measured, not the model: on the new runs "
    f"the two estimators differ by {np.mean(new_shift) * 100:+.1f} points of mean error on "
    f"average. The remaining {new_bias:+.1%} is, as a reading, partly the model's: its β "
    f"are slopes and its overhead and local terms medians, and the runs' noise enters "
    f"too. The change of estimator moves the count of cells inside by {gain[0]:+d}, {gain[1]:+d} and "
    f"{gain[2]:+d} on the three sets of runs above, and the count of runs with every cell "
    f"inside, issue 30's unit, from {whole_runs[0][0]} to {whole_runs[0][1]} of the six runs "
    f"that chose it (in-sample), {whole_runs[1][0]} to {whole_runs[1][1]} of the "
    f"{len(earlier)} earlier records, and {whole_runs[2][0]} to {whole_runs[2][1]} of the "
    f"three new runs, the only runs made to test the change of estimator, which still "
    f"miss the target (the "
    f"earlier records, also unused in the choice, went the other way). A cell's "
    f"error has a standard deviation of about 10 points across runs (the median over the "
    f"cells, over the nine "
    f"runs of this model, {cell_sd:.1%}): the flat tree at 1 Gbit/s, at "
    f"{np.mean(nine['tree', 1.0]):+.0%} on average, sits {edge_sd:.1f} such standard "
    f"deviations from the band's edge. The five cells most under-predicted on average "
    f"over those runs, "
    + ", ".join(f"{k[0]} at {k[1]:g} Gbit/s ({np.mean(nine[k]):+.0%})" for k in biased)
    + f", include the one outside; the flat tree, the most biased, stayed inside in all "
    f"{len(flat_cells)} of its cells (worst {min(flat_cells):+.0%}), and single runs of "
    f"other cells come as close ({closest[0]} at {closest[1]:g} Gbit/s, "
    f"{near[closest]:+.0%}).\n\n"
    f"On these three runs the shift of the mean error from one estimator to the other is "
    f"{np.mean(new_shift) * 100:+.1f} points on average ("
    + ", ".join(f"{x * 100:+.1f}" for x in new_shift)
    + "), about half the four points of the runs that chose it.\n\n"
    "§9.5's test at 0.5 Gbit/s in these runs: the means over every process's rounds put "
    "the 2-level tree ahead in all three (flat over 2-level "
    + ", ".join(f"{y:.2f}" for y in flat_means)
    + "), the slowest process's medians, §9.5's measure, in run 2 only ("
    + ", ".join(f"{z:.2f}" for z in flat_medians)
    + "), and the verdicts on process 0's rounds were "
    + ", ".join(f"\"{v}\"" for v, _ in mean_claims)
    + ". The model predicted the flat tree faster in two ("
    + ", ".join(f"{x:.2f}" for _, x in mean_claims)
    + "): it ordered the two trees as the means do in run 1 only, and as the medians do "
    "in run 3 only."))


# %% [markdown]
# ### A warm-up round, and the permute measured alone (issue 30, continued)
#
# Two changes since, each aimed at something the runs above measured, each tested on
# three new runs with the check's command. The commits named below are this repository's
# (`git show ed38ede` shows one); `results/cluster/README.md` says how and at which commit
# the runs were made.
#
# **A warm-up round.** Over the nine runs of this model a cell's first round was its
# slowest more often than chance (the count above). The rounds at the first rate begin
# right after the methods were compiled (`methods.method_calls` compiles them ahead); the
# programs the model's fits read (`levels.level_calls`, `local_calls`) are compiled at
# their first call, the untimed one of the first round, while the other programs of that
# round are timed (the reduce-scatter's rounds, timed last, likewise with its own). The
# rounds at the second rate begin after the first rate's. The next cell splits the count by rate, and gives each program's first
# round over the median of its later rounds (each round the mean over the processes), for
# every program in `round_s_by_process` (those that measure the reduce-scatter's
# collectives, kept apart in its record, are left out): the median over the programs, and
# the mean of the ratios for the methods and for the programs the model's fits read.

# %%
def first_round(runs, i):
    """At rate `i` of `runs`: every timed program's first round over the median of its
    later rounds (each round the mean over the processes), and for each method's cell
    whether its first round was its slowest."""
    ratio = {n_: [] for n_ in ("method", "fit")}
    for r in runs:
        rate = r["rates"][i]
        for n in rate["round_s_by_process"]:
            x = rounds_of(rate, n).mean(axis=0)
            ratio["method" if n in rate["methods"] else "fit"].append(x[0] / np.median(x[1:]))
    slowest_ = [int(np.argmax(rounds_of(r["rates"][i], n).mean(axis=0)) == 0)
                for r in runs for n in r["rates"][i]["methods"]]
    return ratio, slowest_


def over_twice(ratio):
    """How many of the methods' and of the fits' programs had a first round over twice
    their later rounds' median: `(methods, of, fits, of)`."""
    m, f = ratio["method"], ratio["fit"]
    return sum(x > 2 for x in m), len(m), sum(x > 2 for x in f), len(f)


def say_first(runs, what, first_label):
    out = []
    for i, when in enumerate((f"1 Gbit/s, {first_label}", "0.5 Gbit/s")):
        ratio, slowest_ = first_round(runs, i)
        every = ratio["method"] + ratio["fit"]
        means = (float(np.mean(ratio["method"])), float(np.mean(ratio["fit"])))
        out.append((statistics.median(every), sum(slowest_), len(slowest_), *means))
        print(f"{what}, {when}: the median program's first round over its later rounds' "
              f"median {statistics.median(every):.2f} ({len(every)} programs); first round "
              f"the slowest in {sum(slowest_)} of {len(slowest_)} cells (by chance, about "
              f"{len(slowest_) / 9:.0f}); the mean of the ratios, the methods "
              f"{means[0]:.2f}, the programs the fits read {means[1]:.2f}")
    return out


first_nine = say_first(nine_runs, "the nine runs of this model", "right after compiling")
assert first_nine[0][0] > 1.05 and first_nine[0][1] > 2 * first_nine[0][2] / 9  # the first rate
assert abs(first_nine[1][0] - 1) < 0.02 and first_nine[1][1] < 1.5 * first_nine[1][2] / 9
assert ("butterfly", 0.5) == mean_out[0][0]  # the one miss above: at the second rate
assert all(f[4] > f[3] + 0.2 for f in first_nine) and first_nine[0][3] > 1.1  # the fits' heavier
assert all(f[4] > f[0] for f in first_nine)  # the fits' mean above the median
assert first_nine[1][3] < 1.0 and first_nine[1][1] <= first_nine[1][2] / 9  # methods: no slower
assert all(len(r["rates"][0]["methods"]["reduce_scatter"]["last_round_s_by_process"]) == 11
           for r in nine_runs)  # the reduce-scatter and the ten programs left out
twice = over_twice(first_round(nine_runs, 0)[0])
print("at the first rate, a first round over twice the later rounds' median: "
      f"{twice[0]} of {twice[1]} methods, {twice[2]} of {twice[3]} of the fits' programs")
assert twice[0] <= 3 and 0.15 < twice[2] / twice[3] < 0.3  # "about a fifth"

# %% [markdown]
# So the first round after compiling was slow: at the first rate it was the slowest more
# than twice as often as chance would make it; at the second rate the median program's was
# no different from the rest. The mean of the ratios says more: for the programs the
# model's fits read it is above the median at both rates, so some of their first rounds
# were much slower, and it is higher for them than for the methods at both rates; at the first rate about a fifth of the fits'
# programs had a first round over twice their later median, against a few methods
# (printed). Each timed call already follows an
# untimed call of the same program, so this is not a program's own first execution: it is
# something about the first round as a whole, a cost of starting whose cause was not
# measured. Compiling the fits' programs inside that round, while the processes time
# other calls, is one candidate (a reading). The one miss above, the
# butterfly at 0.5 Gbit/s, was at the second rate, where the methods' first rounds were no
# slower: its slow first round was probably chance (a reading), and a warm-up could not be
# expected to move that cell. A mean carries such a round whole, in the methods' times and
# in the fits of the model's collective terms that are means (each link's α and `call_s`,
# the all-gather's and all-to-all's fits): with the fits' first rounds the heavier, they
# raised the predictions more than the measured means (a reading).
# `benchmark.interleaved_times` now takes `warmup` rounds, each like a timed round and run
# first, whose times are not kept, and the cluster run does one at each rate by default
# (`--warmup-rounds 1`; 0 as every run before). That was decided from the first rate's
# count in the nine runs above; three new runs at `ed38ede` test it
# (`check/warm/2x2x2-run{1,2,3}.json`), with the model of `check/few/`, unchanged at
# `ed38ede`. The next cell refits and reprices their predictions from their rounds, as
# recorded, and prints each run's mean error at each rate beside the nine runs' range.

# %%
WARM_DIR = CHECK / "warm"
warm_check = {i: json.loads((WARM_DIR / f"2x2x2-run{i}.json").read_text()) for i in (1, 2, 3)}
for r in warm_check.values():
    assert r["config"]["warmup_rounds"] == 1 and r["config"]["repeats"] == 9
    assert r["config"]["seq_len"] == 16384 and "collective-permute" not in r["links"]["kinds"]
few_errors(warm_check)  # one model: refitted from their rounds and repriced, as recorded
warm_now = estimator_errors(warm_check.values(), "mean over every process's rounds")
print(f"{'method':<15}{'Gbit/s':>7}   run 1   run 2   run 3   (against the mean)")
for (name, gbit), e_now in warm_now.items():
    print(f"{name:<15}{gbit:>7g}" + "".join(f"{e:>+8.1%}" for e in e_now))
warm_counts = summarise(warm_now)[0]
warm_out = [(k, j + 1, e[j]) for k, e in warm_now.items() for j in range(3) if abs(e[j]) > band]
print(f"\nwithin ±{band:.0%}, of {len(warm_now)} cells in runs 1, 2, 3: {warm_counts}")
print("outside: " + "; ".join(
    f"{k[0]} at {k[1]:g} Gbit/s in run {j} ({e:+.1%})" for k, j, e in warm_out))
first_warm = say_first(warm_check.values(), "the three new runs", "after the warm-up round")


def run_bias(errs):
    """Each (rate, run)'s mean error over its cells, from `(method, Gbit/s) -> [run]`."""
    n = len(next(iter(errs.values())))
    return {g: [float(np.mean([v[j] for k, v in errs.items() if k[1] == g])) for j in range(n)]
            for g in (1.0, 0.5)}


def kernel_rates(runs, i=0):
    """Each run's local kernel alone at rate `i`, GB/s (`fit_local`'s `kernel_alone_Bps`)."""
    return [r["rates"][i]["local"]["kernel_alone_Bps"] / 1e9 for r in runs]


nine_bias = run_bias(nine)  # the nine runs' errors against the mean (the subsection before)
warm_bias = run_bias(warm_now)
for g in (1.0, 0.5):
    print(f"mean error at {g:g} Gbit/s, each run: the nine runs "
          f"{min(nine_bias[g]):+.1%} to {max(nine_bias[g]):+.1%} (over them "
          f"{np.mean(nine_bias[g]):+.1%}); the three new runs "
          + ", ".join(f"{b:+.1%}" for b in warm_bias[g]) + f" (over them "
          f"{np.mean(warm_bias[g]):+.1%})")
print("at 1 Gbit/s without run 3, the three new runs' mean error "
      f"{np.mean(warm_bias[1.0][:2]):+.1%}")
k_few, k_mean, k_warm = (kernel_rates(x) for x in (six_runs, mean_check.values(),
                                                     warm_check.values()))
print(f"the local kernel alone, GB/s: the six runs of `check/few/` {min(k_few):.2f} to "
      f"{max(k_few):.2f}; the three of `check/mean/` {min(k_mean):.2f} to {max(k_mean):.2f}; "
      f"the three new " + ", ".join(f"{k:.2f}" for k in k_warm))
assert warm_counts == [17, 16, 15] and sum(warm_counts) < sum(mean_counts)
assert [(k, j) for k, j, _ in warm_out] == [
    (("reduce_scatter", 1.0), 3), (("ring_pass_q", 1.0), 3), (("butterfly", 0.5), 2)]
assert abs(first_warm[0][0] - 1) < 0.02 and first_warm[0][1] <= first_warm[0][2] / 9  # gone
assert all(abs(x - 1) < 0.06 for x in first_warm[0][3:])  # the first rate: methods and fits
assert first_warm[1][4] > 1.1 and abs(first_warm[1][4] - first_nine[1][4]) < 0.05  # the second
assert first_warm[1][4] > first_warm[1][3] + 0.2  # the fits' still the heavier
assert all(np.mean(warm_bias[g]) < np.mean(nine_bias[g]) - 0.03 for g in (1.0, 0.5))
assert warm_bias[1.0][2] < min(nine_bias[1.0])  # run 3's first rate: below all nine
others = [(g, b) for g in (1.0, 0.5) for j, b in enumerate(warm_bias[g]) if (g, j) != (1.0, 2)]
assert all(min(nine_bias[g]) <= b <= max(nine_bias[g]) for g, b in others)  # within the spread
assert abs(np.mean(warm_bias[1.0][:2]) - np.mean(nine_bias[1.0])) < 0.01  # "within a point"
assert max(warm_bias[0.5][1:]) < np.mean(nine_bias[0.5])  # runs 2 and 3: below its mean
assert {("butterfly", 0.5), ("ring_pass_q", 0.5), ("ring", 0.5)} <= set(biased)  # (next text)
assert max(k_warm + k_mean) < 0.75 * min(k_few)  # slower than `check/few/`'s machine
k_half = [kernel_rates(x, 1) for x in (six_runs, mean_check.values(), warm_check.values())]
print("at 0.5 Gbit/s, the same: " + "; ".join(f"{min(k):.2f} to {max(k):.2f}" for k in k_half))
assert max(k_half[1] + k_half[2]) < 0.75 * min(k_half[0])  # at each rate

# %% [markdown]
# **Not met.** The warm-up did what it was for at the first rate: the median program's
# first round is now no slower than its later rounds, the mean of the ratios is within a
# few percent of 1 for the methods and for the programs the fits read alike, and a cell's
# first round was its slowest no more often than chance would make it. At the second rate
# the programs the fits read still had the heavier first rounds on average, as before the
# warm-up (printed): whatever that is, a warm-up round did not remove it. But the three runs put 17, 16 and 15 of
# the 17 cells within ±30% (printed above), fewer than the three runs of `check/mean/`
# (17, 17 and 16). Outside: the reduce-scatter and the pass-Q ring at 1 Gbit/s in run 3,
# and the butterfly at 0.5 Gbit/s again, in run 2; the split above gave no reason to
# expect the warm-up to prevent that one. The model under-predicted more on average,
# by more than three points at each rate against the nine runs (all printed). At 1 Gbit/s
# that is run 3 alone, whose mean error is below each of the nine runs' at that rate;
# without it, the other two runs' mean is within a point of the nine runs'. At 0.5 Gbit/s
# it is runs 2 and 3, each within the nine runs' spread but both below its mean; how much
# of either shift is noise, the next runs help to say (below). The local kernel alone ran
# slower in these runs and in `check/mean/`'s than in `check/few/`'s (under three quarters
# of its speed, at each rate, printed). Three runs
# cannot say whether the warm-up helps the count or hurts it. It stays: at the first rate
# it takes out of both the fits and the methods' times a cost of the first round after
# compiling; at the second, the fits' heavier first round stayed (printed above).
#
# **The permute measured alone.** Issue 30 asks for each collective's cost measured per
# kind, the collective-permute among them, and three of the five cells most under-predicted
# over the nine runs (printed in the subsection before) issue collective-permutes, all at
# 0.5 Gbit/s: the butterfly (three rounds, partners $i \oplus 1, 2, 4$, back to back,
# priced at the levels' α of a ring step: two rounds inside a node, one across), the pass-Q
# ring (seven query-block permutes, one per step, in flight during its fold) and the
# pass-KV ring (its K and V
# blocks at each step, priced at the slowest link of the ring). At `345e4cf` the cluster
# timed a ring-shift permute over all devices on its own, as it times the all-gather and
# all-to-all, and priced every collective-permute at it. Three runs with the warm-up and the
# check's command (`check/permute/2x2x2-run{1,2,3}.json`; their rounds also timed the lone
# permute's calls) tested it. The next cell prints their errors as recorded, and as the
# model without the permute (that of `ed38ede`, this notebook's) prices the same rounds;
# the permute's fit is read back from its points.

# %%
PERMUTE_DIR = CHECK / "permute"
perm_check = {i: json.loads((PERMUTE_DIR / f"2x2x2-run{i}.json").read_text())
              for i in (1, 2, 3)}


def without_permute(links):
    """A rate's links less the permute's fit: what the model without it prices by."""
    return links | {"kinds": {k: v for k, v in links["kinds"].items()
                              if k != "collective-permute"}}


def perm_errors(runs, priced):
    """(method, Gbit/s) -> each run's error against the mean: `priced` "as recorded" (the
    permute priced as measured alone) or "without the permute" (refitted from the rounds
    by this notebook's model, and checked against the record less the permute)."""
    out = {}
    for r in runs.values():
        for rate in r["rates"]:
            links = refit(r, rate)
            assert json.loads(json.dumps(links)) == without_permute(rate["links"])
            for name, m in rate["methods"].items():
                x = rounds_of(rate, name).mean()
                assert np.isclose(m["mean_s"], x, rtol=1e-12)
                kl = m.get("kinds_last", {})
                pred = m["predicted_s"] if priced == "as recorded" else predicted_by(
                    r, name, links | {"kinds": links["kinds"] | kl}, rate["local"])
                out.setdefault((name, rate["set_Bps"] * 8 / 1e9), []).append(pred / x - 1)
    return out


for r in perm_check.values():
    assert r["config"]["warmup_rounds"] == 1 and r["config"]["repeats"] == 9
    assert "collective-permute" in r["links"]["kinds"]
perm_as = perm_errors(perm_check, "as recorded")
perm_wo = perm_errors(perm_check, "without the permute")
print(f"{'method':<15}{'Gbit/s':>7}   as recorded (permute alone)   without the permute")
for cell in perm_as:
    print(f"{cell[0]:<15}{cell[1]:>7g}  " + "".join(f"{e:>+7.1%}" for e in perm_as[cell])
          + "      " + "".join(f"{e:>+7.1%}" for e in perm_wo[cell]))
perm_counts = {"as recorded": summarise(perm_as)[0], "without the permute": summarise(perm_wo)[0]}
print(f"\nwithin ±{band:.0%}, of {len(perm_as)} cells in runs 1, 2, 3: " + "; ".join(
    f"{k} {v}" for k, v in perm_counts.items()))
perm_fit = [(rate["links"]["kinds"]["collective-permute"], rate["links"]["intra"],
             rate["links"]["inter"]) for r in perm_check.values() for rate in r["rates"]]
for fit, _, _ in perm_fit:  # α and β read back from the points (`levels.alpha_beta`)
    assert np.isclose(fit["alpha_s"], np.mean([t for n, t in fit["points"] if n <= 4096]))
    assert np.allclose(levels.alpha_beta(fit["points"]), (fit["alpha_s"], fit["beta_Bps"]))
alpha_ratio = [f["alpha_s"] / (2 * a["alpha_s"] + b["alpha_s"]) for f, a, b in perm_fit]
print("at each (run, rate): the lone permute's α, ms: " + ", ".join(
    f"{f['alpha_s'] * 1e3:.1f}" for f, _, _ in perm_fit) + "; the inter-node α: " + ", ".join(
    f"{b['alpha_s'] * 1e3:.1f}" for _, _, b in perm_fit) + "; the levels' α the butterfly's "
    "three rounds were priced at (two inside, one across), summed: " + ", ".join(
    f"{(2 * a['alpha_s'] + b['alpha_s']) * 1e3:.1f}" for _, a, b in perm_fit)
    + f"; the lone permute's over that sum {min(alpha_ratio):.2f} to {max(alpha_ratio):.2f}")
print("at each (run, rate): the lone permute's β, MB/s: " + ", ".join(
    f"{f['beta_Bps'] / 1e6:.0f}" for f, _, _ in perm_fit) + "; the inter-node β: " + ", ".join(
    f"{b['beta_Bps'] / 1e6:.0f}" for _, _, b in perm_fit))
c_ = perm_check[1]["config"]
block = c_["seq_len"] // c_["devices"] * c_["problem"]["kv_heads"] * c_["problem"]["head_dim"] * 4
beta_share = [block / f["beta_Bps"] / (f["alpha_s"] + block / f["beta_Bps"])
              for f, _, _ in perm_fit]  # n/β over α + n/β
print(f"the pass-KV ring's K block (and V block), float32: {block / 2**20:g} MiB; the β term's "
      f"share of its price at the lone permute's fit, at each (run, rate): "
      + ", ".join(f"{x:.2f}" for x in beta_share))
assert min(beta_share) > 0.8  # "priced mostly by β"
for name in ("butterfly", "ring_pass_q", "ring"):
    both = [(np.mean(perm_as[name, g]), np.mean(perm_wo[name, g])) for g in (1.0, 0.5)]
    print(f"{name}: mean error at 1 and 0.5 Gbit/s, as recorded "
          + ", ".join(f"{a:+.1%}" for a, _ in both) + "; without the permute "
          + ", ".join(f"{b:+.1%}" for _, b in both))
perm_bias = run_bias(perm_wo)
print("without the permute, mean error at 1 and 0.5 Gbit/s, each run: " + "; ".join(
    ", ".join(f"{perm_bias[g][j]:+.1%}" for g in (1.0, 0.5)) for j in range(3))
    + " (over them " + ", ".join(f"{np.mean(perm_bias[g]):+.1%}" for g in (1.0, 0.5)) + ")")
k_perm = [kernel_rates(perm_check.values(), i) for i in (0, 1)]
print("the local kernel alone in these runs, GB/s, at 1 and 0.5 Gbit/s: " + "; ".join(
    ", ".join(f"{k:.2f}" for k in ks) for ks in k_perm))
sd_run = {g: float(np.std(nine_bias[g], ddof=1)) for g in (1.0, 0.5)}
se_three = {g: sd_run[g] * (1 / 3 + 1 / 9) ** 0.5 for g in (1.0, 0.5)}  # 3 runs' mean less 9's
print("a run's mean error over the nine runs: standard deviation "
      + ", ".join(f"{sd_run[g] * 100:.1f}" for g in (1.0, 0.5)) + " points at 1 and 0.5 Gbit/s; "
      "the standard error of three runs' mean less the nine's "
      + ", ".join(f"{se_three[g] * 100:.1f}" for g in (1.0, 0.5)))
six_now = {k: warm_now[k] + perm_wo[k] for k in warm_now}
print(f"the model of `check/few/` on the six runs with the warm-up (`check/warm/`, then "
      f"`check/permute/` repriced): within ±{band:.0%} {summarise(six_now)[0]}; mean error "
      f"{summarise(six_now)[1]:+.1%}")
lead = {k: perm_as[k] if k[0] == "ring_pass_q" else perm_wo[k] for k in perm_as}
print(f"in-sample, untested: the lone permute for the pass-Q ring only, within ±{band:.0%} "
      f"{summarise(lead)[0]}")
six_verdicts = [r["topology_claim"]["verdict"] for r in (*warm_check.values(),
                                                         *perm_check.values())]
print("§9.5's verdicts at 0.5 Gbit/s in these six runs: " + ", ".join(six_verdicts))
assert set(six_verdicts) == {"no measurable difference"}
assert perm_counts == {"as recorded": [16, 17, 15], "without the permute": [17, 16, 17]}
assert all(0.75 < x < 1.15 for x in alpha_ratio)  # "about that of the three rounds together"
assert all(f["alpha_s"] > b["alpha_s"] for f, _, b in perm_fit)
assert all(f["beta_Bps"] < b["beta_Bps"] for f, _, b in perm_fit)
assert block == 4 * 2**20
mean_of = {(n, g): (np.mean(perm_as[n, g]), np.mean(perm_wo[n, g]))
           for n in ("butterfly", "ring_pass_q", "ring") for g in (1.0, 0.5)}
assert all(mean_of["butterfly", g][0] > 0.2 and abs(mean_of["butterfly", g][1]) < 0.1
           for g in (1.0, 0.5))
assert all(abs(mean_of["ring_pass_q", g][0]) < 0.1 and mean_of["ring_pass_q", g][1] < -0.15
           for g in (1.0, 0.5))
assert all(mean_of["ring", g][0] > 0.05 and abs(mean_of["ring", g][1]) < 0.05 for g in (1.0, 0.5))
assert max(max(perm_as["butterfly", g]) for g in (1.0, 0.5)) > 0.5
assert max(k_perm[0]) < 0.75 * min(k_few) and max(k_perm[1]) < 0.75 * min(k_half[0])
bias_means = {k: [float(np.mean(x[g])) for g in (1.0, 0.5)]
              for k, x in (("permute", perm_bias), ("nine", nine_bias), ("warm", warm_bias))}
z_half = [(bias_means[k][1] - bias_means["nine"][1]) / se_three[0.5] for k in ("warm", "permute")]
z_half_w = [(bias_means[k][1] - bias_means["nine"][1])
            / (np.var(b[0.5], ddof=1) / 3 + sd_run[0.5] ** 2 / 9) ** 0.5
            for k, b in (("warm", warm_bias), ("permute", perm_bias))]
print("at 0.5 Gbit/s, each set's mean less the nine runs', in standard errors: "
      + ", ".join(f"{z:+.1f}" for z in z_half) + " (the nine runs' spread); "
      + ", ".join(f"{z:+.1f}" for z in z_half_w) + " (each set's own, Welch)")
assert all(abs(z) < 1 for z in z_half) and all(abs(z) < 1.5 for z in z_half_w)
assert bias_means["warm"][0] < bias_means["permute"][0] < bias_means["nine"][0]  # "between"
six_rate = [float(np.mean(warm_bias[g] + perm_bias[g])) for g in (1.0, 0.5)]
six_first = warm_bias[1.0] + perm_bias[1.0]
sd_six = float(np.std(six_first, ddof=1))
z_eq = (six_rate[0] - bias_means["nine"][0]) / (sd_run[1.0] * (1 / 6 + 1 / 9) ** 0.5)
z_welch = (six_rate[0] - bias_means["nine"][0]) / (sd_six**2 / 6 + sd_run[1.0] ** 2 / 9) ** 0.5
mean_first = float(np.mean(run_bias(estimator_errors(
    mean_check.values(), "mean over every process's rounds"))[1.0]))
print("over the six runs with the warm-up, mean error at 1 and 0.5 Gbit/s: "
      + ", ".join(f"{x:+.1%}" for x in six_rate) + f"; at 1 Gbit/s a run's mean error "
      f"varies by {sd_six * 100:.1f} points (one standard deviation) over them, and the six's "
      f"mean is {z_welch:+.1f} standard errors from the nine runs' ({z_eq:+.1f} if they "
      f"varied as the nine did); `check/mean/` alone, at 1 Gbit/s: {mean_first:+.1%}")
assert -1.5 < z_welch < -1.0 and -2.5 < z_eq < -1.5 and sd_six > 1.5 * sd_run[1.0]
assert k_perm[0][2] == min(k_warm + k_perm[0]) and k_warm[2] > k_perm[0][2] + 0.3
assert perm_bias[1.0][2] > -0.03 > -0.15 > warm_bias[1.0][2]  # speed and error do not track
assert mean_first > bias_means["nine"][0] > six_rate[0] + 0.03  # the slow machine, no warm-up
few_first = float(np.mean(nine_bias[1.0][:6]))  # `check/few/`'s six, the faster machine
print(f"`check/few/`'s six runs alone, at 1 Gbit/s: {few_first:+.1%}")
assert mean_first > few_first > six_rate[0]
slower_than_mean = [k for k in k_warm + k_perm[0] if k < min(k_mean)]
assert len(slower_than_mean) == 3
assert all(sum(k.startswith("ppermute ") for k in rate["round_s_by_process"]) == 4
           for r in perm_check.values() for rate in r["rates"])  # the lone permute's four
outside_spread = [(g, j) for g in (1.0, 0.5) for j, b in enumerate(perm_bias[g])
                  if not min(nine_bias[g]) <= b <= max(nine_bias[g])]
assert outside_spread == [(1.0, 1)] and perm_bias[1.0][1] < min(nine_bias[1.0])  # below
assert summarise(six_now)[0] == [17, 16, 15, 17, 16, 17] and summarise(lead)[0] == [17, 17, 17]
assert -0.1 < summarise(six_now)[1] < -0.05
tree_edge = perm_wo["tree", 1.0][1]
assert -0.3 <= tree_edge < -0.2995  # inside, by a hair
display(Markdown(
    "**Taken back.** Priced at the lone permute, the butterfly went over: mean error "
    f"{mean_of['butterfly', 1.0][0]:+.0%} and {mean_of['butterfly', 0.5][0]:+.0%} at the "
    f"two rates ({max(perm_as['butterfly', 1.0]):+.0%} in one cell), against "
    f"{mean_of['butterfly', 1.0][1]:+.0%} and {mean_of['butterfly', 0.5][1]:+.0%} priced "
    "as before on the same rounds. One lone permute's α was about that of the butterfly's "
    f"three rounds together at the levels' α (their ratio {min(alpha_ratio):.2f} to "
    f"{max(alpha_ratio):.2f}). Two readings, neither measured: the butterfly runs its three "
    "rounds back to back, as a ring runs its steps, and a chain pays a lone call's start "
    "once (no run timed a chain of permutes); and the lone permute is a ring shift over all "
    "eight devices, two of whose sends cross nodes, with an α above the inter-node α at "
    "every (run, rate), so it over-prices the butterfly's two rounds inside a node whatever "
    "a chain pays. The pass-Q ring came out right on average "
    f"({mean_of['ring_pass_q', 1.0][0]:+.1%} and {mean_of['ring_pass_q', 0.5][0]:+.1%}, "
    f"against {mean_of['ring_pass_q', 1.0][1]:+.0%} and "
    f"{mean_of['ring_pass_q', 0.5][1]:+.0%} without); the pass-KV ring came out over "
    f"({mean_of['ring', 1.0][0]:+.0%} and {mean_of['ring', 0.5][0]:+.0%}, against "
    f"{mean_of['ring', 1.0][1]:+.0%} and {mean_of['ring', 0.5][1]:+.0%}): its K and V "
    f"blocks are {block / 2**20:g} MiB each, priced mostly by β, and the permute's fitted β "
    "was below the inter-node link's at every (run, rate) (all printed). As recorded, the "
    "three runs put " + ", ".join(map(str, perm_counts["as recorded"])) + " of the 17 "
    "cells inside; repriced by the model without the permute, "
    + ", ".join(map(str, perm_counts["without the permute"]))
    + f" (the flat tree at 1 Gbit/s in run 2 inside by a hair, at {tree_edge:+.3%}). So "
    "`345e4cf` was reverted (`cc2686f`), and the model is again that of `check/few/`. A "
    "lead for later, in-sample and untested: pricing only the pass-Q ring's permutes at "
    "the lone permute's fit would put " + ", ".join(map(str, summarise(lead)[0]))
    + " of these runs' cells inside.\n\n"
    "These runs, repriced, bear on the warm runs' shift, read rate by rate against the "
    "nine runs' run-to-run spread (a run's mean error there has a standard deviation of "
    f"{sd_run[1.0] * 100:.1f} and {sd_run[0.5] * 100:.1f} points at the two rates; "
    "printed). At 0.5 Gbit/s, where the methods' first rounds were no slower, each set's mean "
    f"({bias_means['warm'][1]:+.1%} in `check/warm/`, {bias_means['permute'][1]:+.1%} "
    f"here, against the nine runs' {bias_means['nine'][1]:+.1%}) is no more than "
    f"{max(abs(z) for z in z_half_w):.1f} standard errors away (Welch; under 1 at the nine "
    "runs' spread): noise cannot be ruled out. At 1 Gbit/s, where the methods' first "
    "rounds were slower, `check/permute/`'s "
    f"{bias_means['permute'][0]:+.1%} lies between the nine runs' "
    f"({bias_means['nine'][0]:+.1%}) and `check/warm/`'s ({bias_means['warm'][0]:+.1%}), "
    f"and its run 2's first rate ({perm_bias[1.0][1]:+.1%}) is below the nine runs' "
    "spread, as run 3's of `check/warm/` was; over the six runs with the warm-up the first "
    f"rate's mean error is {six_rate[0]:+.1%}, {abs(z_welch):.1f} standard errors under "
    f"the nine runs' (these six varied more: {abs(z_eq):.1f} if they had varied as the "
    "nine did). A slower machine alone does not explain it (a reading): `check/mean/`'s "
    "three runs, on a machine also slower than `check/few/`'s (printed above) and without "
    "the warm-up, under-predicted the first rate less than `check/few/`'s six "
    f"({mean_first:+.1%} against {few_first:+.1%}), though three of the six warm-up runs "
    "ran slower still (" + ", ".join(f"{k:.2f}" for k in slower_than_mean) + " GB/s), "
    "and within the six the error did not follow the speed: `check/permute/`'s run 3, "
    f"the slowest ({k_perm[0][2]:.2f} GB/s), has {perm_bias[1.0][2]:+.1%} at 1 Gbit/s, "
    f"`check/warm/`'s run 3 ({k_warm[2]:.2f} GB/s) {warm_bias[1.0][2]:+.1%}. "
    "What remains is noise, or the warm-up itself: at the first rate it takes "
    "out of the collective terms' means a first round that was heavier in the programs "
    "they read than in the methods, so it lowers the predictions more than the measured "
    "means (a reading; three runs a set cannot tell).\n\n"
    "With the warm-up, the model has been tested on six runs (`check/permute/`'s rounds "
    "also timed the lone permute's four programs): "
    + ", ".join(map(str, summarise(six_now)[0][:3])) + " cells inside (`check/warm/`) and "
    + ", ".join(map(str, summarise(six_now)[0][3:])) + " (`check/permute/`, repriced), "
    f"mean error {summarise(six_now)[1]:+.1%}. Issue 30's cluster target, every cell inside "
    "in each of the three runs of one check, is not met: `check/warm/` has every cell "
    f"inside in {sum(c == 17 for c in warm_counts)} of its three runs, and "
    "`check/permute/`, repriced, in "
    f"{sum(c == 17 for c in perm_counts['without the permute'])} (its runs were made to "
    "test another model)."))


# %% [markdown]
# ### A ring's steps measured, and more rounds (issue 30, continued)
#
# The subsection before ended on a lead: the pass-Q ring was under-predicted on average,
# and a permute measured alone priced it about right on average there (in-sample; that
# lead priced the pass-Q ring alone, at the permute's α and β). Two versions of the idea,
# for both rings' permutes and at the permute's α only, were built and each tested on three new runs with the check's
# command; both were taken back, and then the runs' protocol was changed. In order (the
# commits are this repository's; each set's runs were made at the commit named, by this
# project's log, and committed in the next one):
#
# 1. **One permute alone** (`ad20567`; runs `check/shift/`, committed in `3ed1cf9`). Each
#    round also timed one collective-permute over all eight devices, every device's block
#    to the next device (a ring shift, the pattern of both rings' steps), at the two small
#    sizes of the kinds timed alone (1,024 and 4,096 bytes per device,
#    `levels.kind_sizes`). Its α, by the levels' rule of §9.3 (the mean over both sizes
#    and every process's rounds of a call's time less the per-call overhead, the time of a
#    program with no collective, at least 0), priced every permute of both rings (`Topology.ring_shift` at
#    that commit), not the butterfly's, whose rounds pair devices level by level. No β was
#    measured (small sizes only): the permutes' bytes stayed at the inter-node link's β.
# 2. **A ring's steps in one program** (`3ed1cf9`; runs `check/steps/`, committed in
#    `abaac07`). The same, but timed as a ring issues them: $p-1 = 7$ dependent permutes
#    in one program, its α per step the call's time less the overhead, over 7.
#
# Both pricings were taken back in `abaac07`, whose package and tests are those of
# `d6102d1` (later commits change the `--repeats` help and this notebook's prose-number
# list, nothing the model reads): a ring's permute costs the slowest
# link's α and β. The next cell
# prints both sets' errors as recorded and as that model prices the same rounds. The
# package no longer prices a ring's step, so the recorded predictions are checked in
# closed form: each ring's price at the slowest link, plus its permutes' count
# (`collectives` in the record: 7 for the pass-Q ring, 14 for the pass-KV ring) times the
# measured step's α less the inter-node α; the step's α is refitted from its rounds by
# the rule it was recorded with. (`kinds_last`, used below as in the subsections before,
# holds the reduce-scatter's collectives timed in its own rounds, last.)

# %%
SHIFT_DIR, STEPS_DIR = CHECK / "shift", CHECK / "steps"
shift_check, steps_check = (
    {i: json.loads((d / f"2x2x2-run{i}.json").read_text()) for i in (1, 2, 3)}
    for d in (SHIFT_DIR, STEPS_DIR))
RINGS_ = ("ring", "ring_pass_q")


def ring_step(rate):
    """A record's measured ring step, refitted from its rounds and checked against the
    record: `check/shift/`'s calls ("shift BYTES") hold one permute, `check/steps/`'s
    ("shifts BYTES") seven; α per step is the mean over both small sizes and every
    process's rounds of (time − overhead, at least 0) over the permutes per call."""
    rb, overhead = levels.pooled(rate["round_s_by_process"]), rate["links"]["overhead_s"]
    name, per_call = ("shifts", 7) if "shifts 1024" in rb else ("shift", 1)
    points = [[n, max(t - overhead, 0.0) / per_call] for n in levels.kind_sizes(8)[:2]
              for t in rb[f"{name} {n}"]]
    fit = rate["links"]["shift"]
    assert np.allclose(points, fit["points"], rtol=1e-12, atol=0)
    assert np.isclose(np.mean([t for _, t in points]), fit["alpha_s"], rtol=1e-12)
    return fit["alpha_s"], per_call


def step_errors(runs, priced):
    """(method, Gbit/s) -> each run's error against the mean, with the rings' permutes
    priced "as recorded" (at the measured step) or "at the slowest link" (the package's
    model). The links are refitted from the rounds and checked against the record less
    its step; the recorded predictions are checked in closed form."""
    out = {}
    for r in runs.values():
        for rate in r["rates"]:
            links = refit(r, rate)
            assert json.loads(json.dumps(links)) == {k: v for k, v in rate["links"].items()
                                                     if k != "shift"}
            alpha, _ = ring_step(rate)
            for name, m in rate["methods"].items():
                x = rounds_of(rate, name).mean()
                assert np.isclose(m["mean_s"], x, rtol=1e-12)
                kl = m.get("kinds_last", {})
                pred = predicted_by(r, name, links | {"kinds": links["kinds"] | kl},
                                    rate["local"])
                count = m["collectives"].get("collective-permute", 0) if name in RINGS_ else 0
                moved = pred + count * (alpha - links["inter"]["alpha_s"])
                assert np.isclose(moved, m["predicted_s"], rtol=1e-9)  # the closed form
                out.setdefault((name, rate["set_Bps"] * 8 / 1e9), []).append(
                    (moved if priced == "as recorded" else pred) / x - 1)
    return out


for r in (*shift_check.values(), *steps_check.values()):
    assert r["config"]["warmup_rounds"] == 1 and r["config"]["repeats"] == 9
    assert r["config"]["seq_len"] == 16384 and "collective-permute" not in r["links"]["kinds"]
    for rate in r["rates"]:
        assert rate["methods"]["ring_pass_q"]["collectives"]["collective-permute"] == 7
        assert rate["methods"]["ring"]["collectives"]["collective-permute"] == 14
SETS_ = {"check/shift/": shift_check, "check/steps/": steps_check}
PRICES_ = ("as recorded", "at the slowest link")
step_err = {(s_, p_): step_errors(x, p_) for s_, x in SETS_.items() for p_ in PRICES_}
print(f"{'':<22}{'check/shift/ (one permute a call)':<46}check/steps/ (7 permutes a call)")
print(f"{'method':<15}{'Gbit/s':>7} " + ("as recorded           at the slowest link   " * 2))
for cell in step_err["check/shift/", "as recorded"]:
    print(f"{cell[0]:<15}{cell[1]:>7g}" + "".join(
        "".join(f"{e:>+7.1%}" for e in step_err[s_, p_][cell]) + " " for s_ in SETS_
        for p_ in PRICES_))
step_sum = {k: summarise(v) for k, v in step_err.items()}
for (s_, p_), v in step_err.items():
    misses = [f"{n} at {g:g} Gbit/s in run {j + 1} ({e[j]:+.1%})" for (n, g), e in v.items()
              for j in range(3) if abs(e[j]) > band]
    print(f"{s_} {p_}: within ±{band:.0%} {step_sum[s_, p_][0]} of {len(v)}; mean error "
          f"{step_sum[s_, p_][1]:+.1%}; outside: " + ("; ".join(misses) or "none"))
step_alpha = {s_: [(ring_step(rate)[0], rate["links"]["inter"]["alpha_s"])
                   for r in x.values() for rate in r["rates"]] for s_, x in SETS_.items()}
for s_, v in step_alpha.items():
    print(f"{s_} at each (run, rate): the step's α, ms: " + ", ".join(
        f"{a * 1e3:.1f}" for a, _ in v) + "; the inter-node α: " + ", ".join(
        f"{b * 1e3:.1f}" for _, b in v))
lone_pts = [np.array(rate["links"]["shift"]["points"])[:, 1] for r in shift_check.values()
            for rate in r["rates"]]
print("check/shift/'s one permute alone, ms, at each (run, rate): median "
      + ", ".join(f"{np.median(x) * 1e3:.1f}" for x in lone_pts) + "; largest "
      + ", ".join(f"{x.max() * 1e3:.0f}" for x in lone_pts))


def over_cells(name, f=lambda e: e):
    """(set, price) -> the mean of `f` of method `name`'s errors over its six cells."""
    return {k: float(np.mean(f(np.array(v[name, 1.0] + v[name, 0.5]))))
            for k, v in step_err.items()}


pq_abs, pq_mean = over_cells("ring_pass_q", np.abs), over_cells("ring_pass_q")
print("the pass-Q ring's mean error and mean |error| over its six cells: " + "; ".join(
    f"{s_} {p_} {pq_mean[s_, p_]:+.1%}, {pq_abs[s_, p_]:.1%}" for s_ in SETS_ for p_ in PRICES_))

# %%
step_counts = {k: v[0] for k, v in step_sum.items()}
assert step_counts == {("check/shift/", "as recorded"): [16, 17, 16],
                       ("check/shift/", "at the slowest link"): [17, 17, 16],
                       ("check/steps/", "as recorded"): [17, 14, 17],
                       ("check/steps/", "at the slowest link"): [17, 15, 17]}
assert all(a > b for v in step_alpha.values() for a, b in v)  # above the inter-node α
lone_alpha = [a for a, _ in step_alpha["check/shift/"]]
assert all(np.mean(x) > 1.4 * np.median(x) for x in lone_pts)  # the tail lifts the mean
assert all(pq_abs[s_, "as recorded"] > pq_abs[s_, "at the slowest link"] + 0.05 for s_ in SETS_)
assert pq_mean["check/shift/", "as recorded"] > 0.1 and pq_mean["check/steps/", "as recorded"] > 0.1
assert pq_mean["check/shift/", "at the slowest link"] < -0.1
assert abs(pq_mean["check/steps/", "at the slowest link"]) < 0.01
steps_inter = [b for _, b in step_alpha["check/steps/"]]
odd_one = int(np.argmax(steps_inter))
assert odd_one == 3 and steps_inter[3] > 2.5 * max(steps_inter[:3] + steps_inter[4:])  # run 2, 0.5
run2_misses = [k for k, e in step_err["check/steps/", "at the slowest link"].items()
               if abs(e[1]) > band]
assert run2_misses == [("allgather", 1.0), ("tree", 0.5)]
assert all(step_err["check/steps/", "at the slowest link"][k][1] > band for k in run2_misses)
steps_pq_half = step_err["check/steps/", "as recorded"]["ring_pass_q", 0.5][1]
steps_misses = {k for k, e in step_err["check/steps/", "as recorded"].items()
                for j in range(3) if abs(e[j]) > band}
assert steps_misses == {*run2_misses, ("ring_pass_q", 0.5)}  # the step's own: the pass-Q
assert band < steps_pq_half < band + 0.005  # the third miss as recorded: over, by a hair
shift_misses = [(k, j, e[j]) for k, e in step_err["check/shift/", "as recorded"].items()
                for j in range(3) if abs(e[j]) > band]
assert [(k, j) for k, j, _ in shift_misses] == [(("ring_pass_q", 1.0), 2),
                                                  (("ring_pass_q", 0.5), 0)]
assert all(e > band for *_, e in shift_misses)  # both over
run2_inter_1g = steps_inter[2]  # run 2 at 1 Gbit/s, where the all-gather merge missed
assert min(steps_inter[0], steps_inter[4]) < run2_inter_1g < max(steps_inter[0], steps_inter[4])
kv_abs = over_cells("ring", np.abs)
assert all(abs(kv_abs[s_, "as recorded"] - kv_abs[s_, "at the slowest link"]) < 0.03
           for s_ in SETS_)  # "moved little either way"
perm_alpha = [f["alpha_s"] for f, _, _ in perm_fit]
assert np.mean(lone_alpha) > 1.3 * np.mean(perm_alpha)  # "higher on average"
steps_walls = [r["wall_s"] for r in steps_check.values()]
print("`check/steps/`'s wall times, min: " + ", ".join(f"{w / 60:.1f}" for w in steps_walls))
assert steps_walls[1] > 1.2 * max(steps_walls[0], steps_walls[2])
lone_inter = [b for _, b in step_alpha["check/shift/"]]
assert all(abs(np.median(x) - b) < abs(np.mean(x) - b) for x, b in zip(lone_pts, lone_inter,
                                                                         strict=True))
display(Markdown(
    "**Both taken back.** A permute alone had α "
    f"{min(lone_alpha) * 1e3:.1f} to {max(lone_alpha) * 1e3:.1f} ms at the six (run, rate) "
    "pairs, above the inter-node α at each (printed): the mean of points (a call's time "
    "less the per-call overhead) whose median was "
    f"{min(np.median(x) for x in lone_pts) * 1e3:.1f} to "
    f"{max(np.median(x) for x in lone_pts) * 1e3:.1f} ms and whose largest was "
    f"{min(x.max() for x in lone_pts) * 1e3:.0f} to {max(x.max() for x in lone_pts) * 1e3:.0f}"
    " ms: at each (run, rate) the median was nearer the inter-node α than the mean was, "
    "which the tail lifted. The pass-Q ring pays that α seven times a decode, and went over in two runs "
    "(printed: " + "; ".join(f"{k[0]} at {k[1]:g} Gbit/s in run {j + 1}, {e:+.1%}"
                             for k, j, e in shift_misses) + "): "
    f"{', '.join(map(str, step_counts['check/shift/', 'as recorded']))} cells inside as "
    "recorded, against "
    f"{', '.join(map(str, step_counts['check/shift/', 'at the slowest link']))} at the "
    "slowest link. Seven permutes in one program gave "
    f"{', '.join(map(str, step_counts['check/steps/', 'as recorded']))}, against "
    f"{', '.join(map(str, step_counts['check/steps/', 'at the slowest link']))}. Run 2's "
    "misses were over-predictions, the all-gather merge at 1 Gbit/s and the flat tree at "
    "0.5 Gbit/s in both columns, with the pass-Q ring at 0.5 Gbit/s as recorded "
    f"({steps_pq_half:+.1%}). At 0.5 Gbit/s that run's inter-node α was "
    f"{steps_inter[3] * 1e3:.1f} ms, "
    f"{steps_inter[3] / max(steps_inter[:3] + steps_inter[4:]):.1f} times the largest of the "
    "other five (printed; what it did to that rate's predictions is not separated here), "
    f"and at 1 Gbit/s, where the all-gather merge missed, {run2_inter_1g * 1e3:.1f} ms, "
    "between the other two runs' at that rate, so no clue to that miss. "
    "On the pass-Q ring's six cells the mean |error| was "
    f"{pq_abs['check/shift/', 'as recorded']:.1%} as recorded against "
    f"{pq_abs['check/shift/', 'at the slowest link']:.1%} at the slowest link (`check/shift/`), "
    f"and {pq_abs['check/steps/', 'as recorded']:.1%} against "
    f"{pq_abs['check/steps/', 'at the slowest link']:.1%} (`check/steps/`): on the runs made "
    "to test them, neither measured step priced that ring better than the slowest link "
    "did, and every cell these pricings put outside was the pass-Q ring's or a miss at "
    "either price. These are two variants of the subsection before's in-sample lead, which "
    "priced the pass-Q ring alone at the lone permute's α and β; the lead itself was not "
    "re-run. The pass-KV ring moved little either way (mean |error| "
    + "; ".join(f"{kv_abs[s_, 'as recorded']:.1%} against {kv_abs[s_, 'at the slowest link']:.1%}"
                f" in `{s_}`" for s_ in SETS_) + "). `check/steps/` timed a chain of permutes, "
    "which the subsection before raised as an unmeasured reading (a chain pays a lone "
    "call's start once); its step's α was still above the inter-node α at every (run, "
    "rate), and as no lone permute was timed in the same rounds, the reading stays "
    "untested. The lone permute's α here was higher on average than `check/permute/`'s "
    f"({np.mean(lone_alpha) * 1e3:.1f} against {np.mean(perm_alpha) * 1e3:.1f} ms; "
    f"{min(perm_alpha) * 1e3:.1f} to {max(perm_alpha) * 1e3:.1f} there, with the same "
    "program, sizes and rule), for reasons not measured. The pass-Q "
    "ring's mean error at the slowest link also moved between the sets "
    f"({pq_mean['check/shift/', 'at the slowest link']:+.1%} in `check/shift/`, "
    f"{pq_mean['check/steps/', 'at the slowest link']:+.1%} in `check/steps/`, whose "
    "rounds also timed the seven permutes), so three runs a set do not pin it down, nor "
    "whether a measured step would help on average (the 27-round runs below under-predict "
    "that ring again). `check/steps/`'s run 2 also took longer than its runs 1 and 3 "
    "(wall times printed), with nothing else running by this project's log; what slowed it "
    "is not known."))

# %% [markdown]
# How much of a cell's spread is noise inside a run, which more rounds would cut, and how
# much comes with the run? The next cell refits every one of these twelve runs with the
# warm-up (`check/warm/`, `check/permute/`, `check/shift/`, `check/steps/`) from half of
# its rounds (the odd ones, 5 of 9, then the even ones, 4), and prices each method by the
# package's model from that half alone, against that half's mean (the reduce-scatter left
# out: its collectives are timed in rounds of its own). It first checks that all the
# rounds, refitted the same way, give each run's errors as printed before. If a round's
# noise in a cell's error were independent, with variance $\sigma^2$ per round, the two
# halves' errors would differ with variance $\sigma^2 (1/5 + 1/4)$, and a run of $n$
# rounds would carry $\sigma^2/n$ of it; $\sigma$ is read that way from the halves (a
# model of the noise, not the error of any one round). The odd half always holds the
# first timed round, which ran heavy before the warm-up; the mean of the differences
# shows whether it still shifts that half.

# %%
def half_errors(r, rounds):
    """(method, Gbit/s) -> run `r`'s error with only the timed rounds `rounds` (a slice)
    of every process: links and local work refitted from them (`levels.fit_links`,
    `fit_local`), each method priced by the package's model against its mean over them;
    no reduce-scatter."""
    ctx = run_ctx(r)
    out = {}
    for rate in r["rates"]:
        rb = {k: [p_[rounds] for p_ in v] for k, v in rate["round_s_by_process"].items()}
        links = levels.fit_links(ctx, levels.pooled(rb), rate["set_Bps"] * 8)
        local = levels.fit_local(ctx, {k: v[0] for k, v in rb.items()}, links["overhead_s"], rb)
        for name in rate["methods"]:
            if name != "reduce_scatter":
                out.setdefault((name, rate["set_Bps"] * 8 / 1e9), []).append(
                    predicted_by(r, name, links, local) / np.mean(rb[name]) - 1)
    return out


twelve = [*warm_check.values(), *perm_check.values(), *shift_check.values(),
          *steps_check.values()]
halves = {}
for r in twelve:
    for part, rounds in (("all", slice(None)), ("odd", slice(0, None, 2)),
                         ("even", slice(1, None, 2))):
        for k, e in half_errors(r, rounds).items():
            halves.setdefault(part, {}).setdefault(k, []).extend(e)
now12 = {k: warm_now[k] + perm_wo[k] + step_err["check/shift/", "at the slowest link"][k]
         + step_err["check/steps/", "at the slowest link"][k] for k in halves["all"]}
assert all(np.allclose(halves["all"][k], now12[k], rtol=1e-9, atol=0) for k in now12)
diff = np.array([np.subtract(halves["odd"][k], halves["even"][k]) for k in halves["odd"]])
sigma2 = float(np.var(diff, ddof=1)) / (1 / 5 + 1 / 4)
offsets_out = diff - diff.mean(axis=1, keepdims=True)  # each cell's own mean difference out
sigma2_cell = float((offsets_out**2).sum() / (diff.size - diff.shape[0])) / (1 / 5 + 1 / 4)
total = float(np.sqrt(np.mean([np.var(v, ddof=1) for v in now12.values()])))
inside = (sigma2 / 9) ** 0.5
between = max(total**2 - sigma2 / 9, 0.0) ** 0.5
diff_se = float(np.std(diff, ddof=1)) / diff.size**0.5  # as if the pairs were independent
print(f"{diff.size} (cell, run) pairs of halves: their errors differ with a standard "
      f"deviation of {np.std(diff, ddof=1):.1%}, so σ = {sigma2**0.5:.1%} per round; the "
      f"odd half less the even one, on average: {diff.mean():+.1%} ({diff_se:.1%} if the "
      "pairs were independent); σ with each cell's own mean difference taken out: "
      f"{sigma2_cell**0.5:.1%}")
print(f"a cell's error over the twelve runs of 9 rounds: standard deviation {total:.1%} "
      f"(the root mean square over the {len(now12)} cells); the part inside a run, σ/√9: "
      f"{inside:.1%}; the rest, between runs: {between:.1%}")
for n_r in (9, 18, 27):
    print(f"  with {n_r} rounds a run would carry σ/√{n_r} = {sigma2**0.5 / n_r**0.5:.1%} "
          f"inside, {(sigma2 / n_r + between**2) ** 0.5:.1%} in all")

# %%
predicted27 = (sigma2 / 27 + between**2) ** 0.5
assert inside**2 > 3 * between**2  # "most of the variance inside a run"
assert 0.08 < predicted27 < 0.095 and predicted27 < 0.75 * total
assert abs(diff.mean()) < 2 * diff_se  # no shift resolved (a weak test: see the text)
assert abs(sigma2_cell**0.5 - sigma2**0.5) < 0.05 * sigma2**0.5  # no steady offset carries σ
display(Markdown(
    f"So most of a cell's variance over runs is inside the run: {inside**2 / total**2:.0%} of "
    f"it (standard deviations add in quadrature, as squares: {inside:.1%} inside of the "
    f"{total:.1%} in all). That is a reading under the model of independent rounds, not a "
    "measurement of any one round; σ pools the differences around one mean, and taking "
    f"each cell's own mean difference out changes it little ({sigma2_cell**0.5:.1%}), so no "
    "steady odd-against-even offset in a cell carries it. No shift of the odd half, which holds the first round, "
    f"was resolved ({diff.mean():+.1%} on average, under two standard errors if the pairs "
    "were independent; they are not, as cells move together within a run, and a heavy "
    "first round would also raise that half's fits, so this is a weak test). More rounds "
    f"would cut the part inside: with 27 rounds the same reading gives {predicted27:.1%} in "
    f"all (printed). The part between runs ({between:.1%}) is the difference of two close "
    "estimates, so its own uncertainty is large (not computed here), and it also holds the differences between the sets "
    "(their commits, and the extra programs each timed); the 27-round runs time none of "
    "those. The model itself is not changed by this; a cell's error is a measured ratio of "
    "two noisy means, and the band has to hold that noise too. It is the third change to "
    "how the check measures made after sets that missed (after the mean over every "
    "process's rounds and the warm-up): the check's command now times 27 rounds "
    "(`--repeats 27`; `make cluster` runs that command), three times the rounds for a third "
    "of the variance inside a run (no rule picked 27 over 18 or 36). By this project's "
    "log it was chosen from these halves before any run with 27 rounds was made; git "
    "cannot show that order, as this analysis and those runs were committed together "
    "(`558f166`). Three runs at `abaac07` (the "
    "model of `d6102d1`, with the warm-up), one after the other, test it "
    "(`check/rounds/2x2x2-run{1,2,3}.json`, committed in `558f166`). The next cell refits "
    "their links and reprices their predictions from their rounds, as recorded."))

# %%
ROUNDS_DIR = CHECK / "rounds"
rounds_check = {i: json.loads((ROUNDS_DIR / f"2x2x2-run{i}.json").read_text())
                for i in (1, 2, 3)}
for r in rounds_check.values():
    assert r["config"]["repeats"] == 27 and r["config"]["warmup_rounds"] == 1
    assert "--repeats 27" in r["config"]["command"] and "shift" not in r["links"]
    for rate in r["rates"]:  # one model: refitted from the rounds and repriced, as recorded
        links = refit(r, rate)
        assert json.loads(json.dumps(links)) == rate["links"]
        for name, m in rate["methods"].items():
            kl = m.get("kinds_last", {})
            pred = predicted_by(r, name, links | {"kinds": links["kinds"] | kl}, rate["local"])
            assert np.isclose(pred, m["predicted_s"], rtol=1e-12)
            assert np.shape(rounds_of(rate, name)) == (4, 27)
rounds_now = estimator_errors(rounds_check.values(), "mean over every process's rounds")
print(f"{'method':<15}{'Gbit/s':>7}   run 1   run 2   run 3")
for (name, g), e in rounds_now.items():
    print(f"{name:<15}{g:>7g}" + "".join(f"{x:>+8.1%}" for x in e))
rounds_sum = summarise(rounds_now)
rounds_bias = run_bias(rounds_now)
print(f"\nwithin ±{band:.0%}, of {len(rounds_now)} cells in runs 1, 2, 3: {rounds_sum[0]}; mean "
      f"error {rounds_sum[1]:+.1%}; worst {rounds_sum[3]:+.1%} and {rounds_sum[4]:+.1%}")
print("mean error at 1 and 0.5 Gbit/s, each run: " + "; ".join(
    ", ".join(f"{rounds_bias[g][j]:+.1%}" for g in (1.0, 0.5)) for j in range(3)))
rounds_sd = float(np.sqrt(np.mean([np.var(v, ddof=1) for k, v in rounds_now.items()
                                   if k[0] != "reduce_scatter"])))
warm_walls = [r["wall_s"] for r in warm_check.values()]  # 9 rounds, nothing else timed
wall_ratio = np.mean([r["wall_s"] for r in rounds_check.values()]) / np.mean(warm_walls)
print(f"a cell's error over these three runs: standard deviation {rounds_sd:.1%} (the root "
      f"mean square over the same {len(now12)} cells; over the twelve runs above "
      f"{total:.1%}; the halves' reading for 27 rounds: {sigma2**0.5 / 27**0.5:.1%} inside a "
      f"run, {predicted27:.1%} with the twelve runs' part between runs)")
shared = {(g, j): float(np.mean([e[j] - np.mean(e) for k, e in rounds_now.items()
                                 if k[1] == g and k[0] != "reduce_scatter"]))
          for g in (1.0, 0.5) for j in range(3)}
print("each (run, rate)'s cells less their own means over the three runs, averaged over "
      "the 8 cells: " + ", ".join(f"run {j + 1} at {g:g} Gbit/s {x:+.1%}"
                                  for (g, j), x in shared.items()))
shared_sd = float(np.sqrt(np.mean([x**2 for x in shared.values()]) * 3 / 2))
print(f"those shifts' spread {shared_sd:.1%}, against {rounds_sd / 8**0.5:.1%} if the 8 "
      "cells of a (run, rate) varied independently")
print("wall time per run, min: " + ", ".join(f"{r['wall_s'] / 60:.1f}"
                                             for r in rounds_check.values())
      + "; `check/warm/`'s, with 9 rounds: " + ", ".join(f"{w / 60:.1f}" for w in warm_walls)
      + f"; the ratio of the means {wall_ratio:.2f}")
k_rounds = [kernel_rates(rounds_check.values(), i) for i in (0, 1)]
print("the local kernel alone in these runs, GB/s, at 1 and 0.5 Gbit/s: " + "; ".join(
    ", ".join(f"{k:.2f}" for k in ks) for ks in k_rounds))
rounds_verdicts = [r["topology_claim"]["verdict"] for r in rounds_check.values()]
print("§9.5's verdicts at 0.5 Gbit/s in these runs: " + ", ".join(rounds_verdicts))
inside27 = sigma2**0.5 / 27**0.5
assert rounds_sum[0] == [17, 17, 17] and set(rounds_verdicts) == {"no measurable difference"}
pq_sets = [float(np.mean(e["ring_pass_q", 1.0] + e["ring_pass_q", 0.5]))
           for e in (perm_wo, step_err["check/shift/", "at the slowest link"],
                     step_err["check/steps/", "at the slowest link"])]
pq_moved = max(pq_sets) - min(pq_sets)
run_means = [x for g in (1.0, 0.5) for x in rounds_bias[g]]
assert rounds_sd < 0.75 * total and inside27 < rounds_sd < predicted27  # lower; "between"
k_all_rounds = [k for ks in k_rounds for k in ks]
assert max(k_all_rounds) < 0.75 * min(k_few)
assert shared_sd > 1.5 * rounds_sd / 8**0.5  # the cells of a (run, rate) move together
assert max(-rounds_sum[3], rounds_sum[4]) > 0.25  # "the margin is thin"
assert round(rounds_sum[4] * 100, 1) == 28.3 and round(rounds_sum[3] * 100, 1) == -26.5  # §9.10
assert rounds_now["tree_2level", 1.0][0] == rounds_sum[4]
assert rounds_now["tree", 0.5][0] == rounds_sum[3]
pq_rounds = rounds_now["ring_pass_q", 1.0] + rounds_now["ring_pass_q", 0.5]
assert max(pq_rounds) < 0 and np.mean(pq_rounds) < -0.1  # under in all six cells
nine_round_sets = [warm_counts, perm_counts["without the permute"],
                   step_counts["check/shift/", "at the slowest link"],
                   step_counts["check/steps/", "at the slowest link"]]
assert not any(c == [17, 17, 17] for c in nine_round_sets) and mean_counts != [17, 17, 17]
assert 1.8 < wall_ratio < 2.2  # "about twice"
assert pq_moved > 0.2
display(Markdown(
    f"**{', '.join(map(str, rounds_sum[0]))} of the 17 cells inside**, in each of the three "
    "runs: issue 30's cluster target, every cell within ±30% in each of three runs of one "
    f"check, is met by this check. A cell's error varied by {rounds_sd:.1%} over these runs, "
    f"lower than the {total:.1%} over the twelve runs of 9 rounds and between the halves' "
    f"readings for 27 rounds without the part between runs ({inside27:.1%}) and with the "
    f"twelve runs' {between:.1%} of it ({predicted27:.1%} in all). From three runs whose cells move together "
    f"(below), {rounds_sd:.1%} is itself uncertain, and the drop mixes the rounds with a "
    "change of sets (one commit, no extra programs timed): consistent with the reading, not "
    f"a confirmation of it. The mean error was {rounds_sum[1]:+.1%}, each (run, rate)'s "
    f"{min(run_means):+.1%} to {max(run_means):+.1%} (printed). The local kernel ran at "
    f"{min(k_all_rounds):.2f} to {max(k_all_rounds):.2f} GB/s at the two rates, slower than "
    f"in `check/few/` ({min(k_few):.2f} GB/s or more at 1 Gbit/s; printed). "
    "The cells of a (run, rate) "
    "moved together, more than independent cells would (printed), so the 17 cells of a run "
    "are not 17 independent tries, and how often a run would have every cell inside is not "
    "estimated here. The margin is thin: the worst cells were "
    f"{rounds_sum[4]:+.1%} (the 2-level tree at 1 Gbit/s, run 1) and {rounds_sum[3]:+.1%} "
    "(the flat tree at 0.5 Gbit/s, run 1), and the pass-Q ring was under-predicted in all "
    f"six of its cells (mean {np.mean(pq_rounds):+.1%}; its mean at the slowest link spread "
    f"over {pq_moved * 100:.0f} points among `check/permute/`, `check/shift/` and "
    "`check/steps/`, so three runs do not pin it down, and nothing here explains it). The "
    "17 include the reduce-scatter's cell, which is close to a timing of its own "
    "collectives (weak evidence for the model, as the subsections before say). Before these, none of the four sets of three runs "
    "of 9 rounds with the warm-up had every cell inside in all three, priced by this model "
    "(`check/warm/` as recorded; `check/permute/`, `check/shift/` and `check/steps/` "
    "repriced at the slowest link: "
    + "; ".join(", ".join(map(str, c)) for c in nine_round_sets) + "), nor had "
    f"`check/mean/`, the last set without it ({', '.join(map(str, mean_counts))}). This is "
    "the only set with 27 rounds: it shows the check can pass, not how often it will. A run "
    f"took {wall_ratio:.1f} times as long as a run of `check/warm/`, with 9 rounds "
    "(printed)."))


# %% [markdown]
# ## 9.5 The course's test of the topology argument: 2-level against flat, on the slow link
#
# The paper does not compare a two-level tree with a flat one; its argument is that NCCL's
# Allreduce (rings inside nodes, trees across, paper §5.3) suits the cluster. The course tests the
# idea behind it: a topology-aware tree reduces inside nodes first, so the slow link carries
# only the already-reduced states. Here *flat* is the same `tree_decode` on a 1-D mesh over
# all devices (its Allreduces are rings over every device), and *2-level* the
# `("node", "gpu")` mesh (rings inside each node, then across). Both were timed in the same interleaved
# rounds; the verdict takes the per-round differences, and calls a winner only when their
# median exceeds half their interquartile range. The per-round times are process 0's; the
# times printed are the slowest process's medians, so the two can order flat and 2-level
# differently. For the three runs of §9.4's "Which time a prediction is checked against"
# the text below also gives a third measure, the means over every process's rounds
# (defined there).

# %%
for name, r in runs.items():
    t = r["topology_claim"]
    print(f"{name} at {t['set_Bps'] * 8 / 1e9:g} Gbit/s: flat {t['flat_s'] * 1e3:.1f} ms "
          f"({t['flat_collectives']}), 2-level {t['two_level_s'] * 1e3:.1f} ms "
          f"({t['two_level_collectives']}); median difference flat - 2-level "
          f"{t['difference_s'] * 1e3:+.1f} ms (IQR {t['difference_iqr_s'] * 1e3:.1f} ms), "
          f"2-level faster in {t['two_level_faster_rounds']} of {t['rounds']} rounds: "
          f"{t['verdict']}")
    print(f"    bytes leaving a node per call: flat {t['flat_link_bytes']:,.0f}, "
          f"2-level {t['two_level_link_bytes']:,.0f}")
    assert t["two_level_link_bytes"] > t["flat_link_bytes"]  # the text below explains why
    slow = min(r["rates"], key=lambda x: x["set_Bps"])["methods"]  # the slow link's rounds
    assert t["verdict"] == run.verdict(slow["tree"]["round_s"],
                                       slow["tree_2level"]["round_s"])["verdict"]

# Ring steps per decode. The tree's merge is two XLA all-reduces with three operands in all
# (a max; a numerator and a denominator), and XLA:CPU runs one gloo ring per operand
# (§9.8 reads it in the source and times the merge alone): three rings, each spanning all p
# devices (flat), or the k devices of a node and then the nodes (2-level).
TREE_RINGS = 3
claim_lines, verdicts, model_ratios = [], {}, {}
for name, r in runs.items():
    c_, t = r["config"], r["topology_claim"]
    p_, nodes_ = c_["devices"], c_["nodes"]
    k_ = c_["processes_per_node"] * c_["devices_per_process"]
    flat_steps = TREE_RINGS * 2 * (p_ - 1)
    two_steps = TREE_RINGS * 2 * (k_ - 1) + TREE_RINGS * 2 * (nodes_ - 1)
    model_ratio = t["flat_predicted_s"] / t["two_level_predicted_s"]
    assert two_steps < flat_steps
    verdicts[name], model_ratios[name] = t["verdict"], model_ratio
    claim_lines.append(
        f"{name} ({p_} devices, {k_} per node): flat {TREE_RINGS} · 2({p_} − 1) = "
        f"{flat_steps} ring steps, 2-level {TREE_RINGS} · 2({k_} − 1) + {TREE_RINGS} · "
        f"2({nodes_} − 1) = {two_steps}. The record's model (every ring step at α) predicts flat "
        f"{t['flat_predicted_s'] * 1e3:.1f} ms, 2-level {t['two_level_predicted_s'] * 1e3:.1f} "
        f"ms (flat / 2-level = {model_ratio:.2f}); measured flat {t['flat_s'] * 1e3:.1f} ms, "
        f"2-level {t['two_level_s'] * 1e3:.1f} ms ({t['flat_over_two_level']:.2f}): "
        f"{t['verdict']}.")
assert verdicts == {"2x1x2": "no measurable difference", "2x2x2": "2-level faster"}
assert model_ratios["2x1x2"] < 0.8 and model_ratios["2x2x2"] > 1.25  # flat; 2-level
# §9.7's lengths (one median each, at 1 Gbit/s): 2-level minus flat at each.
xs = {name: r["crossover"]["measured_s"] for name, r in runs.items()}
x_lens = runs["2x1x2"]["crossover"]["seq_lens"]
assert x_lens == runs["2x2x2"]["crossover"]["seq_lens"] == [16, 64, 256, 1024, 4096, 16384]
x_gaps = {name: [(a - b) * 1e3 for a, b in zip(x["tree_2level"], x["tree"], strict=True)]
          for name, x in xs.items()}
for name, g in x_gaps.items():
    print(f"{name}, 2-level minus flat at Tk = {', '.join(f'{n:,}' for n in x_lens)}: "
          + ", ".join(f"{v:+.1f}" for v in g) + " ms")
assert all(v < 0 for v in x_gaps["2x1x2"][:3]) and all(v > 0 for v in x_gaps["2x1x2"][3:5])
assert [i for i, v in enumerate(x_gaps["2x2x2"]) if v < 0] == [2, 3]  # Tk = 256, 1,024
# The same test on the fast link's rounds (bytes matter even less there).
fast_verdicts = {}
for name, r in runs.items():
    fast = max(r["rates"], key=lambda x: x["set_Bps"])
    v_ = run.verdict(fast["methods"]["tree"]["round_s"], fast["methods"]["tree_2level"]["round_s"])
    fast_verdicts[name] = v_["verdict"]
    print(f"{name} at {fast['set_Bps'] * 8 / 1e9:g} Gbit/s: 2-level faster in "
          f"{v_['two_level_faster_rounds']} of {v_['rounds']} rounds: {v_['verdict']}")
assert set(fast_verdicts.values()) == {"no measurable difference"}
# The same rule on the six later runs of the 8-device layout (`check/`, `check/design/`).
later = {f"{kind} {i}": json.loads(
    (ROOT / "results" / "cluster" / "check" / sub / f"2x2x2-run{i}.json").read_text())
    for kind, sub in (("design run", "design"), ("check run", "")) for i in (1, 2, 3)}
later_slow, later_fast = {}, {}
for name, r in later.items():
    fast = max(r["rates"], key=lambda x: x["set_Bps"])
    later_slow[name] = r["topology_claim"]["verdict"]
    later_fast[name] = run.verdict(fast["methods"]["tree"]["round_s"],
                                   fast["methods"]["tree_2level"]["round_s"])["verdict"]
print("later runs, at 0.5 and 1 Gbit/s: " + "; ".join(
    f"{n}: {later_slow[n]}, {later_fast[n]}" for n in later))
later_model = [r["topology_claim"]["flat_predicted_s"] / r["topology_claim"]["two_level_predicted_s"]
               for r in later.values()]
later_meas = [r["topology_claim"]["flat_over_two_level"] for r in later.values()]
print("their flat / 2-level at 0.5 Gbit/s, predicted: " + ", ".join(f"{x:.2f}" for x in later_model)
      + "; measured: " + ", ".join(f"{x:.2f}" for x in later_meas))
assert min(later_model) > 1.01 and sum(x < 1 for x in later_meas) == 5  # by over 1% each
tree_over = {n: [x["methods"][m]["rel_err"] for m in ("tree", "tree_2level")
                 for x in r["rates"] if x["set_Bps"] == min(y["set_Bps"] for y in r["rates"])]
             for n, r in later.items()}
assert all(abs(flat_e) > abs(two_e) for flat_e, two_e in tree_over.values())  # flat's miss larger
for x in runs["2x1x2"]["rates"]:  # the 4-device run: both levels' steps above the flat ring's
    lk_ = x["links"]
    assert lk_["flat"]["alpha_s"] < min(lk_["inter"]["alpha_s"], lk_["intra"]["alpha_s"])
slow_v, fast_v = list(later_slow.values()), list(later_fast.values())
assert slow_v.count("2-level faster") == 1 and slow_v.count("no measurable difference") == 5
assert fast_v.count("2-level faster") == fast_v.count("flat faster") == 1
# Nine further runs of the layout (the reduce-scatter's, in §9.4): the same reading.
further = {f"rs-after {kind} {i}": json.loads(
    (ROOT / "results" / "cluster" / "check" / "rs-after" / sub / f"2x2x2-run{i}.json").read_text())
    for kind, sub, count in (("design run", "design", 6), ("check run", "", 3))
    for i in range(1, count + 1)}
further_slow = [r["topology_claim"]["verdict"] for r in further.values()]
further_meas = [r["topology_claim"]["flat_over_two_level"] for r in further.values()]
print(f"{len(further)} further runs at 0.5 Gbit/s: " + "; ".join(
    f"{n}: {v}" for n, v in zip(further, further_slow, strict=True)))
further_model = [r["topology_claim"]["flat_predicted_s"] / r["topology_claim"]["two_level_predicted_s"]
                 for r in further.values()]
print("their flat / 2-level at 0.5 Gbit/s, predicted: " + ", ".join(f"{x:.3f}" for x in further_model)
      + "; measured: " + ", ".join(f"{x:.2f}" for x in further_meas))
assert further_slow.count("2-level faster") == 3 and sum(x > 1.01 for x in further_model) == 7
assert sum(abs(x - 1) <= 0.01 for x in further_model) == 1  # a tie
all_slow, all_meas = slow_v + further_slow, later_meas + further_meas  # all 15 later runs
print(f"all {len(all_slow)} later runs before §9.4's 'Rings of few elements', at 0.5 Gbit/s: 2-level faster in "
      f"{all_slow.count('2-level faster')}, flat faster in {all_slow.count('flat faster')}; "
      f"medians with the 2-level tree ahead in {sum(x > 1 for x in all_meas)}")
assert all_slow.count("2-level faster") == 4 and "flat faster" not in all_slow
assert sum(x > 1 for x in all_meas) == 9
further_fast, further_fast_meas = [], []  # the nine at 1 Gbit/s, by the same rule
for r in further.values():
    fast = max(r["rates"], key=lambda x: x["set_Bps"])["methods"]
    further_fast.append(run.verdict(fast["tree"]["round_s"], fast["tree_2level"]["round_s"])["verdict"])
    further_fast_meas.append(fast["tree"]["median_s"] / fast["tree_2level"]["median_s"])
print("the nine at 1 Gbit/s: " + ", ".join(further_fast) + "; measured flat / 2-level: "
      + ", ".join(f"{x:.2f}" for x in further_fast_meas))
assert further_fast.count("flat faster") == 2 and further_fast.count("2-level faster") == 1
assert sum(x < 1 for x in further_fast_meas) == 6
later_fast_meas = [
    f_["tree"]["median_s"] / f_["tree_2level"]["median_s"]
    for f_ in (max(r["rates"], key=lambda x: x["set_Bps"])["methods"] for r in later.values())]
all_fast, all_fast_meas = fast_v + further_fast, later_fast_meas + further_fast_meas
print(f"all {len(all_fast)} at 1 Gbit/s: flat faster in {all_fast.count('flat faster')}, "
      f"2-level faster in {all_fast.count('2-level faster')}; medians with the flat tree ahead "
      f"in {sum(x < 1 for x in all_fast_meas)} (the six: "
      + ", ".join(f"{x:.2f}" for x in later_fast_meas) + ")")
assert all_fast.count("flat faster") == 3 and all_fast.count("2-level faster") == 2
assert sum(x < 1 for x in all_fast_meas) == 9
# The same programs in every round of both batches: the same names timed
names_of = [set(r["rates"][0]["round_s_by_process"]) for r in (*later.values(), *further.values())]
assert all(n == names_of[0] for n in names_of)
assert all(set(x["round_s_by_process"]) <= names_of[0]
           for r in (*later.values(), *further.values()) for x in r["rates"])
assert further_slow.count("no measurable difference") == 6 and sum(x > 1 for x in further_meas) == 8
display(Markdown("\n".join(f"* {line}" for line in claim_lines)))

# %% [markdown]
# **Quiz (predict, then read).** Cover the verdicts above and predict: the 2-level schedule
# crosses the slow link once, with states already reduced inside each node, while the flat
# ring crosses it at every one of its steps. Which puts more bytes on the link per call, and
# which would you expect to be faster on this cluster, where the link is slow in bandwidth
# only?
#
# <details><summary>Answer</summary>
#
# The 2-level schedule puts *more* bytes on the link here (both counts are printed above),
# yet it is faster in the 8-device run at Tk = 16,384 on the slow link, and not
# measurably different in the 4-device run (the verdicts above); on the fast link neither
# run shows a difference. Bytes are not what decides it: the states are a
# few kB, and what the 2-level tree saves is ring steps (fewer, though on these cores a
# ring whose buffer leaves segments empty costs less than a full one, measured alone in
# one exploratory run, which would narrow the gap (a reading, not a measurement) or, in
# the model of §9.4's "Rings of few elements", reverses it: that
# model predicts the flat tree faster in five of its six runs at 0.5 Gbit/s, though no
# run's verdict was "flat faster" and the medians put the flat tree ahead, by about 5% or
# less, in three). Of the six later runs of §9.4's `check/` and `check/design/`, one
# repeated the verdict and five did not, and their medians put the flat tree ahead in
# five; of nine further runs, three repeated it, and their medians put the 2-level tree
# ahead in eight (all printed above). In the three runs of `check/mean/` (with the
# model of `check/few/`; §9.4, "Which time a prediction is checked against"), the model
# predicted the flat tree faster in two; the means over every process's rounds put the
# 2-level tree ahead in all three, and the slowest process's medians in one, with the flat
# tree 14% ahead by the medians in a run whose verdict (which reads process 0's rounds)
# was "2-level faster". In the six runs after those (`check/warm/` and `check/permute/`,
# §9.4, "A warm-up round, and the permute measured alone") every verdict was "no
# measurable difference". On this machine the fewer steps did not reliably win. The next
# paragraphs say
# what the record explains and what it does not.
#
# </details>
#
# Why the answer is what it is, on this cluster:
#
# * **Bytes do not decide it.** The states are a few kB (the time they take on the slow
#   link is printed below), a fraction of the 2 ms assumed for a wake-up (§9.3). The 2-level schedule even
#   puts *more* bytes on the link here: its second stage runs $k$ all-reduces at once, one per
#   device of the node, each carrying the whole state, while the flat ring crosses the
#   link with $2\frac{p-1}{p}$ of one state per direction.
# * **The 2-level tree takes fewer ring steps; whether that makes it faster depends on
#   each step's α and on how full each ring is.**
#   Counted with the merge's three rings, the flat tree takes $3 \cdot 2(p-1)$ ring steps
#   per decode and the 2-level tree $3 \cdot 2(k-1) + 3 \cdot 2$ (the list above gives both
#   runs' counts): fewer. These records' cost model prices exactly these steps, every one
#   at α whatever the ring's size (the rule before §9.4's "Rings of few elements"), the 2-level
#   tree's at each level's fitted α and the flat tree's at its own ring's (§9.4 prints all
#   three).
#   In the 8-device run it predicts the 2-level tree faster. By the rule of held segments
#   (§9.4's "Rings of few elements") the flat tree's two rings of 8 elements over all devices, half
#   of whose segments are empty, would be priced lower; this record cannot price them so
#   (it times no few-byte call from which to fit `call_s`), and its flat tree was priced under its measurement
#   (printed above). In the six runs of `check/few/` (priced both ways in §9.4's "Rings
#   of few elements"), at 0.5 Gbit/s, the rule of held segments predicts the flat tree faster in
#   five and the rule before the 2-level tree faster in all six (both printed there). The
#   8-device record's verdict ("2-level faster") agrees with its model on the slow link, but the same test on the 1 Gbit/s rounds, where the states' bytes
#   matter even less, finds no measurable difference (printed above): without a delay on
#   the link the test is inconclusive. Six later runs of the same layout (`check/` and
#   `check/design/`) bear that out: at 0.5 Gbit/s the same verdict rule found the 2-level tree faster in one of
#   six and no measurable difference in the rest, and at 1 Gbit/s it named a winner in
#   each direction once (printed above). At 0.5 Gbit/s the model each run recorded
#   predicted the 2-level tree faster in all six (flat / 2-level above 1), and the
#   measured medians put the flat tree ahead (below 1) in most of them (printed above);
#   the model's error on the flat tree is larger than on the 2-level tree in every one
#   (asserted above), likely in part (a reading) from the over-price of its half-full rings
#   (§9.4's "Rings of few elements"). On these two cores the slow link's verdict
#   repeated once in six, and in three of nine further runs (the reduce-scatter's, in
#   §9.4's subsection on it), where the model each of the nine recorded predicted the
#   2-level tree faster in all but two (one of them a
#   tie, within 1%) and the medians put it ahead in eight, unlike the six: it does not
#   reliably repeat. The methods and the programs timed with them were the same in both
#   batches (the same calls in the rounds, asserted; the nine further runs add calls only
#   in the reduce-scatter's own rounds, after every other method is timed), so the
#   difference is noise, or a shift between batches not explained; at 1 Gbit/s the same
#   nine lean the other way (below). Over
#   all fifteen later runs (`check/`, `check/design/`, `check/rs-after/` and its `design/`)
#   at 0.5 Gbit/s, the verdict
#   was "2-level faster" in four and "flat faster" in none, and the medians put the 2-level
#   tree ahead in nine; at 1 Gbit/s, over all fifteen, "flat faster" in three and "2-level
#   faster" in two, and the medians put the flat tree ahead in nine, six of them among the
#   nine further runs (all printed above). Six runs since (§9.4's "Rings of few elements",
#   which prints their verdicts and ratios) found "2-level faster" once at 0.5 Gbit/s and no
#   measurable difference in the rest; the model they record prices a ring by the segments
#   of its buffer that hold bytes, so the flat tree's two rings of 8 elements over all 8
#   devices (half their segments empty) are priced at 0.52 to 0.62 of a full ring in those
#   runs (measured alone in one exploratory run, 0.61 to 0.68; both printed there), and it
#   predicts the flat tree faster at 0.5 Gbit/s
#   in five of them: in four the medians were within 6% of a tie, and in the one run whose
#   verdict named a winner ("2-level faster") it had predicted the flat tree faster. Those
#   six are left out of the totals above: their rounds time three more calls (the few-byte
#   all-reduces, asserted there), so they are not the same programs as the fifteen. Nor
#   are the three runs since (§9.4, "Which time a prediction is checked against", which
#   prints them), which run the six's programs: at 0.5 Gbit/s their verdicts were
#   "2-level faster" twice and no measurable difference once, their means over every
#   process's rounds put the 2-level tree ahead in all three (their slowest process's
#   medians in one), and the model predicted the flat tree faster in two.
#   In the 4-device run both levels' 2-device rings fit a slower step than the ring over
#   all four devices (§9.4 prints all three), and the record's model (the rule before)
#   predicts the flat tree faster; the measurement finds no measurable difference. The lengths of
#   §9.7 (at 1 Gbit/s, one median each, so no verdict; the gaps are printed above) point
#   both ways: in the 4-device run the 2-level tree took less time than the flat one at
#   the three shortest lengths and more at Tk = 1,024 and 4,096, and in the 8-device run
#   the order changes with Tk (the 2-level tree took less at Tk = 256 and 1,024 only). With no delay on the link, a step's
#   cost is this machine's (§9.3's spread) more than a message's. §9.8 gives the link a
#   delay that outweighs it, and in its sweep (another 4-device layout, 2 nodes × 2
#   processes × 1 device, Tk = 1,024) the 2-level tree wins at every delay above 0.
#
# %%
t = rep["topology_claim"]
ra = rep["rates"][-1]["links"]
print(f"at {t['set_Bps'] * 8 / 1e9:g} Gbit/s: the 2-level tree's {t['two_level_link_bytes']:,.0f} "
      f"B leaving a node take {t['two_level_link_bytes'] / t['set_Bps'] * 1e3:.3f} ms on the "
      f"link; fitted alpha inside a node {ra['intra']['alpha_s'] * 1e3:.2f} ms, across "
      f"{ra['inter']['alpha_s'] * 1e3:.2f} ms per step")
assert ra["inter"]["alpha_s"] < 3 * ra["intra"]["alpha_s"]  # the same order
assert t["two_level_link_bytes"] / t["set_Bps"] < 2e-3  # a fraction of the assumed 2 ms

# %% [markdown]
# On a GPU cluster the inter-node α and β are an order of magnitude worse than NVLink's
# (notebook 6), and that is where the topology argument is expected to hold (notebook 6's
# model; no GPU cluster was measured here). What §9.8 tests is the condition for it: a
# link slow in latency.
#
# ## 9.6 Ring against the link rate
#
# Halve the rate: the ring, which moves $(p-1)/p$ of the cache per token, slows down by
# less than the rate's factor of 2, and by what its bytes predict (Exercise 2 below). The
# other methods move a few kB, whose time on the slow link is a small fraction of a
# millisecond (printed); their factors between the two rates are not the rate's doing (the
# cell prints each factor).

# %%
for name, r in runs.items():
    v = r["ring_vs_rate"]
    print(f"{name}: rate x{v['rate_ratio']:g}; slowdown " + ", ".join(
        f"{mt} x{s:.2f}" for mt, s in v["slowdown"].items()))
    assert 1.5 < v["slowdown"]["ring"] < v["rate_ratio"]  # "less than the rate's factor"
    slow_rate = min(r["rates"], key=lambda x: x["set_Bps"])
    kb_ms = {mt: rec["link_bytes"] / slow_rate["set_Bps"] * 1e3
             for mt, rec in slow_rate["methods"].items() if mt != "ring"}
    share = max(kb_ms[mt] / (rec["median_s"] * 1e3) for mt, rec in slow_rate["methods"].items()
                if mt != "ring")
    print(f"    the others' bytes on the slow link: at most {max(kb_ms.values()):.2f} ms, "
          f"{share:.1%} of their time")
    assert share < 0.02
others_x = [s for r in runs.values() for mt, s in r["ring_vs_rate"]["slowdown"].items()
            if mt != "ring"]
ring_x = [r["ring_vs_rate"]["slowdown"]["ring"] for r in runs.values()]
added_ms = {mt: max(abs(v_[1] - v_[0]) * 1e3 for r in runs.values()
                    for m_, v_ in r["ring_vs_rate"]["median_s"].items() if m_ == mt)
            for mt in runs["2x1x2"]["ring_vs_rate"]["median_s"]}
others_ms = max(x for mt, x in added_ms.items() if mt != "ring")
assert added_ms["ring"] > 20 * others_ms
assert min(others_x) < 1 < max(others_x)  # both directions
display(Markdown(
    f"On the slower link the ring took ×{min(ring_x):.2f} to ×{max(ring_x):.2f} its time. "
    f"The other methods' factors range from ×{min(others_x):.2f} (faster on the slower "
    f"link, which no rate effect does) to ×{max(others_x):.2f}, though their bytes take "
    f"under 2% of their time on the slow link: a latency-bound method's time moved that "
    f"much between the two rates' measurements on this 2-core machine (§9.3's spread of a "
    f"step is the likely reason). In milliseconds the difference is plain: the ring's time changed "
    f"by up to {added_ms['ring']:.0f} ms, any other method's by at most {others_ms:.1f} ms. "
    f"So only the ring's factor says something about the rate (and Exercise 2 predicts it "
    f"from its bytes)."))

fig, ax = plt.subplots(figsize=(7, 3.4))
v = rep["ring_vs_rate"]
names = list(v["median_s"])
width = 0.38
for j, set_Bps in enumerate(v["set_Bps"]):
    xs = np.arange(len(names)) + (j - 0.5) * width
    ax.bar(xs, [v["median_s"][mt][j] * 1e3 for mt in names], width,
           color=[plots.color(mt) for mt in names], alpha=0.55 + 0.45 * j,
           label=f"{set_Bps * 8 / 1e9:g} Gbit/s")
ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right")
ax.set_yscale("log")
ax.set_ylabel("median ms per decode")
ax.set_title(f"{rep['config']['devices']} devices: every method at two link rates")
ax.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [markdown]
# *Figure: for each method, the pale bar is the slow link, the dark one the fast link.
# This is the 8-device run. Ring (red) moves with the rate; the tree methods (blue), the
# pass-Q ring (pink) and the merge patterns (each in its colour of notebook 8) move by the
# factors printed above, in both directions, which their few kB do not explain.*
#
# **Exercise 2 (code).** Predict the ring's time on the slow link from its time on the fast
# one. Only the bytes on the link depend on the rate: write `ring_at_rate(t_fast,
# link_bytes, beta_fast, beta_slow)`, where `link_bytes` is what leaves the busiest node per
# call (`methods["ring"]["link_bytes"]`) and the β are the fitted inter-node rates. The test
# cell compares your prediction with the measured time on the slow link, then checks it on a
# case of its own, in no record.

# %%
def ring_at_rate(t_fast: float, link_bytes: float, beta_fast: float, beta_slow: float) -> float:
    """Seconds per decode on the slow link: the fast time with the link's share re-priced."""
    # TODO: which part of t_fast depends on the link's rate? Re-price only that part.
    return t_fast * beta_fast / beta_slow  # wrong on purpose (all of it scaled): replace it


stub_ring_at_rate = ring_at_rate


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "ring_at_rate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def ring_at_rate(t_fast: float, link_bytes: float, beta_fast: float,
                 beta_slow: float) -> float:  # replaces the stub
    """Seconds per decode on the slow link: the fast time with the link's share re-priced."""
    return t_fast + link_bytes * (1 / beta_slow - 1 / beta_fast)


# %% nbgrader={"grade": true, "grade_id": "test_ring_at_rate", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_ring_at_rate(fn, show=False):
    """Raises AssertionError unless fn predicts the ring's slow-link time within 10%, and a
    case the test builds itself."""
    for name, r in runs.items():
        fast, slow = sorted(r["rates"], key=lambda x: -x["set_Bps"])
        ring = fast["methods"]["ring"]
        pred = fn(ring["median_s"], ring["link_bytes"], fast["links"]["inter"]["beta_Bps"],
                  slow["links"]["inter"]["beta_Bps"])
        meas = slow["methods"]["ring"]["median_s"]
        if show:
            print(f"{name}: ring {ring['median_s'] * 1e3:.0f} ms on the fast link; predicted "
                  f"{pred * 1e3:.0f} ms on the slow one, measured {meas * 1e3:.0f} ms "
                  f"({pred / meas - 1:+.1%})")
        assert abs(pred / meas - 1) < 0.1
    # A case in no record: 0.5 s, 20 MB on the link, 100 MB/s -> 40 MB/s: 0.5 + 0.3 = 0.8 s.
    assert np.isclose(fn(0.5, 2e7, 1e8, 4e7), 0.8, rtol=1e-9), fn(0.5, 2e7, 1e8, 4e7)


try:
    check_ring_at_rate(stub_ring_at_rate)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given (every second scaled by the rate) fails the test")
check_ring_at_rate(ring_at_rate, show=True)

# %% [markdown]
# ## 9.7 Where tree overtakes ring
#
# At a short enough cache the ring's blocks are tiny and its few steps may beat the tree's
# Allreduces. The runs timed tree and ring at short lengths too (the x axis below).

# %%
fig, ax = plt.subplots(figsize=(7, 3.6))
for name, r in runs.items():
    x = r["crossover"]
    for mt, style in (("tree_2level", "-"), ("tree", "--"), ("ring", "-")):
        if name == "2x2x2":
            ax.plot(x["model_grid"], np.array(x["model_s"][mt]) * 1e3, style,
                    color=plots.color(mt), alpha=0.5, label=f"{mt}, model")
            ax.plot(x["seq_lens"], np.array(x["measured_s"][mt]) * 1e3, "o" + style,
                    color=plots.color(mt), label=f"{mt}, measured")
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("Tk (keys in the cache)")
ax.set_ylabel("ms per decode")
ax.set_title("2x2x2 at 1 Gbit/s: tree (blue) against ring (red)")
ax.legend(fontsize=7, ncol=2)
plt.tight_layout()
plt.show()
words = {}  # (run, tree method, "measured" or "model") -> what the series shows
for name, r in runs.items():
    x = r["crossover"]
    print(f"{name} ({r['config']['devices']} devices), measured ms per decode at Tk = "
          + ", ".join(f"{n:,}" for n in x["seq_lens"]))
    for mt in ("tree_2level", "tree", "ring"):
        print(f"    {mt:<12}" + "".join(f"{t * 1e3:>8.1f}" for t in x["measured_s"][mt]))
    for tree in ("tree_2level", "tree"):
        words[name, tree, "measured"] = methods.crossover_words(
            x["seq_lens"], x["measured_s"][tree], x["measured_s"]["ring"])
        words[name, tree, "model"] = methods.crossover_words(
            x["model_grid"], x["model_s"][tree], x["model_s"]["ring"])
        print(f"    {tree} against ring: measured {words[name, tree, 'measured']}; "
              f"model {words[name, tree, 'model']}")
# The 4-device run: the flat tree overtakes the ring between Tk = 64 and 256; every other
# series: the tree faster at every length measured.
x4 = runs["2x1x2"]["crossover"]
assert x4["seq_lens"][:3] == [16, 64, 256]
assert words["2x1x2", "tree", "measured"].startswith("tree overtakes ring at Tk ~ ")
assert 64 < x4["tree_vs_ring"]["measured"] < 256
for name, tree in (("2x1x2", "tree_2level"), ("2x2x2", "tree_2level"), ("2x2x2", "tree")):
    assert words[name, tree, "measured"] == "tree faster at every length"
# Consistent in both runs: from Tk = 256 on, both trees faster than the ring.
for r in runs.values():
    x = r["crossover"]
    for i, tk in enumerate(x["seq_lens"]):
        if tk >= 256:
            assert all(x["measured_s"][t][i] < x["measured_s"]["ring"][i]
                       for t in ("tree_2level", "tree"))
# The 4-device run's 2-level tree at Tk = 16 and 64: faster than the ring, by little.
close = [x4["measured_s"]["ring"][i] / x4["measured_s"]["tree_2level"][i] - 1 for i in (0, 1)]
assert all(0 < c < 0.25 for c in close)
print("2x1x2 at Tk = 16 and 64: the ring slower than the 2-level tree by "
      + " and ".join(f"{c:.0%}" for c in close))
x8 = runs["2x2x2"]["crossover"]["measured_s"]["tree_2level"]
assert x8[2] < x8[0]  # more keys, less time: the scatter, not the local work
print(f"2x2x2, the 2-level tree measured {x8[0] * 1e3:.1f} ms at Tk = 16 and "
      f"{x8[2] * 1e3:.1f} ms at Tk = 256")
over_flat = {name: [p_ / m_ for p_, m_ in zip(r["crossover"]["predicted_s"]["tree"],
                                             r["crossover"]["measured_s"]["tree"], strict=True)]
             for name, r in runs.items()}
assert all(2.05 <= x < 2.45 for o in over_flat.values() for x in o[:3])  # 2.1x-2.4x, Tk <= 256
c8, over8 = runs["2x2x2"]["crossover"], over_flat["2x2x2"]
err8 = [p_ / m_ - 1 for p_, m_ in zip(c8["predicted_s"]["tree_2level"],
                                      c8["measured_s"]["tree_2level"], strict=True)]
assert min(over8) > 1 and min(err8) < 0 < max(err8)  # flat: below its line; 2-level: both
for name, o in over_flat.items():
    print(f"{name}, the flat tree's model time over the measured at each length: "
          + ", ".join(f"{x:.2f}" for x in o))
# The model's crossovers in keys per device (Tk / p), where it has one.
kpd = {(name, tree): r["crossover"][f"{tree}_vs_ring"]["predicted"] / r["config"]["devices"]
       for name, r in runs.items() for tree in ("tree_2level", "tree")
       if r["crossover"][f"{tree}_vs_ring"]["predicted"] is not None}
print("the model's crossovers in keys per device: " + ", ".join(
    f"{name} {tree} {v:.0f}" for (name, tree), v in kpd.items())
      + f"; measured: 2x1x2 tree {x4['tree_vs_ring']['measured'] / 4:.0f}")
assert set(kpd) == {("2x1x2", "tree_2level"), ("2x2x2", "tree")}  # one in each run
# The model against the measured order of flat tree and ring, length by length: as
# measured from Tk = 256 on in both runs, not at Tk = 16 and 64 in either.
order = {name: [(x["predicted_s"]["tree"][i] < x["predicted_s"]["ring"][i],
                 x["measured_s"]["tree"][i] < x["measured_s"]["ring"][i])
                for i in range(len(x["seq_lens"]))]
         for name, x in ((n_, r["crossover"]) for n_, r in runs.items())}
for name in runs:
    assert [pred == meas for pred, meas in order[name]] == [False] * 2 + [True] * 4
assert [pred for pred, _ in order["2x1x2"][:2]] == [True, True]  # flat tree faster, wrongly
assert [pred for pred, _ in order["2x2x2"][:2]] == [False, False]  # the ring, wrongly
print("lengths where the model orders flat tree and ring as measured: 2x1x2 "
      f"{sum(a == b for a, b in order['2x1x2'])} of 6, 2x2x2 "
      f"{sum(a == b for a, b in order['2x2x2'])} of 6 (not Tk = 16 and 64)")
display(Markdown(
    "The cost model places one crossover in each run: "
    + " and ".join(f"the {'2-level' if tree == 'tree_2level' else 'flat'} tree's in the "
                   f"{runs[name]['config']['devices']}-device run, at {v:.0f} keys per device"
                   for (name, tree), v in kpd.items())
    + f" (the measured one: the flat tree's in the 4-device run, at "
      f"{x4['tree_vs_ring']['measured'] / 4:.0f})."))

# %% [markdown]
# *Figure: dots are measured medians, pale lines the cost model. The ring's line rises with
# Tk at the link's rate; the model's tree lines stay flat until the local kernel's cost
# shows. The measured flat tree lies below its line at every length (the model's time over
# the measured is printed above), and the 2-level tree's points fall on both sides of
# its line: it took less time at Tk = 256 than at Tk = 16 (printed above), which no local
# work explains.*
#
# One crossover was measured: in the 4-device run the flat tree overtakes the ring between
# Tk = 64 and Tk = 256. The 2-level tree, whose rings are shorter, took less time than the ring at
# every length in both runs, though at the 4-device run's two shortest lengths by margins
# (printed above) that one median per length cannot call. In the 8-device run both trees
# took less at every length. What both runs show consistently: from Tk = 256 on, both
# trees beat the ring.
#
# The cost model's crossovers (the line above) come from step counts: below a crossover
# the ring's $p-1$ steps of almost nothing (a K and a V send each) and its one broadcast
# ring cost less than the tree's three rings. It orders the flat tree and the ring as
# measured from Tk = 256 on in both runs, and at Tk = 16 and 64 in neither: in the
# 4-device run it has the flat tree faster there, where the ring was; in the 8-device run
# the ring, where the flat tree was. At the shortest lengths the step-count account is not
# borne out. Either way, on these links, the regime lies far below any realistic
# context. A link slow in latency changes the order:
# in §9.8's sweep (Tk = 1,024) the pass-KV ring beats the flat tree at every added delay;
# of the three tree merges swept, the 2-level tree and the butterfly beat the pass-KV
# ring, and the pass-Q ring does too (§9.8 prints and asserts it).

# %% [markdown]
# ## 9.8 A link with a delay
#
# §9.5 ended on a condition to test: does the 2-level schedule win once the link is slow in
# latency? This kernel
# has no delay qdisc (`netem` and its kin are missing), so `tree-attention-edu cluster
# --link-delay-ms δ` builds the links in user space (`cluster/delay.py`), δ being the one-way
# delay in ms (§9.4 keeps D for the head dimension):
#
# * each node's namespace gets a **TUN device**, an interface whose packets go to a process
#   instead of a wire, holding the node's address (no veth, no bridge);
# * a **forwarder** process in the switch namespace holds every node's TUN open, reads each
#   IPv4 packet a node sends, and writes it into the destination node's TUN δ ms after it
#   read it (a deadline heap, so each link stays first in, first out);
# * the tbf of the set rate sits on each TUN's way out: a node's sending is shaped, its
#   receiving is not (the veth path shaped both ends; with 2 nodes the two are the same).
#
# Everything below is **a record read back**: runs made as root on this project's 2-core
# machine and stored in `results/cluster/` (the probe while another heavy job ran, its
# load average printed; the collectives with no other job running, their stored load
# below 1.8; the sweep right after the rate runs, its load, from the cluster's own
# processes, printed below). nbval checks that
# this notebook reads them the same way each time, not that a new run would measure the
# same; each assertion checks a claim of the prose against the record.
#
# First, does the forwarder delay what it should? The probe (`--probe`) sends a small UDP
# datagram from node 0 to node 1 and back, many times, on the plain veth path and through
# the forwarder at each delay, and times one TCP stream at the set rate. A round trip
# should take $2\delta$.

# %%
LAT = ROOT / "results" / "cluster"
probe = json.loads((LAT / "delay-probe.json").read_text())
print(f"{probe['command']}\n(load average {probe['load_average'][0]:.1f} while it ran; "
      f"{probe['message_bytes']}-byte datagrams)\n")
print(f"{'path':<11}{'δ':>6}{'round trip':>13}{'2δ':>8}{'error':>8}{'TCP at 1 Gbit/s set':>22}")
errors_2d = []
for x in probe["paths"]:
    rt, d = x["round_trip"]["median_s"], x["delay_ms"]
    tcp = next(st for st in x["streams"] if st["set_Bps"] == 125e6)  # 1 Gbit/s
    err = "" if not d else f"{rt / (2 * d * 1e-3) - 1:+.1%}"
    if d:
        errors_2d.append(rt / (2 * d * 1e-3) - 1)
        assert x["within_tolerance"]
    print(f"{x['path']:<11}{'-' if d is None else f'{d:g} ms':>6}{rt * 1e3:>10.3f} ms"
          f"{'-' if not d else f'{2 * d:g} ms':>8}{err:>8}"
          f"{tcp['rate_Bps'] / 1e6:>12.0f} MB/s ({tcp['of_set']:.0%})")
    assert tcp["of_set"] >= 0.85  # the set rate, less at the longest delay (slow start?)
assert max(abs(e) for e in errors_2d) < 0.05  # every delayed round trip within 5% of 2δ
assert probe["forwarder_overhead_s"] < 1e-4  # the forwarder's own cost: under 0.1 ms
print(f"\nevery delayed round trip within {max(abs(e) for e in errors_2d):.1%} of 2δ, "
      f"always late, never early; the forwarder itself adds "
      f"{probe['forwarder_overhead_s'] * 1e6:.0f} µs per round trip")
assert min(errors_2d) > 0
delayed = [x for x in probe["paths"] if x["delay_ms"]]
tcp_1g = [next(st["of_set"] for st in x["streams"] if st["set_Bps"] == 125e6) for x in delayed]
assert int(np.argmin(tcp_1g)) == int(np.argmax([x["delay_ms"] for x in delayed]))

# %% [markdown]
# The delay is what was asked, a little late, and a stream still gets most of the set rate,
# least at the longest delay. The README of `results/cluster/` gives the likely reasons,
# which this record does not show: the forwarder waking from its timer on a loaded
# machine, and TCP's slow start taking a larger share of a 2-second stream. The link is
# now slow in latency.
#
# ### How many delays each collective pays
#
# Gloo's TCP transport sends a message only after the receiver's "ready to receive" notice
# has arrived. So a message across nodes costs **two** one-way delays, $2\delta$: the notice
# one way, the data the other (except where the receiver registered its buffer beforehand,
# as gloo's reduce-scatter does: its data goes without a notice). With that rule and each collective's algorithm, as XLA:CPU
# calls gloo (the sources, file and commit, are in the record), a call over $p$ devices on
# at least two nodes pays:
#
# | collective | algorithm | one-way delays per call |
# |---|---|---|
# | all-reduce | gloo's ring (XLA asks for it): $2(p-1)$ steps in lockstep | Exercise 3 |
# | all-gather | gloo's ring: $p-1$ steps | Exercise 3 |
# | reduce-scatter | gloo's halving-doubling (from its source) | $\log_2(\text{nodes}) + 2$ |
# | all-to-all | XLA's own: every send posted at once | Exercise 3 |
# | collective-permute | XLA's own: one send | 2 (one message) |
# | permute-exchange | XLA's own: a collective-permute whose pairs swap, both sends at once | Exercise 3 |
#
# A ring step pays $2\delta$ even where only some of its hops cross nodes: a step waits both
# for the data from one neighbour and for its own send to the other to complete, which
# needs that neighbour's notice, so the slowest hop sets every step's pace. The cell reads
# each collective's measured slope: the least-squares slope of the slowest process's median
# time per call against $\delta$, in units of $\delta$, in four layouts (nodes × processes × devices).
# `permute-exchange` (last row) is one butterfly round across nodes, devices $i$ and
# $i \oplus p/2$ swapping.

# %%
collectives_rec = json.loads((LAT / "latency-collectives.json").read_text())
layouts = collectives_rec["layouts"]
kinds = ["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
         "permute-exchange"]
delays_swept = sorted({pt["delay_ms"] for lay in layouts for pt in lay["points"]})
print("recorded by: " + "; ".join(lay["command"] for lay in layouts[:1])
      + f" (and the same with --layout {', '.join(lay['layout'] for lay in layouts[1:])})")
print(f"δ in {delays_swept} ms, {layouts[0]['repeats']} calls per point; "
      f"measured delays per call (the counts: Exercise 3's test)\n")
print(f"{'collective':<20}" + "".join(f"{lay['layout'] + ' p=' + str(lay['p']):>16}"
                                      for lay in layouts))
for kind in kinds:
    print(f"{kind:<20}" + "".join(
        f"{lay['fits'][kind]['delays_per_call']:>16.1f}" for lay in layouts))
for kind in kinds[:5]:
    print(f"  {kind}: {collectives_rec['algorithms'][kind]['algorithm']}")


def fit(lay, kind):
    return lay["fits"][kind]["delays_per_call"], lay["fits"][kind]["predicted_delays"]


for lay in layouts:  # the prose below, checked against the record
    for kind in ("all-reduce", "all-gather"):  # the rings: within 10% of the count
        got, want_d = fit(lay, kind)
        assert abs(got / want_d - 1) < 0.10, (lay["layout"], kind)
    for kind in ("all-to-all", "collective-permute", "permute-exchange"):  # one message: 2
        got, want_d = fit(lay, kind)
        assert want_d == 2 and abs(got - 2) < 0.5, (lay["layout"], kind)
    got, want_d = fit(lay, "reduce-scatter")  # above its count in every layout
    assert got > want_d
by_p = {lay["p"]: lay for lay in layouts}
assert fit(by_p[8], "all-reduce")[0] > 2 * fit(by_p[4], "all-reduce")[0]  # grows with p
rs_over = [fit(lay, "reduce-scatter")[0] / fit(lay, "reduce-scatter")[1] - 1 for lay in layouts]
assert sum(x > 0.2 for x in rs_over) == 3  # "well above in three of four"
print("reduce-scatter above its count: " + ", ".join(
    f"{lay['layout']} {x:+.0%}" for lay, x in zip(layouts, rs_over, strict=True)))

# The tree's merge as one program, and one psum of two arrays: rings per call.
print("\nrings per call (measured delays / one all-reduce's count 4(p-1)):")
for kind in ("all-reduce-pair", "allreduce-merge"):
    per_ring = [fit(lay, kind)[0] / fit(lay, "all-reduce")[1] for lay in layouts]
    print(f"{kind:<20}" + "".join(f"{x:>16.2f}" for x in per_ring))
    print(f"  {kind}: {collectives_rec['algorithms'][kind]['algorithm']}")
    want_rings = {"all-reduce-pair": 2, "allreduce-merge": 3}[kind]
    assert all(abs(x / want_rings - 1) < 0.05 for x in per_ring), kind  # 2 and 3 rings
# At δ = 0 a ring step costs what the machine charges, not the link: per step of one
# all-reduce, against the α per step that §9.4's rate runs fitted on their ring over all
# devices, and the larger of their two levels' α (an earlier model's price of that step).
step0 = {lay["layout"]: next(pt for pt in lay["points"] if pt["delay_ms"] == 0)
         ["median_s"]["all-reduce"] / (2 * (lay["p"] - 1)) for lay in layouts}
alpha_ring = [x["links"]["flat"]["alpha_s"] for r in runs.values() for x in r["rates"]]
alpha_level = [max(x["links"]["inter"]["alpha_s"], x["links"]["intra"]["alpha_s"])
               for r in runs.values() for x in r["rates"]]
print("at δ = 0, one all-reduce per ring step: " + ", ".join(
    f"{k} {v * 1e3:.2f} ms" for k, v in step0.items())
      + f"; in §9.4's runs, a step of the ring over all devices {min(alpha_ring) * 1e3:.2f} "
      f"to {max(alpha_ring) * 1e3:.2f} ms, the larger level α {min(alpha_level) * 1e3:.2f} "
      f"to {max(alpha_level) * 1e3:.2f} ms")
assert max(step0.values()) < min(alpha_level) and max(step0.values()) <= max(alpha_ring)
assert sum(v < min(alpha_ring) for v in step0.values()) == 2  # two below, two inside
# The layout of the sweep below: one all-reduce against one collective-permute.
lay4 = next(lay for lay in layouts if lay["layout"] == "2x2x1")
print(f"\n2x2x1: one all-reduce {fit(lay4, 'all-reduce')[0]:.1f} delays, one collective-permute "
      f"{fit(lay4, 'collective-permute')[0]:.1f}: "
      f"{fit(lay4, 'all-reduce')[0] / fit(lay4, 'collective-permute')[0]:.1f}x")

# %% [markdown]
# **Exercise 3 (code).** Fill in the table's last column: write `one_way_delays(kind, p,
# nodes)`, the one-way delays one call of `kind` pays over `p` devices on `nodes` nodes (at
# least two), from the algorithms in the table and the $2\delta$ rule above. The test
# compares it with the record's source counts in all four layouts and prints them; the
# measurements above show how close the counts come. The package's
# `collectives.predicted_terms` raises while your function runs.

# %%
def one_way_delays(kind: str, p: int, nodes: int) -> int:
    """One-way delays δ that one call of `kind` pays over p devices on `nodes` >= 2 nodes,
    on gloo's TCP transport (a message across nodes costs 2δ: notice, then data)."""
    # TODO: one count per row of the table above (every kind in `kinds`, permute-exchange
    # included). Hint: what sets the pace of a step, and how many steps run one after another?
    return 2  # right for one message only: replace it


stub_one_way_delays = one_way_delays


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "one_way_delays", "locked": false, "schema_version": 3, "solution": true, "task": false}
def one_way_delays(kind: str, p: int, nodes: int) -> int:  # replaces the stub
    """One-way delays δ that one call of `kind` pays over p devices on `nodes` >= 2 nodes,
    on gloo's TCP transport (a message across nodes costs 2δ: notice, then data)."""
    return {"all-reduce": 2 * 2 * (p - 1), "all-gather": 2 * (p - 1),
            "reduce-scatter": int(np.log2(nodes)) + 2, "all-to-all": 2,
            "collective-permute": 2, "permute-exchange": 2}[kind]


# %% nbgrader={"grade": true, "grade_id": "test_one_way_delays", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_one_way_delays(fn, show=False):
    """Raises AssertionError unless fn gives the record's source counts in every layout."""
    if show:
        print(f"{'source counts':<20}" + "".join(f"{lay['layout'] + ' p=' + str(lay['p']):>16}"
                                                 for lay in layouts))
    own = AssertionError("count them yourself: collectives.predicted_terms is the answer")
    for lay in layouts:
        nodes_l = int(lay["layout"].split("x")[0])
        for kind in kinds:
            try:
                with mock.patch.object(collectives, "predicted_terms", side_effect=own):
                    got = fn(kind, lay["p"], nodes_l)
            except KeyError:
                raise AssertionError(f"one_way_delays has no count for {kind!r}: every "
                                     f"kind of the table needs one") from None
            want_d = lay["fits"][kind]["predicted_delays"]
            assert got == want_d, f"{lay['layout']} {kind}: {got}, the record says {want_d}"
    if show:
        for kind in kinds:
            print(f"{kind:<20}" + "".join(
                f"{fn(kind, lay['p'], int(lay['layout'].split('x')[0])):>16}" for lay in layouts))


try:
    check_one_way_delays(stub_one_way_delays)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
check_one_way_delays(one_way_delays, show=True)
print("one_way_delays == the record's source counts, in every layout   ✓")

# %% [markdown]
# The rings follow their counts within 10% in every layout, and grow with $p$; the
# one-message collectives stay near 2 whatever $p$. Reduce-scatter follows its source least
# well: it pays at or above its count in every layout, 20% or more above in three of four
# (printed; why it pays more than its count was not measured). The butterfly's
# exchange across nodes pays its 2 in every layout.
#
# A `psum` of two arrays is one XLA all-reduce with two operands, and it pays two rings'
# worth of delays: XLA:CPU's `AllReduceThunk` calls gloo once per operand, one after the
# other. The tree's merge alone (`merges.allreduce_core`: a max, then the numerator and
# denominator) pays three, in every layout (the rows above). At $\delta = 0$ a ring step
# costs a fraction of a millisecond (printed above), less than the larger level α of
# §9.4's runs in every layout, and no more than the largest step those runs fit on their
# ring over all devices, which is what the model now charges each step of the flat tree
# (two layouts' steps here fall below that range, two inside it). The comparison is loose: separate runs over different paths (the
# forwarder's TUN devices here, veth and a bridge in §9.3), tiny arrays here and the small
# messages there (at most 16 KiB per step, the cut-off), and a median of calls here against a mean of small
# messages there (§9.3 prints the pooled mean and median; within one fit the mean can lie
# above or below the median).
#
# So an XLA:CPU `psum` over $p$ devices pays $4(p-1)$ one-way delays per operand on this
# transport:
# tree decoding's Allreduce merge is no tree here. Notebook 8 (§8.7) says why: the
# $\log p$ of the paper's Algorithm 3 belongs to the algorithm a library runs, and gloo, as
# XLA calls it, runs rings. The butterfly merge (`merge="butterfly"`, notebook 8, §8.2.6)
# writes the tree into the program: $\log_2 p$ collective-permutes, 2 delays each where
# they cross nodes.

# %% [markdown]
# ### Every method against the delay
#
# The sweep: the same cluster at five delays, every method timed in interleaved rounds at
# each, on a 4-device layout of its own: 2 nodes × 2 processes × 1 device, through the
# forwarder (its settings are printed). The flat tree's and the 2-level tree's merges are XLA all-reduces, so gloo
# rings; the butterfly's are collective-permutes. The source count of each method is what
# the table above predicts for its collectives:
#
# * flat tree: its merge's three rings (a max, a numerator, a denominator, one gloo ring per
#   operand, as the merge timed alone above) span all $p$ devices, $4(p-1)$ each;
# * 2-level tree: the rings inside a node cross nothing; the same number across nodes have
#   2 devices, $4 \cdot 1$ each;
# * butterfly: round 0 pairs devices of one node, round 1 crosses, 2;
# * pass-KV ring: $2(p-1)$ permutes (a K and a V block per step), 2 each, and the final
#   all-reduce that broadcasts the output (the cell prints its collectives);
# * pass-Q ring: $p-1$ permutes, an all-to-all and an all-gather.
#
# The slope of each method's time against $\delta$ is the number of one-way delays it pays per
# decode step. The cell checks the record's slopes by refitting them.

# %%
def method_counts(count, p: int, nodes: int) -> dict[str, int]:
    """Each method's one-way delays per decode step (the list above), from `count(kind, p,
    nodes)`, the delays of one call of a collective `kind`: Exercise 3's `one_way_delays`,
    or the package's `collectives.predicted_terms` ("The cost model against the record")."""
    return {
        "tree": TREE_RINGS * count("all-reduce", p, nodes),
        "tree_2level": TREE_RINGS * count("all-reduce", nodes, nodes),  # across: 1 per node
        "butterfly": count("collective-permute", p, nodes),
        "ring": (p - 1) * 2 * count("collective-permute", p, nodes)
                + count("all-reduce", p, nodes),
        "ring_pass_q": (p - 1) * count("collective-permute", p, nodes)
                       + count("all-to-all", p, nodes) + count("all-gather", p, nodes),
    }


# %% nbgrader={"grade": true, "grade_id": "test_one_way_delays_2", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
sweep = json.loads((LAT / "latency-2x2x1.json").read_text())
cfg = sweep["reports"]["0.0"]["config"]
p4, nodes4 = cfg["devices"], cfg["nodes"]
D_ms = np.array(sweep["delays_ms"])
print(f"{cfg['nodes']}x{cfg['processes_per_node']}x{cfg['devices_per_process']}: {p4} devices, "
      f"{cfg['link_gbit'][0]:g} Gbit/s, Tk = {cfg['seq_len']:,}, {cfg['q_heads']} heads of "
      f"{cfg['head_dim']}, batch {cfg['batch']}, {cfg['repeats']} rounds per point; "
      f"δ in {D_ms.tolist()} ms\n  {sweep['command']}\n  note (δ written for its D): "
      f"{sweep['note'].replace('D=', 'δ = ')}")
ring_coll = sweep["reports"]["0.0"]["methods"]["ring"]["collectives"]
assert ring_coll == {"all-reduce": 1, "collective-permute": 2 * (p4 - 1)}  # the current ring
print(f"  the pass-KV ring's collectives in this sweep: {ring_coll}\n")
sm = sweep["methods"]  # before the student's function runs: later cells need it
slopes = {mt: r["delays_per_step"] for mt, r in sm.items()}
source_count = method_counts(one_way_delays, p4, nodes4)
print(f"{'method':<13}" + "".join(f"{f'δ={d:g}':>8}" for d in D_ms)
      + f"{'slope':>8}{'count':>8}{'model':>8}   model's error across δ")
for mt, r in sm.items():
    slope = np.polyfit(D_ms * 1e-3, r["median_s"], 1)[0]  # seconds per second of δ
    assert np.isclose(slope, r["delays_per_step"])  # the record's slope, refitted
    print(f"{mt:<13}" + "".join(f"{t * 1e3:>8.1f}" for t in r["median_s"])
          + f"{r['delays_per_step']:>8.1f}"
          + f"{source_count[mt]:>8}"
          f"{r['predicted_delays_per_step']:>8.1f}   "
          + " ".join(f"{e:+.0%}" for e in r["rel_err"]))
print("(ms per decode step, the slowest process's median; slopes in one-way delays δ; count:\n"
      " from the algorithms' sources, the trees with their merge's 3 rings; model: the cost\n"
      " model's slope)")
assert min(slopes, key=slopes.get) == "butterfly"  # the smallest slope
assert abs(slopes["butterfly"] - source_count["butterfly"]) < 0.5  # its count: 2
assert slopes["tree_2level"] < slopes["tree"]
for mt in sm:  # every method within 10% of its count
    assert abs(slopes[mt] / source_count[mt] - 1) < 0.10, mt
print("slope / count - 1: " + ", ".join(
    f"{mt} {slopes[mt] / source_count[mt] - 1:+.0%}" for mt in sm))
# §9.7: with a delay the pass-KV ring beats the flat tree; the 2-level tree, the butterfly
# and the pass-Q ring beat the pass-KV ring (every δ > 0)
for i in range(1, len(D_ms)):
    med = {mt: r["median_s"][i] for mt, r in sm.items()}
    assert med["ring"] < med["tree"]
    assert max(med["tree_2level"], med["butterfly"], med["ring_pass_q"]) < med["ring"]
# "The flat tree pays the most; the 2-level tree less than either ring"
assert max(slopes, key=slopes.get) == "tree"
assert slopes["tree_2level"] < slopes["ring_pass_q"] < slopes["ring"]
last = -1  # the largest delay
print(f"\nat δ = {D_ms[last]:g} ms: butterfly {sm['butterfly']['median_s'][last] * 1e3:.0f} ms, "
      f"2-level tree {sm['tree_2level']['median_s'][last] * 1e3:.0f} ms, flat tree "
      f"{sm['tree']['median_s'][last] * 1e3:.0f} ms per decode step")

# %%
fig, ax = plt.subplots(figsize=(7, 3.8))
styles = {"tree": "--", "tree_2level": "-", "butterfly": "-", "ring": "-", "ring_pass_q": "-"}
for mt, r in sm.items():
    ax.plot(D_ms, np.array(r["median_s"]) * 1e3, "o" + styles[mt], color=plots.color(mt),
            label=f"{mt}: {r['delays_per_step']:.1f} δ per step")
    ax.plot(D_ms, np.array(r["predicted_s"]) * 1e3, styles[mt], color=plots.color(mt),
            alpha=0.35)
ax.set_xlabel("one-way delay δ of the inter-node link (ms)")
ax.set_ylabel("median ms per decode step")
ax.set_title(f"{cfg['nodes']}x{cfg['processes_per_node']}x{cfg['devices_per_process']}, "
             f"recorded: every method against the link's delay")
ax.legend(fontsize=8)
ax.grid(alpha=0.3)
plt.tight_layout()
plt.show()

# %% [markdown]
# *Figure: dots and dark lines are the recorded medians, pale lines the cost model's
# predictions; blue the two trees (flat dashed), red the pass-KV ring, pink the pass-Q
# ring, cyan the butterfly. The slope of a line is the number of one-way delays a decode
# step pays.*
#
# Read the table and the figure together:
#
# * **The butterfly pays the fewest delays**, its count of 2: one round crosses the link.
#   The flat tree pays the most, because its Allreduces are rings that span all devices;
#   the 2-level tree's rings across nodes have 2 devices, and it pays less than either
#   ring.
# * **Every method follows its count** within 10%, the trees counted with their merge's
#   three rings (read in the source, and timed alone above). The pass-KV ring pays the
#   least against its count, 9% fewer delays (printed above); the record does not say
#   which of its 24 it saves.
# * A method's time at $\delta = 0$ is not its order at large $\delta$: the slope decides once the
#   link is slow.
#
# ### 2-level against flat, with latency
#
# The same test as §9.5, at each delay, from the same interleaved rounds.

# %%
for d in D_ms:
    rep_d = sweep["reports"][f"{d:.1f}"]
    t = rep_d["topology_claim"]
    again = run.verdict(rep_d["methods"]["tree"]["round_s"],
                        rep_d["methods"]["tree_2level"]["round_s"])["verdict"]
    assert t["verdict"] == again  # the verdict, recomputed from the rounds
    assert (t["verdict"] == "2-level faster") == (d > 0)  # at every δ > 0, and only there
    print(f"δ = {d:>4g} ms: flat {t['flat_s'] * 1e3:7.1f} ms, 2-level {t['two_level_s'] * 1e3:6.1f} "
          f"ms ({t['flat_over_two_level']:.1f}x), 2-level faster in "
          f"{t['two_level_faster_rounds']} of {t['rounds']} rounds: {t['verdict']}")
ratios_d = [sweep["reports"][f"{d:.1f}"]["topology_claim"]["flat_over_two_level"]
            for d in D_ms if d > 0]
# The source counts from the package (collectives.predicted_terms), not Exercise 3's function.
across_2 = collectives.predicted_terms(nodes4, 1)["all-reduce"]  # one device per node
flat_p4 = collectives.predicted_terms(p4, p4 // nodes4)["all-reduce"]
bf_gain = [sm["tree_2level"]["median_s"][i] / sm["butterfly"]["median_s"][i]
           for i, d in enumerate(D_ms) if d > 0]
assert min(bf_gain) > 5  # "the butterfly beats it by far": about 6x at every delay above 0
print(f"the butterfly against the 2-level tree at every δ > 0 (§9.8's table): "
      f"{min(bf_gain):.1f}x to {max(bf_gain):.1f}x faster")
display(Markdown(f"With a delay on the link, the course's 2-level schedule beats the flat tree "
                 f"at every delay above 0, by {min(ratios_d):.1f}× to {max(ratios_d):.1f}×: its rings "
                 f"across nodes have {nodes4} devices, so they pay {across_2} delays each, "
                 f"against {flat_p4} for the flat ring over all {p4}. Without a delay, in "
                 f"this sweep (Tk = {cfg['seq_len']:,}, through the forwarder), the "
                 f"difference is not measurable."))

# %% [markdown]
# The idea behind the paper's topology argument (paper §5.3) holds here once the link is slow in
# latency. But on this transport the 2-level tree is still a set of rings, and the butterfly, a tree written as point-to-point
# exchanges, beats it by far (6.1× to 6.8× at every delay above 0: the line printed above).
#
# ### The cost model against the record
#
# The cost model is not fitted to these timings. At each delay the run fits α (printed
# below) and β from all-reduces over each level and over all devices, and the model prices
# every method with them, as in §9.4 (the rule before its subsection "Rings of few elements"; a record read
# back): on this transport (`Topology.ring_only`), each
# all-reduce or all-gather over all devices as one ring at the step measured on that ring,
# one ring per operand, the trees' merges one level at a time, the butterfly's rounds
# inside a node at the intra-node α and β.
# Its errors, in the table above, read back as recorded:

# %%
print("inter-node alpha fitted at each δ: " + ", ".join(
    f"{a * 1e3:.1f} ms" for a in sweep["inter_alpha_s"]))
intra_a = [sweep["reports"][f"{d:.1f}"]["links"]["intra"]["alpha_s"] for d in D_ms]
print("intra-node alpha fitted at each δ: " + ", ".join(f"{a * 1e3:.1f} ms" for a in intra_a))
flat_a = [sweep["reports"][f"{d:.1f}"]["links"]["flat"]["alpha_s"] for d in D_ms]
print(f"alpha per step of the ring over all {p4} devices, fitted at each δ: "
      + ", ".join(f"{a * 1e3:.1f} ms" for a in flat_a))
flat_step0 = sm["tree"]["median_s"][0] / (TREE_RINGS * 2 * (p4 - 1))
print(f"at δ = 0 the flat tree's whole decode per ring step: {flat_step0 * 1e3:.2f} ms "
      f"({sm['tree']['median_s'][0] * 1e3:.1f} ms over {TREE_RINGS * 2 * (p4 - 1)} steps)")
assert flat_a[0] > 1.2 * flat_step0 and intra_a[0] > 1.2 * flat_step0
for mt, r in sm.items():
    print(f"{mt:<13} error {min(r['rel_err']):+.0%} to {max(r['rel_err']):+.0%}; slope "
          f"{r['predicted_delays_per_step']:.1f} δ predicted, {r['delays_per_step']:.1f} measured")
positive_d = slice(1, None)
worst_d = max(abs(e) for r in sm.values() for e in r["rel_err"][positive_d])
assert worst_d < calibrate.BAND  # every method, every δ > 0: inside the band
misses_0 = {mt: r["rel_err"][0] for mt, r in sm.items() if abs(r["rel_err"][0]) > calibrate.BAND}
assert set(misses_0) == {"tree", "butterfly", "ring_pass_q"} and min(misses_0.values()) > 0
# The package's counts, not Exercise 3's function: this cell runs in the students' release.
package_count = method_counts(
    lambda kind, p, nodes: collectives.predicted_terms(p, p // nodes)[kind], p4, nodes4)
for mt, r in sm.items():  # the model's slopes: its counts, within 5%
    assert abs(r["predicted_delays_per_step"] / package_count[mt] - 1) < 0.05, mt
# The fitted alpha per ring step grows with δ at about the 2δ rule.
a_slope = np.polyfit(D_ms, np.array(sweep["inter_alpha_s"]) * 1e3, 1)[0]
assert 1.8 < a_slope < 2.2  # about 2 delays per ring step
print(f"the fitted inter-node alpha grows by {a_slope:.2f} δ per ring step")
display(Markdown(
    f"At every delay above 0 the model predicts every method within {worst_d:.0%} (the band "
    f"is ±{calibrate.BAND:.0%}), and its slopes are the source counts within 5%. At "
    f"δ = 0 it over-predicts " + ", ".join(f"{mt} ({e:+.0%})" for mt, e in misses_0.items())
    + ". There α is what the machine charges, not the link, and the micro-benchmarks "
    "charge more per step than the decodes pay: the step of the ring over all devices, "
    f"fitted from all-reduces on their own ({flat_a[0] * 1e3:.2f} ms), and the step inside "
    f"a node ({intra_a[0] * 1e3:.2f} ms) both exceed what the flat tree's whole decode took "
    f"per ring step ({flat_step0 * 1e3:.2f} ms, compute included). The model charges the "
    "first to every step of the flat tree and to the pass-Q ring's all-gather and "
    "all-to-all over all devices, the second to the butterfly's round inside a node. Why "
    "a step of an all-reduce timed on its own costs more than one inside a decode is not "
    "known."))

# %% [markdown]
# The model's latency terms are the source counts: each ring step is priced at the α fitted
# at that delay, which grows by about $2\delta$ per step (printed above), as the $2\delta$
# rule says. Earlier versions of this model priced one ring per XLA all-reduce rather
# than one per operand, every ring at the two levels' own α rather than the slowest hop's,
# then every ring over all devices at the slower level's α rather than at the step
# measured on that ring, and every butterfly round across nodes. An earlier sweep of this layout, made while
# another test suite loaded the machine, had fitted about four rings' worth of delays for
# the trees (48.6 and 17.7 δ per step, in the README), which no program or source explained; recorded again with no other job running, the slopes are the
# three rings the source gives (`results/cluster/README.md` has both). Why the loaded
# sweep's trees paid more per delay is not known. Reading XLA:CPU's
# `AllReduceThunk` and timing the merge alone (the table of collectives above) fixed the
# model's counts. The model's slopes then follow from those counts and the α fitted in the
# same runs, so they agree with the counts by construction; the test of the model is its
# prediction of each measured time, which it never sees (within the band at every δ > 0).
#
# <div class="admonition tip"><p class="admonition-title">Takeaway</p>
# <p>On gloo's TCP transport a message across nodes costs two one-way delays, and XLA:CPU's
# all-reduce is a ring: 4(p − 1) delays per operand, three rings for the tree's merge.
# Tree decoding's Allreduce merge is then no tree; the 2-level mesh shortens its rings and
# beats the flat tree at every delay above 0 (at δ = 0, in this sweep, no measurable
# difference), and the
# butterfly, log2 p point-to-point rounds, pays the fewest delays of the five methods
# swept. The latency of a tree is the algorithm's, not the collective's name.</p></div>
#
# ## 9.9 Run it yourself
#
# As root on Linux, one command builds the cluster, runs everything of §9.2 to §9.7 for the
# 8-device run, and removes everything it made (2 min 44 s when recorded, in
# `results/cluster/README.md`); it is
# the recorded command (printed in §9.2), writing to `out/`, and `--processes-per-node 1`
# makes the 4-device run:
#
# ```bash
# sudo .venv/bin/tree-attention-edu cluster --nodes 2 --processes-per-node 2 --devices-per-process 2 \
#     --link-gbit 1,0.5 --seq-len 16384 --sweep 16,64,256,1024,4096,16384 \
#     --json out/cluster.json
# ```
#
# One point of §9.8's sweep (the others change `--link-delay-ms`; the probe is
# `--probe 0,2,5,10,20`):
#
# ```bash
# sudo .venv/bin/tree-attention-edu cluster --nodes 2 --processes-per-node 2 --devices-per-process 1 \
#     --link-gbit 1 --link-delay-ms 5 --seq-len 1024 --repeats 9 \
#     --methods tree,tree_2level,butterfly,ring,ring_pass_q --json out/cluster-5ms.json
# ```
#
# The cell below reruns a small cluster live where this kernel has the privileges
# (two nodes of one process with two devices, one rate, three methods), and says why not
# elsewhere. Its output is a fresh measurement, so nbval does not
# compare it. A short live run like this, three rounds on shared cores, can order the flat
# and the 2-level tree either way, and the ring against them too; draw no conclusion from
# its ordering. §9.5 and §9.8 read the recorded runs, with more rounds and a verdict that
# asks whether a difference exceeds its spread.

# %%
# NBVAL_IGNORE_OUTPUT
reason = netns.missing_privileges()
if reason is None:
    code, live = run.run_cluster(run.ClusterConfig(
        nodes=2, processes_per_node=1, devices_per_process=2, link_gbit=(1.0,), seq_len=1024,
        methods=("tree", "tree_2level", "ring"), repeats=3))
    assert code == 0  # each worker's own account streamed above, as it ran
    print(run.summary(live))
    print(f"({live['config']['repeats']} rounds on shared cores: these times, and the model's "
          f"errors against them, vary from run to run; §9.4 and §9.5 read the recorded runs)")
    assert netns.owned() == []  # nothing left behind
else:
    print(f"skipped: {reason}")

# %% [markdown]
# ## 9.10 Summary
#
# * Network namespaces, veth pairs, a bridge and token-bucket filters make nodes and a link
#   of a chosen rate on one machine; `jax.distributed` over gloo makes their processes one
#   set of devices, and the launcher removes everything on every way out.
# * Fitted from all-reduces of growing size, the inter-node β matched the rate set within
#   ±20% at both rates in these records, though the README's six re-runs of the 8-device
#   layout fitted it above the rate set (§9.3); the six model-check runs of §9.4 (`check/`)
#   fitted 87% to 126% of it, and the nine further runs within ±20% in every fit, above the
#   rate set in more than half and below it in the rest, around it: whether from a fit's
#   noise or §9.3's overcount is not measured; α on these two cores is probably a scheduler's, not a
#   network's.
# * The ring is bandwidth-bound: predicted from β within 10% in these records, and slower
#   when the rate halves, by less than the rate's factor, as its bytes predict (§9.6). The
#   tree methods send a few kB; between the two rates their times moved in both
#   directions, by more than their bytes can explain (§9.3's spread of a step on these two cores is the likely
#   reason).
# * 2-level against flat, on a link slow only in bandwidth: the 2-level tree takes fewer
#   ring steps; on the slow link it is faster in the 8-device run, as these records' cost model
#   predicts (this record cannot price the flat tree's half-full rings by the rule of held
#   segments, so whether that rule would still predict the 2-level tree faster here is not
#   known; §9.5), and not measurably different in the 4-device run, where the model predicts
#   the flat tree faster; on the fast link neither run shows a difference, so without a
#   delay the test is inconclusive (§9.5). In six later runs of the 8-device layout
#   (`check/` and `check/design/`) the
#   model each recorded predicted the 2-level tree faster at 0.5 Gbit/s every time (by over
#   1% each), the
#   slow link's verdict repeated once, and the medians put the flat tree ahead in five;
#   in nine further runs the verdict repeated three times, and the medians put the
#   2-level tree ahead in eight: the verdict does not reliably repeat (§9.5). Priced at a step measured on its own ring over all devices, the flat
#   tree is predicted within 20% in both records at every rate at Tk = 16,384 (§9.4; not
#   in every later run, and at 0.5 Gbit/s over-predicted in all six of §9.4's `check/` and
#   `check/design/` runs,
#   by the model each recorded and by these records' model alike; in
#   nine further runs inside ±30% in each at that rate and lower on average, for a reason
#   not known),
#   though 2.1 to 2.4 times over at Tk ≤ 256 in both (§9.7); priced at
#   the larger of the levels' fitted α, it is over-predicted in all four. In the 8-device
#   record the model under-predicts every other method but the ring, at every rate each
#   was timed at. Measured since, in one exploratory run (a patch not kept): a collective
#   issued after the kernel waits for it longer than the kernel takes alone, by a wait
#   that never shrinks with the length (within 0.1 ms) and was over three times longer at
#   16,384 keys than at 2,048. With that wait read as a rate, the all-gather and all-to-all timed alone and a chain's
#   step for the flat tree, the model puts more cells within ±30% than these records'
#   model does in each of three new check runs (`check/`), short of issue 30's target of
#   every cell, missing one, two and four cells; the
#   flat tree is over-predicted at 0.5 Gbit/s in all three (`check/`, in §9.4). The one cell
#   missed in all three is the reduce-scatter merge, whose reduce-scatter costs more after
#   another collective than alone; priced from its two collectives timed in its own
#   rounds, alone and as a pair, it was inside the band in four of five design runs (the
#   pair from process 0's rounds) and in all three later check runs (`check/rs-after/`,
#   from every process's), which missed one other cell in all three together; that cell is now close to a timing of its own
#   collectives, weak evidence for the model as a whole, and the other cells missed less
#   with their predictions untouched by the change: the measurements moved (noise, or a
#   shift between batches not explained; §9.4). A gloo ring skips the segments of
#   its operand that hold no bytes. The model of `check/few/` prices such a ring (e.g.
#   `one_pass`'s one-element flag) by the segments that hold bytes, and predicts the
#   2-level tree slower than `one_pass`, as most earlier runs measured it (§9.4), where the model
#   before predicted a tie. Over the six runs of `check/few/` (three design, three check)
#   that rule is worth one cell of the 102,
#   orders the methods as measured more often, and makes the errors a little larger on
#   average: with it the model under-predicts the flat tree in each of those six runs, and
#   at 0.5 Gbit/s predicts
#   it faster than the 2-level tree in five of six, where the medians were mostly close to
#   a tie and the one verdict that named a winner named the 2-level tree. Probably (a
#   reading, not a measurement) part of the larger errors is the rule's own under-price of rings of few elements, and
#   part a shortfall the old price of small rings had hidden and the model does not
#   explain (§9.4, "Rings of few elements"). The runs since check each prediction against the mean over every
#   process's rounds, the estimator the model's collective terms take, where the runs
#   before took the slowest process's median. That changes what is measured, not the
#   model: it moves the mean error up by about four points on the runs that chose it and
#   on the earlier records, and on three new runs by +1.9 on average (−0.1 to +4.2), and the count of cells
#   inside by +3, −1 and +1 on those three sets (the count of runs with every cell
#   inside: from four of six to six of six on the runs that chose it, five of 15 to four,
#   and one of three to two). Those three runs put 17, 17 and 16 of the 17 cells
#   within ±30% (against the slowest process's median, 17, 16 and 16): issue 30's cluster
#   target was still not met then (§9.4, "Which time a prediction is checked against"). A
#   warm-up round before the timed ones (the first round after compiling was the slowest
#   at the first rate more often than chance) gave 17, 16 and 15 in three runs (three
#   runs cannot say whether it helps the count), and the permute priced as measured alone
#   over-priced the butterfly and the pass-KV ring and was taken back, though it priced
#   the pass-Q ring about right (a lead, in-sample; its three runs, repriced without it:
#   17, 16 and 17; §9.4, "A warm-up round, and the permute measured alone"). Two variants
#   of that lead failed on new runs: a ring's permutes priced at a ring shift measured
#   alone, or at seven in one program, priced the pass-Q ring worse than the slowest link
#   did there, and both were taken back (the lead itself was not re-run). By a reading of the rounds' halves (each round's noise taken as
#   independent), most of a cell's spread was noise inside a run, so the check now times
#   27 rounds a run (`--repeats 27`), and its three runs put 17, 17 and 17 of the 17
#   cells inside, the worst at +28.3% and −26.5%: issue 30's cluster target met by that
#   check, with a thin margin and the pass-Q ring under-predicted in all six of its cells.
#   It is one set of three runs, after the sets of 9 rounds with the warm-up, each of which
#   missed a cell or more (a change to how the check measures, made after those misses):
#   it shows the check can pass, not how often it will (§9.4, "A ring's steps measured,
#   and more rounds"). The course's 2-level schedule (the idea behind the paper's
#   §5.3 topology argument) wins at every delay above 0 once the link is slow in latency
#   (§9.8's sweep, 2 nodes × 2 processes × 1 device; at δ = 0 no measurable difference).
# * Measured, both trees beat the ring from Tk = 256 on in both runs; in the 4-device run
#   the flat tree overtakes the ring between Tk = 64 and 256. The cost model orders the
#   flat tree and the ring as measured from Tk = 256 on, and at Tk = 16 and 64 in neither
#   run (§9.7).
# * With a delay on the link (a TUN forwarder, round trips within a few percent of $2\delta$),
#   a gloo message across nodes costs $2\delta$ (a notice, then the data), an XLA:CPU
#   all-reduce is a ring of $4(p-1)\delta$, and one with several operands runs one ring per
#   operand: the tree's merge pays three. The 2-level tree then beats the flat one at every
#   delay above 0 (at δ = 0, in that sweep, no measurable difference), the butterfly merge, a tree written
#   as `ppermute` rounds, pays the fewest delays of the five methods swept, and every
#   method's slope matches its source count
#   within 10%. The cost model, pricing those counts, predicts every method within the
#   ±30% band at every delay above 0 (§9.8, a record read back).
#
# ## 9.11 Exercises
#
# **Exercise 4 (code).** At what link rate would the bytes one device sends per call in the
# flat tree (inside and across nodes) cost as much as one wake-up of a sleeping peer, taken
# as 2 ms (§9.3's assumed round figure, not a kernel constant), for the states of §9.4? How
# much slower than the slowest link here is that? Write `slice_rate(p, n, slice_s)`: the
# bytes per second at
# which the bytes the flat ring sends per device and call, for states of `n` bytes over
# `p` devices (§9.4's closed form), take `slice_s` seconds. The test compares it with the
# record's byte counts and with a case of its own, then prints the answer.

# %%
def slice_rate(p: int, n: float, slice_s: float) -> float:
    """Bytes per second at which the flat ring's bytes per device and call take slice_s."""
    # TODO: how many bytes does one device send in a ring all-reduce of n bytes?
    return n / slice_s  # wrong on purpose: replace it


stub_slice_rate = slice_rate


# %% tags=["solution"] jupyter={"source_hidden": true} nbgrader={"grade": false, "grade_id": "slice_rate", "locked": false, "schema_version": 3, "solution": true, "task": false}
def slice_rate(p: int, n: float, slice_s: float) -> float:  # replaces the stub
    """Bytes per second at which the flat ring's bytes per device and call take slice_s."""
    return 2 * (p - 1) / p * n / slice_s  # a ring sends 2(p-1)/p of the state per device


# %% nbgrader={"grade": true, "grade_id": "test_slice_rate", "locked": true, "points": 1, "schema_version": 3, "solution": false, "task": false}
def check_slice_rate(fn):
    """Raises AssertionError unless fn prices the recorded flat-tree bytes, in both runs, and
    a case the test builds itself."""
    for r in runs.values():
        c_, m_ = r["config"], r["methods"]["tree"]
        pr = c_["problem"]
        n_ = pr["batch"] * pr["q_heads"] * 4 * (pr["head_dim"] + 2)  # maxima, then sums
        sent = m_["bytes_inter"] + m_["bytes_intra"]  # read from the compiled program
        assert np.isclose(fn(c_["devices"], n_, 2e-3), sent / 2e-3, rtol=1e-9, atol=0)
    # A case in no record: 5 devices, 1 kB, 0.5 s: 2 · 4/5 · 1000 B in 0.5 s = 3200 B/s.
    assert np.isclose(fn(5, 1e3, 0.5), 3200.0, rtol=1e-9, atol=0), fn(5, 1e3, 0.5)


try:
    check_slice_rate(stub_slice_rate)
    print("the stub cell passes the test (filled in?)")
except AssertionError:
    print("the stub as given fails the test")
check_slice_rate(slice_rate)
rate = slice_rate(p, n, 2e-3)  # §9.4's run: p devices, states of n bytes
flat = rep["methods"]["tree"]
assert np.isclose(rate * 2e-3, flat["bytes_inter"] + flat["bytes_intra"])  # its flat tree's
slowest = min(x["set_Bps"] for x in rep["rates"])
print(f"{rate * 2e-3:,.0f} B in 2 ms is {rate / 1e6:.2f} MB/s = {rate * 8 / 1e6:.1f} Mbit/s: "
      f"{slowest / rate:.0f} times slower than the slowest link here")

# %% [markdown]
#
# **Exercise 5.** The ring at the slower rate took less than twice as long as at the
# faster one (§9.6 prints the factors), though the rate halved. Which parts of its time do
# not depend on the rate?
#
# <details><summary>Answer</summary>
#
# The local kernel over $p$ blocks per device, the copy XLA:CPU makes of each block before
# sending it, the per-step latencies and the per-call overhead. The cost model's ring
# prediction splits its time into these parts (`costmodel.predict_ring`).
#
# </details>
#
# ## 9.12 References
#
# * Shyam et al., *Tree Attention*, arXiv 2408.04093: §5.3 (topology-aware reduction).
# * `ip-netns(8)`, `veth(4)`, `tc-tbf(8)`: the Linux manual pages of network namespaces,
#   virtual ethernet pairs and the token-bucket filter.
# * RFC 2544, *Benchmarking Methodology for Network Interconnect Devices*, §C.2.2: the
#   `198.18.0.0/15` range, reserved for benchmarking.
# * Thakur, Rabenseifner and Gropp, *Optimization of Collective Communication Operations
#   in MPICH*, IJHPCA 19(1), 2005: the α–β costs of the collectives' algorithms; and
#   Patarasuk and Yuan, *Bandwidth optimal all-reduce algorithms for clusters of
#   workstations*, JPDC 69(2), 2009: the ring all-reduce's $2(p-1)$ steps.
