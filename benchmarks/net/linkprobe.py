"""What a link between two namespaces (:mod:`netns`) really delays: TCP round trip and stream.

:func:`rtt_ms` times a ping-pong of small messages over one TCP connection from namespace B
to namespace A (``TCP_NODELAY``; each round trip crosses the link twice, so a one-way delay
``d`` shows as ``2 d`` plus what the link itself costs); :func:`stream_mb_per_s` times one
TCP stream from B to A; :func:`datagrams` sends numbered UDP datagrams of random bytes both
ways and checks that each arrives once, unchanged, in order, and how late. Each runs in a
child process (this file as a program), which opens one socket in each namespace (one
process, so one clock for both ends), so the caller's namespace is left alone.

Usage (root; prints one JSON line per link)::

    python benchmarks/net/linkprobe.py                       # veth, then the relay at 0, 0.25, 1 ms
    python benchmarks/net/linkprobe.py --delays 1 --kinds auto
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import netns  # this folder: Python puts a script's own folder on sys.path

_MESSAGE_BYTES = 64
_CHUNK_BYTES = 1 << 20


def rtt_ms(link: netns.Link, count: int = 300) -> dict[str, float]:
    """Round trips of a 64-byte message and its 64-byte answer over ``link``, in ms:
    ``median``, ``min``, ``p10``, ``p90`` (after 20 untimed ones).

    Raises:
        RuntimeError: the probe failed or took over a minute.
    """
    return _run_probe("rtt", link, count)


def stream_mb_per_s(link: netns.Link, megabytes: int = 200) -> float:
    """MB/s (10^6 bytes) of one TCP stream of ``megabytes`` MB from namespace B to A.

    Raises:
        RuntimeError: the probe failed or took over a minute.
    """
    return _run_probe("stream", link, megabytes)["mb_per_s"]


def datagrams(link: netns.Link, count: int = 400) -> dict[str, float]:
    """Send ``count`` numbered UDP datagrams of random bytes (1 to 9000 bytes, some over
    1500) each way, in bursts of 20; returns ``received`` (how many arrived unchanged, in
    order, each once: ``2 * count`` on a link that neither drops, corrupts nor reorders) and
    ``one_way_ms_min`` / ``one_way_ms_median`` (from send to receipt).

    Raises:
        RuntimeError: the probe failed or took over a minute.
    """
    return _run_probe("udp", link, count)


def _run_probe(what: str, link: netns.Link, n: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--probe", what, *link.namespaces, link.addresses[0], str(n)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired as exc:
        raise RuntimeError(f"the {what} probe over {link.ifnames} took over 60 s") from exc
    if proc.returncode != 0:
        raise RuntimeError(f"the {what} probe over {link.ifnames} failed: {proc.stderr.strip()}")
    return json.loads(proc.stdout)


def _connected_pair(ns_a: str, ns_b: str, addr_a: str) -> tuple[socket.socket, socket.socket]:
    """(server side in A, client side in B) of one TCP connection across the link."""
    netns.enter_net(ns_a)
    with socket.socket() as listener:
        listener.bind((addr_a, 0))
        listener.listen(1)
        netns.enter_net(ns_b)
        client = socket.create_connection(listener.getsockname(), timeout=30)
        server, _ = listener.accept()
    for s in (server, client):
        s.settimeout(30)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server, client


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("the other side closed the connection")
        got += n


def _probe_rtt(server: socket.socket, client: socket.socket, count: int) -> dict[str, float]:
    message, buf = b"x" * _MESSAGE_BYTES, memoryview(bytearray(_MESSAGE_BYTES))
    times = []
    for i in range(count + 20):
        t0 = time.perf_counter()
        client.sendall(message)
        _recv_exactly(server, buf)
        server.sendall(message)
        _recv_exactly(client, buf)
        if i >= 20:
            times.append(1e3 * (time.perf_counter() - t0))
    cuts = statistics.quantiles(times, n=10)
    return {"median": statistics.median(times), "min": min(times), "p10": cuts[0], "p90": cuts[-1],
            "count": count}


def _probe_stream(server: socket.socket, client: socket.socket, megabytes: int) -> dict[str, float]:
    total = megabytes * 10**6
    chunk = b"\0" * _CHUNK_BYTES

    def send() -> None:
        left = total
        while left:
            left -= client.send(chunk[: min(left, _CHUNK_BYTES)])

    buf = memoryview(bytearray(_CHUNK_BYTES))
    sender = threading.Thread(target=send, daemon=True)
    t0 = time.perf_counter()
    sender.start()
    got = 0
    while got < total:
        n = server.recv_into(buf)
        if n == 0:
            raise ConnectionError("the sender closed the connection early")
        got += n
    seconds = time.perf_counter() - t0
    sender.join()
    return {"mb_per_s": total / 1e6 / seconds, "seconds": seconds}


def _probe_udp(ns_a: str, ns_b: str, addr_a: str, count: int) -> dict[str, float]:
    netns.enter_net(ns_a)
    a = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    a.bind((addr_a, 0))
    netns.enter_net(ns_b)
    b = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    b.connect(a.getsockname())
    a.connect(b.getsockname())
    rng = random.Random(0)
    received, late_ms = 0, []
    with a, b:
        for s in (a, b):
            s.settimeout(10)
        for start in range(0, 2 * count, 20):
            src, dst = (b, a) if start % 40 == 0 else (a, b)  # alternate directions by burst
            burst = [i.to_bytes(4, "big") + rng.randbytes(rng.choice((1, 500, 1400, 4000, 8996)))
                     for i in range(start, min(start + 20, 2 * count))]
            sent_at = []
            for datagram in burst:
                sent_at.append(time.monotonic())
                src.send(datagram)
            for datagram, t_sent in zip(burst, sent_at, strict=True):
                got = dst.recv(65536)
                late_ms.append(1e3 * (time.monotonic() - t_sent))
                if got != datagram:
                    return {"received": received, "first_wrong": int.from_bytes(got[:4], "big"),
                            "one_way_ms_min": min(late_ms), "one_way_ms_median": statistics.median(late_ms)}
                received += 1
    return {"received": received, "one_way_ms_min": min(late_ms),
            "one_way_ms_median": statistics.median(late_ms)}


def _probe_main(what: str, ns_a: str, ns_b: str, addr_a: str, n: str) -> None:
    if what == "udp":
        print(json.dumps(_probe_udp(ns_a, ns_b, addr_a, int(n))), flush=True)
        return
    server, client = _connected_pair(ns_a, ns_b, addr_a)
    with server, client:
        probe = _probe_rtt if what == "rtt" else _probe_stream
        result = probe(server, client, int(n))
    print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> None:
    """Measure each asked link; print one JSON line for each."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", nargs=5, help=argparse.SUPPRESS)  # the child's mode
    p.add_argument("--delays", default="0,0.25,1", help="one-way delays in ms (default 0,0.25,1)")
    p.add_argument("--kinds", default="tun-relay", help="netns.delayed_link kinds (default tun-relay)")
    p.add_argument("--veth", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure a plain veth pair (default on)")
    p.add_argument("--count", type=int, default=300, help="timed round trips per link")
    p.add_argument("--megabytes", type=int, default=200, help="MB streamed per link")
    args = p.parse_args(argv)
    if args.probe:
        _probe_main(*args.probe)
        return
    why = netns.unavailable()
    if why:
        raise SystemExit(f"linkprobe needs network namespaces: {why}")
    plan = [("netem", 0.0)] if args.veth else []
    plan += [(k, float(d)) for k in args.kinds.split(",") for d in args.delays.split(",")]
    for kind, delay_ms in plan:
        with netns.delayed_link(delay_ms, kind=kind) as link:
            rtt = rtt_ms(link, args.count)
            mb_per_s = stream_mb_per_s(link, args.megabytes)
        print(json.dumps({"bench": "link", "delay_kind": link.delay_kind, "delay_ms": link.delay_ms,
                          "rtt_ms": {k: round(v, 3) for k, v in rtt.items() if k != "count"},
                          "rtt_count": args.count, "stream_mb_per_s": round(mb_per_s, 1),
                          "cores": os.cpu_count(), "loadavg": [round(x, 2) for x in os.getloadavg()]}),
              flush=True)


if __name__ == "__main__":
    main()
