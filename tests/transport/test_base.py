"""The transport interface: URL dispatch, protocol conformance, duplicate memory, light import."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shardreplay.errors import ConfigError
from shardreplay.transport import ChunkReader, ChunkWriter, Transport, open_transport
from shardreplay.transport.base import RecentIds
from tests.transport.transport_helpers import SPEC


@pytest.mark.parametrize("url, options, match", [
    ("ftp://host/x", {}, "unknown transport"),
    ("file://otherhost/dir", {}, "file:///absolute"),
    ("local", {"no_such_option": 1}, "bad option"),
    ("local", {"capacity_bytes": 10}, "capacity_bytes"),
    ("redis://127.0.0.1:1/0", {"max_len": 0}, "max_len"),
])
def test_bad_urls_and_options_are_config_errors(url: str, options: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        open_transport(url, SPEC, **options)


def _ends(transport: Transport) -> tuple[ChunkWriter, ChunkReader]:
    writer, reader = transport.writer(), transport.reader()
    assert isinstance(transport, Transport)
    assert isinstance(writer, ChunkWriter) and isinstance(reader, ChunkReader)
    return writer, reader


def test_every_transport_has_the_same_interface(tmp_path: Path, redis_server) -> None:
    for url in ("local", tmp_path.absolute().as_uri(), redis_server.url):
        writer, reader = _ends(open_transport(url, SPEC))
        with pytest.raises(ConfigError, match="max_chunks"):
            reader.receive(0)
        assert reader.receive(4, timeout_s=0.0) == []
        reader.ack([])
        writer.close()
        reader.close()


def test_recent_ids_forget_beyond_the_window() -> None:
    recent = RecentIds(window=3)
    assert [recent.check_and_add(0, q) for q in (1, 2, 3)] == [False, False, False]
    assert recent.check_and_add(0, 2) and not recent.check_and_add(1, 2)
    assert not recent.check_and_add(0, 4)  # 1 falls out of the window
    assert not recent.check_and_add(0, 1)
    with pytest.raises(ConfigError):
        RecentIds(window=0)


def test_importing_transport_and_policy_does_not_load_redis() -> None:
    code = ("import sys, shardreplay.transport, shardreplay.policy\n"
            "print(sorted(m for m in ('redis', 'safetensors') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]"
