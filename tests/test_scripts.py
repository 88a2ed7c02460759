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
