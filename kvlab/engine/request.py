"""One request's life on the engine: the :class:`Request` served, the :class:`SequenceState` it runs as
between prefill and release, and what :meth:`~kvlab.engine.driver.Engine.prefill` and
:meth:`~kvlab.engine.driver.Engine.decode` report.

Units: token counts in tokens, block counts in blocks, times in seconds (``*_s``).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from kvlab.cache import AccessContext, KVBlock
from kvlab.errors import ConfigError
from kvlab.names import renamed_attribute
from kvlab.workload.workload import Workload


def _label(column: pd.Categorical | None, i: int) -> str | None:
    if column is None:
        return None
    value = column[i]
    return None if pd.isna(value) else str(value)


@dataclass(eq=False)
class Request:
    """One prompt to serve.

    ``tokens``: int64 token ids (P >= 1). ``output_tokens``: tokens to generate (>= 1; the first comes
    from the prefill's logits, each further one costs a decode step). ``forced_outputs``: known output
    ids emitted instead of the argmax (teacher forcing, so a later turn can reuse the answer's blocks).
    ``key_values`` (unsafe research hook): values hashed instead of the token ids (same length), e.g.
    the text's bytes for text-keyed reuse. ``seq``: admission index for the policy context (-1: the
    engine's counter).
    """

    tokens: np.ndarray
    request_id: int = -1
    arrival: float = 0.0
    output_tokens: int = 1
    forced_outputs: np.ndarray | None = None
    adapter: str | None = None
    salt: str | None = None
    tenant: str | None = None
    category: str | None = None
    turn: int = -1
    key_values: np.ndarray | None = None
    seq: int = -1
    _keys: tuple[list[int], list[Hashable]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.tokens = np.ascontiguousarray(self.tokens, dtype=np.int64)
        if self.tokens.ndim != 1 or len(self.tokens) == 0:
            raise ConfigError(f"a request needs a 1-D prompt of >= 1 token ids, got shape {self.tokens.shape}")
        if int(self.output_tokens) < 1:
            raise ConfigError(f"output_tokens must be >= 1 (the prefill emits one), got {self.output_tokens}")
        if self.key_values is not None:
            self.key_values = np.ascontiguousarray(self.key_values, dtype=np.int64)
            if self.key_values.shape != self.tokens.shape:
                raise ConfigError(
                    f"key_values has shape {self.key_values.shape}, the prompt {self.tokens.shape}: "
                    "custom keys need one value per token"
                )

    @classmethod
    def from_workload(
        cls, workload: Workload, i: int, *, output_tokens: int | str = 1, force_outputs: bool = False
    ) -> Request:
        """Row ``i`` of a token workload. ``output_tokens``: an int, or ``"workload"`` for the row's
        ``output_length`` (at least 1). ``force_outputs`` emits the row's known output ids when it has them."""
        if workload.kind != "tokens":
            raise ConfigError(
                "the engine runs token workloads; expand a block-id trace first (kvlab.workload.expand_to_tokens)"
            )
        if output_tokens == "workload":
            n_out = max(1, int(workload.output_length[i]))
        elif isinstance(output_tokens, int | np.integer) and not isinstance(output_tokens, bool):
            n_out = int(output_tokens)
        else:
            raise ConfigError(f"output_tokens must be an int >= 1 or 'workload', got {output_tokens!r}")
        forced = workload.output(i) if force_outputs else None
        return cls(
            tokens=workload.prompt(i),
            request_id=int(workload.request_id[i]),
            arrival=float(workload.arrival[i]),
            output_tokens=n_out,
            forced_outputs=None if forced is None or len(forced) == 0 else np.asarray(forced, dtype=np.int64),
            adapter=_label(workload.adapter, i),
            salt=_label(workload.salt, i),
            tenant=_label(workload.tenant, i),
            category=_label(workload.category, i),
            turn=int(workload.turn[i]) if workload.turn is not None else -1,
            seq=i,
        )


@dataclass(eq=False)
class SequenceState:
    """A running request between prefill and release.

    Invariants: ``tokens`` are the ids whose K/V are computed (prompt, then fed output tokens), in the
    pool at positions ``0 .. len(tokens) - 1`` of ``blocks`` and in ``cache`` (the working copy);
    ``blocks[:len(keys)]`` carry keys; ``emitted[-1]`` is the next token to feed; ``logits`` are the
    last computed position's logits.
    """

    request: Request
    tokens: list[int]
    blocks: list[KVBlock]
    keys: list[int]
    cache: object
    logits: torch.Tensor
    emitted: list[int]
    ctx: AccessContext
    hit_blocks: int
    decode_blocks: int = 0
    decode_evictions: int = 0
    released: bool = False

    @property
    def num_computed(self) -> int:
        """Tokens whose K/V are stored (positions)."""
        return len(self.tokens)


@dataclass
class PrefillResult:
    """What one prefill did. ``state`` is None when the request was not admitted (nothing changed).

    Times (seconds, device-synchronised): ``lookup_s`` hashing, lookup and allocation (``hash_s`` of it:
    the prompt's block keys, 0 when the request was hashed before, as ``run`` does); ``gather_s`` pool
    -> working cache; ``forward_s`` the suffix forward; ``scatter_s`` working cache -> pool and keying;
    ``prefill_s`` the whole call, which is the TTFT when the request did not queue.
    """

    admitted: bool
    prompt_tokens: int
    full_blocks: int
    hit_blocks: int = 0
    hit_tokens: int = 0
    computed_prompt_tokens: int = 0
    new_blocks: int = 0
    evictions: int = 0
    orphan_evictions: int = 0
    false_hit_blocks: int = 0
    first_token: int = -1
    logits: torch.Tensor | None = None
    lookup_s: float = 0.0
    gather_s: float = 0.0
    forward_s: float = 0.0
    scatter_s: float = 0.0
    prefill_s: float = 0.0
    state: SequenceState | None = None
    hash_s: float = 0.0

    #: the old name of ``computed_prompt_tokens`` (the prompt tokens this prefill ran through the model)
    computed_tokens = renamed_attribute("computed_prompt_tokens")


@dataclass
class DecodeResult:
    """Tokens emitted by ``decode`` (in order), the steps run, blocks allocated and evicted, seconds."""

    tokens: list[int]
    steps: int
    new_blocks: int
    evictions: int
    decode_s: float
