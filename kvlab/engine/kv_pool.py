"""The paged KV pool: one device tensor of ``num_blocks`` blocks, indexed by the cache core's block ids.

Layout ``[num_blocks, layers, 2, kv_heads, block_size, head_dim]`` (``2`` = keys, values), one dtype.
Block-major: block ``b`` is one contiguous chunk holding every layer's K and V for its ``block_size``
token slots, so moving a block (gather, a future offload tier) is a single index along dim 0 and
``bytes_per_block = 2 x layers x kv_heads x head_dim x block_size x bytes per value`` is a plain slice.
Slot ``s`` of block ``b`` holds the K/V of token position ``j * block_size + s`` of a sequence whose
``j``-th block is ``b``. Keys are stored after RoPE (as the model caches them), so a block is only valid
at the positions it was computed for (seed 000).

Gather and write are vectorised: one ``index_select`` over the block dim of a permuted view for a gather
(a single copy, already in sequence order), one indexed assignment over (block, slot) pairs for a write;
no per-token Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvlab.errors import ConfigError


@dataclass(frozen=True)
class KVLayout:
    """Shape of one token's and one block's K/V. Units: ``block_size`` in tokens, sizes in bytes."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def bytes_per_value(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """``2 x layers x kv_heads x head_dim x bytes per value`` (docs/semantics.md kv_bytes_per_token)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_value

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_for_bytes(self, capacity_bytes: int) -> int:
        """Whole blocks that fit in ``capacity_bytes`` (rounded down; at least 1 or ConfigError)."""
        if int(capacity_bytes) < self.bytes_per_block:
            raise ConfigError(
                f"capacity of {capacity_bytes} bytes holds no block of {self.bytes_per_block} bytes "
                f"({self.block_size} tokens x {self.bytes_per_token} bytes per token)"
            )
        return int(capacity_bytes) // self.bytes_per_block

    def pool_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        return (num_blocks, self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    def to_dict(self) -> dict:
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "block_size": self.block_size,
            "dtype": str(self.dtype).removeprefix("torch."),
            "bytes_per_token": self.bytes_per_token,
            "bytes_per_block": self.bytes_per_block,
        }


class KVPool:
    """``num_blocks`` blocks of K/V on ``device`` (module docstring: layout). Initially all zeros."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu") -> None:
        if num_blocks < 1:
            raise ConfigError(f"a KV pool needs >= 1 block, got {num_blocks}")
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.device = torch.device(device)
        self.data = torch.zeros(layout.pool_shape(self.num_blocks), dtype=layout.dtype, device=self.device)

    @property
    def nbytes(self) -> int:
        """Bytes of the pool tensor (``num_blocks x bytes_per_block``)."""
        return self.num_blocks * self.layout.bytes_per_block

    def _ids(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)

    def gather(self, block_ids: Sequence[int], num_tokens: int | None = None) -> torch.Tensor:
        """K/V of the sequence stored in ``block_ids`` (in order): ``[layers, 2, kv_heads, T, head_dim]``,
        ``T = num_tokens`` (default: all slots, ``len(block_ids) x block_size``). A new tensor."""
        lay = self.layout
        n = len(block_ids)
        total = n * lay.block_size
        if num_tokens is None:
            num_tokens = total
        if not 0 <= num_tokens <= total:
            raise ConfigError(f"cannot gather {num_tokens} tokens from {n} blocks of {lay.block_size}")
        if n == 0:
            return self.data.new_zeros((lay.num_layers, 2, lay.num_kv_heads, 0, lay.head_dim))
        # one copy: select the blocks from a [L, 2, H, N, bs, D] view, so the result is already sequence-major
        picked = self.data.permute(1, 2, 3, 0, 4, 5).index_select(3, self._ids(block_ids))
        kv = picked.view(lay.num_layers, 2, lay.num_kv_heads, total, lay.head_dim)
        return kv[:, :, :, :num_tokens]

    def write(self, block_ids: Sequence[int], start: int, kv: torch.Tensor) -> None:
        """Store ``kv`` [layers, 2, kv_heads, T, head_dim] as token positions ``[start, start + T)`` of the
        sequence whose blocks are ``block_ids`` (position p goes to slot ``p % block_size`` of block
        ``block_ids[p // block_size]``). Cast to the pool dtype."""
        lay = self.layout
        count = int(kv.shape[3])
        if count == 0:
            return
        expected = (lay.num_layers, 2, lay.num_kv_heads, count, lay.head_dim)
        if tuple(kv.shape) != expected:
            raise ConfigError(f"KV of shape {tuple(kv.shape)} does not fit the pool layout {expected}")
        if start < 0 or start + count > len(block_ids) * lay.block_size:
            raise ConfigError(f"positions [{start}, {start + count}) exceed {len(block_ids)} blocks")
        pos = torch.arange(start, start + count, device=self.device)
        blocks = self._ids(block_ids)[pos // lay.block_size]
        slots = pos % lay.block_size
        view = self.data.permute(0, 4, 1, 2, 3, 5)  # [N, bs, L, 2, H, D], a view of the pool
        view[blocks, slots] = kv.permute(3, 0, 1, 2, 4).to(lay.dtype)
