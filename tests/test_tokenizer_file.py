"""The default tokenizer is a committed file (sha256 checked, provenance beside it, the same ids and identity as
before it was committed, no text folder needed); retraining is explicit under a new name; a production
vocabulary is fetched from a pinned wheel (here a small fake one: checksums passed as parameters)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("transformers")

from kvlab.cli import main  # noqa: E402
from kvlab.errors import ConfigError  # noqa: E402
from kvlab.workload import sources  # noqa: E402
from kvlab.workload import tokenizer_fetch as tf  # noqa: E402
from kvlab.workload import tokenizer_files as tfiles  # noqa: E402
from kvlab.workload import tokenizer_store as ts  # noqa: E402
from kvlab.workload.rank_tokenizer import CL100K_PATTERN  # noqa: E402
from kvlab.workload.tokenizer import load_tokenizer  # noqa: E402

SAMPLE = ("Hello, world! The KV cache holds 1024 blocks.\nUSER: what is a prefix cache? <|im_start|>user\n"
          "Übergrößenträger 東京 🚀")
# recorded with the trained-on-load kvlab-bpe (cache file kvlab-bpe-1f710f6626f24ffef5457d1a.json) before the commit
BEFORE_IDS = [42, 4496, 14, 763, 3, 1951, 4354, 56, 267, 383, 261, 4516, 946, 6571, 12007, 16, 201, 55, 53, 14166, 28,
              1887, 301, 260, 663, 72, 814, 267, 383, 261, 33, 223, 1, 342, 264, 201, 130, 253, 379, 899, 130, 117,
              15515, 304, 84, 130, 100, 942, 6920, 254, 112, 163, 121, 108, 223, 175, 256, 251, 225]
BEFORE_CHAT_IDS = [1, 85, 6019, 201, 36, 71, 4915, 16, 2, 201, 1, 342, 264, 201, 42, 75, 2, 201, 1, 576, 354, 450, 201]
BEFORE_IDENTITY = {
    "tokenizer": "kvlab-bpe-16384",
    "tokenizer_sha256": "d1c39dfa8c8f7dece230f6ea75969c7e698ddbd1f7cf797737be2aa32b95745e",
    "template_sha256": "9a6ac2cf411f21cf1fa155617d146256deee33e64c43eace6c36fd9eb3dd5a2a",
    "vocab_size": 16384,
}


@pytest.fixture
def no_text(monkeypatch, tmp_path):
    """No text anywhere and no training: every way to text or training fails the test."""
    def fail(*a, **k):
        raise AssertionError("the default tokenizer looked for text or trained")

    for module, name in ((sources, "shared_corpus"), (sources, "shared_text_dir"), (tfiles, "train_bpe"),
                         (ts, "training_text")):
        monkeypatch.setattr(module, name, fail)
    monkeypatch.setenv("KVLAB_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    monkeypatch.setenv("KVLAB_TRACE_DIRS", str(tmp_path / "empty"))


# ------------------------------------------------------------------------------------------ the committed file
def test_committed_file_sha256_and_provenance():
    data = (ts.DATA_DIR / "kvlab-bpe.json").read_bytes()
    record = json.loads((ts.DATA_DIR / "kvlab-bpe.provenance.json").read_text())
    assert hashlib.sha256(data).hexdigest() == ts.KVLAB_BPE_SHA256 == record["sha256"]
    assert record["size"] == len(data) and record["file"] == "kvlab-bpe.json" and record["name"] == "kvlab-bpe"
    assert record["settings"] == {"vocab_size": 16384, "min_frequency": 2, "chat_template": "chatml",
                                  "special_tokens": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
    assert record["recipe"] == tfiles.RECIPE and record["tokenizers_version"].count(".") == 2
    assert record["training_key"].startswith("1f710f6626f24ffef5457d1a")  # the old cache file's name
    names = [f["path"] for f in record["files"]]
    assert len(names) == 14 and names[0] == "cacheblend/musique_s.json" and "mt_bench/question.jsonl" in names
    assert all(not n.startswith("/") and ".." not in n for n in names)
    assert all(len(f["sha256"]) == 64 and f["size"] > 0 for f in record["files"])


def test_provenance_names_the_shared_text(shared_file):
    record = json.loads((ts.DATA_DIR / "kvlab-bpe.provenance.json").read_text())
    for f in record["files"]:
        path = shared_file(f"text/{f['path']}")
        assert (ts.sha256_file(path), path.stat().st_size) == (f["sha256"], f["size"]), f["path"]


def test_default_loads_without_any_text_and_gives_the_same_ids(no_text, tmp_path):
    tok = load_tokenizer()
    assert tok.identity() == BEFORE_IDENTITY == load_tokenizer("kvlab-bpe").identity()
    assert tok.encode(SAMPLE) == BEFORE_IDS
    chat = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert tok.encode(chat, add_special_tokens=False) == BEFORE_CHAT_IDS
    assert not (tmp_path / "tokenizers").exists()  # nothing written


def test_a_changed_committed_file_is_refused(monkeypatch, tmp_path):
    data = bytearray((ts.DATA_DIR / "kvlab-bpe.json").read_bytes())
    data[-3] ^= 1
    (tmp_path / "kvlab-bpe.json").write_bytes(bytes(data))
    monkeypatch.setattr(ts, "DATA_DIR", tmp_path)
    with pytest.raises(ConfigError, match="is not kvlab-bpe's d1c39dfa") as e:
        load_tokenizer()
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------------------------ retraining
TINY_TEXTS = ["the cache holds the blocks of the prompt", "a prefix cache reuses the blocks of a prompt"] * 20


@pytest.fixture
def tiny_training(monkeypatch, tmp_path):
    """Training text: a tiny in-memory corpus with one stand-in file (no corpus needed)."""
    src = tmp_path / "text" / "tiny.txt"
    src.parent.mkdir()
    src.write_text("\n".join(TINY_TEXTS))
    monkeypatch.setattr(ts, "training_text", lambda text_dir=None: ([("tiny.txt", src)], list(TINY_TEXTS)))
    folder = tmp_path / "tokenizers"
    monkeypatch.setenv("KVLAB_TOKENIZER_CACHE", str(folder))
    return folder


@pytest.mark.parametrize("name", ["kvlab-bpe", "tekken", "byte", "ranks-x", "kvlab-bpe-2", "a/b", "", "x.json",
                                  "-x", "x" * 65])
def test_train_refuses_reserved_and_bad_names(tiny_training, monkeypatch, name):
    monkeypatch.setattr(tfiles, "train_bpe", lambda *a, **k: pytest.fail("trained before refusing"))
    with pytest.raises(ConfigError, match="--name") as e:
        ts.train_named(name)
    assert "\n" not in str(e.value) and not tiny_training.exists()


def test_train_writes_a_name_once_and_loads_it(tiny_training, capsys):
    assert main(["tokenizer", "train", "--name", "mine", "--vocab-size", "512"]) == 0
    assert sorted(p.name for p in tiny_training.iterdir()) == ["mine.json", "mine.provenance.json"]  # no temp files
    record = json.loads((tiny_training / "mine.provenance.json").read_text())
    data = (tiny_training / "mine.json").read_bytes()
    assert record["sha256"] == hashlib.sha256(data).hexdigest() and record["settings"]["vocab_size"] == 512
    assert record["files"] == [{"path": "tiny.txt", "sha256": ts.sha256_file(tiny_training.parent / "text/tiny.txt"),
                                "size": (tiny_training.parent / "text/tiny.txt").stat().st_size}]
    tok = load_tokenizer("mine")
    assert tok.name == "mine" and tok.identity()["tokenizer_sha256"] == record["sha256"]
    ids = tok.encode("the prefix cache")
    assert load_tokenizer("mine").encode("the prefix cache") == ids
    capsys.readouterr()
    assert main(["tokenizer", "train", "--name", "mine"]) == 2  # the same name again: refused, one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists already" in err and "choose another name" in err
    assert (tiny_training / "mine.json").read_bytes() == data  # kept
    assert main(["tokenizer", "list"]) == 0
    assert any(line.split()[:2] == ["mine", "present"] for line in capsys.readouterr().out.splitlines())
    (tiny_training / "mine.json").write_bytes(data + b"\n")  # still valid JSON, another file
    with pytest.raises(ConfigError, match="was changed after training"):
        load_tokenizer("mine")


# ------------------------------------------------------------------------------------------ fetch
def tiny_tekken() -> bytes:
    """A Tekken-format vocabulary: the 256 bytes and four merges, three special ids reserved before them."""
    ranks = {bytes([b]): b for b in range(256)}
    for tok in (b"he", b"ll", b"llo", b"hello"):
        ranks[tok] = len(ranks)
    vocab = [{"rank": r, "token_bytes": base64.b64encode(t).decode(), "token_str": None} for t, r in ranks.items()]
    obj = {"config": {"pattern": CL100K_PATTERN, "default_vocab_size": len(ranks) + 3,
                      "default_num_special_tokens": 3, "version": "v7"},
           "vocab": vocab, "special_tokens": [{"rank": 0, "token_str": "<unk>"}, {"rank": 1, "token_str": "<s>"}]}
    return json.dumps(obj).encode()


def fake_wheel(folder: Path, member: bytes) -> Path:
    """A minimal valid wheel ``mistral_common-1.13.1-py3-none-any.whl`` holding ``member`` as the Tekken file."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "mistral_common-1.13.1-py3-none-any.whl"
    info = "mistral_common-1.13.1.dist-info"
    files = {
        tf.TEKKEN.member: member,
        "mistral_common/__init__.py": b"",
        f"{info}/METADATA": b"Metadata-Version: 2.1\nName: mistral-common\nVersion: 1.13.1\n",
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: kvlab-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},sha256={base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b'=').decode()},"
                     f"{len(d)}\n" for name, d in files.items()) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in {**files, f"{info}/RECORD": record.encode()}.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def fake_tekken(monkeypatch, tmp_path):
    """A fake wheel in a find-links folder, and ``FETCHABLE["tekken"]`` pinned to its checksums."""
    member = tiny_tekken()
    wheel = fake_wheel(tmp_path / "wheels", member)
    source = tf.WheelFile("tekken", "mistral-common==1.13.1", ts.sha256_file(wheel), tf.TEKKEN.member,
                          hashlib.sha256(member).hexdigest(), "Apache-2.0", "a test vocabulary")
    monkeypatch.setitem(tf.FETCHABLE, "tekken", source)
    monkeypatch.setenv("KVLAB_TOKENIZER_CACHE", str(tmp_path / "tokenizers"))
    return wheel, source, member


def test_fetch_from_a_local_wheel_then_load_offline(fake_tekken, tmp_path, capsys):
    wheel, source, member = fake_tekken
    with pytest.raises(ConfigError, match="run `kvlab tokenizer fetch tekken`"):
        load_tokenizer("tekken")
    assert main(["tokenizer", "fetch", "tekken", "--wheel", str(wheel)]) == 0
    assert "fetched to" in capsys.readouterr().out
    target = tmp_path / "tokenizers" / "tekken.json"
    assert target.read_bytes() == member
    tok = load_tokenizer("tekken")
    assert tok.name == "tekken" and tok.encode("hello") == [259 + 3]  # rank 259, after the 3 special ids
    assert main(["tokenizer", "fetch", "tekken", "--wheel", str(wheel)]) == 0  # again: nothing to do
    assert "already present" in capsys.readouterr().out
    assert main(["tokenizer", "list"]) == 0
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()}
    assert rows == {"kvlab-bpe": "present", "byte": "present", "tekken": "present"}


def test_fetch_through_pip_from_a_find_links_folder(fake_tekken, tmp_path, monkeypatch):
    """pip download itself (no index: the wheel folder as find-links), so pip's own settings are honoured."""
    wheel, source, member = fake_tekken
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    path, fetched = tf.fetch("tekken", source=source)
    assert fetched and path.read_bytes() == member
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match=r"pip download mistral-common==1.13.1 failed: .*give --wheel PATH") as e:
        tf.fetch("tekken", source=source, folder=tmp_path / "other")
    assert "\n" not in str(e.value) and not (tmp_path / "other").exists()


def test_fetch_refuses_wrong_checksums_and_writes_nothing(fake_tekken, tmp_path, capsys):
    wheel, source, member = fake_tekken
    folder = tmp_path / "tokenizers"
    bad_wheel = dataclasses.replace(source, wheel_sha256="0" * 64)
    with pytest.raises(ConfigError, match="refusing this wheel"):
        tf.fetch("tekken", wheel=wheel, source=bad_wheel)
    bad_member = dataclasses.replace(source, member_sha256="1" * 64)
    with pytest.raises(ConfigError, match="tekken_240911.json has sha256 .* not 1111"):
        tf.fetch("tekken", wheel=wheel, source=bad_member)
    assert not folder.exists() or list(folder.iterdir()) == []
    assert main(["tokenizer", "fetch", "tekken", "--wheel", str(fake_wheel(tmp_path / "w2", b"{}"))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "refusing this wheel" in err
    folder.mkdir(exist_ok=True)
    (folder / "tekken.json").write_text("mine")  # a file kvlab did not write: kept, fetch refused
    with pytest.raises(ConfigError, match="exists and is not tekken's file"):
        tf.fetch("tekken", wheel=wheel, source=source)
    assert (folder / "tekken.json").read_text() == "mine"
    with pytest.raises(ConfigError, match="not a fetchable tokenizer"):
        tf.fetch("nosuch")


def test_the_pinned_tekken_source():
    assert tf.FETCHABLE["tekken"] == tf.TEKKEN and tf.TEKKEN.requirement == "mistral-common==1.13.1"
    assert tf.TEKKEN.member == "mistral_common/data/tekken_240911.json" and tf.TEKKEN.licence == "Apache-2.0"
