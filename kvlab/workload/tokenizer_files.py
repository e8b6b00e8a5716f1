"""What the tokenizer modules share, below all of them: the tokenizer folder, the ``tokenizers`` library,
kvlab's BPE recipe (:func:`train_bpe`, its settings and :func:`training_key`), file checksums and the
never-replacing atomic placement of a new file (:func:`place_new`).

Imported by :mod:`kvlab.workload.tokenizer_fetch`, :mod:`kvlab.workload.tokenizer_store` and
:mod:`kvlab.workload.tokenizer` (in that order, bottom up), so none of them imports another in a circle.
Units: sizes in tokens (vocabulary) and bytes (files).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError

BPE_VOCAB_SIZE = 16384  # tokens
BPE_MIN_FREQUENCY = 2
BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
RECIPE = "byte-level-bpe-v1"  # kvlab's BPE recipe (train_bpe); part of the training key and provenance


# ------------------------------------------------------------------------------------------ the tokenizer folder
def tokenizer_cache_dir(cache: str | os.PathLike | None = None) -> Path:
    """The tokenizer folder (trained and fetched tokenizers, rank-file conversions): ``cache``, else
    ``$KVLAB_TOKENIZER_CACHE``, else ``$KVLAB_CACHE/tokenizers`` (kvlab's cache folder, as the tests set it),
    else ``~/.cache/kvlab/tokenizers``. The committed kvlab-bpe is not here (package data)."""
    if cache is not None:
        return Path(cache)
    env = os.environ.get("KVLAB_TOKENIZER_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("KVLAB_CACHE")
    return Path(base) / "tokenizers" if base else Path.home() / ".cache" / "kvlab" / "tokenizers"


def tokenizers_lib() -> Any:
    """The ``tokenizers`` package; ConfigError naming the extra to install when it is missing."""
    try:
        import tokenizers
    except ImportError:
        raise ConfigError("kvlab's BPE tokenizer needs the 'tokenizers' package: pip install 'kvlab[engine]'") from None
    return tokenizers


def train_bpe(texts: Iterable[str], *, vocab_size: int = BPE_VOCAB_SIZE, min_frequency: int = BPE_MIN_FREQUENCY) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts`` (GPT-2 pre-tokeniser, untrimmed offsets)."""
    tk = tokenizers_lib()
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    tok = tk.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(BPE_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok


def training_key(texts: list[str], vocab_size: int, min_frequency: int) -> str:
    """sha256 over the training text and every setting that changes the vocabulary."""
    h = hashlib.sha256()
    settings = {"vocab_size": vocab_size, "min_frequency": min_frequency, "special": BPE_SPECIAL_TOKENS,
                "tokenizers": tokenizers_lib().__version__, "recipe": RECIPE}
    h.update(json.dumps(settings, sort_keys=True).encode())
    for t in texts:
        h.update(b"\x1e")
        h.update(t.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ files
def place_new(path: Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically, never replacing a file already there.

    The bytes go to a temp file beside ``path`` (fsynced), which is then hard-linked to ``path``: the link
    fails when ``path`` exists (so a concurrent writer's file is kept), and a reader sees the whole file or
    none. ConfigError naming ``path`` if it exists."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise ConfigError(f"{path}: exists already; kvlab never replaces it (choose another name)") from None
        except OSError:  # a file system without hard links: check, then rename (atomic, but not exclusive)
            if os.path.lexists(path):
                raise ConfigError(f"{path}: exists already; kvlab never replaces it (choose another name)") from None
            os.rename(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)
    return path


__all__ = ["BPE_MIN_FREQUENCY", "BPE_SPECIAL_TOKENS", "BPE_VOCAB_SIZE", "RECIPE", "place_new",
           "tokenizer_cache_dir", "tokenizers_lib", "train_bpe", "training_key"]
