"""The repository's traces/ folder: the registry as data (traces/registry.json) and its README table, the committed
text corpora, the search order, text corpora found and fetched like traces, and examples that name traces by
registry name. Every download goes to a temporary repository root (never the real traces/), from file:// URLs."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

import kvlab
import kvlab.workload.registry as registry
from kvlab.cli import main
from kvlab.errors import ChecksumError, ConfigError, DownloadError
from kvlab.workload import sources
from kvlab.workload.registry import CORPORA, TRACES, download, download_command, find_local, readme_table

REPO = Path(kvlab.__file__).resolve().parents[1]
CORPUS_NAMES = ("cacheblend_musique", "cacheblend_inputs", "mt_bench_questions", "mt_bench_answers", "sharegpt_500")
COMMITTED = {"mt_bench_questions", "mt_bench_answers", "sharegpt_500"}
BEGIN, END = "<!-- registry table", "<!-- end of registry table -->"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def tmp_repo(tmp_path, monkeypatch) -> Path:
    """A temporary repository root (its traces/ and ../shared/traces are empty), an empty KVLAB_TRACE_DIRS and
    a private cache: nothing of the real checkout is searched or written."""
    monkeypatch.setattr(registry, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.setenv("KVLAB_TRACE_DIRS", "")
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "repo"


def _corpus(monkeypatch, url: str, data: bytes, **kw) -> str:
    """Register text corpus ``test_corpus`` (group text/testgroup, file corpus.json) for ``data``."""
    entry = {"kind": "text", "url": url, "filename": "corpus.json", "format": "json", "size": len(data),
             "sha256": _sha(data), "sha256_prefix": None, "requests": 1, "group": "text/testgroup",
             "description": "test", "licence": "test", "used_for": "tests", "committed": False,
             "checksum_source": "test", **kw}
    monkeypatch.setitem(CORPORA, "test_corpus", entry)
    return "test_corpus"


# ---------------------------------------------------------------------- the registry as data
def test_registry_json_is_the_registry_and_the_readme_table_agrees():
    data = registry.load_registry(REPO / "traces" / "registry.json")
    assert data == registry.entries() and registry.REGISTRY_FILE == REPO / "traces" / "registry.json"
    assert set(CORPUS_NAMES) == set(CORPORA) and not set(TRACES) & set(CORPORA)
    readme = (REPO / "traces" / "README.md").read_text()
    start = readme.index("-->\n", readme.index(BEGIN)) + 4
    assert readme[start: readme.index(END)].rstrip("\n") == readme_table()
    for name in data:
        assert f"`{name}`" in readme and f"`kvlab download {name}`" in readme
    for words in ("<repo>/traces", "$KVLAB_TRACE_DIRS", "~/.cache/kvlab/traces", "../shared/traces"):
        assert words in readme  # the search order is stated


def test_corpus_entries_pin_their_sources():
    cacheblend = "YaoJiayi/CacheBlend/55ad02675939f783a38d579393527d218a7fd581"
    fastchat = "lm-sys/FastChat/0e6d3e4beaab66f4d3f93db72541a4abab8af28d"
    sharegpt = "ml-energy/leaderboard-v2/c3af7f31e231a2a7021c5f8e2a54dd712d02e6e2"
    commits = {"cacheblend_musique": cacheblend, "cacheblend_inputs": cacheblend, "mt_bench_questions": fastchat,
               "mt_bench_answers": fastchat, "sharegpt_500": sharegpt}
    for name, e in CORPORA.items():
        assert e["kind"] == "text" and e["format"] in ("json", "jsonl") and e["group"].startswith("text/"), name
        assert f"https://raw.githubusercontent.com/{commits[name]}/" in e["url"], name
        assert e["committed"] == (name in COMMITTED) and e["licence"] and e["used_for"], name
    files = CORPORA["cacheblend_inputs"]["files"]
    assert list(files) == [f"{k}.json" for k in range(1, 11)]
    assert sum(f["size"] for f in files.values()) == CORPORA["cacheblend_inputs"]["size"]
    assert "Apache-2.0" in CORPORA["mt_bench_questions"]["licence"]


def test_a_broken_registry_file_is_one_line(tmp_path):
    good = json.loads((REPO / "traces" / "registry.json").read_text())
    bad = json.loads(json.dumps(good))
    bad["entries"]["sharegpt_500"]["size"] = "216075"
    (tmp_path / "r.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match=r"r.json: entries.sharegpt_500.size: expected int or NoneType") as ei:
        registry.load_registry(tmp_path / "r.json")
    assert "\n" not in str(ei.value)
    bad["entries"]["sharegpt_500"].update(size=1, group="../outside")
    (tmp_path / "r.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="group: a relative path of plain names"):
        registry.load_registry(tmp_path / "r.json")


# ---------------------------------------------------------------------- committed files
def test_committed_text_files_are_the_registry_files():
    for name in sorted(COMMITTED):
        e = CORPORA[name]
        path = REPO / "traces" / e["group"] / e["filename"]
        data = path.read_bytes()
        assert len(data) == e["size"] and _sha(data) == e["sha256"], name
        assert find_local(name) == path  # <repo>/traces is searched first
    assert (REPO / "traces" / "text" / "SOURCE.md").is_file()


def test_no_trace_and_no_cacheblend_file_is_committed():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "traces"], cwd=REPO, capture_output=True, text=True, check=True)
    allowed = {"traces/README.md", "traces/registry.json", "traces/.gitattributes", "traces/text/SOURCE.md"}
    allowed |= {f"traces/{CORPORA[n]['group']}/{CORPORA[n]['filename']}" for n in COMMITTED}
    assert set(tracked.stdout.split()) <= allowed
    ignored = subprocess.run(["git", "check-ignore", "traces/mooncake/conversation_trace.jsonl",
                              "traces/text/cacheblend/musique_s.json", "traces/text/cacheblend/inputs/1.json"],
                             cwd=REPO, capture_output=True, text=True)
    assert len(ignored.stdout.split()) == 3  # downloads are git-ignored


# ---------------------------------------------------------------------- search order
def test_search_order_repo_traces_first(tmp_repo, tmp_path, monkeypatch):
    data = b'[{"prompt": "hello"}]\n'
    name = _corpus(monkeypatch, "file:///nowhere/corpus.json", data)
    env, cache, shared = tmp_path / "env", tmp_path / "cache", tmp_path / "shared" / "traces"
    monkeypatch.setenv("KVLAB_TRACE_DIRS", str(env))
    assert registry.search_dirs() == [tmp_repo / "traces", env, cache, shared]
    places = [tmp_repo / "traces" / "text" / "testgroup" / "corpus.json", env / "corpus.json",
              cache / "text" / "testgroup" / "corpus.json", shared / "corpus.json"]
    for p in places:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    for p in places:  # each copy wins until it is removed
        assert find_local(name) == p and download(name) == p
        p.unlink()
    assert find_local(name) is None


def test_a_wrong_copy_first_in_the_order_is_an_error(tmp_repo, monkeypatch, tmp_path):
    data = b'[{"prompt": "hello"}]\n'
    name = _corpus(monkeypatch, "file:///nowhere/corpus.json", data)
    first = tmp_repo / "traces" / "text" / "testgroup" / "corpus.json"
    first.parent.mkdir(parents=True)
    first.write_bytes(data.replace(b"hello", b"hellO"))  # same size, other content
    (tmp_path / "shared" / "traces").mkdir(parents=True)
    (tmp_path / "shared" / "traces" / "corpus.json").write_bytes(data)
    with pytest.raises(ChecksumError, match="kvlab download test_corpus --force") as ei:
        find_local(name)
    assert ei.value.path == str(first)


# ---------------------------------------------------------------------- missing corpora
def test_a_missing_corpus_is_one_line_naming_the_download(tmp_repo):
    loaders = {"cacheblend_musique": sources.musique_records, "cacheblend_inputs": sources.cacheblend_records,
               "mt_bench_questions": sources.mt_bench_records, "sharegpt_500": sources.sharegpt_records}
    for name, load in loaders.items():
        with pytest.raises(ConfigError) as ei:
            load()
        msg = str(ei.value)
        assert "\n" not in msg and msg.endswith(f"run: {download_command(name)}"), msg
    with pytest.raises(ConfigError) as ei:
        sources.shared_corpus()
    msg = str(ei.value)
    assert "\n" not in msg and msg.endswith("run: " + " && ".join(f"kvlab download {n}" for n in CORPUS_NAMES))


def test_explicit_paths_win(tmp_repo, tmp_path):
    f = tmp_path / "q.jsonl"
    f.write_text('{"question_id": 1, "turns": ["a", "b"]}\n')
    recs = sources.mt_bench_records(f)
    assert [r.user_turns for r in recs] == [["a", "b"]] and recs[0].source == str(f)


def test_loaders_read_the_committed_text_first():
    q = sources.mt_bench_records()
    assert len(q) == 80 and q[0].source == str(REPO / "traces" / "text" / "mt_bench" / "question.jsonl")
    assert sum(r.meta["answer_source"] == "reference" for r in q) == 30
    s = sources.sharegpt_records(limit=3)
    assert len(s) == 3 and s[0].source.startswith(str(REPO / "traces" / "text"))


# ---------------------------------------------------------------------- downloads
def test_corpus_download_lands_in_traces_group_atomically(tmp_repo, tmp_path, monkeypatch, capsys):
    data = b'[{"prompt": "hello", "response": "hi"}]\n'
    src = tmp_path / "www" / "corpus.json"
    src.parent.mkdir()
    src.write_bytes(data)
    name = _corpus(monkeypatch, src.as_uri(), data)
    target = tmp_repo / "traces" / "text" / "testgroup" / "corpus.json"
    assert main(["download", name]) == 0
    assert capsys.readouterr().out.strip() == str(target) and target.read_bytes() == data
    assert sorted(p.name for p in target.parent.iterdir()) == ["corpus.json"]  # no .part left
    # A transfer that does not match the registry leaves the verified file as it was, and no .part.
    src.write_bytes(data.replace(b"hi", b"ho"))
    with pytest.raises(DownloadError, match="checksum mismatch"):
        download(name, force=True, progress=False)
    assert target.read_bytes() == data and sorted(p.name for p in target.parent.iterdir()) == ["corpus.json"]
    assert main(["download", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in (*TRACES, *CORPORA)) and str(target) in out


def test_folder_corpus_downloads_only_missing_members(tmp_repo, tmp_path, monkeypatch):
    www = tmp_path / "www" / "inputs"
    www.mkdir(parents=True)
    files = {}
    for k in (1, 2, 10):
        body = json.dumps({"0": f"passage {k}", "query": f"q{k}"}).encode()
        (www / f"{k}.json").write_bytes(body)
        files[f"{k}.json"] = {"size": len(body), "sha256": _sha(body)}
    name = _corpus(monkeypatch, www.as_uri(), b"", filename="inputs", size=sum(f["size"] for f in files.values()),
                   sha256=None, files=files)
    fetched: list[str] = []
    real = registry._fetch

    def counting(url, dest, **kw):
        fetched.append(url.rsplit("/", 1)[1])
        return real(url, dest, **kw)

    monkeypatch.setattr(registry, "_fetch", counting)
    folder = download(name, progress=False)
    assert folder == tmp_repo / "traces" / "text" / "testgroup" / "inputs" and fetched == list(files)
    assert [r.id for r in sources.cacheblend_records(folder)] == ["cacheblend-1", "cacheblend-2", "cacheblend-10"]
    (folder / "2.json").unlink()  # an interrupted download: the folder is not a copy, the rest is kept
    assert find_local(name) is None
    fetched.clear()
    assert download(name, progress=False) == folder and fetched == ["2.json"]


# ---------------------------------------------------------------------- examples
def test_examples_name_traces_by_registry_name():
    from kvlab.inputs import parse_yaml

    for file in sorted((REPO / "examples" / "experiments").glob("*.yaml")):
        text = file.read_text()
        assert "../" not in text, file.name
        data = parse_yaml(text, str(file))
        paths = [data["trace"]["path"], *data.get("sweep", {}).get("grid", {}).get("trace.path", [])]
        for p in paths:
            assert p in TRACES or (file.parent / p).is_file(), (file.name, p)
