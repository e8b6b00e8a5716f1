"""Block hashing: chained block keys (DESIGN.md "Block key") and dense-id workload encoding."""

from kvlab.hashing.hasher import (
    BLOCK_RESIZE_CAVEAT,
    ENCODING_VERSION,
    SCHEMES,
    STABLE_SCHEMES,
    BlockHasher,
    EncodedWorkload,
    encode_workload,
    truth_hasher,
)

__all__ = [
    "BLOCK_RESIZE_CAVEAT",
    "ENCODING_VERSION",
    "SCHEMES",
    "STABLE_SCHEMES",
    "BlockHasher",
    "EncodedWorkload",
    "encode_workload",
    "truth_hasher",
]
