"""What one worker of a cluster run knows: the run's `Settings` (as the launcher writes
them) and, once `jax.distributed` is up, its `Context`: its process id and node, the two
meshes over the same devices, each device's node, and the lines it has told.

The two meshes take the devices in (process, id) order, so that each node's devices are
neighbours:

* `two`, `("node", "gpu")` of shape `(nodes, processes_per_node · devices_per_process)`:
  with `seq_axes=("node", "gpu")` the tree's Allreduces run over "gpu" (inside each node)
  first, then over "node" (across the slow links);
* `flat`, `("x",)` over all devices: one Allreduce over every device, which gloo runs as one
  ring whose every step waits for the ring's inter-node hops.

The K/V cache is sharded identically on both (device i holds keys `[i·t, (i+1)·t)`).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from typing import TYPE_CHECKING, TextIO

from . import processes as ps

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from ..perf.benchmark import Problem


MAX_WARMUP_ROUNDS = 100
"""The most untimed rounds a run may ask for before each set of timed ones (`Settings`)."""


@dataclasses.dataclass
class Settings:
    """The run's settings, as the launcher writes them into each worker's spec."""

    nodes: int
    processes_per_node: int
    devices_per_process: int
    coordinator: str
    rates_bps: list[float]
    seq_len: int
    methods: list[str]
    repeats: int
    sweep: list[int]
    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    seed: int
    init_timeout: float
    control: str
    keep_outputs: bool = False
    warmup_rounds: int = 0  # untimed rounds before the timed ones (a spec without it: none)

    @property
    def processes(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def devices(self) -> int:
        return self.processes * self.devices_per_process

    def problem(self, seq_len: int) -> Problem:
        """The decoded problem at KV length `seq_len`: one query, float32."""
        from ..perf.benchmark import Problem

        return Problem(
            seq_len=seq_len,
            batch=self.batch,
            q_len=1,
            q_heads=self.q_heads,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
        )


@dataclasses.dataclass
class Context:
    """One process's place in the run: its settings `s`, id `pid` and node, the meshes
    `two` and `flat`, the node of every device, and its story (`say`, kept in `lines`)."""

    s: Settings
    pid: int
    out: TextIO
    two: Mesh
    flat: Mesh
    node_of_device: list[int]
    lines: list[str] = dataclasses.field(default_factory=list)

    @property
    def node(self) -> int:
        return self.pid // self.s.processes_per_node

    def node_of(self, i: int) -> int:
        return self.node_of_device[i]

    def say(self, text: str) -> None:
        """One line of this process's story, prefixed by who tells it."""
        line = f"[process {self.pid}/{self.s.processes} node {self.node}] {text}"
        self.lines.append(line)
        print(line, file=self.out, flush=True)


def start(s: Settings, pid: int, out: TextIO, lines: list[str]) -> Context:
    """Join the run (`jax.distributed` over gloo, this process simulating
    `devices_per_process` CPU devices) and build the two meshes; says what it holds (to
    `out`, and into `lines`)."""
    import jax

    from ..core.devices import make_mesh

    jax.config.update("jax_num_cpu_devices", s.devices_per_process)
    jax.config.update("jax_enable_x64", True)  # for nothing but the checks; inputs f32
    t0 = time.perf_counter()
    ps.initialize_distributed(s.coordinator, s.processes, pid, s.init_timeout)
    up_s = time.perf_counter() - t0
    k = s.processes_per_node * s.devices_per_process
    two = make_mesh((s.nodes, k), ("node", "gpu"))
    flat = make_mesh(s.devices, "x")
    devices = list(two.devices.flat)
    assert devices == list(flat.devices.flat)  # the same order on both meshes
    nodes = [d.process_index // s.processes_per_node for d in devices]
    ctx = Context(s, pid, out, two, flat, nodes, lines)
    mine = [d.id for d in jax.local_devices()]
    ctx.say(
        f"jax.distributed up in {up_s:.1f} s: {jax.process_count()} processes, "
        f"{jax.device_count()} devices; mine: {mine} (gloo over {os.uname().nodename} -> "
        f"{_my_address()})"
    )
    where = [
        f"{i} (node {nodes[i]}, gpu {i % k})"
        for i, d in enumerate(devices)
        if d.process_index == pid
    ]
    ctx.say(
        f"mesh ('node', 'gpu') = {tuple(two.devices.shape)}; my devices at mesh positions "
        f"{', '.join(where)}"
    )
    return ctx


def _my_address() -> str:
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "?"
