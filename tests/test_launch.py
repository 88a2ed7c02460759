"""The multi-process launcher: a real run, and every fault leaves no process behind.

Each fault test starts `python -m tree_attention_edu launch` with two tiny workers that the
`TAE_LAUNCH_TEST_SLEEP` hook keeps waiting, inflicts the fault, and then checks the exit
status, the one line on stderr, how long the launcher took, and that no worker (by pid) and
no member of a worker's process group is left. The measured table is printed at the end
of the module (`pytest -s` or `-rA` to see it).
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from tree_attention_edu.cluster import launch
from tree_attention_edu.cluster import processes as ps

ENV = ps.child_env()  # XLA_FLAGS less a device count: the CLI sets its own
WAIT = 120  # generous: slow start-up on a loaded machine is not what is tested
FAULT_TABLE: list[tuple[str, object, float, int]] = []


@pytest.fixture(scope="module", autouse=True)
def fault_table(request):
    yield
    if not FAULT_TABLE:
        return
    rows = [f"{'scenario':<34}{'exit status':>12}{'time to exit':>14}{'processes left':>16}"]
    rows += [f"{s:<34}{c!s:>12}{t:>13.2f}s{n:>16}" for s, c, t, n in FAULT_TABLE]
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        print("\n" + "\n".join(rows), flush=True)


# ---------------------------------------------------------------------------------------
# /proc helpers


def stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, pgrp, session) of `pid`, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[2]), int(fields[3])


def all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def alive(pid: int) -> bool:
    """Exists and is not a zombie (a zombie holds no resources; its parent may be init)."""
    s = stat(pid)
    if s is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return s[0] != "Z"


def children(pid: int) -> list[int]:
    return [p for p in all_pids() if (s := stat(p)) and s[1] == pid]


def left_over(pids: list[int]) -> list[int]:
    """Live processes among `pids`, or in the process group or session of one of them."""
    groups = set(pids)

    def ours(p):
        s = stat(p)
        return s is not None and (p in groups or s[2] in groups or s[3] in groups)

    return sorted(p for p in all_pids() if ours(p) and alive(p))


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------
# A launch with waiting workers


class Run:
    def __init__(self, tmp_path, *args, sleep="60", processes=2):
        self.tmp = tmp_path
        env = {**ENV, ps.TEST_SLEEP_ENV: sleep, "TMPDIR": str(tmp_path)}
        self.out, self.err = tmp_path / "stdout", tmp_path / "stderr"
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tree_attention_edu",
                    "launch",
                    "--processes",
                    str(processes),
                    "--devices-per-process",
                    "1",
                    "--seq-len",
                    "64",
                    *args,
                ],
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
            )
        self.processes = processes
        self.workers: list[int] = []

    def wait_for_workers(self) -> list[int]:
        """Until every worker sits in the test hook (its guards are then in place)."""

        def ready():
            if self.proc.poll() is not None:
                raise AssertionError(f"launcher exited early: {self.err.read_text()}")
            return self.out.read_text().count("test hook: sleeping") == self.processes

        wait_until(ready, WAIT, "workers to start")
        self.workers = children(self.proc.pid)
        assert len(self.workers) == self.processes, self.workers
        return self.workers

    def wait(self) -> tuple[int, list[str]]:
        code = self.proc.wait(timeout=WAIT)
        return code, [s for s in self.err.read_text().splitlines() if s.strip()]

    def pids(self) -> list[int]:
        return [self.proc.pid, *self.workers]

    def cleanup(self) -> None:
        for pid in left_over(self.pids()):
            os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for r in started:
        r.cleanup()


def check_clean(run: Run, scenario: str, code, t0: float) -> None:
    elapsed = time.monotonic() - t0
    # Everything the run started must be gone at once (a short grace for the kernel).
    try:
        wait_until(lambda: not left_over(run.pids()), 5, "the run's processes to go")
    finally:
        FAULT_TABLE.append((scenario, code, elapsed, len(left_over(run.pids()))))
    assert not left_over(run.pids())


def one_error_line(lines: list[str], *words: str) -> None:
    assert len(lines) == 1, lines
    assert lines[0].startswith("launch: "), lines
    assert "Traceback" not in lines[0]
    for w in words:
        assert w in lines[0], lines


# ---------------------------------------------------------------------------------------
# Faults


@pytest.mark.parametrize(
    "sig, words",
    [(signal.SIGKILL, ["worker 1", "SIGKILL"]), (signal.SIGSTOP, ["worker 1", "stopped"])],
    ids=["SIGKILL", "SIGSTOP"],
)
def test_worker_killed_or_stopped(sig, words, tmp_path, runs):
    run = Run(tmp_path)
    runs.append(run)
    workers = run.wait_for_workers()
    t0 = time.monotonic()
    os.kill(workers[1], sig)
    code, lines = run.wait()
    assert code == 1
    one_error_line(lines, *words)
    assert time.monotonic() - t0 < 10  # detected in a fraction of a second; slack for load
    check_clean(run, f"worker {sig.name}", code, t0)


@pytest.mark.parametrize(
    "sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"]
)
def test_launcher_signalled(sig, tmp_path, runs):
    run = Run(tmp_path)
    runs.append(run)
    run.wait_for_workers()
    t0 = time.monotonic()
    os.kill(run.proc.pid, sig)
    code, lines = run.wait()
    assert code == 128 + sig
    one_error_line(lines, sig.name)
    assert time.monotonic() - t0 < 10
    check_clean(run, f"launcher {sig.name}", code, t0)


@pytest.mark.parametrize("pdeathsig", [True, False], ids=["pdeathsig", "watchdog"])
def test_launcher_killed(pdeathsig, tmp_path, runs, monkeypatch):
    """SIGKILL of the launcher: the workers die with it (PR_SET_PDEATHSIG), or, without
    that, their watchdog thread sees the parent change and exits."""
    if not pdeathsig:
        monkeypatch.setitem(ENV, ps.TEST_NO_PDEATHSIG_ENV, "1")
    run = Run(tmp_path)
    runs.append(run)
    workers = run.wait_for_workers()
    t0 = time.monotonic()
    os.kill(run.proc.pid, signal.SIGKILL)
    code, _ = run.wait()
    assert code == -signal.SIGKILL
    wait_until(lambda: not any(alive(w) for w in workers), 10, "the workers to die")
    check_clean(run, "launcher SIGKILL" + ("" if pdeathsig else " (watchdog only)"), code, t0)


def test_overall_timeout(tmp_path, runs):
    """A worker that never gets going (the hook sleeps 60 s) is stopped by --timeout."""
    run = Run(tmp_path, "--timeout", "4", sleep="1:60")
    runs.append(run)
    t0 = time.monotonic()
    code, lines = run.wait()
    assert code == 1
    one_error_line(lines, "timed out after 4 s")
    check_clean(run, "hung worker, --timeout 4", code, t0)
    assert time.monotonic() - t0 < 30


def test_init_timeout(tmp_path, runs):
    """jax.distributed gives up on a missing peer after --init-timeout, not 300 s."""
    run = Run(tmp_path, "--init-timeout", "3", "--timeout", "100", sleep="1:60")
    runs.append(run)
    t0 = time.monotonic()
    code, lines = run.wait()
    assert code == 1
    one_error_line(lines, "worker 0", "jax.distributed: DEADLINE_EXCEEDED")
    check_clean(run, "hung worker, --init-timeout 3", code, t0)
    assert time.monotonic() - t0 < 60


def test_explicit_port_in_use(tmp_path, runs):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = Run(tmp_path, "--port", str(port))
        runs.append(run)
        t0 = time.monotonic()
        code, lines = run.wait()
    assert code == 1
    one_error_line(lines, f"port {port}", "in use")
    check_clean(run, "--port already in use", code, t0)


def test_worker_failure_summary(monkeypatch, capfd, tmp_path):
    """A worker that exits non-zero stops the others; its exit status is in the one line."""
    real_popen = subprocess.Popen

    def popen(cmd, **kw):
        if cmd[-1].endswith("worker1.json"):  # `python -m tree_attention_edu.cli.worker SPEC`
            cmd = [
                sys.executable,
                "-c",
                f"import sys; print('{ps.WORKER_ERROR} ValueError: bad', "
                "file=sys.stderr); sys.exit(3)",
            ]
        return real_popen(cmd, **kw)

    monkeypatch.setenv(ps.TEST_SLEEP_ENV, "60")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept worker logs
    monkeypatch.setattr(subprocess, "Popen", popen)
    assert launch.run_local(processes=2, devices_per_process=1, seq_len=64, timeout=60) == 1
    lines = [s for s in capfd.readouterr().err.splitlines() if s.startswith("launch")]
    one_error_line(lines, "worker 1", "exited with status 3", "ValueError: bad")
    # The failed run's folder keeps each worker's spec and log.
    (kept,) = tmp_path.glob("tae-launch-*")
    spec = ps.WorkerSpec.read(str(kept / "worker0.json"))
    assert spec.role == "launch" and spec.process_id == 0
    assert launch.LocalRun(**spec.settings).seq_len == 64


def test_worker_entry_point_fails_in_one_line(tmp_path):
    """`python -m tree_attention_edu.cli.worker`: without a spec, a usage line and status 2;
    with a bad one, the one line the launcher quotes (`WORKER_ERROR`) and status 1."""

    def worker(*args):
        return subprocess.run(
            [sys.executable, "-m", ps.WORKER_MODULE, *args],
            capture_output=True,
            text=True,
            env=ENV,
            timeout=WAIT,
        )

    done = worker()
    assert done.returncode == 2 and done.stderr.startswith("usage: python -m "), done.stderr
    bad = tmp_path / "spec.json"
    bad.write_text('{"role": "launch", "process_id": 0, "settings": {"processes": 2}}')
    done = worker(str(bad))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"{ps.WORKER_ERROR} TypeError: "), lines


def test_bad_launch_arguments():
    with pytest.raises(ValueError, match="must be >= 1"):
        launch.run_local(processes=0)
    with pytest.raises(ValueError, match="timeout"):
        launch.run_local(timeout=float("nan"))
    with pytest.raises(ValueError, match="port"):
        launch.run_local(port=70000)


@pytest.mark.slow
def test_multi_process_launch_retries_a_taken_port(monkeypatch, capfd):
    """A real run (2 processes x 4 devices) whose first port is taken by someone else
    between the launcher's pick and the coordinator's bind: worker 0 says so, and the
    launcher retries with another port."""
    real_bind = launch._bind
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()

    class Taken:  # what the launcher "holds": a port that another process has meanwhile
        def getsockname(self):
            return busy.getsockname()

        def close(self):
            pass

    calls = []

    def bind(port):
        calls.append(port)
        return Taken() if len(calls) == 1 else real_bind(port)

    monkeypatch.setattr(launch, "_bind", bind)
    port = busy.getsockname()[1]
    try:
        code = launch.run_local(processes=2, devices_per_process=4, seq_len=1000, timeout=240)
    finally:
        busy.close()
    out, err = capfd.readouterr()
    assert code == 0, err
    assert f"port {port} on 127.0.0.1 is in use" in err and "retrying with another port" in err
    assert out.count(" OK") == 4 and "MISMATCH" not in out


def test_children_keep_xla_flags_but_the_device_count(monkeypatch):
    """A child sets its own device count; a CPU cap or an optimisation level passes on."""
    monkeypatch.setenv(
        "XLA_FLAGS",
        "--xla_cpu_max_isa=SSE4_2 --xla_force_host_platform_device_count=8 "
        "--xla_backend_optimization_level=0",
    )
    want = "--xla_cpu_max_isa=SSE4_2 --xla_backend_optimization_level=0"
    assert ps.child_env()["XLA_FLAGS"] == want
    assert ps.worker_env()["XLA_FLAGS"] == want
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    assert "XLA_FLAGS" not in ps.child_env()
    monkeypatch.delenv("XLA_FLAGS")
    assert "XLA_FLAGS" not in ps.worker_env()
