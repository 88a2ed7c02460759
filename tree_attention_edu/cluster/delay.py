"""A link with a set one-way delay, in user space: one TUN device per node and a forwarder.

This kernel has no delay qdisc (`netem`, `fq`, `cake`, `etf`, `taprio` are all missing), so
a delay cannot be set on a veth. Instead, with a delay (`netns.create(..., delay_s=D)`) the
nodes are not joined by veth pairs and a bridge. Each node's namespace holds one TUN device
(`TUN`) that carries the node's address, and so the route to the cluster's subnet; one
process, the forwarder, holds every node's TUN open. It reads each IP packet a node sends,
looks up its IPv4 destination among the nodes' addresses, and writes it into that node's
TUN `D` seconds after it read it:

    node 0 ns                       switch ns                         node 1 ns
    [tun0 198.18.0.1] --read--> forwarder: hold D --write--> [tun0 198.18.0.2]
     tbf (node -> forwarder)                                    tbf (node -> forwarder)

* **What is shaped.** The tbf of the set rate sits on each TUN's egress: a node *sends* at
  most R. What it receives is not shaped (a write into a TUN is the node's ingress, where
  Linux has no shaping qdisc). With 2 nodes each receiver has one sender, so this is the
  veth path's shaping; with more, several nodes may send to one at once (incast) faster
  than R.
* **Delay.** Every packet, either way, is held `D` after the forwarder reads it, so a
  message's round trip is 2D plus the path's own cost (measured: `probe`). The forwarder
  waits in `select` (microsecond timeouts, timer slack of 1 ns), so a packet is late by a
  scheduler wake-up: on this project's busy 2-core machine a round trip came out 0.05 to
  0.25 ms over 2D (`results/cluster/README.md`). D = 0 still goes through the forwarder,
  which is how its own overhead is measured (about 10 to 30 us a round trip there).
* **Order.** A packet's deadline is its arrival + D, so packets leave in the order they
  came (ties broken by arrival number): each link stays FIFO, as TCP expects of a wire.
* **Memory.** At most `MAX_HELD_BYTES` are held; beyond that a packet is dropped, as a
  switch with a full buffer would, and counted (TCP retransmits it).
* **MTU.** A TUN device has no segmentation offload unless asked for (`IFF_VNET_HDR`), so
  TCP's segments are the MTU: `TUN_MTU` = 65,000 B makes each read and write move up to
  64 kB, as the veth path's GSO packets do, and the per-packet cost of a Python loop small.
  Measured there, the forwarder sustains 0.6 to 1.2 GB/s (5 to 10 Gbit/s): above that, the
  forwarder and not the tbf sets the rate.

Lifecycle: `netns.create` makes the TUN devices (persistent, `ip tuntap add` inside each
node's namespace), then `start` runs the forwarder (`python -m tree_attention_edu.cli.
forwarder`) inside the switch namespace; it attaches to each TUN by entering that node's
namespace (`setns`), returns to its own, and says it is ready. `netns.destroy` stops it
before it deletes the namespaces; the TUN devices vanish with them. The forwarder dies with
its launcher (`processes.guard_parent`: PR_SET_PDEATHSIG and a watchdog), and lives in the
switch namespace, so that the removal of a killed run's leftovers kills it too.

Pure parts (`ipv4_destination`, `DelayLine`) need no privilege; the rest needs root.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import heapq
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field

from . import processes as ps

TUN = "tun0"  # a node's interface when its link has a delay, inside its namespace
TUN_MTU = 65000  # no GSO on a TUN: one 64 kB TCP segment per read/write (see above)
MAX_DELAY_MS = 200.0  # a long intercontinental path; more only grows the buffers
MAX_HELD_BYTES = 64 << 20  # held packets, all links: 1 Gbit/s x 200 ms is 25 MB
READ_SIZE = 65536  # above the largest IPv4 packet
READ_BATCH = 64  # packets read from one TUN per wake-up before due ones are written
READY = "ready"  # the forwarder's first line on stdout
START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 2.0
FORWARDER_MODULE = "tree_attention_edu.cli.forwarder"
CLONE_NEWNET = 0x40000000
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
PR_SET_TIMERSLACK = 29


class ForwarderError(RuntimeError):
    """The forwarder could not start or attach (the message is one line)."""


# ---------------------------------------------------------------------------------------
# Pure parts


def ipv4_destination(packet: bytes) -> bytes | None:
    """The 4-byte destination address of an IPv4 packet; None for anything else (IPv6,
    a truncated header), which the forwarder drops."""
    if len(packet) < 20 or packet[0] >> 4 != 4 or (packet[0] & 0x0F) < 5:
        return None
    return packet[16:20]


@dataclass
class DelayLine:
    """Packets held until their deadline (arrival + `delay_s`), released in deadline order;
    equal deadlines keep their arrival order, so every link stays FIFO. Holds at most
    `max_bytes`: `push` refuses (and counts) a packet beyond that."""

    delay_s: float
    max_bytes: int = MAX_HELD_BYTES
    held_bytes: int = 0
    dropped: int = 0
    _heap: list[tuple[float, int, int, bytes]] = field(default_factory=list, repr=False)
    _seq: int = 0

    def push(self, now: float, dest: int, packet: bytes) -> bool:
        """Hold `packet` for `dest` until `now + delay_s`; False if it was dropped."""
        if self.held_bytes + len(packet) > self.max_bytes:
            self.dropped += 1
            return False
        heapq.heappush(self._heap, (now + self.delay_s, self._seq, dest, packet))
        self._seq += 1
        self.held_bytes += len(packet)
        return True

    def due(self, now: float) -> list[tuple[int, bytes]]:
        """Every `(dest, packet)` whose deadline is `now` or earlier, oldest first."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, _, dest, packet = heapq.heappop(self._heap)
            self.held_bytes -= len(packet)
            out.append((dest, packet))
        return out

    def timeout(self, now: float) -> float | None:
        """Seconds until the next deadline (0 if one is due); None when nothing is held."""
        return max(0.0, self._heap[0][0] - now) if self._heap else None

    def __len__(self) -> int:
        return len(self._heap)


# ---------------------------------------------------------------------------------------
# The forwarder process


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def enter_netns(path: str) -> None:
    """Move this thread into the network namespace at `path` (`/run/netns/NS` or
    `/proc/self/ns/net`); sockets and TUN devices opened afterwards belong to it. Python
    3.11 has no `os.setns`, hence libc."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if _libc().setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


@contextlib.contextmanager
def inside(namespace: str):
    """Run the body in network namespace `namespace` (by name), then return to this one."""
    own = os.open("/proc/self/ns/net", os.O_RDONLY)
    try:
        enter_netns(os.path.join("/run/netns", namespace))
        try:
            yield
        finally:
            if _libc().setns(own, CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), "setns back to this process's namespace")
    finally:
        os.close(own)


def attach(namespace: str, name: str = TUN) -> int:
    """A non-blocking fd of the TUN device `name` in `namespace`: reads give the IP packets
    the node sends, writes deliver packets to it."""
    with inside(namespace):  # the device is looked up in the namespace of the open
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
        except OSError:
            os.close(fd)
            raise
    return fd


@dataclass
class Counts:
    """What the forwarder did, for its exit line."""

    packets: int = 0
    bytes: int = 0
    unroutable: int = 0
    write_errors: int = 0


def _read_into(fd: int, line: DelayLine, routes: dict[bytes, int], now: float, c: Counts) -> None:
    """Read up to `READ_BATCH` packets from `fd` into the delay line."""
    for _ in range(READ_BATCH):
        try:
            packet = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return
        dest = routes.get(ipv4_destination(packet) or b"")
        if dest is None:
            c.unroutable += 1
        elif line.push(now, dest, packet):
            c.packets += 1
            c.bytes += len(packet)


def serve(fds: list[int], addresses: list[bytes], delay_s: float, counts: Counts) -> None:
    """Forward forever: a packet read from any of `fds` whose destination is
    `addresses[j]` is written to `fds[j]` `delay_s` after it was read."""
    routes = {a: j for j, a in enumerate(addresses)}
    line = DelayLine(delay_s)
    while True:
        ready, _, _ = select.select(fds, [], [], line.timeout(time.monotonic()))
        now = time.monotonic()
        for fd in ready:
            _read_into(fd, line, routes, now, counts)
        for dest, packet in line.due(time.monotonic()):
            try:
                os.write(fds[dest], packet)
            except OSError:  # the node's device is gone or refused it: the packet is lost
                counts.write_errors += 1


def forwarder_main(spec: dict) -> int:
    """The forwarder process (`cli/forwarder.py`): attach to every node's TUN, say ready on
    stdout, forward until killed; on SIGTERM, one line of counts on stderr."""
    _libc().prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)  # wake-ups at the deadline, not 50 us on
    fds = [attach(ns, spec.get("tun", TUN)) for ns in spec["namespaces"]]
    addresses = [bytes(int(b) for b in a.split(".")) for a in spec["addresses"]]
    counts = Counts()

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(0)

    # The handler before "ready": a stop that follows at once still gets its counts line.
    signal.signal(signal.SIGTERM, stop)
    print(READY, flush=True)
    try:
        serve(fds, addresses, float(spec["delay_s"]), counts)
    finally:
        print(
            f"forwarder: {counts.packets} packets ({counts.bytes} B) forwarded, "
            f"{counts.unroutable} unroutable, {counts.write_errors} lost on write",
            file=sys.stderr,
            flush=True,
        )
    return 0


# ---------------------------------------------------------------------------------------
# Launcher side


def start(
    switch: str, namespaces: list[str], addresses: list[str], delay_s: float, log: str
) -> subprocess.Popen:
    """Start the forwarder inside namespace `switch` between the TUNs of `namespaces`
    (whose nodes have `addresses`), its stderr in the file `log`, and wait until it has
    attached to every one. Raises `ForwarderError` (one line) if it does not."""
    spec = json.dumps(
        {"namespaces": namespaces, "addresses": addresses, "delay_s": delay_s, "tun": TUN}
    )
    cmd = ["ip", "netns", "exec", switch, sys.executable, "-m", FORWARDER_MODULE, spec]
    with open(log, "wb") as err:
        proc = subprocess.Popen(
            cmd, env=ps.worker_env(), stdout=subprocess.PIPE, stderr=err, start_new_session=True
        )
    assert proc.stdout is not None
    with proc.stdout:
        ready, _, _ = select.select([proc.stdout], [], [], START_TIMEOUT_S)
        line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
    if line != READY:
        stop(proc)
        why = ps.worker_summary(log).strip(" ()") or last_line(log)
        raise ForwarderError(
            f"the delay forwarder did not start within {START_TIMEOUT_S:g} s"
            + (f": {why}" if why else "")
        )
    return proc


def last_line(log: str) -> str:
    """The last non-empty line of the file `log` ('' if none)."""
    with contextlib.suppress(OSError), open(log, errors="replace") as f:
        lines = [s.strip() for s in f.read().splitlines() if s.strip()]
        return lines[-1] if lines else ""
    return ""


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the forwarder (it prints its counts), SIGKILL it if it lingers; reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
