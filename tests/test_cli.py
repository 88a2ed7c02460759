"""The command line, the main demonstration and the real multi-process launch."""

import json
import os
import subprocess
import sys

import pytest

from tree_attention_edu import benchmark, launch

ENV = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "tree_attention_edu.cli", *args],
                          capture_output=True, text=True, timeout=timeout, env=ENV)


@pytest.mark.slow
def test_demo_small(tmp_path):
    fig = tmp_path / "fig.png"
    r = run_cli("demo", "--seq-len", "2048", "--heads", "4", "--head-dim", "32",
                "--repeats", "1", "--figure", str(fig))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "softmax vs grad_zeta F(0)" in r.stdout and "17/17" in r.stdout
    for method in ("single", "tree", "tree_energy", "ring"):
        assert f"\n{method} " in r.stdout
    assert fig.stat().st_size > 10_000


@pytest.mark.slow
def test_bench_json_records(tmp_path):
    path = tmp_path / "bench.json"
    r = run_cli("bench", "--seq-lens", "1024,2048", "--heads", "2", "--head-dim", "16",
                "--repeats", "1", "--mesh", "2level", "--json", str(path),
                "--calibration-seq-lens", "1024,3072")
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(path.read_text())
    records = report["records"]
    assert {r["method"] for r in records} == set(benchmark.METHODS)
    assert {r["seq_len"] for r in records} == {1024, 2048}
    fields = {"method", "devices", "seq_len", "median_s", "collective_bytes", "temp_bytes",
              "max_abs_err"}
    for rec in records:
        assert fields <= set(rec)
        assert rec["max_abs_err"] < 1e-4, rec
    by = {(r["method"], r["seq_len"]): r for r in records}
    # Tree bytes do not grow with Tk; ring bytes double with it.
    assert by[("tree", 1024)]["collective_bytes"] == by[("tree", 2048)]["collective_bytes"]
    assert by[("ring", 2048)]["collective_bytes"] == 2 * by[("ring", 1024)]["collective_bytes"]

    bw = report["bandwidth"]
    assert bw["machine_read_gbs"] > 0
    assert {"xla_bthd", "xla_bhtd", "einsum_reference", "tree_bhtd"} <= set(bw["kernels"])
    for k in bw["kernels"].values():
        assert k["kv_bytes"] == 2 * 2048 * 2 * 16 * 4
        assert k["fraction"] == pytest.approx(k["gbs"] / bw["machine_read_gbs"])
    assert "machine read bandwidth" in r.stdout and "of machine" in r.stdout

    cal = report["calibration"]
    assert {(c["method"], c["seq_len"]) for c in cal} == {
        (m, n) for m in ("tree", "ring") for n in (1024, 3072)}
    for c in cal:
        assert c["devices"] == 8 and c["predicted_s"] > 0 and c["measured_s"] > 0
    assert "worst |error|" in r.stdout


def test_generate_checks_tokens():
    r = run_cli("generate", "--method", "ring", "--mesh", "2level", "--prompt-len", "40",
                "--new-tokens", "6", "--prefill-chunk", "16", "--prefill-method", "tree")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens identical to single-device generation: True" in r.stdout
    assert "prefill (tree)" in r.stdout and "prefill (single)" in r.stdout
    assert "tokens/s" in r.stdout and "per-token latency" in r.stdout


@pytest.mark.slow
def test_multi_process_launch():
    code = launch.run_local(processes=2, devices_per_process=4, seq_len=1000, timeout=240)
    assert code == 0


def test_launch_reports_a_failing_worker(monkeypatch):
    """A worker that dies makes the launcher stop the others and exit non-zero."""
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        if "--process-id" in cmd and cmd[cmd.index("--process-id") + 1] == "1":
            cmd = [sys.executable, "-c", "import sys; sys.exit(3)"]
        return real_popen(cmd, **kw)

    monkeypatch.setattr(launch.subprocess, "Popen", popen)
    assert launch.run_local(processes=2, devices_per_process=1, seq_len=64, timeout=60) == 1


def test_bad_launch_arguments():
    with pytest.raises(ValueError, match="must be >= 1"):
        launch.run_local(processes=0)


def test_generate_methods_match_the_model():
    from tree_attention_edu import cli, model

    assert sorted(cli.GENERATE_METHODS) == sorted(model.METHODS)
