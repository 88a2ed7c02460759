"""The command line: argument checks (in-process, no JAX work), help, version, the main
demonstration and generation. The multi-process launcher is tested in test_launch.py."""

import argparse
import importlib.metadata
import json
import subprocess
import sys

import pytest

import tree_attention_edu as tae
from tree_attention_edu import cli
from tree_attention_edu.cli import memory
from tree_attention_edu.cli import plumbing as cl
from tree_attention_edu.cluster import processes as ps
from tree_attention_edu.perf import benchmark

ENV = ps.child_env()  # XLA_FLAGS less a device count: the CLI sets its own


def run_cli(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "tree_attention_edu", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Run in a scratch folder: checking a default output path may create its folder."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def call(argv, capsys):
    """`cli.main(argv)` in-process: (exit status, stderr lines)."""
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    return code, [line for line in err.splitlines() if line.strip()]


# (argv, the text the one error line must contain). Every case exits with status 2 before
# any work starts. `{file}` is an existing file and `{dir}` an existing folder.
BAD_FLAGS = [
    # demo (the problem flags are shared with bench)
    ("demo --devices 0", "--devices"),
    ("demo --devices -1", "--devices"),
    ("demo --devices 100000", "--devices"),
    ("demo --devices many", "--devices"),
    ("demo --seq-len 0", "--seq-len"),
    ("demo --seq-len -5", "--seq-len"),
    ("demo --seq-len 1.5", "--seq-len"),
    ("demo --seq-len 1e12", "GB of memory"),
    ("demo --heads 0", "--heads"),
    ("demo --heads 1e12", "GB of memory"),
    ("demo --head-dim 0", "--head-dim"),
    ("demo --batch 0", "--batch"),
    ("demo --repeats 0", "--repeats"),
    ("demo --dtype float64", "--dtype"),
    ("demo --mesh 3d", "--mesh"),
    ("demo --mesh 2level --devices 3", "--mesh 2level needs an even --devices"),
    ("demo --figure fig.nope", "--figure"),
    ("demo --figure {dir}", "--figure"),
    ("demo --figure {file}/fig.png", "--figure"),
    ("demo --no-such-flag", "--no-such-flag"),
    # bench
    ("bench --methods foo", "--methods"),
    ("bench --methods tree,foo", "'foo'"),
    ("bench --methods ,", "--methods"),
    ("bench --seq-lens ''", "--seq-lens"),
    ("bench --seq-lens 1,,2", "--seq-lens"),
    ("bench --seq-lens 0,5", "--seq-lens"),
    ("bench --seq-lens 1e12", "--seq-lens: needs about"),
    ("bench --seq-len 1e12", "--seq-len: needs about"),
    ("bench --seq-len 5 --seq-lens 4,5", "--seq-lens"),
    ("bench --sections foo", "--sections"),
    ("bench --sections bandwidth,calibrate", "'calibrate'"),
    ("bench --sections patterns,foo", "'foo'"),
    ("bench --methods ring_pass_q,ring_pass_k", "'ring_pass_k'"),
    ("bench --calibration-seq-lens -1", "--calibration-seq-lens"),
    ("bench --calibration-seq-lens 1e11", "--calibration-seq-lens: needs about"),
    ("bench --json {file}/bench.json", "--json"),
    ("bench --json {dir}", "--json"),
    ("bench --repeats -3", "--repeats"),
    # generate
    ("generate --method foo", "--method"),
    ("generate --method ''", "--method"),
    ("generate --prefill-method foo", "--prefill-method"),
    ("generate --prompt-len 0", "--prompt-len"),
    ("generate --prompt-len 1e9 --batch 100", "--prompt-len"),
    ("generate --new-tokens 0", "--new-tokens"),
    ("generate --new-tokens 1e9", "--new-tokens: needs about"),
    ("generate --batch 0", "--batch"),
    ("generate --prefill-chunk 0", "--prefill-chunk"),
    ("generate --temperature -1", "--temperature"),
    ("generate --temperature nan", "--temperature"),
    ("generate --temperature inf", "--temperature"),
    ("generate --temperature hot", "--temperature"),
    ("generate --seed -1", "--seed"),
    ("generate --vocab 0", "--vocab"),
    ("generate --vocab 1e9", "--vocab"),
    ("generate --preset huge", "--preset"),
    ("generate --devices 0", "--devices"),
    ("generate --mesh 2level --devices 5", "--mesh 2level"),
    # generate with a checkpoint
    ("generate --checkpoint {dir} --prompt-ids 1,2", "has no config.json"),
    ("generate --checkpoint {file} --prompt-ids 1", "does not start with the GGUF magic"),
    ("generate --chat --prompt-ids 1", "--chat: formats text prompts"),
    ("generate --checkpoint {dir} --prompt hi --chat", "--chat: needs a chat template"),
    ("generate --checkpoint {dir}", "give the prompts"),
    ("generate --prompt-ids 1,2", "--prompt-ids: needs --checkpoint"),
    ("generate --prompt hello", "--prompt: needs --checkpoint"),
    ("generate --prompt-ids 1,x", "--prompt-ids"),
    ("generate --prompt-ids ''", "--prompt-ids"),
    ("generate --prompt-ids -1", "--prompt-ids"),
    ("generate --prompt a --prompt-ids 1", "not allowed with"),
    ("generate --checkpoint {dir} --prompt-ids 1 --vocab 5", "--vocab: sets the random"),
    ("generate --checkpoint {dir} --prompt-ids 1 --preset tiny", "--preset"),
    ("generate --dtype bfloat16", "--dtype: is the dtype of a checkpoint"),
    ("generate --dtype float16", "--dtype"),
    ("generate --json {dir}", "--json"),
    # launch
    ("launch --processes 0", "--processes"),
    ("launch --devices-per-process 0", "--devices-per-process"),
    ("launch --processes 100 --devices-per-process 100", "--devices-per-process"),
    ("launch --seq-len 0", "--seq-len"),
    ("launch --seq-len 1e12", "--seq-len"),
    ("launch --timeout 0", "--timeout"),
    ("launch --timeout nan", "--timeout"),
    ("launch --port 70000", "--port"),
    ("launch --cluster --port 1234", "--port"),
    ("launch --cluster --seq-len 1e12", "--seq-len/--processes: needs about"),
    # fetch-model: the folder is checked before the download
    ("fetch-model --cache ''", "`cache` is empty"),
    ("fetch-model --cache {file}", "is a file, not a folder"),
    ("fetch-model --cache {file}/models", "cannot be used as a folder"),
    # cluster: tc's token bucket has a smallest rate
    ("cluster --link-gbit 1e-300", "--link-gbit"),
    ("cluster --seq-len 1e12", "--seq-len: needs about"),
    ("cluster --sweep 16,1e12", "--sweep: needs about"),
    ("cluster --warmup-rounds -1", "--warmup-rounds: must be an integer >= 0"),
    ("cluster --warmup-rounds 1e30", "warmup_rounds must be an int in [0, 100]"),
    ("cluster --probe 0 --warmup-rounds 2", "does not use --warmup-rounds"),
    ("cluster --slurm --warmup-rounds 0", "does not use --warmup-rounds"),
    # calibrate: meshes, lengths, band; --json and --band only with --check
    ("calibrate --meshes 2x", "--meshes"),
    ("calibrate --meshes 8,0", "--meshes"),
    ("calibrate --meshes 100000", "--meshes"),
    ("calibrate --check --seq-lens 4", "--seq-lens 4 leaves devices"),
    ("calibrate --check --seq-lens 1e12", "GB of memory"),
    ("calibrate --check --band 0", "--band"),
    ("calibrate --check --band nan", "--band"),
    ("calibrate --json out.json", "--json is for --check"),
    ("calibrate --check --json {dir}", "--json"),
    # the command itself
    ("", "COMMAND"),
    ("frobnicate", "frobnicate"),
]


@pytest.mark.parametrize("argv, names", BAD_FLAGS, ids=[a or "(none)" for a, _ in BAD_FLAGS])
def test_bad_flags_fail_in_one_line(argv, names, in_tmp, capsys):
    (in_tmp / "a_file").write_text("x")
    (in_tmp / "a_dir").mkdir()
    args = [
        a.replace("{file}", str(in_tmp / "a_file")).replace("{dir}", str(in_tmp / "a_dir"))
        for a in argv.split()
    ]
    args = ["" if a == "''" else a for a in args]
    code, lines = call(args, capsys)
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("tree-attention-edu") and ": error: " in lines[0], lines
    assert names in lines[0], lines
    assert "Traceback" not in lines[0]
    assert sorted(in_tmp.iterdir()) == [in_tmp / "a_dir", in_tmp / "a_file"]  # nothing written


def test_bad_flags_as_a_real_process():
    """The console entry point prints one line and exits 2, no traceback."""
    r = run_cli("demo", "--devices", "0", timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "tree-attention-edu demo: error: argument --devices: must be a positive integer, "
        "got '0' (see 'tree-attention-edu demo --help')"
    ]


@pytest.mark.parametrize(
    "exc, code, text",
    [
        (
            ValueError("`scale` must be a finite number, got nan.\nmore detail"),
            1,
            "tree-attention-edu: error: `scale` must be a finite number, got nan.",
        ),
        (
            TypeError("`mesh` must be a jax.sharding.Mesh"),
            1,
            "tree-attention-edu: error: `mesh` must be a jax.sharding.Mesh",
        ),
        (
            RuntimeError("RESOURCE_EXHAUSTED: out of memory"),
            1,
            "tree-attention-edu: error: RuntimeError: RESOURCE_EXHAUSTED: out of memory (set "
            "TREE_ATTENTION_EDU_TRACEBACK=1 for the traceback)",
        ),
        (
            cl.CommandFailed("three-way agreement FAILED"),
            1,
            "tree-attention-edu: error: three-way agreement FAILED",
        ),
        (KeyboardInterrupt(), 130, "tree-attention-edu: interrupted"),
    ],
)
def test_run_time_errors_are_one_line(exc, code, text, monkeypatch, capsys, in_tmp):
    def boom(args):
        raise exc

    monkeypatch.delenv(cl.TRACEBACK_ENV, raising=False)
    monkeypatch.setattr(cli.demo, "run", boom)
    assert call(["demo"], capsys) == (code, [text])


def test_traceback_on_request(monkeypatch, in_tmp):
    monkeypatch.setenv(cl.TRACEBACK_ENV, "1")
    monkeypatch.setattr(cli.demo, "run", lambda args: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli.main(["demo"])


def test_too_many_devices_for_a_started_jax_is_one_line(capsys, in_tmp):
    """JAX already runs with 8 devices here, so 16 cannot be simulated: a run-time error."""
    import jax

    jax.devices()  # start the backends
    code, lines = call(["demo", "--devices", "16", "--figure", ""], capsys)
    assert code == 1 and len(lines) == 1 and lines[0].startswith("tree-attention-edu: error:")
    assert "Traceback" not in lines[0]


def test_too_many_devices_on_an_accelerator_says_what_to_pass(monkeypatch):
    """On a one-GPU machine the default --devices 8 cannot be simulated there: the error says
    which --devices runs on the GPU and how to simulate CPU devices instead (measured on an
    H200, where it was make_mesh's CPU advice)."""
    import jax

    from tree_attention_edu.cli import common

    monkeypatch.setattr(jax, "device_count", lambda: 1)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(
        RuntimeError,
        match=r"--devices 8: JAX's default backend is gpu, with 1 "
        r"device\(s\); pass --devices 1 .* JAX_PLATFORMS=cpu",
    ):
        common.setup(argparse.Namespace(devices=8))


def parsed(argv, monkeypatch) -> argparse.Namespace:
    """The arguments a subcommand would run with (checked), without running it."""
    seen = {}
    module = {c.NAME: c for c in cli.COMMANDS}[argv[0]]
    monkeypatch.setattr(module, "run", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(argv) == 0
    return seen["args"]


def test_bench_honours_seq_len(monkeypatch, in_tmp):
    assert parsed(["bench"], monkeypatch).seq_lens == [65536]
    assert parsed(["bench", "--seq-len", "1024"], monkeypatch).seq_lens == [1024]
    assert parsed(["bench", "--seq-lens", "1024,2048"], monkeypatch).seq_lens == [1024, 2048]
    assert parsed(["bench", "--seq-len", "512", "--seq-lens", "512"], monkeypatch).seq_lens == [512]
    args = parsed(["bench", "--sections", "", "--methods", "tree,ring,tree"], monkeypatch)
    assert args.sections == [] and args.methods == ["tree", "ring"]
    assert parsed(["bench"], monkeypatch).calibration_seq_lens == [16384, 32768, 65536, 131072]
    assert parsed(["bench"], monkeypatch).sections == ["bandwidth", "calibration"]
    assert parsed(["bench", "--sections", "patterns"], monkeypatch).sections == ["patterns"]


def test_generate_and_launch_defaults(monkeypatch, in_tmp):
    args = parsed(["generate", "--temperature", "0.5", "--seed", "7"], monkeypatch)
    assert args.method == ["tree"] and args.temperature == 0.5 and args.seed == 7
    args = parsed(["launch", "--timeout", "30", "--port", "0"], monkeypatch)
    assert (args.processes, args.devices_per_process, args.timeout, args.cluster) == (
        2,
        4,
        30.0,
        False,
    )


def test_launch_cluster_is_reachable(monkeypatch, in_tmp):
    """`launch --cluster` (what srun starts) runs one process of the SLURM run in-process."""
    from tree_attention_edu.cluster import launch

    seen = []
    monkeypatch.setattr(launch, "slurm_worker", lambda seq_len: seen.append(seq_len) or 0)
    assert cli.main(["launch", "--cluster", "--seq-len", "1048576"]) == 0
    assert seen == [1048576]


def test_memory_names_the_flag_that_weighs_most():
    """The refused flag is the largest part's: new tokens or the prompts, each by the cache
    positions and logits it adds (`generate --new-tokens 1e9` named --prompt-len/--batch)."""
    from tree_attention_edu.llama.model import PRESETS

    def need(prompt_len, new_tokens):
        return memory.generation(
            PRESETS["tiny"],
            ("--vocab", 1),
            ("--prompt-len", prompt_len),
            batch=3,
            prefill_chunk=512,
            new_tokens=new_tokens,
            devices=8,
            runs=2,
            what="",
        )

    assert need(1024, 10**9).flag == "--new-tokens"
    assert need(10**9, 32).flag == "--prompt-len"
    big = need(1024, 10**9)
    # The cache twice at every position, the logits of every run's new tokens and one more.
    positions = memory.capacity(1024, 512, 10**9, 8)
    cfg = PRESETS["tiny"]
    cache = cfg.layers * 2 * 3 * cfg.kv_heads * positions * cfg.head_dim * 4
    assert big.total == 1 + 2 * cache + 4 * 3 * cfg.vocab * (2 * 10**9 + 1)


def test_memory_of_a_model_counts_its_weights():
    """`weight_count` reads the random model's shapes from `init_params` without starting
    JAX's devices."""
    import math

    import jax

    from tree_attention_edu.llama.model import PRESETS, init_params

    cfg = PRESETS["small"]
    params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    assert memory.weight_count(cfg) == sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    assert 25e6 < memory.weight_count(cfg) < 30e6  # "~30M parameters"


def test_launch_memory_is_the_launch_problems():
    """The launch check sizes the problem every worker decodes (`launch_problem`)."""
    from tree_attention_edu.cluster.launch import launch_problem

    p = launch_problem(4096)
    need = memory.workers({"--seq-len": p}, 2)
    assert p.kv_bytes == 2 * p.batch * 4096 * p.kv_heads * p.head_dim * 4
    assert need.total == 2 * (4 * p.kv_bytes + memory.RUNTIME_BYTES)


def test_output_paths_are_checked_without_leaving_files(in_tmp, monkeypatch):
    args = parsed(["bench", "--json", "deep/er/bench.json"], monkeypatch)
    assert args.json == "deep/er/bench.json"
    assert (in_tmp / "deep" / "er").is_dir() and not (in_tmp / "deep/er/bench.json").exists()
    (in_tmp / "old.json").write_text("keep")
    parsed(["bench", "--json", "old.json"], monkeypatch)
    assert (in_tmp / "old.json").read_text() == "keep"


def test_every_option_has_help_and_help_shows_defaults(capsys):
    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subs.choices) == {
        "demo",
        "bench",
        "calibrate",
        "generate",
        "speed",
        "fetch-model",
        "launch",
        "cluster",
        "student",
        "grade",
    }
    for name, sub in [("", parser), *subs.choices.items()]:
        for action in sub._actions:
            assert action.help, (name, action.option_strings or action.dest)
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "(default: 8)" in out and "(default: 65536)" in out and "(default: float32)" in out
    with pytest.raises(SystemExit):
        cli.main(["launch", "--help"])
    out = capsys.readouterr().out
    assert "--cluster" in out and "--port" in out and "(default: 120.0)" in out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    want = importlib.metadata.version("tree_attention_edu")
    assert capsys.readouterr().out.strip() == f"tree-attention-edu {want}"


def test_python_dash_m_runs_the_cli():
    r = run_cli("--version", timeout=120)
    assert r.returncode == 0, r.stderr
    want = importlib.metadata.version("tree_attention_edu")
    assert r.stdout.strip() == f"tree-attention-edu {want}"


def test_method_lists_are_the_packages():
    """One registry each: the flags offer exactly the package's methods."""
    from tree_attention_edu.llama import model

    assert cli.generate.METHODS is model.METHODS
    assert cli.bench.METHODS is benchmark.METHODS


def test_benchmark_pads_a_length_the_devices_do_not_divide():
    """`demo --devices 3` used to fail placing K/V (IndivisibleError): 100 keys on 3 devices."""
    import tree_attention_edu as tae

    problem = benchmark.Problem(seq_len=100, q_heads=2, kv_heads=2, head_dim=8)
    records = benchmark.run(tae.make_mesh(3, "x"), problem, methods=("tree", "xla_auto"), repeats=1)
    assert [r.method for r in records] == ["tree", "xla_auto"]
    for r in records:
        assert r.devices == 3 and r.seq_len == 100 and r.max_abs_err < 1e-5, r


@pytest.mark.slow
@pytest.mark.cpu_only  # 8 simulated CPU devices
def test_demo_small(tmp_path):
    fig = tmp_path / "fig.png"
    r = run_cli(
        "demo",
        "--seq-len",
        "2048",
        "--heads",
        "4",
        "--head-dim",
        "32",
        "--repeats",
        "1",
        "--figure",
        str(fig),
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "softmax vs grad_zeta F(0)" in r.stdout and "17/17" in r.stdout
    for method in ("single", "tree", "tree_energy", "ring"):
        assert f"\n{method} " in r.stdout
    assert fig.stat().st_size > 10_000


@pytest.mark.slow
@pytest.mark.cpu_only  # 8 simulated CPU devices
def test_bench_json_records(tmp_path):
    path = tmp_path / "bench.json"
    r = run_cli(
        "bench",
        "--seq-lens",
        "1024,2048",
        "--heads",
        "2",
        "--head-dim",
        "16",
        "--repeats",
        "1",
        "--mesh",
        "2level",
        "--json",
        str(path),
        "--calibration-seq-lens",  # the records' lengths: their programs, compiled once
        "1024,2048",
        "--sections",
        "bandwidth,calibration,patterns",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(path.read_text())
    records = report["records"]
    assert {r["method"] for r in records} == set(benchmark.METHODS)
    assert {r["seq_len"] for r in records} == {1024, 2048}
    fields = {
        "method",
        "devices",
        "seq_len",
        "median_s",
        "collective_bytes",
        "temp_bytes",
        "max_abs_err",
        "argument_bytes",
    }
    for rec in records:
        assert fields <= set(rec)
        assert rec["max_abs_err"] < 1e-4, rec
    by = {(r["method"], r["seq_len"]): r for r in records}
    # Tree bytes do not grow with Tk; the ring's K/V blocks double with it (its output
    # broadcast, 1 x 1 x 2 heads x 16 x 4 bytes, does not).
    assert by[("tree", 1024)]["collective_bytes"] == by[("tree", 2048)]["collective_bytes"]
    out = 2 * 16 * 4
    assert by[("ring", 2048)]["collective_bytes"] - out == 2 * (
        by[("ring", 1024)]["collective_bytes"] - out
    )

    bw = report["bandwidth"]
    assert bw["machine_read_gbs"] > 0
    assert {"xla_bthd", "xla_bhtd", "einsum_reference", "tree_bhtd"} <= set(bw["kernels"])
    for k in bw["kernels"].values():
        assert k["kv_bytes"] == 2 * 2048 * 2 * 16 * 4
        assert k["fraction"] == pytest.approx(k["gbs"] / bw["machine_read_gbs"])
    assert "machine read bandwidth" in r.stdout and "of machine" in r.stdout

    dev = report["device"]
    assert set(dev) == {"platform", "kind", "jax_version", "nominal_gbs", "measured_gbs"}
    assert dev["platform"] == "cpu" and dev["nominal_gbs"] is None and dev["measured_gbs"] > 0
    for k in bw["kernels"].values():
        assert k["frac_measured"] == pytest.approx(k["gbs"] / dev["measured_gbs"])
        assert k["frac_nominal"] is None
    assert "read bandwidth measured" in r.stdout and "of measured" in r.stdout

    cal = report["calibration"]
    assert {(c["method"], c["seq_len"]) for c in cal} == {
        (m, n) for m in ("tree", "ring") for n in (1024, 2048)
    }
    for c in cal:
        assert c["devices"] == 8 and c["predicted_s"] > 0 and c["measured_s"] > 0
    assert "worst |error|" in r.stdout

    # Every merge pattern and both rings, measured in the same run.
    pats = report["patterns"]
    assert [(x["name"], x["seq_len"]) for x in pats] == [
        (m, n) for n in (1024, 2048) for m in benchmark.PATTERNS
    ]
    assert set(benchmark.PATTERNS) == {*tae.MERGES, "ring", "ring_pass_q"}
    fields = {
        "name",
        "devices",
        "seq_len",
        "collectives",
        "collective_bytes",
        "temp_bytes",
        "median_s",
        "predicted_s",
        "max_abs_err",
    }
    for x in pats:
        assert fields <= set(x) and x["devices"] == 8, x
        assert x["max_abs_err"] < 1e-4 and x["median_s"] > 0 and x["predicted_s"] > 0, x
        assert x["fast_path"] == (x["name"] == "one_pass"), x
    pat = {(x["name"], x["seq_len"]): x for x in pats}
    for n in (1024, 2048):  # the same programs as the method records: the same bytes
        assert pat[("allreduce", n)]["collective_bytes"] == by[("tree", n)]["collective_bytes"]
        assert pat[("ring", n)]["collective_bytes"] == by[("ring", n)]["collective_bytes"]
        assert pat[("ring", n)]["collectives"] == {"collective-permute": 2 * 7, "all-reduce": 1}
        # one Allreduce(sum) where allreduce has two, on each level of the 2-level mesh
        one, two = pat[("one_pass", n)]["collectives"], pat[("allreduce", n)]["collectives"]
        assert set(one) == set(two) == {"all-reduce"} and 2 * one["all-reduce"] == two["all-reduce"]
    assert "Patterns:" in r.stdout and "(fast path)" in r.stdout


@pytest.mark.cpu_only
def test_generate_checks_tokens():
    r = run_cli(
        "generate",
        "--method",
        "ring",
        "--mesh",
        "2level",
        "--prompt-len",
        "40",
        "--new-tokens",
        "6",
        "--prefill-chunk",
        "16",
        "--prefill-method",
        "tree",
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tokens identical to single-device generation: True" in r.stdout
    assert "prefill (tree)" in r.stdout and "prefill (single)" in r.stdout
    assert "tokens/s" in r.stdout and "per-token latency" in r.stdout


# --- generate --checkpoint ----------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A bf16, tied, llama3-scaled checkpoint in two shards, with a tokenizer of its vocab."""
    import llama_reference as ref

    path = tmp_path_factory.mktemp("ckpt")
    config = ref.tiny_config(tied=True, llama3=True)
    ref.write_checkpoint(path, config, ref.random_weights(config, 7), "bfloat16", 2)
    ref.write_tokenizer(path, 64)
    return path


@pytest.mark.cpu_only
def test_generate_from_a_checkpoint_matches_the_reference(tiny_checkpoint, in_tmp, capsys):
    """Ragged --prompt-ids, --json: the tokens and first logits of the float64 reference."""
    import llama_reference as ref
    import numpy as np

    prompts = [[1, 5, 9, 3, 7, 20, 33, 40, 2, 11], [4, 8, 15]]
    argv = [
        "generate",
        "--checkpoint",
        str(tiny_checkpoint),
        "--method",
        "tree",
        "--no-check",
        "--new-tokens",
        "5",
        "--prefill-chunk",
        "8",
        "--json",
        "out.json",
    ]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "prompt 2: [" in out and "wrote out.json" in out
    report = json.loads((in_tmp / "out.json").read_text())
    assert report["prompts"] == prompts and report["method"] == "tree"
    config, weights = ref.read_checkpoint(tiny_checkpoint)
    for b, prompt in enumerate(prompts):
        tokens, logits = ref.greedy(config, weights, prompt, 5)
        assert report["tokens"][b] == tokens.tolist()
        assert len(report["logits_last"][b]) == 64
        err = np.abs(np.array(report["logits_last"][b]) - logits[0]).max()
        assert err < 3e-6 * np.abs(logits[0]).max(), err
    assert report["methods"]["tree"]["tokens"] == report["tokens"]


@pytest.mark.cpu_only
def test_generate_text_through_the_tokenizer(tiny_checkpoint, in_tmp, capsys):
    assert (
        cli.main(
            [
                "generate",
                "--checkpoint",
                str(tiny_checkpoint),
                "--prompt",
                "w5 w17 w63 w8",
                "--new-tokens",
                "3",
                "--method",
                "single",
                "--prefill-chunk",
                "8",
                "--json",
                "out.json",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    report = json.loads((in_tmp / "out.json").read_text())
    assert report["prompts"] == [[1, 5, 17, 63, 8]]  # <s> prepended by the tokenizer
    text = " ".join(f"w{t}" for t in report["tokens"][0] if t >= 3)
    assert report["text"] == [text] and f"'<s> w5 w17 w63 w8' -> '{text}'" not in out
    assert f"'w5 w17 w63 w8' -> '{text}'" in out


@pytest.mark.parametrize(
    "name, change, message",
    [
        (
            "heads",
            lambda c, w: c.update(num_key_value_heads=3),
            "num_attention_heads (4) must be a multiple of num_key_value_heads (3)",
        ),
        (
            "missing-tensor",
            lambda c, w: w.pop("model.norm.weight"),
            "`model.norm.weight` is missing from the checkpoint",
        ),
        (
            "dtype",
            lambda c, w: w.update({"model.norm.weight": w["model.norm.weight"].astype("i1")}),
            "has dtype I8, which the loader cannot read",
        ),
        (
            "token-id",
            lambda c, w: None,
            "token id 64 (prompt 1, position 1) is outside the checkpoint's vocabulary [0, 64)",
        ),
    ],
)
def test_generate_refuses_a_malformed_checkpoint_in_one_line(
    name, change, message, tmp_path, capsys
):
    import llama_reference as ref

    config = ref.tiny_config()
    weights = ref.random_weights(config, 0)
    change(config, weights)
    extra = {k: v for k, v in weights.items() if v.dtype.kind == "i"}
    ref.write_checkpoint(
        tmp_path, config, {k: v for k, v in weights.items() if k not in extra}, extra=extra
    )
    code, lines = call(
        [
            "generate",
            "--checkpoint",
            str(tmp_path),
            "--prompt-ids",
            "1,64" if name == "token-id" else "1,2",
        ],
        capsys,
    )
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("tree-attention-edu generate: error: ") and message in lines[0]
    assert "Traceback" not in lines[0]


# --- the device block of the bench JSON (benchmark.device_info) -------------------------------


@pytest.mark.parametrize(
    ("kind", "gbs"),
    [
        ("NVIDIA H100 80GB HBM3", 3350),
        ("NVIDIA H100 PCIe", 2000),
        ("NVIDIA H100 NVL", 3900),
        ("NVIDIA H200", 4800),
        ("NVIDIA A100-SXM4-80GB", 2039),
        ("NVIDIA A100-SXM4-40GB", 1555),
        ("NVIDIA A100-PCIE-40GB", 1555),
        ("NVIDIA A100 80GB PCIe", 1935),
        ("NVIDIA B200", 8000),
        ("AMD Instinct MI300X", 5300),
        ("NVIDIA GH200 480GB", None),
        ("cpu", None),
        ("TPU v5 lite", None),
    ],
)
def test_nominal_hbm_gbs(kind, gbs):
    assert benchmark.nominal_hbm_gbs(kind) == gbs


@pytest.mark.cpu_only
def test_device_info_on_cpu():
    dev = benchmark.device_info(nbytes=32 * 2**20, repeats=3)
    assert set(dev) == {"platform", "kind", "jax_version", "nominal_gbs", "measured_gbs"}
    assert dev["platform"] == "cpu" and isinstance(dev["kind"], str)
    assert dev["nominal_gbs"] is None and isinstance(dev["measured_gbs"], float)
    assert dev["measured_gbs"] > 0
    import jax

    assert dev["jax_version"] == jax.__version__
    assert benchmark.device_info(measure=False)["measured_gbs"] is None
    json.dumps(dev)  # plain JSON values


def test_device_fractions():
    ks = {"a": {"gbs": 50.0}, "b": {"gbs": 10.0}}
    benchmark.device_fractions(ks, {"measured_gbs": 100.0, "nominal_gbs": 200.0})
    assert ks["a"] == {"gbs": 50.0, "frac_measured": 0.5, "frac_nominal": 0.25}
    benchmark.device_fractions(ks, {"measured_gbs": 100.0, "nominal_gbs": None})
    assert ks["b"]["frac_measured"] == 0.1 and ks["b"]["frac_nominal"] is None


def test_gpu_bench_script_rejects_bad_args(capsys):
    """scripts/gpu_bench.py: a usage error is one line and exit status 2 (its `--quick` run,
    a sweep on tiny sizes, is exercised by hand: see results/gpu/README.md)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent.parent / "scripts" / "gpu_bench.py"
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for argv in (
        ["--dtypes", "int8"],
        ["--seq-lens", "0"],
        ["--attach", "nofile"],
        ["--max-kv-fraction", "2"],
        ["--kernels", "xla,"],
    ):
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("gpu_bench.py: error: argument"), err


@pytest.mark.parametrize(
    "rel_err, regret, code, miss",
    [
        (0.2, 0.10, 0, None),
        (0.31, 0.0, 1, "ring on 8 at Tk=4096"),
        (0.2, 0.11, 1, "auto on 2x4 at Tk=4096"),
    ],
)
def test_calibrate_check_exits_1_when_a_cell_or_a_regret_misses(
    monkeypatch, capsys, tmp_path, rel_err, regret, code, miss
):
    """`calibrate --check` exits 1 when the report holds a failure (a cell outside ±30% or a
    regret over 10%) and 0 when it holds none, naming the miss; the model check itself is
    stubbed (it is a benchmark, not a unit test)."""
    from tree_attention_edu.perf import modelcheck

    def fake_run(meshes, seq_lens, repeats, progress):
        cell = modelcheck.Cell("ring", "8", 4096, 1.0 + rel_err, 1.0, rel_err)
        row = modelcheck.AutoRow("2x4", 4096, 1, 8, 8, "allgather", "all_to_all", regret)
        return modelcheck.Report([cell], [row], {})

    monkeypatch.setattr(modelcheck, "run", fake_run)
    out = tmp_path / "check.json"
    got, err = call(["calibrate", "--check", "--json", str(out)], capsys)
    assert got == code
    assert json.loads(out.read_text())["auto"][0]["regret"] == regret
    assert (miss is None) or any(miss in line for line in err)
