"""Network namespaces: the nodes of a cluster on one machine, joined by shaped links.

One network namespace per node (its own interfaces, addresses, routes and ports) and one
more for the switch. Nothing is created in the machine's own namespace: every interface is
born inside the namespace it belongs to. Two kinds of link:

* **veth** (the default): the switch is a Linux bridge, with one veth pair per node, one end
  in the node's namespace, the other a port of the bridge.

      node 0 ns                    switch ns                    node 1 ns
      [uplink0 198.18.0.1] ==veth== [port0]-br0-[port1] ==veth== [uplink0 198.18.0.2]
       tbf (node -> switch)         tbf (switch -> node)          tbf ...

  Every link is shaped in both directions by a token-bucket filter (`tc qdisc ... tbf rate
  R`) on the egress of each veth end: a node sends at most R and receives at most R, as a
  switch port of rate R. Its latency is what the kernel gives (about 10 us for a round
  trip); the worker measures it.
* **delayed** (`delay_s=D`, the CLI's `--link-delay-ms`): this kernel has no delay qdisc
  (`netem` and the like are missing), so each node gets a TUN device instead of a veth, and
  a forwarder process in the switch namespace holds every packet D before it delivers it
  (`delay`). The tbf sits on each TUN's egress: a node sends at most R; what it receives
  is not shaped (the same for 2 nodes). D = 0 still goes through the forwarder.

Addresses come from 198.18.0.0/15 (RFC 2544: reserved for benchmarking interconnects), and
only the namespaces' interfaces carry them: the workers talk only to each other.
`ip netns exec NS` bind-mounts `/etc/netns/NS/hosts` over `/etc/hosts`; there this machine's
host name resolves to the node's own address (on its veth or its TUN), which is how gloo
picks its interface.

Ownership: every name starts with `PREFIX-<run id>-`, and the run holds an exclusive lock on
`LOCK_DIR/PREFIX-<run id>.lock` while it lives. A run killed with SIGKILL leaves its
namespaces behind (its forwarder dies with it, as its workers do); the next run
(`clear_leftovers`) deletes those whose lock nobody holds, chosen by that prefix only, and
kills what still runs inside them. A TUN device lives and dies with its namespace. Concurrent
runs do not disturb each other.

Needs root (CAP_NET_ADMIN for links and qdiscs, CAP_SYS_ADMIN for the namespaces' mounts);
`missing_privileges` says what is missing.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from . import delay as dl
from . import processes as ps

PREFIX = "tae-cl"
SUBNET = "198.18.0.0/24"
LOCK_DIR = "/run/tae-cluster"
ETC_NETNS = "/etc/netns"
RUN_NETNS = "/run/netns"
UPLINK = "uplink0"  # a node's interface, inside its namespace
BRIDGE = "br0"  # the switch, inside the switch namespace
MIN_BURST = 128 * 1024  # tbf bucket: above a 64 KB GSO packet, so none is split
BURST_S = 0.001  # ... and at least 1 ms of traffic at the rate
QUEUE_S = 0.1  # tbf queue: 100 ms at the rate before it drops
CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21
TCP_BUFFER_MAX = 64 << 20  # TCP's largest buffers in a delayed network's nodes


class NetworkError(RuntimeError):
    """A namespace, link or qdisc could not be made (the message is one line)."""


class NoPrivilege(NetworkError):
    """This process may not create network namespaces (not root, or capabilities missing)."""


def _capabilities() -> int | None:
    """This process's effective capability set (Linux), or None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except OSError:
        pass
    return None


def missing_privileges() -> str | None:
    """Why this process cannot build a cluster of namespaces, in one line; None if it can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not on PATH; install iproute2"
    caps = _capabilities()
    need = {"CAP_NET_ADMIN": CAP_NET_ADMIN, "CAP_SYS_ADMIN": CAP_SYS_ADMIN}
    if caps is None:
        if os.geteuid() != 0:
            return "creating network namespaces needs root; run it as root (e.g. with sudo)"
        return None
    lacking = [name for name, bit in need.items() if not caps >> bit & 1]
    if lacking:
        return (
            f"creating network namespaces needs root ({' and '.join(lacking)} missing "
            f"from this process); run it as root (e.g. with sudo)"
        )
    return None


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode:
        why = next((s.strip() for s in done.stderr.splitlines() if s.strip()), "")
        raise NetworkError(f"`{' '.join(cmd)}` failed: {why or f'status {done.returncode}'}")
    return done


def tbf_args(rate_bps: float) -> list[str]:
    """`tc` arguments of a token-bucket filter of `rate_bps` bits per second."""
    if not rate_bps > 0:
        raise ValueError(f"the link rate must be positive bits per second, got {rate_bps!r}")
    burst = max(MIN_BURST, int(rate_bps / 8 * BURST_S))
    return [
        "tbf",
        "rate",
        f"{int(rate_bps)}bit",
        "burst",
        str(burst),
        "latency",
        f"{int(QUEUE_S * 1000)}ms",
    ]


@dataclass
class Network:
    """What `create` made: `nodes` namespaces joined by a switch, and the lock that owns them."""

    prefix: str
    run_id: str
    nodes: int
    addresses: list[str]
    rate_bps: float
    hostname: str
    delay_s: float | None = None  # None: veth pairs and a bridge; else TUNs and a forwarder
    _lock: TextIO | None = field(default=None, repr=False)
    _forwarder: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def base(self) -> str:
        return f"{self.prefix}-{self.run_id}"

    def node(self, i: int) -> str:
        """The namespace of node `i`."""
        return f"{self.base}-n{i}"

    def host(self, i: int) -> str:
        """Node `i`'s host name, as a cluster's node list names it: its namespace's name
        (every node's hosts file resolves it to the node's address; `cluster.slurm`)."""
        return self.node(i)

    @property
    def switch(self) -> str:
        return f"{self.base}-sw"

    @property
    def namespaces(self) -> list[str]:
        return [self.switch, *(self.node(i) for i in range(self.nodes))]

    @property
    def uplink(self) -> str:
        """A node's interface to the others: its veth, or its TUN when links have a delay."""
        return UPLINK if self.delay_s is None else dl.TUN

    def shaped(self) -> list[tuple[str, str]]:
        """Every (namespace, interface) whose egress the tbf shapes: both ends of each veth,
        or, with a delay, each node's TUN (what a node sends; see `delay`)."""
        out = [(self.node(i), self.uplink) for i in range(self.nodes)]
        if self.delay_s is not None:
            return out
        return out + [(self.switch, f"port{i}") for i in range(self.nodes)]

    def forwarder_exit(self) -> str | None:
        """None while the delay forwarder runs (or there is none); else how it ended."""
        p = self._forwarder
        if p is None or p.poll() is None:
            return None
        why = dl.last_line(forwarder_log(self.prefix, self.run_id))
        how = ps.describe_exit(p.returncode)
        return f"the delay forwarder (pid {p.pid}) {how}" + (f" ({why})" if why else "")


def _lock_path(prefix: str, run_id: str) -> str:
    return os.path.join(LOCK_DIR, f"{prefix}-{run_id}.lock")


def forwarder_log(prefix: str, run_id: str) -> str:
    """Where the run's delay forwarder writes its stderr (removed with the run)."""
    return os.path.join(LOCK_DIR, f"{prefix}-{run_id}.forwarder.log")


def _take_lock(prefix: str, run_id: str) -> TextIO:
    os.makedirs(LOCK_DIR, exist_ok=True)
    f = open(_lock_path(prefix, run_id), "w")  # held for the run's life
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _is_live(prefix: str, run_id: str) -> bool:
    """True while some process holds the run's lock (its launcher is alive)."""
    try:
        f = open(_lock_path(prefix, run_id))
    except OSError:
        return False
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        return False


def check_delay(delay_s: float | None) -> None:
    """Raise ValueError unless `delay_s` is None (no forwarder) or in [0, MAX_DELAY_MS]."""
    if delay_s is None:
        return
    ok = isinstance(delay_s, int | float) and not isinstance(delay_s, bool)
    if not (ok and 0 <= delay_s <= dl.MAX_DELAY_MS / 1000):
        raise ValueError(
            f"the link delay must be in [0, {dl.MAX_DELAY_MS / 1000:g}] s, got {delay_s!r}"
        )


def plan(
    nodes: int,
    rate_bps: float,
    *,
    prefix: str = PREFIX,
    subnet: str = SUBNET,
    hostname: str | None = None,
    run_id: str = "RUN",
    delay_s: float | None = None,
) -> tuple[Network, list[list[str]]]:
    """The network `create` makes, and every command it runs for it, in order (the hosts
    files `/etc/netns/NODE/hosts`, and with a delay the nodes' TCP buffer limits and the
    forwarder, aside). Pure: runs nothing,
    needs no privilege. With `delay_s` (seconds, 0 included) the nodes get TUN devices
    instead of veth pairs (`delay`)."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"`nodes` must be an int >= 1, got {nodes!r}")
    tbf = tbf_args(rate_bps)
    check_delay(delay_s)
    net_range = ipaddress.ip_network(subnet)
    if nodes > net_range.num_addresses - 2:
        raise ValueError(f"{nodes} nodes do not fit in {subnet}; pass a larger subnet")
    hosts = [str(a) for a in list(net_range.hosts())[:nodes]]
    net = Network(
        prefix, run_id, nodes, hosts, float(rate_bps), hostname or socket.gethostname(), delay_s
    )
    cmds = (
        _veth_commands(net, net_range.prefixlen)
        if delay_s is None
        else _tun_commands(net, net_range.prefixlen)
    )
    cmds += [["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf] for ns, dev in net.shaped()]
    return net, cmds


def _veth_commands(net: Network, prefixlen: int) -> list[list[str]]:
    """A bridge in the switch namespace, and per node a veth pair from it to the bridge."""
    sw = net.switch
    cmds = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"],
        ["ip", "-n", sw, "link", "set", BRIDGE, "up"],
    ]
    for i in range(net.nodes):
        ns, port = net.node(i), f"port{i}"
        cmds += [
            ["ip", "netns", "add", ns],
            # Both ends are born in their namespaces: nothing appears in the machine's.
            [
                "ip",
                "link",
                "add",
                UPLINK,
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                sw,
            ],
            ["ip", "-n", sw, "link", "set", port, "master", BRIDGE],
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", ns, "addr", "add", f"{net.addresses[i]}/{prefixlen}", "dev", UPLINK],
            ["ip", "-n", ns, "link", "set", UPLINK, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]  # same-node peers use lo
    return cmds


def _tun_commands(net: Network, prefixlen: int) -> list[list[str]]:
    """An empty switch namespace (the forwarder's home), and per node a persistent TUN
    device made inside its namespace, holding its address (so the route to the subnet)."""
    cmds = [["ip", "netns", "add", net.switch]]
    for i in range(net.nodes):
        ns = net.node(i)
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "tuntap", "add", "dev", dl.TUN, "mode", "tun"],
            ["ip", "-n", ns, "link", "set", dl.TUN, "mtu", str(dl.TUN_MTU)],
            ["ip", "-n", ns, "addr", "add", f"{net.addresses[i]}/{prefixlen}", "dev", dl.TUN],
            ["ip", "-n", ns, "link", "set", dl.TUN, "up"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
        ]
    return cmds


def hosts_file(net: Network, i: int) -> str:
    """`/etc/netns/NODE/hosts` of node `i`: this machine's name is the node's own address,
    which is how gloo, inside the namespace, picks the node's interface; then every node's
    host name (`Network.host`) and address, as on a real cluster, so that a node list
    (SLURM's, `cluster.slurm`) resolves the same in every node."""
    nodes = "".join(f"{a} {net.host(j)}\n" for j, a in enumerate(net.addresses))
    return f"127.0.0.1 localhost\n{net.addresses[i]} {net.hostname}\n{nodes}"


def create(
    nodes: int,
    rate_bps: float,
    *,
    prefix: str = PREFIX,
    subnet: str = SUBNET,
    hostname: str | None = None,
    delay_s: float | None = None,
) -> Network:
    """Make `nodes` namespaces and a switch, with links shaped to `rate_bps` bits per second
    (the commands of `plan`, then the hosts files); with `delay_s`, links of that one-way
    delay: TUN devices and the forwarder, started last (`delay`).

    On any failure, whatever was made is removed again and a `NetworkError` says which
    command failed. Call `destroy` when done (`with network(...)` does).
    """

    def planned(run_id: str) -> tuple[Network, list[list[str]]]:
        return plan(
            nodes,
            rate_bps,
            prefix=prefix,
            subnet=subnet,
            hostname=hostname,
            run_id=run_id,
            delay_s=delay_s,
        )

    planned("RUN")  # checks first
    reason = missing_privileges()
    if reason:
        raise NoPrivilege(reason)
    run_id = f"{os.getpid()}{os.urandom(2).hex()}"
    net, cmds = planned(run_id)
    net._lock = _take_lock(prefix, run_id)
    try:
        for cmd in cmds:
            _run(*cmd)
        for i in range(nodes):
            etc = os.path.join(ETC_NETNS, net.node(i))
            os.makedirs(etc, exist_ok=True)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write(hosts_file(net, i))
        if delay_s is not None:
            _size_tcp_buffers(net)
            _start_forwarder(net)
    except BaseException:
        destroy(net)
        raise
    return net


def _size_tcp_buffers(net: Network) -> None:
    """Let TCP's windows grow to `TCP_BUFFER_MAX` in each node of a delayed network: a
    window must hold a round trip of data (1 Gbit/s x 2 x 20 ms is 5 MB; a namespace's
    default send buffer stops at 4 MB), or the delay would also cut the rate."""
    for i in range(net.nodes):
        with dl.inside(net.node(i)):
            for name in ("tcp_rmem", "tcp_wmem"):
                path = f"/proc/sys/net/ipv4/{name}"
                with open(path) as f:
                    low, default, high = f.read().split()
                with open(path, "w") as f:
                    f.write(f"{low} {default} {max(int(high), TCP_BUFFER_MAX)}")


def _start_forwarder(net: Network) -> None:
    assert net.delay_s is not None
    nodes = [net.node(i) for i in range(net.nodes)]
    log = forwarder_log(net.prefix, net.run_id)
    try:
        net._forwarder = dl.start(net.switch, nodes, net.addresses, net.delay_s, log)
    except dl.ForwarderError as e:
        raise NetworkError(str(e)) from None


def set_rate(net: Network, rate_bps: float) -> None:
    """Change every link's rate (both directions) to `rate_bps` bits per second, live."""
    tbf = tbf_args(rate_bps)
    for ns, dev in net.shaped():
        _run("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *tbf)
    net.rate_bps = float(rate_bps)


def _pids(ns: str) -> list[int]:
    done = _run("ip", "netns", "pids", ns, check=False)
    return [int(s) for s in done.stdout.split() if s.isdigit()]


def _remove(prefix: str, run_id: str, namespaces: list[str]) -> None:
    """Kill the processes inside `namespaces`, delete them and their /etc/netns entries,
    then the run's lock file. Idempotent: what is already gone is skipped."""
    for ns in namespaces:
        for pid in _pids(ns):  # processes inside a namespace of ours are ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    for ns in namespaces:
        if os.path.exists(os.path.join(RUN_NETNS, ns)):
            _run("ip", "netns", "del", ns, check=False)
        shutil.rmtree(os.path.join(ETC_NETNS, ns), ignore_errors=True)
    end = time.monotonic() + 5
    while any(_pids(ns) for ns in namespaces if os.path.exists(os.path.join(RUN_NETNS, ns))):
        if time.monotonic() > end:
            break
        time.sleep(0.02)
    for path in (forwarder_log(prefix, run_id), _lock_path(prefix, run_id)):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def destroy(net: Network) -> None:
    """Remove everything `create` made (the forwarder, processes inside, namespaces and so
    the TUN devices, /etc/netns entries, the lock); idempotent."""
    if net._forwarder is not None:
        dl.stop(net._forwarder)
    _remove(net.prefix, net.run_id, net.namespaces)
    if net._lock is not None:
        net._lock.close()
        net._lock = None


@contextlib.contextmanager
def network(nodes: int, rate_bps: float, **kw):
    """`create` ... `destroy`, as a context manager."""
    net = create(nodes, rate_bps, **kw)
    try:
        yield net
    finally:
        destroy(net)


def _owned(prefix: str) -> dict[str, list[str]]:
    """Run id -> names (namespaces, /etc/netns entries) carrying `prefix-<run id>-`."""
    names: set[str] = set()
    for folder in (RUN_NETNS, ETC_NETNS):
        with contextlib.suppress(OSError):
            names.update(os.listdir(folder))
    runs: dict[str, list[str]] = {}
    for name in sorted(names):
        if not name.startswith(prefix + "-"):
            continue
        run_id, sep, _ = name[len(prefix) + 1 :].rpartition("-")
        if sep and run_id:
            runs.setdefault(run_id, []).append(name)
    with contextlib.suppress(OSError):
        for lock in os.listdir(LOCK_DIR):
            if lock.startswith(prefix + "-") and lock.endswith(".lock"):
                runs.setdefault(lock[len(prefix) + 1 : -len(".lock")], [])
    return runs


def leftovers(prefix: str = PREFIX) -> list[str]:
    """Namespaces and /etc/netns entries of runs whose launcher is gone (nobody holds the
    lock), named `prefix-...`; lock files of such runs appear as `LOCK_DIR/...`."""
    out = []
    for run_id, names in _owned(prefix).items():
        if not _is_live(prefix, run_id):
            out += names
            if os.path.exists(_lock_path(prefix, run_id)):
                out.append(_lock_path(prefix, run_id))
    return out


def owned(prefix: str = PREFIX) -> list[str]:
    """Every namespace or /etc/netns entry named `prefix-...`, live or not (for tests)."""
    return sorted({n for names in _owned(prefix).values() for n in names})


def clear_leftovers(prefix: str = PREFIX) -> list[str]:
    """Delete what runs killed without teardown left behind: their processes, namespaces,
    /etc/netns entries and locks, chosen by `prefix` only (live runs are kept). Returns the
    names removed."""
    removed = []
    for run_id, names in _owned(prefix).items():
        if _is_live(prefix, run_id):
            continue
        _remove(prefix, run_id, names)
        removed += names
    return removed
