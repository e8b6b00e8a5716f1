"""Registry and downloader, tested against a local http.server only (never the real internet)."""

from __future__ import annotations

import functools
import hashlib
import http.server
import io
import json
import os
import socket
import threading
import urllib.request
from pathlib import Path

import pytest

import kvlab.workload.fetching as fetching
import kvlab.workload.registry as registry
from kvlab.errors import ChecksumError, ConfigError, DownloadError, TraceFileError
from kvlab.workload import download, load_trace, resolve_trace
from kvlab.workload.registry import (
    FORMATS,
    TRACES,
    VERIFY_CACHE,
    fetch,
    file_sha256,
    find_local,
    trace_cache_dir,
    verify_local,
)

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
    """Empty cache and trace dirs, and a temporary repository root: its traces/ (where downloads land) and its
    sibling ../shared/traces are empty folders of tmp_path, never the real ones."""
    cache = tmp_path / "cache"
    dirs = tmp_path / "dirs"
    dirs.mkdir()
    monkeypatch.setenv("KVLAB_CACHE", str(cache))
    monkeypatch.setenv("KVLAB_TRACE_DIRS", str(dirs))
    monkeypatch.setattr(registry, "REPO_ROOT", tmp_path / "repo")
    return cache, dirs


def landed(tmp_path: Path) -> Path:
    """Where :func:`download` puts the test entry: ``<tmp repo>/traces/testgroup/kvlab_test_trace.jsonl``."""
    return tmp_path / "repo" / "traces" / "testgroup" / "kvlab_test_trace.jsonl"


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


def test_download_success_then_cached(server, isolated, monkeypatch, closed_url, tmp_path):
    cache, _ = isolated
    name = register(monkeypatch, f"{server}/trace.jsonl")
    path = download(name, progress=False)
    assert path == landed(tmp_path) and path.read_bytes() == PAYLOAD  # <repo>/traces/<group>/
    assert sorted(p.name for p in path.parent.iterdir()) == ["kvlab_test_trace.jsonl"]
    assert sorted(p.name for p in cache.iterdir()) == [VERIFY_CACHE]
    # Second call: served from traces/, no network (the URL now points at a closed port), and no
    # re-hash either: the download recorded the verified sha256.
    register(monkeypatch, closed_url)
    hashed = count_hashing(monkeypatch)
    assert download(name) == path
    assert hashed == []
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
def test_download_checksum_mismatch(server, isolated, monkeypatch, field, value, what, tmp_path):
    cache, _ = isolated
    url = f"{server}/trace.jsonl"
    name = register(monkeypatch, url, **{field: value, **({"sha256": None} if field == "sha256_prefix" else {})})
    with pytest.raises(DownloadError) as ei:
        download(name, progress=False)
    msg = str(ei.value)
    assert "checksum mismatch" in msg and url in msg and what in msg and "place it at" in msg
    assert not cache.exists() or list(cache.iterdir()) == []
    assert not (tmp_path / "repo" / "traces").exists()  # no file, no .part, no folder the call created


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


def count_hashing(monkeypatch) -> list[Path]:
    """Record every full-file hash the registry computes (the list grows with each one)."""
    calls: list[Path] = []
    real = fetching.sha256_file

    def counting(path, *a, **kw):
        calls.append(Path(path))
        return real(path, *a, **kw)

    monkeypatch.setattr(fetching, "sha256_file", counting)
    return calls


@pytest.mark.parametrize("bad", [PAYLOAD[:-1], PAYLOAD[:-2] + b"7\n"], ids=["truncated", "same-size-corrupt"])
def test_local_copy_mismatch_is_an_error(isolated, monkeypatch, closed_url, bad):
    cache, dirs = isolated
    name = register(monkeypatch, closed_url)
    local = dirs / "kvlab_test_trace.jsonl"
    local.write_bytes(bad)
    for call in (lambda: find_local(name), lambda: download(name, timeout=5), lambda: load_trace(name)):
        with pytest.raises(ChecksumError) as ei:
            call()
        e = ei.value
        assert e.path == str(local) and e.expected == TRACES[name]["sha256"]
        assert e.actual == hashlib.sha256(bad).hexdigest()
        msg = str(e)
        assert str(local) in msg and e.expected in msg and e.actual in msg and "\n" not in msg
    assert isinstance(e, DownloadError)
    # A good copy in the cache does not hide the bad one: the first copy found must be right.
    cache.mkdir(exist_ok=True)
    (cache / "kvlab_test_trace.jsonl").write_bytes(PAYLOAD)
    with pytest.raises(ChecksumError):
        download(name)
    local.unlink()
    assert download(name) == cache / "kvlab_test_trace.jsonl"


def test_local_copy_hash_is_cached(isolated, monkeypatch, closed_url):
    cache, dirs = isolated
    name = register(monkeypatch, closed_url)
    local = dirs / "kvlab_test_trace.jsonl"
    local.write_bytes(PAYLOAD)
    hashed = count_hashing(monkeypatch)
    assert download(name) == local and hashed == [local]
    assert download(name) == local and find_local(name) == local and hashed == [local]  # cache hits
    record = json.loads((cache / VERIFY_CACHE).read_text())[str(local.resolve())]
    assert record["sha256"] == hashlib.sha256(PAYLOAD).hexdigest() and record["size"] == len(PAYLOAD)
    # Rewriting the file (new mtime) invalidates the entry: the corrupt copy is re-hashed and refused.
    local.write_bytes(PAYLOAD[:-2] + b"7\n")
    os.utime(local, ns=(1, 1))
    with pytest.raises(ChecksumError):
        download(name)
    assert len(hashed) == 2


@pytest.mark.parametrize(
    "garbage", [b"", b"{not json", b"[1, 2]", b'{"x": 5}', b"\xff\xfe", b"[" * 100_000, b'{"a": 1, "a": 2}']
)
def test_corrupt_verify_cache_is_tolerated(isolated, monkeypatch, closed_url, garbage):
    cache, dirs = isolated
    name = register(monkeypatch, closed_url)
    local = dirs / "kvlab_test_trace.jsonl"
    local.write_bytes(PAYLOAD)
    cache.mkdir()
    (cache / VERIFY_CACHE).write_bytes(garbage)
    hashed = count_hashing(monkeypatch)
    assert download(name) == local and len(hashed) == 1
    assert download(name) == local and len(hashed) == 1  # the cache was rewritten, valid
    # A forged entry with a wrong digest is only a cache: the file still has to match the registry.
    key = str(local.resolve())
    entries = json.loads((cache / VERIFY_CACHE).read_text())
    entries[key]["sha256"] = "0" * 64
    (cache / VERIFY_CACHE).write_text(json.dumps(entries))
    with pytest.raises(ChecksumError):
        download(name)
    entries[key]["sha256"] = 17  # not even a string: ignored, re-hashed
    (cache / VERIFY_CACHE).write_text(json.dumps(entries))
    assert download(name) == local


def test_unwritable_verify_cache_only_costs_a_rehash(isolated, monkeypatch, closed_url, tmp_path):
    _, dirs = isolated
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    monkeypatch.setenv("KVLAB_CACHE", str(blocker / "cache"))  # mkdir fails: a file is in the way
    name = register(monkeypatch, closed_url)
    local = dirs / "kvlab_test_trace.jsonl"
    local.write_bytes(PAYLOAD)
    hashed = count_hashing(monkeypatch)
    assert download(name) == local and download(name) == local and len(hashed) == 2
    assert file_sha256(local) == hashlib.sha256(PAYLOAD).hexdigest()


def test_unreadable_local_copy_is_named(isolated, monkeypatch, closed_url):
    _, dirs = isolated
    name = register(monkeypatch, closed_url)
    local = dirs / "kvlab_test_trace.jsonl"
    local.write_bytes(PAYLOAD)

    def denied(path, *a, **kw):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(fetching, "sha256_file", denied)
    with pytest.raises(TraceFileError, match="permission denied") as ei:
        load_trace(name)
    assert ei.value.path == str(local)


def test_verify_local_without_known_checksums(isolated, monkeypatch, closed_url, tmp_path):
    name = register(monkeypatch, closed_url, size=None, sha256=None, sha256_prefix=None)
    f = tmp_path / "anything.jsonl"
    f.write_bytes(b"whatever")
    hashed = count_hashing(monkeypatch)
    assert verify_local(name, f) == f and hashed == []
    name = register(monkeypatch, closed_url, size=None, sha256=None, sha256_prefix="ffff")
    with pytest.raises(ChecksumError, match="start with the expected ffff"):
        verify_local(name, f)


class _FakeResponse(io.BytesIO):
    """What ``urllib.request.urlopen`` returns, enough for :func:`fetch`."""

    def __init__(self, data: bytes) -> None:
        super().__init__(data)
        self.headers = {"Content-Length": str(len(data))}


def test_fetch_with_mocked_opener_verifies_before_rename(isolated, monkeypatch, tmp_path):
    cache, _ = isolated
    served = {"data": PAYLOAD}
    urls: list[str] = []

    def fake_urlopen(url, timeout=None):
        urls.append(url)
        return _FakeResponse(served["data"])

    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    name = register(monkeypatch, "https://example.invalid/kvlab_test_trace.jsonl")
    hashed = count_hashing(monkeypatch)
    path = download(name, progress=False)
    assert path.read_bytes() == PAYLOAD and urls == ["https://example.invalid/kvlab_test_trace.jsonl"]
    assert load_trace(name).checksum == hashlib.sha256(PAYLOAD).hexdigest() and hashed == []
    # A corrupted transfer of the right size is refused; the verified copy in traces/<group>/ stays.
    served["data"] = PAYLOAD[:-2] + b"7\n"
    with pytest.raises(DownloadError, match="checksum mismatch"):
        download(name, force=True, progress=False)
    assert path == landed(tmp_path) and path.read_bytes() == PAYLOAD
    assert sorted(p.name for p in path.parent.iterdir()) == ["kvlab_test_trace.jsonl"]
    assert sorted(p.name for p in cache.iterdir()) == [VERIFY_CACHE]


def test_unknown_names(isolated):
    with pytest.raises(DownloadError, match="known: .*mooncake_conversation"):
        download("no_such_trace")
    with pytest.raises(DownloadError, match="did you mean 'mooncake_synthetic'"):
        download("mooncake_synthtic")
    with pytest.raises(ConfigError, match="neither a file nor a known trace"):
        resolve_trace("no_such_trace")
    with pytest.raises(ConfigError, match="did you mean 'alibaba_traceA'"):
        load_trace("alibaba_tracea")
    with pytest.raises(ConfigError, match="no such file"):
        load_trace("some/dir/trace.jsonl")


def test_load_trace_user_mistakes(tmp_path, monkeypatch):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [3]}\n')
    with pytest.raises(ConfigError, match="unknown trace format 'mooncak' \\(did you mean 'mooncake'\\?\\)"):
        load_trace(f, format="mooncak")
    with pytest.raises(ConfigError, match="unknown trace format 7"):
        load_trace(f, format=7)
    with pytest.raises(ConfigError, match="takes no option 'block_size'"):
        load_trace(f, block_size=16)
    with pytest.raises(ConfigError, match="registry name or a file path"):
        load_trace(3.5)
    with pytest.raises(TraceFileError, match="is a directory") as ei:
        load_trace(tmp_path)
    assert ei.value.path == str(tmp_path) and ei.value.line is None
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(TraceFileError, match="not a regular file"):  # not a hang
        load_trace(fifo, format="mooncake")
    real_read = Path.read_bytes

    def denied(self):
        if self == f:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read(self)

    monkeypatch.setattr(Path, "read_bytes", denied)
    with pytest.raises(TraceFileError, match="permission denied") as ei:
        load_trace(f, format="mooncake")
    assert ei.value.path == str(f)
    real_open = open
    monkeypatch.setattr(
        "builtins.open",
        lambda p, *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission denied"))
        if Path(p) == f
        else real_open(p, *a, **k),
    )
    with pytest.raises(TraceFileError, match="permission denied"):
        load_trace(f)  # format detection opens the file first


def test_cache_dir_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("KVLAB_CACHE", raising=False)
    assert trace_cache_dir() == Path.home() / ".cache" / "kvlab" / "traces"
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    assert trace_cache_dir() == tmp_path
    assert trace_cache_dir(tmp_path / "x") == tmp_path / "x"


def test_registry_entries_are_complete():
    keys = {
        "kind",
        "url",
        "filename",
        "format",
        "size",
        "sha256",
        "sha256_prefix",
        "requests",
        "group",
        "description",
        "licence",
        "used_for",
        "committed",
        "checksum_source",
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
    size_unknown = {"mooncake_toolagent", "mooncake_arxiv"}  # published nowhere we could read
    for name, e in TRACES.items():
        assert set(e) == keys and e["kind"] == "trace" and not e["committed"], name
        assert e["format"] in FORMATS and e["url"].startswith("https://") and e["url"].endswith(e["filename"])
        sha = e["sha256"]
        assert type(sha) is str and len(sha) == 64 and int(sha, 16) >= 0 and sha == sha.lower(), name
        assert sha.startswith(e["sha256_prefix"] or ""), name
        assert (e["size"] is None) == (name in size_unknown), name
        assert e["size"] is None or (type(e["size"]) is int and e["size"] > 0)
    assert len({e["sha256"] for e in TRACES.values()}) == len(TRACES)
    assert registry.KNOWN_TRACES is TRACES


@pytest.mark.shared
def test_shared_traces_found_without_network(shared_file, isolated, monkeypatch, closed_url):
    conv = shared_file("mooncake/conversation_trace.jsonl")
    monkeypatch.setattr(registry, "shared_traces_dir", lambda: conv.parents[1])  # the real ../shared/traces, last
    monkeypatch.setitem(TRACES, "mooncake_conversation", dict(TRACES["mooncake_conversation"], url=closed_url))
    assert download("mooncake_conversation") == conv
    path, fmt = resolve_trace("mooncake_conversation")
    assert (path, fmt) == (conv, "mooncake")
    for name in ("mooncake_conversation", "mooncake_synthetic"):
        e = TRACES[name]
        p = shared_file(f"mooncake/{e['filename']}")
        assert p.stat().st_size == e["size"]
        assert hashlib.sha256(p.read_bytes()).hexdigest() == e["sha256"]
