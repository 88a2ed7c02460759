"""Measure the links themselves: a small message's round trip and a TCP stream's rate between
two node namespaces, over the veth path and over the delay forwarder (`delay`).

`round_trip(net)` and `stream_rate(net)` run inside this one process: it opens each socket
after entering the node's namespace (`delay.inside`), and a socket stays in the namespace
it was made in. No worker, no JAX: what is timed is the link and the kernel's path to it.

`probe(...)` builds a 2-node network per path (the veth path, then the forwarder at each
delay), measures each, and removes it; `tree-attention-edu cluster --probe 0,2,5,10,20`
runs it and writes the report (`results/cluster/delay-probe.json`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

from . import delay as dl
from . import netns

MESSAGE_BYTES = 64  # a small message: one datagram there and back
WARM_UP = 3  # round trips not timed
STREAM_CHUNK = 1 << 20  # bytes per send of the TCP stream
TOLERANCE = 0.2  # a delayed link's round trip must be 2D within ±20%


def _socket_in(namespace: str, kind: socket.SocketKind) -> socket.socket:
    with dl.inside(namespace):
        return socket.socket(socket.AF_INET, kind)


def round_trip(
    net: netns.Network,
    a: int = 0,
    b: int = 1,
    *,
    budget_s: float = 1.0,
    min_count: int = 10,
    max_count: int = 1000,
) -> list[float]:
    """Seconds of each round trip of a `MESSAGE_BYTES` UDP datagram from node `a` to node
    `b` and back (b echoes it), for about `budget_s` seconds: at least `min_count`, at most
    `max_count` of them, after `WARM_UP` ones not timed (the veth path resolves its
    neighbour on the first). One thread does both ends, so
    nothing else is timed but the two crossings."""
    server = _socket_in(net.node(b), socket.SOCK_DGRAM)
    client = _socket_in(net.node(a), socket.SOCK_DGRAM)
    with server, client:
        server.bind((net.addresses[b], 0))
        client.bind((net.addresses[a], 0))
        client.connect(server.getsockname())
        for s in (server, client):
            s.settimeout(5.0)  # a lost datagram ends the probe with an error, not a hang
        message = bytes(MESSAGE_BYTES)

        def there_and_back() -> float:
            t0 = time.perf_counter()
            client.send(message)
            data, peer = server.recvfrom(MESSAGE_BYTES)
            server.sendto(data, peer)
            client.recv(MESSAGE_BYTES)
            return time.perf_counter() - t0

        for _ in range(WARM_UP):
            there_and_back()
        times: list[float] = []
        end = time.perf_counter() + budget_s
        while len(times) < max_count and (len(times) < min_count or time.perf_counter() < end):
            times.append(there_and_back())
    return times


def stream_rate(net: netns.Network, a: int = 0, b: int = 1, seconds: float = 2.0) -> float:
    """Bytes per second a TCP stream from node `a` to node `b` sustains, sending for
    `seconds`: the bytes received over the time from the first to the last byte."""
    listener = _socket_in(net.node(b), socket.SOCK_STREAM)
    sender = _socket_in(net.node(a), socket.SOCK_STREAM)
    got = {"bytes": 0, "first": 0.0, "last": 0.0}
    with listener, sender:
        listener.bind((net.addresses[b], 0))
        listener.listen(1)
        sender.settimeout(30.0)
        sender.connect(listener.getsockname())
        receiver, _ = listener.accept()

        def drain() -> None:
            buf = bytearray(STREAM_CHUNK)
            with receiver:
                while n := receiver.recv_into(buf):
                    got["last"] = time.perf_counter()
                    if not got["bytes"]:
                        got["first"] = got["last"]
                    got["bytes"] += n

        thread = threading.Thread(target=drain, name="tae-probe-drain", daemon=True)
        thread.start()
        chunk, end = bytes(STREAM_CHUNK), time.perf_counter() + seconds
        while time.perf_counter() < end:
            sender.sendall(chunk)
        sender.shutdown(socket.SHUT_WR)
        thread.join(timeout=60.0)
    return got["bytes"] / max(got["last"] - got["first"], 1e-9)


def describe(times: list[float]) -> dict[str, Any]:
    """Median, 10th and 90th percentiles, minimum and count of round-trip `times`."""
    deciles = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return {
        "median_s": statistics.median(times),
        "p10_s": deciles[0],
        "p90_s": deciles[-1],
        "min_s": min(times),
        "count": len(times),
    }


def measure_path(
    rates_bps: list[float],
    delay_s: float | None,
    *,
    prefix: str = netns.PREFIX,
    rtt_budget_s: float = 1.0,
    stream_s: float = 2.0,
) -> dict[str, Any]:
    """One path's round trip (at the first rate) and stream rate at each of `rates_bps`:
    the veth path when `delay_s` is None, else the forwarder with that one-way delay."""
    with netns.network(2, rates_bps[0], prefix=prefix, delay_s=delay_s) as net:
        rtt = describe(round_trip(net, budget_s=rtt_budget_s))
        streams = []
        for rate in rates_bps if stream_s > 0 else []:
            netns.set_rate(net, rate)
            got = stream_rate(net, seconds=stream_s)
            streams.append({"set_Bps": rate / 8, "rate_Bps": got, "of_set": got / (rate / 8)})
    out: dict[str, Any] = {
        "path": "veth" if delay_s is None else "forwarder",
        "delay_ms": None if delay_s is None else delay_s * 1e3,
        "round_trip": rtt,
        "streams": streams,
    }
    if delay_s:
        want = 2 * delay_s
        out["expected_round_trip_s"] = want
        out["within_tolerance"] = abs(rtt["median_s"] / want - 1) <= TOLERANCE
    return out


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit(128 + signal), so that the `finally` blocks
    remove the network (SIGINT already raises KeyboardInterrupt)."""

    def leave(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    old = {s: signal.signal(s, leave) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def probe(
    rates_bps: list[float],
    delays_s: list[float],
    *,
    prefix: str = netns.PREFIX,
    rtt_budget_s: float = 1.0,
    stream_s: float = 2.0,
    command: str | None = None,
) -> dict[str, Any]:
    """The veth path, then the forwarder at each of `delays_s`: round trips and stream
    rates (`measure_path`), and the forwarder's own cost at D = 0 where it was measured."""
    reason = netns.missing_privileges()
    if reason:
        raise netns.NoPrivilege(reason)
    netns.clear_leftovers(prefix)
    with exit_on_signals():
        paths = [
            measure_path(rates_bps, d, prefix=prefix, rtt_budget_s=rtt_budget_s, stream_s=stream_s)
            for d in (None, *delays_s)
        ]
    rep: dict[str, Any] = {
        "command": command,
        "load_average": os.getloadavg(),  # the machine is shared: how busy it was
        "message_bytes": MESSAGE_BYTES,
        "stream_s": stream_s,
        "tun_mtu": dl.TUN_MTU,
        "tcp_buffer_max": netns.TCP_BUFFER_MAX,
        "tolerance": TOLERANCE,
        "paths": paths,
    }
    zero = next((p for p in paths if p["delay_ms"] == 0), None)
    if zero is not None:
        veth = paths[0]["round_trip"]["median_s"]
        rep["forwarder_overhead_s"] = zero["round_trip"]["median_s"] - veth
    return rep


def summary(rep: dict[str, Any]) -> str:
    """The probe's report as a fixed-width table: per path, the round trip's median (10th
    to 90th percentile), the expected 2D, and the stream's rate at each set rate."""
    rates = [s["set_Bps"] * 8 / 1e9 for s in rep["paths"][0]["streams"]]
    head = f"{'path':<22}{'round trip ms':>14}{'p10-p90 ms':>16}{'2D ms':>8}" + "".join(
        f"{f'MB/s @{r:g}G':>13}" for r in rates
    )
    rows = [head, "-" * len(head)]
    for p in rep["paths"]:
        r = p["round_trip"]
        name = "veth" if p["delay_ms"] is None else f"forwarder D={p['delay_ms']:g} ms"
        spread = f"{r['p10_s'] * 1e3:.3f}-{r['p90_s'] * 1e3:.3f}"
        want = p.get("expected_round_trip_s")
        rows.append(
            f"{name:<22}{r['median_s'] * 1e3:>14.3f}{spread:>16}"
            f"{'-' if want is None else f'{want * 1e3:.1f}':>8}"
            + "".join(f"{s['rate_Bps'] / 1e6:>13.0f}" for s in p["streams"])
        )
    if "forwarder_overhead_s" in rep:
        rows.append(
            f"the forwarder's own cost (D=0 minus veth): "
            f"{rep['forwarder_overhead_s'] * 1e6:+.0f} us per round trip"
        )
    return "\n".join(rows)
