"""Real BPE vocabularies from rank files (tiktoken format, Mistral's Tekken JSON) as ``tokenizers`` BPEs.

Several models publish their vocabulary as *ranks*: every token's bytes with its rank, merges implied
(a pair merges when its concatenation has the lowest rank). Two formats are read:

* tiktoken files (``*.tiktoken``, Llama-3's original ``tokenizer.model``): one ``<base64 bytes> <rank>``
  per line; no split pattern or special tokens inside, so ``pattern`` defaults to :data:`CL100K_PATTERN`
  (Llama-3's pattern too) and special tokens are given by the caller;
* Tekken (``tekken*.json``, shipped e.g. in the ``mistral-common`` package): ``config.pattern``, the
  vocabulary as ``{rank, token_bytes}`` and ``default_num_special_tokens`` ids reserved before it
  (named from ``special_tokens`` where the file lists them, ``<SPECIAL_i>`` otherwise).

:func:`tokenizer_from_ranks` derives the merge list (for each token, the last merge that byte-level BPE
restricted to lower ranks makes, as Hugging Face's own tiktoken conversion does) and builds a byte-level
``tokenizers.Tokenizer`` with ``ignore_merges`` (a pre-token that is itself in the vocabulary is one
token, as in tiktoken), so it encodes exactly as the rank-based encoder. Conversions are cached by the
file's sha256 (a 150k vocabulary takes ~10-20 s to convert once).
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError
from kvlab.inputs import regular_file
from kvlab.workload._common import atomic_open, read_trace_bytes

CL100K_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
"""The split pattern of cl100k_base and Llama-3 (tiktoken files do not carry their pattern)."""


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (the alphabet of byte-level BPE vocabularies)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars = keep[:]
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int | None = None) -> list[bytes]:
    """Rank-based BPE of ``token``: merge the adjacent pair with the lowest rank (below ``max_rank``)."""
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best, at = None, -1
        for k in range(len(parts) - 1):
            r = ranks.get(parts[k] + parts[k + 1])
            if r is not None and (best is None or r < best):
                best, at = r, k
        if best is None or (max_rank is not None and best >= max_rank):
            break
        parts[at : at + 2] = [parts[at] + parts[at + 1]]
    return parts


def read_tiktoken(path: str | os.PathLike) -> dict[bytes, int]:
    """Ranks of a tiktoken file (``<base64> <rank>`` lines); ConfigError naming the line otherwise."""
    ranks: dict[bytes, int] = {}
    for ln, line in enumerate(read_trace_bytes(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            tok, rank = line.split()
            ranks[base64.b64decode(tok, validate=True)] = int(rank)
        except ValueError:
            raise ConfigError(f"{path}:{ln}: not a tiktoken rank line ('<base64 bytes> <rank>')") from None
    return ranks


def read_tekken(path: str | os.PathLike) -> tuple[dict[bytes, int], str, dict[str, int]]:
    """Ranks (ids shifted past the special tokens), split pattern and special tokens of a Tekken JSON file."""
    try:
        obj = json.loads(read_trace_bytes(path))
        cfg = obj["config"]
        n_special = int(cfg["default_num_special_tokens"])
        limit = int(cfg.get("default_vocab_size", n_special + len(obj["vocab"]))) - n_special
        ranks = {base64.b64decode(v["token_bytes"]): int(v["rank"]) + n_special
                 for v in obj["vocab"] if int(v["rank"]) < limit}
        named = {int(s["rank"]): s["token_str"] for s in obj.get("special_tokens") or []}
        pattern = cfg["pattern"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a Tekken tokenizer file ({type(e).__name__}: {e})") from None
    specials = {named.get(i, f"<SPECIAL_{i}>"): i for i in range(n_special)}
    return ranks, pattern, specials


def check_ranks(ranks: dict[bytes, int], path: str | os.PathLike) -> None:
    """ConfigError naming ``path`` unless ``ranks`` is a usable byte-level vocabulary: not empty, and every one
    of the 256 single bytes a token (byte-level BPE builds every text from them; without one, the text holding
    that byte loses it silently). Real rank files (cl100k, o200k, Llama-3, Tekken) hold all 256."""
    if not ranks:
        raise ConfigError(f"{path}: holds no token ranks; an empty vocabulary encodes every text to nothing")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ConfigError(f"{path}: the vocabulary lacks {len(missing)} of the 256 single bytes (first: "
                          f"{bytes([missing[0]])!r}); a byte-level vocabulary needs all of them to encode any text")


def tokenizer_from_ranks(ranks: dict[bytes, int], pattern: str, special_tokens: dict[str, int] | None = None) -> Any:
    """A byte-level ``tokenizers.Tokenizer`` equivalent to rank-based BPE with ``ranks`` and split ``pattern``.

    Ranks are the token ids; ``special_tokens`` maps names to their own ids.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    b2u = _byte_to_unicode()
    enc = {tok: "".join(b2u[b] for b in tok) for tok in ranks}
    vocab = {enc[tok]: r for tok, r in ranks.items()}
    merges = []
    for tok, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(tok) < 2:
            continue
        parts = bpe_parts(ranks, tok, max_rank=r)
        if len(parts) != 2:
            raise ConfigError(f"rank {r}: token {tok!r} cannot be built from two lower-ranked tokens")
        merges.append((enc[parts[0]], enc[parts[1]]))
    clash = sorted(set(special_tokens or {}) & set(vocab))
    if clash:
        raise ConfigError(f"special token {clash[0]!r} is also a regular token of the vocabulary")
    vocab.update(special_tokens or {})  # at their own ids (Tekken reserves the first ones)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False),
    ])
    tok.decoder = decoders.ByteLevel()
    if special_tokens:
        by_id = sorted(special_tokens.items(), key=lambda kv: kv[1])
        tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name, _ in by_id])
    return tok


def rank_file_tokenizer(
    path: str | os.PathLike,
    *,
    pattern: str | None = None,
    special_tokens: dict[str, int] | None = None,
    cache_dir: str | os.PathLike,
) -> Any:
    """The ``tokenizers.Tokenizer`` of a rank file (``tekken*.json`` or a tiktoken file), converted once and
    cached in the folder ``cache_dir`` (:func:`kvlab.workload.tokenizer_files.tokenizer_cache_dir` resolves it) by the
    sha256 of the file, pattern and special tokens."""
    from tokenizers import Tokenizer

    p = regular_file(path, "tokenizer file")  # a FIFO or device is refused before it is opened
    data = read_trace_bytes(p)
    if not data.strip():
        raise ConfigError(f"{p}: the tokenizer file is empty (no token ranks); an empty vocabulary encodes every "
                          "text to nothing")
    key = hashlib.sha256(data)
    key.update(json.dumps([pattern, sorted((special_tokens or {}).items())]).encode())
    folder = Path(cache_dir)
    out = folder / f"ranks-{p.stem}-{key.hexdigest()[:24]}.json"
    if out.is_file():
        return Tokenizer.from_file(str(out))
    if p.suffix == ".json":
        ranks, file_pattern, specials = read_tekken(p)
        specials = {**specials, **(special_tokens or {})}
    else:
        ranks, file_pattern, specials = read_tiktoken(p), CL100K_PATTERN, dict(special_tokens or {})
    check_ranks(ranks, p)
    tok = tokenizer_from_ranks(ranks, pattern or file_pattern, specials)
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_open(out, "w", encoding="utf-8") as f:
        f.write(tok.to_str())
    return tok
