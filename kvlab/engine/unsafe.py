"""The unsafe key schemes, run for real: what each one's extra hits do to a model's outputs.

Each :class:`UnsafeScenario` is a small token workload built so that the unsafe scheme produces hits the
safe default (chained ``xxh3_128`` over token ids, adapter and salt included) does not, plus the two
hashers. :func:`measure_unsafe` runs both schemes on the engine in verify mode and tabulates the damage.
Every hit of the unsafe scheme that the safe scheme would not make reuses a block whose *true identity*
(chained sha256 over token ids and all extras) differs: ``false_hit_blocks`` counts them.

| scenario | unsafe scheme | the false hit |
|---|---|---|
| ``unchained`` | ``chained=False`` (position-independent) | a document's blocks 1-3 reused at positions 0-2 |
| ``truncated`` | ``truncate_bits=8``, a forged colliding first block | another prompt's whole chain after a collision |
| ``no_adapter`` | ``include_adapter=False``, two LoRA-like adapters | adapter A's K/V served to adapter B |
| ``text_keyed`` | keys over the text's bytes, not token ids | two tokenizers (ids shifted by 3) share K/V |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from kvlab.engine.adapters import AdapterSet
from kvlab.engine.driver import Engine
from kvlab.engine.model import model_id, vocab_size
from kvlab.errors import ConfigError
from kvlab.hashing import BlockHasher
from kvlab.names import renamed_keyword
from kvlab.workload.text import ByteTokenizer
from kvlab.workload.workload import Workload, from_lists

SCENARIOS = ("unchained", "truncated", "no_adapter", "text_keyed")
ADAPTERS = ("lora-a", "lora-b")
TEXT_OFFSETS = (0, 3)  # the two tokenizations: ByteTokenizer(0) and ByteTokenizer(3)
_TEXT = (
    "the cache stores state not text keys values depend on token ids positions model weights and the mask "
    "a block is valid only after the same ordered prefix under the same computation an adapter changes "
    "every projection so its blocks belong to it alone reuse at another position rotates keys wrongly"
)
_WORDS = tuple(_TEXT.split(" "))


@dataclass
class UnsafeScenario:
    """A workload, the safe and the unsafe hasher, and (text-keyed only) per-row values the unsafe
    scheme hashes instead of token ids. ``adapters``: adapter names the workload's rows use."""

    name: str
    breaks: str
    workload: Workload
    safe: BlockHasher
    unsafe: BlockHasher
    unsafe_key_values: list[np.ndarray] | None = None
    adapters: tuple[str, ...] | None = None


def _blocks(rng: np.random.Generator, n_tokens: int, vocab: int) -> np.ndarray:
    return rng.integers(0, vocab, size=n_tokens, dtype=np.int64)


def unchained(mid: str, vocab: int, *, block_size: int = 16, seed: int = 0, docs: int = 3) -> UnsafeScenario:
    """Document ``d`` (4 blocks) + question, then its blocks 1-3 + another question: unchained keys of
    blocks 1-3 equal the first request's, so they are reused one block position earlier."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(docs):
        doc = _blocks(rng, 4 * block_size, vocab)
        prompts.append(np.concatenate([doc, _blocks(rng, 5, vocab)]))
        prompts.append(np.concatenate([doc[block_size:], _blocks(rng, 7, vocab)]))
    return UnsafeScenario(
        "unchained", "position: blocks computed at positions 16-63 reused at 0-47 (RoPE keys rotated wrongly)",
        from_lists(prompts, arrival=np.arange(len(prompts), dtype=float)),
        BlockHasher(model_id=mid), BlockHasher(model_id=mid, chained=False),
    )


def forge_collision(hasher: BlockHasher, target: int, block_size: int, vocab: int, rng: np.random.Generator,
                    max_tries: int = 1 << 20) -> np.ndarray:
    """A random first block whose key under ``hasher`` equals ``target`` (feasible for truncated keys)."""
    for _ in range(max_tries):
        cand = _blocks(rng, block_size, vocab)
        if hasher.token_keys(cand, block_size)[0] == target:
            return cand
    raise ConfigError(f"no collision with key {target} in {max_tries} tries ({hasher.key_bits}-bit keys)")


def truncated(mid: str, vocab: int, *, block_size: int = 16, seed: int = 0, docs: int = 3,
              bits: int = 8) -> UnsafeScenario:
    """Document (3 blocks) + question, then a forged first block colliding with the document's under
    ``bits``-bit keys + the document's blocks 1-2: one collision makes the whole chain match."""
    rng = np.random.default_rng(seed)
    unsafe = BlockHasher(model_id=mid, truncate_bits=bits)
    prompts = []
    for _ in range(docs):
        doc = _blocks(rng, 3 * block_size, vocab)
        forged = forge_collision(unsafe, unsafe.token_keys(doc, block_size)[0], block_size, vocab, rng)
        prompts.append(np.concatenate([doc, _blocks(rng, 5, vocab)]))
        prompts.append(np.concatenate([forged, doc[block_size:], _blocks(rng, 6, vocab)]))
    return UnsafeScenario(
        "truncated", f"identity: a {bits}-bit key collision on block 0 serves another prompt's whole chain",
        from_lists(prompts, arrival=np.arange(len(prompts), dtype=float)),
        BlockHasher(model_id=mid), unsafe,
    )


def no_adapter(mid: str, vocab: int, *, block_size: int = 16, seed: int = 0, docs: int = 3) -> UnsafeScenario:
    """Document + question under adapter A, the same document under B, then again under A (a true hit)."""
    rng = np.random.default_rng(seed)
    prompts, adapters = [], []
    for _ in range(docs):
        doc = _blocks(rng, 3 * block_size, vocab)
        for name in (ADAPTERS[0], ADAPTERS[1], ADAPTERS[0]):
            prompts.append(np.concatenate([doc, _blocks(rng, 5, vocab)]))
            adapters.append(name)
    return UnsafeScenario(
        "no_adapter", "model identity: K/V computed under adapter lora-a served to lora-b",
        from_lists(prompts, arrival=np.arange(len(prompts), dtype=float), adapter=adapters),
        BlockHasher(model_id=mid), BlockHasher(model_id=mid, include_adapter=False), adapters=ADAPTERS,
    )


def _text(rng: np.random.Generator, n_words: int) -> str:
    return " ".join(_WORDS[i] for i in rng.integers(0, len(_WORDS), size=n_words))


def text_key_values(text: str, tokens: Sequence[int]) -> np.ndarray:
    """The text's UTF-8 bytes as per-token key values (needs one byte per token, as ByteTokenizer gives)."""
    data = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    if len(data) != len(tokens):
        raise ConfigError(f"text-keyed values need one byte per token: {len(data)} bytes, {len(tokens)} tokens")
    return data


def text_keyed(mid: str, vocab: int, *, block_size: int = 16, seed: int = 0, docs: int = 3) -> UnsafeScenario:
    """The same text tokenised by two tokenizers (byte ids, and byte ids + 3: a vocabulary with three more
    special tokens in front). Keyed by text they share every block; their token ids share none."""
    if vocab < 256 + max(TEXT_OFFSETS):
        raise ConfigError(f"text_keyed needs a vocabulary of >= {256 + max(TEXT_OFFSETS)} ids, got {vocab}")
    rng = np.random.default_rng(seed)
    toks = [ByteTokenizer(off) for off in TEXT_OFFSETS]
    prompts, values = [], []
    for _ in range(docs):
        text = _text(rng, 14)
        for tok in toks:
            ids = tok.encode(text)
            prompts.append(ids)
            values.append(text_key_values(text, ids))
    return UnsafeScenario(
        "text_keyed", "tokenization: K/V of ByteTokenizer(0) ids served to ByteTokenizer(3) ids of the same text",
        from_lists(prompts, arrival=np.arange(len(prompts), dtype=float)),
        BlockHasher(model_id=mid), BlockHasher(model_id=mid), unsafe_key_values=values,
    )


def unsafe_scenarios(mid: str, vocab: int, *, block_size: int = 16, seed: int = 0) -> list[UnsafeScenario]:
    """One scenario per unsafe variant (module docstring), for a model id and vocabulary size."""
    return [f(mid, vocab, block_size=block_size, seed=seed) for f in (unchained, truncated, no_adapter, text_keyed)]


def _share(flags: np.ndarray) -> float:
    """Mean of a boolean array; NaN when empty (no request qualified)."""
    return float(flags.mean()) if len(flags) else float("nan")


def measure_unsafe(
    model: torch.nn.Module,
    scenarios: Sequence[UnsafeScenario] | None = None,
    *,
    block_size: int = 16,
    capacity_blocks: int | None = None,
    verify_tokens: int = 4,
    seed: int = 0,
    device: str | torch.device | None = None,
    num_threads: int | None = None,
    **old_names: int,
) -> pd.DataFrame:
    """Run each scenario under its safe and its unsafe scheme (verify mode); one row per (scenario, scheme).

    Columns: ``hit_blocks`` reused, ``false_hit_blocks`` reused with a different true identity (in
    ``false_hit_requests`` requests), ``failed_requests`` (verify), ``logit_max_abs`` (max over requests),
    ``logit_max_abs_false`` / ``logit_rel_false`` (median over requests with a false hit),
    ``argmax_agreement`` (share of clear-margin requests whose argmax matches), ``greedy_agreement`` (mean
    share of leading greedy tokens that match), both also over false-hit requests only (``*_false``, NaN
    without any), ``kv_max_abs`` (max over requests, pool vs reference). ``capacity_blocks``: each engine's
    pool in blocks (default 64; the old keyword ``num_blocks`` is accepted too).
    """
    capacity_blocks = renamed_keyword("measure_unsafe", "capacity_blocks", capacity_blocks, old_names)
    if capacity_blocks is None:
        capacity_blocks = 64
    if scenarios is None:
        scenarios = unsafe_scenarios(model_id(model), vocab_size(model), block_size=block_size, seed=seed)
    rows = []
    for sc in scenarios:
        for scheme in ("safe", "unsafe"):
            adapters = AdapterSet(model, sc.adapters, seed=seed) if sc.adapters else None
            try:
                engine = Engine(model, capacity_blocks=capacity_blocks, block_size=block_size,
                                hasher=sc.safe if scheme == "safe" else sc.unsafe, adapters=adapters,
                                device=device, num_threads=num_threads)
                values = sc.unsafe_key_values if scheme == "unsafe" else None
                res = engine.run(sc.workload, verify=True, verify_tokens=verify_tokens, key_values=values,
                                 key_label="text-keyed")
            finally:
                if adapters is not None:
                    adapters.remove()
            f = res.requests
            false = f[f["false_hit_blocks"] > 0]
            clear = f["verify_argmax_clear"].to_numpy(bool)
            f_clear = false["verify_argmax_clear"].to_numpy(bool)
            rows.append({
                "scenario": sc.name,
                "scheme": scheme,
                "hash": res.summary["hash"],
                "requests": len(f),
                "hit_blocks": int(f["hit_blocks"].sum()),
                "false_hit_blocks": int(f["false_hit_blocks"].sum()),
                "false_hit_requests": len(false),
                "failed_requests": int((~f["verify_passed"].to_numpy(bool)).sum()),
                "logit_max_abs": float(f["verify_logit_max_abs"].max()),
                "logit_max_abs_false": float(false["verify_logit_max_abs"].median()) if len(false) else 0.0,
                "logit_rel_false": float(false["verify_logit_rel"].median()) if len(false) else 0.0,
                "argmax_agreement": _share(f["verify_argmax_match"].to_numpy(bool)[clear]),
                "argmax_agreement_false": _share(false["verify_argmax_match"].to_numpy(bool)[f_clear]),
                "greedy_agreement": float((f["verify_greedy_agree"] / f["verify_greedy_k"]).mean()),
                "greedy_agreement_false": float((false["verify_greedy_agree"] / false["verify_greedy_k"]).mean())
                if len(false) else float("nan"),
                "kv_max_abs": float(f["verify_kv_max_abs"].max()),
                "breaks": sc.breaks,
            })
    return pd.DataFrame(rows)
