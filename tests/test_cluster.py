"""A cluster on one machine: a real run of network namespaces and workers, and every fault
leaves nothing behind (no process, namespace, /etc/netns entry or lock).

The run and the fault tests need root (network namespaces); elsewhere they are skipped with
the reason. The fault tests start `python -m tree_attention_edu cluster` with tiny workers
that the launcher's test hook (`TAE_LAUNCH_TEST_SLEEP`) keeps waiting before
`jax.distributed` starts, inflict the fault, and check the exit status, the one line on
stderr, the time to exit, and what is left. The measured table is printed at the end of
the module (`pytest -s` or `-rA` to see it).
"""

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from reference import np_attention
from test_launch import alive, all_pids, children, wait_until

from tree_attention_edu.cluster import netns
from tree_attention_edu.cluster import processes as ps
from tree_attention_edu.cluster.methods import (
    CLUSTER_METHODS,
    crossover,
    level_bytes,
    reference_attention,
)
from tree_attention_edu.cluster.run import ClusterConfig
from tree_attention_edu.perf import benchmark
from tree_attention_edu.perf.introspect import Collective

PREFIX = "tae-cltest"  # this module's runs only: a real run elsewhere is never touched
ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
WAIT = 120
TEARDOWN: list[tuple[str, object, float, int, int]] = []
SMALL = [
    "--nodes",
    "2",
    "--processes-per-node",
    "1",
    "--devices-per-process",
    "2",
    "--seq-len",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--prefix",
    PREFIX,
]


def _namespaces_unavailable() -> str | None:
    reason = netns.missing_privileges()
    if reason:
        return reason
    try:
        with netns.network(2, 1e9, prefix=PREFIX + "-probe"):
            pass
    except netns.NetworkError as e:
        return f"cannot create network namespaces here: {e}"
    return None


REASON = _namespaces_unavailable()
needs_root = pytest.mark.skipif(REASON is not None, reason=str(REASON))


@pytest.fixture(scope="module", autouse=True)
def teardown_table(request):
    yield
    if not TEARDOWN:
        return
    rows = [
        f"{'scenario':<48}{'exit status':>12}{'time to exit':>14}{'processes left':>16}"
        f"{'namespaces left':>17}"
    ]
    rows += [f"{s:<48}{c!s:>12}{t:>13.2f}s{n:>16}{m:>17}" for s, c, t, n, m in TEARDOWN]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(rows), flush=True)


def owned_anything() -> list[str]:
    """Namespaces, /etc/netns entries and locks of this module's prefix."""
    locks = (
        [f for f in os.listdir(netns.LOCK_DIR) if f.startswith(PREFIX)]
        if os.path.isdir(netns.LOCK_DIR)
        else []
    )
    return netns.owned(PREFIX) + locks


def root_links() -> list[str]:
    """The interfaces of this machine's own namespace, with their state and addresses."""
    return sorted(
        subprocess.run(
            ["ip", "-br", "addr"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    )


def processes_with(text: str) -> list[int]:
    """Live processes whose command line mentions `text`."""
    out = []
    for pid in all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            continue
        if text in cmd and alive(pid) and pid != os.getpid():
            out.append(pid)
    return out


# ---------------------------------------------------------------------------------------
# Pure parts: no namespaces needed


def test_reference_attention_matches_the_loop_reference():
    rng = np.random.default_rng(0)
    q, k, v = (
        rng.normal(size=(2, 3, 4, 8)),
        rng.normal(size=(2, 17, 2, 8)),
        rng.normal(size=(2, 17, 2, 6)),
    )
    np.testing.assert_allclose(
        reference_attention(q, k, v), np_attention(q, k, v), rtol=1e-12, atol=1e-12
    )


def test_level_bytes_closed_forms():
    """Per-device bytes inside and across 2 nodes of 2 devices, by gloo's algorithms."""

    def node(i):
        return i // 2

    n = 1000
    ar_two = [
        Collective("all-reduce", ((0, 1), (2, 3)), n),  # over "gpu": inside nodes
        Collective("all-reduce", ((0, 2), (1, 3)), n),
    ]  # over "node": across
    got = level_bytes(ar_two, node, 4)
    # A ring of 2 sends 2·(1/2)·n per member: n inside for the first, n across for the second.
    assert got == {"bytes_inter": n, "bytes_intra": n, "link_bytes": 2 * n}
    flat = level_bytes([Collective("all-reduce", ((0, 1, 2, 3),), n)], node, 4)
    # A ring of 4 (0→1→2→3→0) sends 2·3/4·n per member; hops 1→2 and 3→0 cross.
    assert flat["bytes_inter"] == pytest.approx(2 * 1.5 * n / 4)
    assert flat["bytes_intra"] == pytest.approx(2 * 1.5 * n / 4)
    assert flat["link_bytes"] == pytest.approx(1.5 * n)
    ring = level_bytes(
        [Collective("collective-permute", ((0, 1), (1, 2), (2, 3), (3, 0)), n, count=3)], node, 4
    )
    assert ring == {"bytes_inter": 1.5 * n, "bytes_intra": 1.5 * n, "link_bytes": 3 * n}
    a2a = level_bytes([Collective("all-to-all", ((0, 1, 2, 3),), n)], node, 4)
    assert a2a["bytes_inter"] == pytest.approx(n / 2) and a2a["bytes_intra"] == n / 4


def test_cluster_methods_are_the_merge_patterns_and_rings():
    """The flat tree, then every merge pattern on the 2-level mesh (the Allreduce one is the
    paper's tree: `tree_2level`), then both rings."""
    from tree_attention_edu.core.merges import MERGES

    assert CLUSTER_METHODS == (
        "tree",
        "tree_2level",
        *(m for m in MERGES if m != "allreduce"),
        "ring",
        "ring_pass_q",
    )


def test_crossover_interpolates_and_says_none():
    lens = [64, 256, 1024]
    assert crossover(lens, [2.0, 2.0, 2.0], [1.0, 4.0, 16.0]) == pytest.approx(128.0)
    assert crossover(lens, [1.0, 1.0, 1.0], [2.0, 3.0, 4.0]) is None  # tree always faster
    assert crossover(lens, [5.0, 5.0, 5.0], [2.0, 3.0, 4.0]) is None  # ring always faster


def test_bad_settings_exit_2_with_one_line():
    for args, words in (
        (["--nodes", "1"], "nodes"),
        (["--seq-len", "65"], "multiples of the 4 devices"),
        (["--heads", "6", "--kv-heads", "4"], "kv_heads"),
        (["--link-gbit", "0"], "--link-gbit"),
        (["--methods", "tree,bogus"], "bogus"),
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "tree_attention_edu",
                "cluster",
                "--nodes",
                "2",
                "--devices-per-process",
                "2",
                *args,
            ],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=WAIT,
        )
        lines = [s for s in done.stderr.splitlines() if s.strip()]
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and words in lines[0] and "Traceback" not in lines[0], lines
    with pytest.raises(ValueError, match="nodes"):
        ClusterConfig(nodes=1).check()


def test_without_privileges_exit_2_with_one_line():
    """No CAP_NET_ADMIN / CAP_SYS_ADMIN (dropped with capsh): one line, status 2."""
    if shutil.which("capsh") is None or os.geteuid() != 0:
        pytest.skip("needs root and capsh to drop the capabilities")
    cmd = (
        f"{sys.executable} -m tree_attention_edu cluster --nodes 2 "
        f"--devices-per-process 2 --seq-len 64 --prefix {PREFIX}"
    )
    done = subprocess.run(
        ["capsh", "--drop=cap_net_admin,cap_sys_admin", "--", "-c", cmd],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=WAIT,
    )
    lines = [s for s in done.stderr.splitlines() if s.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and "needs root" in lines[0] and "CAP_NET_ADMIN" in lines[0], lines


# ---------------------------------------------------------------------------------------
# A real run


@needs_root
def test_small_cluster_runs_tree_2level_and_ring(tmp_path):
    """2 nodes × 1 process × 2 devices: tree (flat), tree (2-level) and ring against an
    independent float64 reference, bytes per level against closed forms, the link rate
    changed live, and nothing left behind."""
    out = tmp_path / "cluster.json"
    links_before = root_links()
    t0 = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "tree_attention_edu",
            "cluster",
            *SMALL,
            "--methods",
            "tree,tree_2level,ring",
            "--link-gbit",
            "2,1",
            "--repeats",
            "1",
            "--sweep",
            "16,64",
            "--keep-outputs",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**ENV, "TMPDIR": str(tmp_path)},
        timeout=300,
    )
    elapsed = time.monotonic() - t0
    assert done.returncode == 0, done.stderr[-3000:]
    rep = json.loads(out.read_text())
    # What every process printed: each names itself and its node.
    for pid, node in ((0, 0), (1, 1)):
        assert f"[process {pid}/2 node {node}] jax.distributed up" in done.stdout
    # The answer, against a reference that shares nothing with the package.
    prob = benchmark.Problem(seq_len=64, q_heads=4, kv_heads=2, head_dim=16)
    q, k, v = benchmark.make_inputs(prob, seed=0)
    want = np_attention(q, k, v)
    for rate in rep["rates"]:
        assert set(rate["methods"]) == {"tree", "tree_2level", "ring"}
        for name, m in rate["methods"].items():
            np.testing.assert_allclose(
                np.array(m["output"]), want, rtol=2e-5, atol=2e-5, err_msg=name
            )
            assert m["max_abs_err"] <= 2e-5
            assert m["median_s"] > 0 and m["predicted_s"] > 0
    m = rep["methods"]
    # Bytes per level, from the compiled program: the tree's states are B·Tq·Hq·(Dv+1)·4
    # (sum) and B·Tq·Hq·4 (max); a ring of 2 sends each once, a ring of 4 2·3/4 of it.
    n = 1 * 1 * 4 * (16 + 1) * 4 + 1 * 1 * 4 * 4
    assert m["tree_2level"]["bytes_intra"] == n and m["tree_2level"]["bytes_inter"] == n
    assert m["tree"]["bytes_inter"] == pytest.approx(2 * 0.75 * n / 2)
    # The ring: 3 steps, K and V blocks of 16 keys × 2 heads × 16 × 4 B; 1 device in 2 crosses.
    block = 16 * 2 * 16 * 4
    # ...then the all-reduce that broadcasts shard 0's output (1 x 1 x 4 x 16 x 4 B): a ring
    # of 4 sends 2·3/4 of it, half of the devices across.
    out = 1 * 1 * 4 * 16 * 4
    assert m["ring"]["bytes_inter"] == 3 * 2 * block / 2 + 2 * 0.75 * out / 2
    assert m["ring"]["link_bytes"] == 3 * 2 * block + 2 * 0.75 * out
    # Two rates were set, and each level was fitted at each.
    assert [r["set_Bps"] for r in rep["rates"]] == [2e9 / 8, 1e9 / 8]
    for level in ("inter", "intra"):
        assert rep["links"][level]["alpha_s"] >= 0 and rep["links"][level]["beta_Bps"] > 0
    assert rep["links"]["inter"]["set_Bps"] == 2e9 / 8
    assert rep["config"]["nodes"] == 2 and rep["config"]["devices"] == 4
    # The crossover sweep, at the first rate: Tk=64 is the run's own length, 16 is timed anew.
    x = rep["crossover"]
    assert x["seq_lens"] == [16, 64] and set(x["measured_s"]) == {"tree", "tree_2level", "ring"}
    assert x["measured_s"]["ring"][1] == m["ring"]["median_s"] and len(x["model_grid"]) > 10
    assert {"tree_vs_ring", "tree_2level_vs_ring"} <= set(x)
    # Nothing left behind, and no interface of the machine's own namespace was touched.
    assert owned_anything() == []
    assert root_links() == links_before
    assert processes_with(str(tmp_path)) == []
    TEARDOWN.append(
        (
            "small run, success",
            done.returncode,
            elapsed,
            len(processes_with(str(tmp_path))),
            len(owned_anything()),
        )
    )


# ---------------------------------------------------------------------------------------
# Faults


class Launch:
    """A cluster launcher whose workers wait in the test hook."""

    def __init__(self, tmp_path, sleep="60"):
        env = {**ENV, ps.TEST_SLEEP_ENV: sleep, "TMPDIR": str(tmp_path)}
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tree_attention_edu",
                    "cluster",
                    *SMALL,
                    "--methods",
                    "tree",
                    "--link-gbit",
                    "1",
                ],
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        self.workers: list[int] = []

    def wait_for_workers(self) -> list[int]:
        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited early: {self.err.read_text()}")
            return self.out.read_text().count("test hook: sleeping") == 2

        wait_until(ready, WAIT, "workers to start")
        self.workers = children(self.proc.pid)
        assert len(self.workers) == 2, self.workers
        assert len(netns.owned(PREFIX)) == 3  # two nodes and the switch
        return self.workers

    def wait(self) -> tuple[int, list[str]]:
        code = self.proc.wait(timeout=WAIT)
        return code, [s for s in self.err.read_text().splitlines() if s.strip()]

    def left(self) -> list[int]:
        return [p for p in (self.proc.pid, *self.workers) if alive(p)]

    def cleanup(self) -> None:
        for pid in self.left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        netns.clear_leftovers(PREFIX)


@pytest.fixture
def launches():
    started: list[Launch] = []
    yield started
    for r in started:
        r.cleanup()


def check_clean(run: Launch, scenario: str, code, t0: float) -> None:
    elapsed = time.monotonic() - t0
    try:
        wait_until(lambda: not run.left() and not owned_anything(), 5, "teardown")
    finally:
        TEARDOWN.append((scenario, code, elapsed, len(run.left()), len(owned_anything())))
    assert not run.left() and owned_anything() == []


def one_line(lines: list[str], *words: str) -> None:
    lines = [s for s in lines if not s.startswith("cluster: note:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith("cluster: ") and "Traceback" not in lines[0], lines
    for w in words:
        assert w in lines[0], lines


@needs_root
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=["SIGINT", "SIGTERM", "SIGHUP"]
)
def test_launcher_signalled(sig, tmp_path, launches):
    run = Launch(tmp_path)
    launches.append(run)
    run.wait_for_workers()
    t0 = time.monotonic()
    os.kill(run.proc.pid, sig)
    code, lines = run.wait()
    assert code == 128 + sig
    one_line(lines, sig.name, "removed the namespaces")
    assert time.monotonic() - t0 < 10
    check_clean(run, f"launcher {sig.name}", code, t0)


@needs_root
def test_worker_crash(tmp_path, launches):
    run = Launch(tmp_path)
    launches.append(run)
    workers = run.wait_for_workers()
    t0 = time.monotonic()
    os.kill(workers[1], signal.SIGKILL)
    code, lines = run.wait()
    assert code == 1
    one_line(lines, "worker 1", "SIGKILL")
    check_clean(run, "worker killed (SIGKILL)", code, t0)


@needs_root
@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "watchdog"])
def test_launcher_killed_then_next_start_clears(pdeathsig, tmp_path, launches, monkeypatch):
    """SIGKILL of the launcher: its workers die with it (PR_SET_PDEATHSIG, or without it
    their watchdog thread); its namespaces stay until the next start, which removes them
    (by this prefix only) and goes on."""
    if not pdeathsig:
        monkeypatch.setitem(ENV, ps.TEST_NO_PDEATHSIG_ENV, "1")
    first = tmp_path / "first"
    first.mkdir()
    run = Launch(first)
    launches.append(run)
    workers = run.wait_for_workers()
    left_behind = netns.owned(PREFIX)
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGKILL)
    code, _ = run.wait()
    assert code == -signal.SIGKILL
    wait_until(lambda: not any(alive(w) for w in workers), 10, "the workers to die")
    assert netns.owned(PREFIX) == left_behind  # nobody could remove them ...
    assert sorted(netns.leftovers(PREFIX)) != []  # ... and they are known to be stale
    how = "" if pdeathsig else ", watchdog only"
    TEARDOWN.append(
        (
            f"launcher SIGKILL{how} (ns stay)",
            code,
            time.monotonic() - t0,
            len(run.left()),
            len(left_behind),
        )
    )
    second = tmp_path / "second"
    second.mkdir()
    nxt = Launch(second)
    launches.append(nxt)
    nxt.wait_for_workers()
    assert not set(left_behind) & set(netns.owned(PREFIX))  # the old ones are gone
    notes = [s for s in nxt.err.read_text().splitlines() if "leftover" in s]
    assert notes and all(n in notes[0] for n in left_behind), notes
    t1 = time.monotonic()
    os.kill(nxt.proc.pid, signal.SIGTERM)
    code, lines = nxt.wait()
    assert code == 128 + signal.SIGTERM
    one_line(lines, "SIGTERM")
    check_clean(nxt, f"next start clears them{how}, SIGTERM", code, t1)


def test_plan_makes_nothing_outside_its_namespaces():
    """Every command of the plan names one of the run's namespaces, each veth is created
    inside the namespaces it joins, and every link is shaped in both directions."""
    net, cmds = netns.plan(3, 5e8, prefix="tae-x", run_id="42")
    names = set(net.namespaces)
    assert names == {"tae-x-42-sw", "tae-x-42-n0", "tae-x-42-n1", "tae-x-42-n2"}
    for cmd in cmds:
        if cmd[:3] == ["ip", "netns", "add"]:
            assert cmd[3] in names
        elif cmd[:3] == ["ip", "link", "add"]:  # created in the node, its peer in the switch
            assert cmd[cmd.index("netns") + 1] in names and cmd[-1] == net.switch
        else:
            assert cmd[1] == "-n" and cmd[2] in names, cmd
    shaped = [(c[2], c[6]) for c in cmds if c[0] == "tc"]
    assert sorted(shaped) == sorted(net.shaped()) and len(shaped) == 2 * 3
    assert net.addresses == ["198.18.0.1", "198.18.0.2", "198.18.0.3"]
    assert netns.hosts_file(net, 2).splitlines()[1] == f"198.18.0.3 {net.hostname}"


def test_tbf_arguments():
    args = netns.tbf_args(1e9)
    assert args[:3] == ["tbf", "rate", "1000000000bit"]
    assert int(args[args.index("burst") + 1]) >= netns.MIN_BURST
    with pytest.raises(ValueError, match="rate"):
        netns.tbf_args(0)
    assert math.isclose(int(netns.tbf_args(8e9)[4]), 8e9 / 8 * netns.BURST_S)
