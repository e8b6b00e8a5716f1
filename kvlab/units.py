"""Unit constants, defined once: binary byte sizes and the millisecond.

Bytes: ``KIB`` = 2**10, ``MIB`` = 2**20, ``GIB`` = 2**30, ``TIB`` = 2**40 (kvlab's GiB/TiB are binary:
``capacity_gib`` is ``capacity_gib * GIB`` bytes). Time: seconds throughout; ``MS_PER_S`` converts
seconds to milliseconds for display only. Plain ints/floats, so arithmetic with them is exact as before.
"""

from __future__ import annotations

#: bytes in a kibibyte (2**10)
KIB: int = 1 << 10
#: bytes in a mebibyte (2**20)
MIB: int = 1 << 20
#: bytes in a gibibyte (2**30)
GIB: int = 1 << 30
#: bytes in a tebibyte (2**40)
TIB: int = 1 << 40
#: milliseconds per second (a display factor: kvlab's times are seconds)
MS_PER_S: float = 1e3

__all__ = ["GIB", "KIB", "MIB", "MS_PER_S", "TIB"]
