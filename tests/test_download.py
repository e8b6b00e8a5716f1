"""Registry and downloader, tested against a local http.server only (never the real internet)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import socket
import threading
from pathlib import Path

import pytest

import kvlab.workload.registry as registry
from kvlab.errors import ConfigError, DownloadError
from kvlab.workload import download, load_trace, resolve_trace
from kvlab.workload.registry import FORMATS, TRACES, fetch, find_local, trace_cache_dir

PAYLOAD = b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}\n' * 50


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):
        pass


@pytest.fixture
def server(tmp_path):
    """Serve ``tmp_path/www`` on 127.0.0.1; yields the base URL."""
    root = tmp_path / "www"
    root.mkdir()
    (root / "trace.jsonl").write_bytes(PAYLOAD)
    handler = functools.partial(_QuietHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(5)


@pytest.fixture
def closed_url():
    """A URL on a local port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/trace.jsonl"


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """Empty cache and trace dirs, and no sibling ../shared/traces lookup for the test entries."""
    cache = tmp_path / "cache"
    dirs = tmp_path / "dirs"
    dirs.mkdir()
    monkeypatch.setenv("KVLAB_CACHE", str(cache))
    monkeypatch.setenv("KVLAB_TRACE_DIRS", str(dirs))
    return cache, dirs


def register(monkeypatch, url: str, **kw) -> str:
    entry = {
        "url": url,
        "filename": "kvlab_test_trace.jsonl",
        "format": "mooncake",
        "size": len(PAYLOAD),
        "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
        "sha256_prefix": None,
        "requests": 50,
        "group": "testgroup",
        "description": "test",
    }
    entry.update(kw)
    monkeypatch.setitem(TRACES, "test_trace", entry)
    return "test_trace"


def test_download_success_then_cached(server, isolated, monkeypatch, closed_url):
    cache, _ = isolated
    name = register(monkeypatch, f"{server}/trace.jsonl")
    path = download(name, progress=False)
    assert path == cache / "kvlab_test_trace.jsonl" and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in cache.iterdir()) == ["kvlab_test_trace.jsonl"]
    # Second call: served from the cache, no network (the URL now points at a closed port).
    register(monkeypatch, closed_url)
    assert download(name) == path
    w = load_trace(name)
    assert len(w) == 50 and w.name == "test_trace" and w.block_size == 512


def test_download_explicit_cache_dir_and_prefix(server, isolated, monkeypatch, tmp_path):
    digest = hashlib.sha256(PAYLOAD).hexdigest()
    name = register(monkeypatch, f"{server}/trace.jsonl", sha256=None, sha256_prefix=digest[:8], size=None)
    path = download(name, cache_dir=tmp_path / "elsewhere", progress=False)
    assert path == tmp_path / "elsewhere" / "kvlab_test_trace.jsonl"


@pytest.mark.parametrize(
    "field, value, what",
    [("sha256", "0" * 64, "sha256"), ("size", 12345, "bytes"), ("sha256_prefix", "ffffffff", "start with")],
)
def test_download_checksum_mismatch(server, isolated, monkeypatch, field, value, what):
    cache, _ = isolated
    url = f"{server}/trace.jsonl"
    name = register(monkeypatch, url, **{field: value, **({"sha256": None} if field == "sha256_prefix" else {})})
    with pytest.raises(DownloadError) as ei:
        download(name, progress=False)
    msg = str(ei.value)
    assert "checksum mismatch" in msg and url in msg and what in msg and "place it at" in msg
    assert not cache.exists() or list(cache.iterdir()) == []  # neither the file nor a .part remains


def test_download_404(server, isolated, monkeypatch):
    url = f"{server}/missing.jsonl"
    name = register(monkeypatch, url)
    with pytest.raises(DownloadError, match="HTTP 404") as ei:
        download(name, progress=False)
    assert url in str(ei.value) and "KVLAB_TRACE_DIRS" in str(ei.value)


def test_download_unreachable(isolated, monkeypatch, closed_url):
    name = register(monkeypatch, closed_url)
    with pytest.raises(DownloadError, match="offline or unreachable") as ei:
        download(name, progress=False, timeout=5)
    assert closed_url in str(ei.value)
    with pytest.raises(DownloadError):
        fetch(closed_url, isolated[0] / "x.jsonl", timeout=5)


def test_local_search_path_first(isolated, monkeypatch, closed_url, tmp_path):
    _, dirs = isolated
    name = register(monkeypatch, closed_url)
    (dirs / "testgroup").mkdir()
    local = dirs / "testgroup" / "kvlab_test_trace.jsonl"
    local.write_bytes(PAYLOAD)
    assert download(name) == local
    assert resolve_trace(name) == (local, "mooncake")
    direct = tmp_path / "dir2" / "kvlab_test_trace.jsonl"
    direct.parent.mkdir()
    direct.write_bytes(PAYLOAD)
    monkeypatch.setenv("KVLAB_TRACE_DIRS", os.pathsep.join([str(direct.parent), str(dirs)]))
    assert download(name) == direct
    # force=True ignores local copies and fetches (here: fails, the URL is closed).
    with pytest.raises(DownloadError):
        download(name, force=True, timeout=5)


def test_local_copy_with_wrong_size_is_ignored(isolated, monkeypatch, closed_url):
    _, dirs = isolated
    name = register(monkeypatch, closed_url)
    (dirs / "kvlab_test_trace.jsonl").write_bytes(PAYLOAD[:-1])
    with pytest.warns(UserWarning, match="ignoring"):
        assert find_local(name) is None
    with pytest.warns(UserWarning), pytest.raises(DownloadError):
        download(name, timeout=5)


def test_unknown_names(isolated):
    with pytest.raises(DownloadError, match="known: .*mooncake_conversation"):
        download("no_such_trace")
    with pytest.raises(ConfigError, match="neither a file nor a known trace"):
        resolve_trace("no_such_trace")


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLAB_CACHE", raising=False)
    assert trace_cache_dir() == Path.home() / ".cache" / "kvlab" / "traces"
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    assert trace_cache_dir() == tmp_path
    assert trace_cache_dir(tmp_path / "x") == tmp_path / "x"


def test_registry_entries_are_complete():
    keys = {
        "url",
        "filename",
        "format",
        "size",
        "sha256",
        "sha256_prefix",
        "requests",
        "group",
        "description",
    }
    assert {
        "mooncake_conversation",
        "mooncake_synthetic",
        "mooncake_toolagent",
        "mooncake_arxiv",
        "alibaba_traceA",
        "alibaba_traceB",
        "alibaba_coder",
        "alibaba_thinking",
    } <= set(TRACES)
    for name, e in TRACES.items():
        assert set(e) == keys, name
        assert e["format"] in FORMATS and e["url"].startswith("https://") and e["url"].endswith(e["filename"])
        if e["sha256"]:
            assert len(e["sha256"]) == 64 and e["sha256"].startswith(e["sha256_prefix"] or "")
    assert registry.KNOWN_TRACES is TRACES


@pytest.mark.shared
def test_shared_traces_found_without_network(shared_file, isolated, monkeypatch, closed_url):
    conv = shared_file("mooncake/conversation_trace.jsonl")
    monkeypatch.setitem(TRACES, "mooncake_conversation", dict(TRACES["mooncake_conversation"], url=closed_url))
    assert download("mooncake_conversation") == conv
    path, fmt = resolve_trace("mooncake_conversation")
    assert (path, fmt) == (conv, "mooncake")
    for name in ("mooncake_conversation", "mooncake_synthetic"):
        e = TRACES[name]
        p = shared_file(f"mooncake/{e['filename']}")
        assert p.stat().st_size == e["size"]
        assert hashlib.sha256(p.read_bytes()).hexdigest() == e["sha256"]
