"""Block hashing: chained block keys (``keys``, docs/semantics.md, "Blocks and keys") and dense-id workload
encoding (``encode``)."""

from kvlab.hashing.encode import BLOCK_RESIZE_CAVEAT, EncodedWorkload, encode_workload
from kvlab.hashing.keys import ENCODING_VERSION, SCHEMES, STABLE_SCHEMES, BlockHasher, truth_hasher

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
