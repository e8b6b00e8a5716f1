"""The columns of a run's tables checked against the metric table (kvlab.metrics), so that a result whose
checksums match but whose columns are not kvlab's (a hand-edited manifest) is refused by name.

Rules, for a run whose manifest's ``driver`` is one of :data:`kvlab.metrics.DRIVERS` and each of its tables
that :data:`kvlab.metrics.TABLES` defines (``requests.parquet``, ``timeseries.parquet``), after old names are
read under today's (kvlab.names):

* every column is an entry of that table, or matches a pattern entry (``hit_tokens_dram`` is
  ``hit_tokens_<tier>``, :func:`kvlab.metrics.table_name`);
* its dtype fits the entry's unit: ``bool`` a boolean column (or an object column of booleans and missing
  values); ``label``, ``id``, ``list`` and ``as <metric>`` any dtype (trace labels are text or numbers); every
  other unit (tokens, blocks, seconds, bytes, fractions, counts...) a numeric, non-boolean column;
* ``requests.parquet`` has :data:`kvlab.metrics.SUMMARY_INPUTS`, the columns every summary is computed from.

Runs of other drivers (layout and tier studies, which write tables of their own) and tables the metric table
does not define are read without this check.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from pandas.api import types

from kvlab.errors import ResultsError, printable
from kvlab.metrics import DRIVERS, SUMMARY_INPUTS, TABLES, table_name

#: units whose columns may hold any dtype: text or numbers
ANY_DTYPE = ("label", "id", "list", "as <metric>")


def fits(unit: str, column: pd.Series) -> bool:
    """Whether ``column``'s dtype fits ``unit`` (module docstring)."""
    dtype = column.dtype
    if unit in ANY_DTYPE:
        return True
    if unit == "bool":
        if types.is_bool_dtype(dtype):
            return True
        return types.is_object_dtype(dtype) and all(isinstance(v, bool) for v in column.dropna())
    return types.is_numeric_dtype(dtype) and not types.is_bool_dtype(dtype)


def check_columns(path: Path, driver: object, tables: dict[str, pd.DataFrame]) -> None:
    """Refuse (ResultsError naming the file and the column) a table of run ``path`` whose columns are not
    the metric table's (module docstring); ``driver``: the manifest's."""
    if driver not in DRIVERS:
        return
    for name, frame in tables.items():
        file = f"{name}.parquet"
        table = TABLES.get(file)
        if table is None:
            continue
        for column in frame.columns:
            entry = table_name(str(column), table)
            if entry is None:
                raise ResultsError(f"{path / file}: column {printable(str(column))!r} is not a {file} column of "
                                   "kvlab.metrics (docs/metrics.md); the file was not written by kvlab")
            unit = table[entry].unit
            if not fits(unit, frame[column]):
                raise ResultsError(f"{path / file}: column {column!r} is {frame[column].dtype}, not a {unit} "
                                   "column (kvlab.metrics); the file was not written by kvlab")
        if file == "requests.parquet":
            missing = [c for c in SUMMARY_INPUTS if c not in frame.columns]
            if missing:
                raise ResultsError(f"{path / file}: lacks column {missing[0]!r} (every {file} kvlab writes has "
                                   f"{', '.join(SUMMARY_INPUTS)})")


__all__ = ["ANY_DTYPE", "check_columns", "fits"]
