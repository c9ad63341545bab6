"""``rediss://``: chunks and policies over TLS, with a CA and client certificates made
in the test.

A redis-server is started with TLS only (``--port 0 --tls-port P``) and
``--tls-auth-clients yes``: a client must show a certificate signed by the test's CA.
The transport and the policy broadcast reach it with
``rediss://host:P/0?ssl_ca_certs=CA&ssl_certfile=CERT&ssl_keyfile=KEY`` (the query
options go to redis-py as they are); without the client certificate the server refuses,
and the error names the server. Skipped, with the reason, where openssl or a TLS-capable
redis-server is missing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from shardreplay.errors import TransportError
from shardreplay.policy import open_publisher, open_subscriber, wait_for_policy
from shardreplay.transport import open_transport
from shardreplay.transport.redis import check_reachable
from tests.support import free_port
from tests.transport.transport_helpers import SPEC, assert_same_chunk, make_chunk, receive_all

pytestmark = pytest.mark.redis


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _make_certificates(d: Path) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by it."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
             "/CN=shardreplay-test-ca", "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", "san.ext", "-out", f"{name}.crt", cwd=d)


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    tmp_path = tmp_path_factory.mktemp("tls")
    binary, openssl = shutil.which("redis-server"), shutil.which("openssl")
    if binary is None or openssl is None:
        pytest.skip("needs redis-server and openssl (apt-get install redis-server openssl)")
    certs = tmp_path / "certs"
    certs.mkdir()
    _make_certificates(certs)
    port = free_port()
    args = [binary, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(tmp_path), "--tls-cert-file", str(certs / "server.crt"),
            "--tls-key-file", str(certs / "server.key"), "--tls-ca-cert-file", str(certs / "ca.crt"),
            "--tls-auth-clients", "yes"]
    log = tmp_path / "redis.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while not _listening(port):
            if proc.poll() is not None:
                text = log.read_text(errors="replace")
                if "TLS" in text or "tls" in text:
                    pytest.skip(f"this redis-server cannot serve TLS: {text.strip().splitlines()[-1]}")
                raise RuntimeError(f"redis-server with TLS exited: {text}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server with TLS did not listen in time: {log.read_text()}")
            time.sleep(0.05)
        yield port, certs
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _url(port: int, certs: Path, *, client_cert: bool = True) -> str:
    query = f"ssl_ca_certs={certs / 'ca.crt'}"
    if client_cert:
        query += f"&ssl_certfile={certs / 'client.crt'}&ssl_keyfile={certs / 'client.key'}"
    return f"rediss://127.0.0.1:{port}/0?{query}"


def test_chunks_and_policies_travel_over_tls_with_a_client_certificate(tls_server: tuple[int, Path]) -> None:
    port, certs = tls_server
    url = _url(port, certs)
    deadline = time.monotonic() + 10
    while True:  # the server may still be starting
        try:
            check_reachable(url, 2.0)
            break
        except TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    transport = open_transport(url, SPEC, stream="shardreplay:tls-test:chunks:0")
    sent = [make_chunk(3, q) for q in range(4)]
    writer = transport.writer()
    for chunk in sent:
        writer.send(chunk, timeout_s=10)
    writer.close()
    reader = transport.reader()
    try:
        got = receive_all(reader, 4)
    finally:
        reader.close()
    for a, b in zip(sent, got, strict=True):
        assert_same_chunk(a, b)
    publisher = open_publisher(url)
    subscriber = open_subscriber(url, check_interval_s=0)
    publisher.publish(7, {"w": np.arange(3, dtype=np.float32)})
    update = wait_for_policy(subscriber, 10)
    assert update.version == 7 and np.array_equal(np.asarray(update.weights["w"]), np.arange(3))
    publisher.close()
    subscriber.close()


def test_without_a_client_certificate_the_server_refuses_and_is_named(tls_server: tuple[int, Path]) -> None:
    port, certs = tls_server
    time.sleep(0.5)
    with pytest.raises(TransportError, match=f"127.0.0.1:{port}"):
        check_reachable(_url(port, certs, client_cert=False), 2.0)
