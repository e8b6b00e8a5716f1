"""Workloads: the columnar request stream, trace loaders, generators and token expansion."""

from kvlab.workload.alibaba import chain_block_ids, load_alibaba
from kvlab.workload.expand import block_tokens, expand_to_tokens
from kvlab.workload.generate import synthetic_chat, zipf_blocks
from kvlab.workload.load import load_trace
from kvlab.workload.mooncake import load_mooncake
from kvlab.workload.native_jsonl import load_jsonl, save_jsonl
from kvlab.workload.native_parquet import load_parquet, save_parquet
from kvlab.workload.objects import flatten_blocks, object_sequence
from kvlab.workload.registry import TRACES, detect_format, download, resolve_trace
from kvlab.workload.text import ByteTokenizer, mt_bench_sessions, rag_prompts, sharegpt_first_turns
from kvlab.workload.workload import Workload, from_lists

__all__ = [
    "TRACES",
    "ByteTokenizer",
    "Workload",
    "block_tokens",
    "chain_block_ids",
    "detect_format",
    "download",
    "expand_to_tokens",
    "flatten_blocks",
    "from_lists",
    "load_alibaba",
    "load_jsonl",
    "load_mooncake",
    "load_parquet",
    "load_trace",
    "mt_bench_sessions",
    "object_sequence",
    "rag_prompts",
    "resolve_trace",
    "save_jsonl",
    "save_parquet",
    "sharegpt_first_turns",
    "synthetic_chat",
    "zipf_blocks",
]
