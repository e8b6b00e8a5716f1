"""Batched forward (kvlab.engine.batched) vs one sequence per forward: decode and prefill tokens/s.

Model: the ``cpu-bench`` shape (Llama, 4 layers, hidden 512, 8 query / 2 KV heads of 64 dims, MLP 1,536,
vocabulary 32,000), random weights, fp32, block size 16 (``--shape`` / ``--device`` / ``--dtype`` for others).

* **decode**: ``B`` sequences, each with a ``--context``-token prompt already in the pool, run ``--steps``
  greedy decode steps. *sequential* = the driver's way: one ``forward_tokens`` per sequence and step with the
  sequence's working cache (``DynamicCache``); *batched* = one ``forward_batch`` per step over the ``B``
  decode tokens. tokens/s = ``B x steps / wall seconds``.
* **prefill**: ``B`` prompts of ``--prompt`` tokens from position 0. *sequential* = one ``forward_tokens``
  per prompt; *batched* = one ``forward_batch`` over all of them. tokens/s = ``B x prompt / wall seconds``.

Each measurement is the best (min) of ``--repeats`` after one warm-up, alternating the two methods; on a
shared machine the median is printed beside it. Targets (issue 13): decode at batch 16 >= 3x sequential,
prefill within 5 % of sequential.

Run: ``python benchmarks/bench_batched.py [--batches 1 4 16] [--threads 1] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvlab.engine import PagedModel, build_random_model
from kvlab.engine.batched import BatchEntry
from kvlab.engine.compute import sync_device


def _tables(batch: int, blocks_each: int) -> list[list[int]]:
    return [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]


def decode_sequential(pm: PagedModel, prompts: list[np.ndarray], tables: list[list[int]], steps: int) -> float:
    caches, last = [], []
    for p, t in zip(prompts, tables, strict=True):
        logits, cache = pm.forward_tokens(p, t, 0)
        caches.append(cache)
        last.append(int(logits.argmax()))
    sync_device(pm.device)
    t0 = time.perf_counter()
    for step in range(steps):
        for i, (p, t) in enumerate(zip(prompts, tables, strict=True)):
            logits, caches[i] = pm.forward_tokens([last[i]], t, len(p) + step, working=caches[i])
            last[i] = int(logits.argmax())
    sync_device(pm.device)
    return time.perf_counter() - t0


def decode_batched(pm: PagedModel, prompts: list[np.ndarray], tables: list[list[int]], steps: int) -> float:
    logits = pm.forward_batch([BatchEntry(t, 0, p) for p, t in zip(prompts, tables, strict=True)])
    last = [int(x.argmax()) for x in logits]
    sync_device(pm.device)
    t0 = time.perf_counter()
    for step in range(steps):
        logits = pm.forward_batch([BatchEntry(t, len(p) + step, [tok])
                                   for p, t, tok in zip(prompts, tables, last, strict=True)])
        last = [int(x.argmax()) for x in logits]
    sync_device(pm.device)
    return time.perf_counter() - t0


def prefill_sequential(pm: PagedModel, prompts: list[np.ndarray], tables: list[list[int]]) -> float:
    sync_device(pm.device)
    t0 = time.perf_counter()
    for p, t in zip(prompts, tables, strict=True):
        pm.forward_tokens(p, t, 0)
    sync_device(pm.device)
    return time.perf_counter() - t0


def prefill_batched(pm: PagedModel, prompts: list[np.ndarray], tables: list[list[int]]) -> float:
    sync_device(pm.device)
    t0 = time.perf_counter()
    pm.forward_batch([BatchEntry(t, 0, p) for p, t in zip(prompts, tables, strict=True)])
    sync_device(pm.device)
    return time.perf_counter() - t0


def measure(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Run each timing function once (warm-up) and then ``repeats`` times, alternating; seconds per run."""
    for fn in fns.values():
        fn()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            out[name].append(fn())
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="cpu-bench")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=256, help="prompt tokens before decoding")
    ap.add_argument("--steps", type=int, default=16, help="decode steps per measurement")
    ap.add_argument("--prompt", type=int, default=256, help="prefill prompt tokens")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = build_random_model(args.shape, seed=0, dtype=args.dtype, device=args.device)
    bs = args.block_size
    blocks_each = -(-(max(args.context + args.steps, args.prompt) + 1) // bs)
    pm = PagedModel(model, capacity_blocks=blocks_each * max(args.batches), block_size=bs,
                    num_threads=args.threads)
    rng = np.random.default_rng(0)
    vocab = pm.vocab_size
    print(f"# {args.shape} {pm.model_dtype} on {pm.device}, {args.threads} thread(s), block {bs}; "
          f"best of {args.repeats} (median)")
    print("| phase | batch | tokens | sequential tok/s | batched tok/s | batched / sequential |")
    print("|---|---:|---:|---:|---:|---:|")
    for phase in ("decode", "prefill"):
        for batch in args.batches:
            tables = _tables(batch, blocks_each)
            if phase == "decode":
                prompts = [rng.integers(0, vocab, args.context) for _ in range(batch)]
                tokens = batch * args.steps
                fns = {"sequential": lambda p=prompts, t=tables: decode_sequential(pm, p, t, args.steps),
                       "batched": lambda p=prompts, t=tables: decode_batched(pm, p, t, args.steps)}
            else:
                prompts = [rng.integers(0, vocab, args.prompt) for _ in range(batch)]
                tokens = batch * args.prompt
                fns = {"sequential": lambda p=prompts, t=tables: prefill_sequential(pm, p, t),
                       "batched": lambda p=prompts, t=tables: prefill_batched(pm, p, t)}
            with torch.no_grad():
                runs = measure(fns, args.repeats)
            best = {k: tokens / min(v) for k, v in runs.items()}
            med = {k: tokens / statistics.median(v) for k, v in runs.items()}
            print(f"| {phase} | {batch} | {tokens} | {best['sequential']:,.0f} ({med['sequential']:,.0f}) | "
                  f"{best['batched']:,.0f} ({med['batched']:,.0f}) | "
                  f"{best['batched'] / best['sequential']:.2f} ({med['batched'] / med['sequential']:.2f}) |",
                  flush=True)


if __name__ == "__main__":
    main()
