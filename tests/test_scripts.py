"""Two of the GPU scripts run on a CPU at tiny sizes, so that an API they call cannot rot between
the rare sessions with a GPU (`scripts/gpu_bench.py` called a kernel helper the core move
had renamed, and nothing noticed until a GPU was lent)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.cpu_only  # the quick run's CPU facts (cudnn via xla, simulated devices)
def test_gpu_bench_quick_writes_its_record(tmp_path):
    out = tmp_path / "quick.json"
    bench = _load("gpu_bench")
    assert (
        bench.main(
            [
                "--quick",
                "--shapes",
                "gqa8_2x32_b2",
                "--seq-lens",
                "256",
                "--dtypes",
                "float32",
                "--kernels",
                "xla_bhtd,cudnn,flash,tree_decode",
                "--repeats",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["config"]["complete"] is True
    assert set(report["device"]) == {
        "platform",
        "kind",
        "jax_version",
        "nominal_gbs",
        "measured_gbs",
    }
    records = report["bandwidth"]["kernels"]
    assert {r["kernel"] for r in records.values()} == {
        "xla_bhtd",
        "cudnn_via_xla",
        "flash",
        "tree_decode",
    }
    timed = [r for r in records.values() if "gbs" in r]
    assert len(timed) == 3 and all(r["gbs"] > 0 and r["median_s"] > 0 for r in timed)
    assert "needs a CUDA GPU" in records["flash float32 gqa8_2x32_b2 Tk=256"]["skipped"]


@pytest.mark.cpu_only  # the quick run's CPU facts (cudnn via xla, simulated devices)
def test_gpu_checks_quick_compares_the_gradients(tmp_path, capsys):
    out = tmp_path / "grads.json"
    assert _load("gpu_checks").main(["--quick", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["implementation"] == "xla" and report["within_tolerance"] is True
    assert report["shape"]["kv_lengths"] == [155, 256]  # the last of 4 chunks is empty
    diffs = report["relative_max_abs_difference"]
    assert set(diffs) == {"cudnn vs xla", "cudnn vs float32 reference", "xla vs float32 reference"}
    assert all(0 < e < 2e-2 for row in diffs.values() for e in row.values())


def test_latency_sweep_runs_one_cluster_per_delay_and_fits_the_slopes(tmp_path, monkeypatch):
    """`scripts/latency_sweep.py` (root and namespaces in real use): one `cluster` command
    per delay, each with its own `--link-delay-ms`, read back and fitted by
    `collectives.delay_sweep`; here the commands are faked, with 3 delays per step."""
    sweep = _load("latency_sweep")
    seen = []

    def fake_run(cmd, **_):
        d = float(cmd[cmd.index("--link-delay-ms") + 1])
        seen.append(d)
        t = 0.004 + 3 * d / 1e3
        method = {
            "median_s": 2 * t,  # the slowest process's median: not what the sweep fits
            "mean_s": t,
            "predicted_s": t * 1.1,
            "collectives": {"all-reduce": 1},
        }
        rep = {
            "config": {"link_delay_ms": d, "command": " ".join(cmd)},
            "links": {"inter": {"alpha_s": 2 * d / 1e3}},
            "methods": {"tree": method},
        }
        Path(cmd[cmd.index("--json") + 1]).write_text(json.dumps(rep))
        return type("Done", (), {"returncode": 0, "stdout": "", "stderr": ""})()

    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    out = tmp_path / "sweep.json"
    assert sweep.main(["--delays", "0,5,10", "--repeats", "3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert seen == [0.0, 5.0, 10.0] and list(doc["reports"]) == ["0.0", "5.0", "10.0"]
    tree = doc["methods"]["tree"]
    assert tree["delays_per_step"] == pytest.approx(3.0)
    assert tree["predicted_delays_per_step"] == pytest.approx(3.3)
    assert doc["layout"] == "2x2x1" and len(doc["load_average_1min_before_after"]) == 3
    assert "--repeats 3" in doc["command"] and "3 interleaved rounds" in doc["note"]
    assert doc["measured_as"] == "mean_s" and "the mean over every process's rounds" in doc["note"]
    assert tree["rel_err"] == pytest.approx([0.1] * 3)
    for bad in ("0,x", "0,0.01", "-1,2", "5"):  # argparse's own error: exit 2, one line
        with pytest.raises(SystemExit) as exit_:
            sweep.main(["--delays", bad, "--json", str(out)])
        assert exit_.value.code == 2
    for bad in ("2x2", "2x0x1", "axbxc"):  # the layout, parsed by cli.plumbing.layout
        with pytest.raises(SystemExit) as exit_:
            sweep.main(["--layout", bad, "--json", str(out)])
        assert exit_.value.code == 2
    seen.clear()
    assert sweep.main(["--layout", "4x1x1", "--delays", "0,5", "--json", str(out)]) == 0
    cmd = json.loads(out.read_text())["reports"]["5.0"]["config"]["command"].split()
    assert cmd[cmd.index("--nodes") + 1 : cmd.index("--nodes") + 6] == [
        "4", "--processes-per-node", "1", "--devices-per-process", "1"
    ]  # fmt: skip
    assert json.loads(out.read_text())["layout"] == "4x1x1"
    collectives = _load("latency_collectives")
    with pytest.raises(SystemExit) as exit_:  # one node: nothing crosses a link
        collectives.main(["--layout", "1x2x2", "--json", str(out)])
    assert exit_.value.code == 2
