"""kvlab's own trace formats, JSONL and Parquet: the old import path of their loaders and writers.

The format lives in three modules: :mod:`.native_schema` (fields, header, the rules both readers and
both writers share), :mod:`.native_jsonl` and :mod:`.native_parquet`.
"""

from kvlab.workload.native_jsonl import load_jsonl, save_jsonl
from kvlab.workload.native_parquet import load_parquet, save_parquet

__all__ = ["load_jsonl", "load_parquet", "save_jsonl", "save_parquet"]
