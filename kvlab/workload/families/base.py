"""Shared types of the workload families: generated requests, length and arrival distributions, text pools.

A family turns a config (a validated pydantic model, :class:`FamilyConfig`, fixed seed) into a list of
:class:`GeneratedRequest` objects: messages made of tagged :class:`~kvlab.workload.render.Part` s, an
arrival time (seconds), an output length (tokens) and labels. :func:`kvlab.workload.families.family_workload`
renders them once into a segmented token :class:`~kvlab.workload.workload.Workload`.

Units: lengths are **tokens** of the config's ``tokenizer`` (the *length tokenizer*, ``kvlab-bpe`` by
default); a text cut to ``n`` tokens tokenises to exactly ``n`` tokens on its own and to about ``n`` inside
a rendered prompt (BPE is not compositional). Times are **seconds**; rates are per second.

Randomness: only ``numpy.random.Generator(PCG64(seed))``, one stream per family run, so a config gives the
same requests on every machine.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal

import numpy as np
import pandas as pd
from pydantic import Field

from kvlab.arguments import require_text
from kvlab.errors import ConfigError
from kvlab.schema import Schema
from kvlab.workload._common import csr
from kvlab.workload.render import Message as Message  # re-exported: families build Messages
from kvlab.workload.render import Part
from kvlab.workload.tokenizer import ByteTextTokenizer, HFTokenizer, TextTokenizer, load_tokenizer

ANSWER_SOURCES = ("reference", "corpus", "none")
"""Where a request's answer text comes from: a data set's own answer, corpus text of a fitted length, none."""

REASONING_OPEN = "<think>\n"
REASONING_CLOSE = "\n</think>\n\n"
"""Reasoning text is an ``output`` part wrapped in these markers (Qwen3's ``<think>`` block)."""


def reasoning_part(text: str) -> Part:
    """An ``output`` part holding reasoning text, marked with :data:`REASONING_OPEN` / :data:`REASONING_CLOSE`."""
    return Part("output", REASONING_OPEN + text + REASONING_CLOSE)


def is_reasoning(part: Part) -> bool:
    """Whether ``part`` is reasoning (an ``output`` part made by :func:`reasoning_part`)."""
    return part.kind == "output" and part.text.startswith(REASONING_OPEN) and part.text.endswith(REASONING_CLOSE)


@dataclass(frozen=True)
class GeneratedRequest:
    """One generated request: what to render, when it arrives, what it produces, and its labels.

    ``messages`` are the prompt (each part tagged with its segment kind); ``response`` is the assistant
    output this request produces when its text is known (``output`` parts: reasoning, a tool call, an
    answer), else empty. ``output_tokens`` counts the response in length-tokenizer tokens (or is drawn from
    the output-length distribution when there is no response text). ``turn`` is 1-based; ``session`` and
    ``tenant`` are 0-based ids within one family run. ``meta`` holds family details (ids of the documents,
    system prompt, record used) and takes no part in equality.
    """

    messages: tuple[Message, ...]
    arrival: float  # seconds
    output_tokens: int  # tokens
    session: int
    turn: int
    tenant: int
    category: str
    answer_source: str  # one of ANSWER_SOURCES
    response: tuple[Part, ...] = ()
    meta: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if self.answer_source not in ANSWER_SOURCES:
            raise ConfigError(f"GeneratedRequest.answer_source {self.answer_source!r} is not one of {ANSWER_SOURCES}")


# ------------------------------------------------------------------------------------------ distributions
FITTED_OUTPUT_LENGTHS: dict[str, dict] = {
    # levels in percent; quantiles in tokens (numpy.percentile, linear) of the trace's output_length column
    "mooncake_conversation": {
        "levels": [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 97.5, 99, 99.9, 100],
        "quantiles": [1.0, 10.0, 24.0, 46.0, 100.0, 156.5, 213.0, 256.0, 291.0, 322.5, 350.0, 375.0, 399.0, 423.0,
                      447.0, 472.0, 504.0, 543.0, 597.0, 698.0, 835.2, 1118.5, 2000.0, 2000.0],
        "mean": 342.62, "lognormal": (5.3364, 1.3584),
        "source": "Mooncake FAST'25 conversation_trace.jsonl (12,031 requests; git blob 5a371794), "
                  "../shared/traces/mooncake; mean 342.62 tokens (paper Table 2: 343)",
    },
    "mooncake_synthetic": {
        "levels": [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 97.5, 99, 99.9, 100],
        "quantiles": [1.0, 2.0, 4.0, 6.0, 8.0, 11.0, 16.0, 22.0, 32.0, 49.0, 69.0, 92.0, 126.0, 169.0, 210.4, 250.0,
                      288.6, 332.2, 389.0, 519.0, 658.0, 768.1, 813.1, 893.0],
        "mean": 149.12, "lognormal": (3.9163, 1.7685),
        "source": "Mooncake FAST'25 synthetic_trace.jsonl (3,993 requests; git blob e4838049), "
                  "../shared/traces/mooncake",
    },
    "alibaba_traceA_sample": {
        "levels": [0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 97.5, 99, 99.9, 100],
        "quantiles": [37.0, 208.0, 222.4, 234.9, 285.0, 322.5, 342.9, 371.4, 402.6, 418.3, 432.0, 445.2, 466.8,
                      519.8, 566.6, 569.8, 582.4, 641.7, 810.3, 822.3, 910.6, 963.7, 995.5, 999.0],
        "mean": 461.95, "lognormal": (5.9697, 0.6804),
        "source": "Alibaba Bailian traceA, the 20-record sample "
                  "../shared/traces/alibaba/sample_traceA_multiturn_20.jsonl "
                  "(multi-turn; too small for the tail: prefer mooncake_conversation)",
    },
}
"""Output-length fits (tokens), computed once from ../shared/traces with :func:`fit_lengths` and cached here
with their source (tests/test_families.py recomputes them): an empirical quantile table (sampled by inverse
CDF, linear between levels) and, for reference, the lognormal ``(mu, sigma)`` of ``log(output_length)``."""


FIT_LEVELS = (0, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90, 95, 97.5, 99, 99.9, 100)


def fit_lengths(values: Sequence[int] | np.ndarray, source: str) -> dict:
    """A :data:`FITTED_OUTPUT_LENGTHS` entry for ``values`` (tokens): quantiles at :data:`FIT_LEVELS` (numpy's
    linear percentiles, rounded to 0.1), the mean and the lognormal ``(mu, sigma)`` of ``log(max(v, 1))``."""
    v = np.asarray(values, dtype=np.float64)
    if not len(v):
        raise ConfigError("fit_lengths: no values")
    logs = np.log(np.maximum(v, 1))
    return {"levels": list(FIT_LEVELS), "quantiles": np.percentile(v, FIT_LEVELS).round(1).tolist(),
            "mean": round(float(v.mean()), 2), "lognormal": (round(float(logs.mean()), 4), round(float(logs.std()), 4)),
            "source": source}


class LengthDist(Schema):
    """A distribution of lengths (tokens) or counts; sampled values are rounded and clipped to ``[min, max]``.

    * ``constant``: ``value``;
    * ``uniform``: integers in ``[min, max]``;
    * ``lognormal``: vLLM ``benchmarks/multi_turn`` style, mean ``average`` and median ``median_ratio *
      average`` (``sigma = sqrt(2 ln(1 / median_ratio))``), or ``mu``/``sigma`` directly;
    * ``fitted``: inverse-CDF sampling of :data:`FITTED_OUTPUT_LENGTHS` ``[fit]``.
    """

    kind: Literal["constant", "uniform", "lognormal", "fitted"] = "constant"
    value: Annotated[float, Field(ge=0)] = 0
    min: Annotated[int, Field(ge=0)] = 0
    max: Annotated[int, Field(ge=0)] | None = None
    average: Annotated[float, Field(gt=0)] | None = None
    median_ratio: Annotated[float, Field(gt=0, lt=1)] = 0.85
    mu: float | None = None
    sigma: Annotated[float, Field(ge=0)] | None = None
    fit: Literal["mooncake_conversation", "mooncake_synthetic", "alibaba_traceA_sample"] = "mooncake_conversation"

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` int64 draws."""
        if self.kind == "constant":
            x = np.full(n, float(self.value))
        elif self.kind == "uniform":
            hi = self.max if self.max is not None else self.min
            if hi < self.min:
                raise ConfigError(f"LengthDist: uniform max {hi} < min {self.min}")
            x = rng.integers(self.min, hi + 1, size=n).astype(np.float64)
        elif self.kind == "lognormal":
            if self.average is not None:
                mu = math.log(self.average * self.median_ratio)
                sigma = math.sqrt(2 * math.log(1 / self.median_ratio))
            elif self.mu is not None and self.sigma is not None:
                mu, sigma = self.mu, self.sigma
            else:
                raise ConfigError("LengthDist: lognormal needs average, or mu and sigma")
            x = rng.lognormal(mu, sigma, size=n)
        else:
            f = FITTED_OUTPUT_LENGTHS[self.fit]
            x = np.interp(rng.random(n) * 100.0, f["levels"], f["quantiles"])
        hi = np.inf if self.max is None else self.max
        return np.clip(np.rint(x), self.min, hi).astype(np.int64)


def const(n: int) -> LengthDist:
    """A constant length of ``n`` tokens."""
    return LengthDist(kind="constant", value=n, min=0)


class ArrivalProcess(Schema):
    """Arrival times (seconds from 0) of sessions or requests at mean ``rate`` per second.

    * ``poisson``: exponential gaps;
    * ``gamma``: Gamma gaps with coefficient of variation ``cv`` (``cv > 1`` is bursty; ``cv = 1`` is Poisson);
    * ``diurnal``: a Poisson process whose rate swings as ``rate * (1 + amplitude * sin(2 pi (t / period_s +
      phase)))`` (thinning), e.g. a day compressed to ``period_s`` seconds;
    * ``burst``: everything at time 0 (closed-loop benchmarks that start all clients at once).
    """

    process: Literal["poisson", "gamma", "diurnal", "burst"] = "poisson"
    rate: Annotated[float, Field(gt=0)] = 1.0
    cv: Annotated[float, Field(gt=0)] = 2.0
    period_s: Annotated[float, Field(gt=0)] = 3600.0
    amplitude: Annotated[float, Field(ge=0, le=1)] = 0.8
    phase: float = 0.0

    def times(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` non-decreasing arrival times (seconds)."""
        if self.process == "burst":
            return np.zeros(n)
        if self.process == "poisson":
            return np.cumsum(rng.exponential(1.0 / self.rate, size=n))
        if self.process == "gamma":
            shape = 1.0 / self.cv**2
            return np.cumsum(rng.gamma(shape, 1.0 / (shape * self.rate), size=n))
        peak = self.rate * (1 + self.amplitude)
        out: list[float] = []
        t = 0.0
        while len(out) < n:
            gaps = rng.exponential(1.0 / peak, size=max(16, 2 * (n - len(out))))
            u = rng.random(len(gaps))
            for g, v in zip(gaps.tolist(), u.tolist(), strict=True):
                t += g
                lam = self.rate * (1 + self.amplitude * math.sin(2 * math.pi * (t / self.period_s + self.phase)))
                if v * peak <= lam:
                    out.append(t)
                    if len(out) == n:
                        break
        return np.array(out)


def zipf_weights(n: int, a: float) -> np.ndarray:
    """Zipf(``a``) probabilities of ranks 1..n (rank 1 most popular)."""
    w = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** a
    return w / w.sum()


# ------------------------------------------------------------------------------------------ configs
class FamilyConfig(Schema):
    """Fields every family shares: the seed, the length tokenizer (a :func:`load_tokenizer` spec) and the
    text folder (default ``../shared/traces/text``)."""

    seed: Annotated[int, Field(ge=0)] = 0
    tokenizer: str = "kvlab-bpe"
    text_dir: str | None = None


# ------------------------------------------------------------------------------------------ text
@functools.lru_cache(maxsize=8)
def length_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer that measures lengths (cached per spec)."""
    return load_tokenizer(spec)


def token_ids(tokenizer: TextTokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Ids of each text (no special tokens), fast paths for the byte and Hugging Face tokenizers."""
    if isinstance(tokenizer, ByteTextTokenizer):
        return [tokenizer.bytes.encode(t) for t in texts]
    if isinstance(tokenizer, HFTokenizer):
        texts = [require_text(t, f"texts[{k}]") for k, t in enumerate(texts)]  # as encode_offsets checks it
        return list(tokenizer.hf(texts, add_special_tokens=False)["input_ids"]) if texts else []
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def request_columns(reqs: Sequence[GeneratedRequest], tokenizer: TextTokenizer) -> tuple[dict, np.ndarray]:
    """The Workload columns of requests (:class:`GeneratedRequest`, or objects with its fields; ``response``
    optional) in row order: ``session``, ``turn``, ``parent`` (row of the same
    session's previous turn, -1 if none), ``tenant`` (``tenant<k>``), ``category``; and the output lengths
    (tokens): each response's token count under ``tokenizer`` when every request has a response text (its ids
    then become ``output_offsets`` / ``output_values``, the known outputs), else ``output_tokens``."""
    row_of = {(r.session, r.turn): i for i, r in enumerate(reqs)}
    columns: dict[str, object] = {
        "session": np.array([r.session for r in reqs], dtype=np.int64),
        "turn": np.array([r.turn for r in reqs], dtype=np.int64),
        "parent": np.array([row_of.get((r.session, r.turn - 1), -1) for r in reqs], dtype=np.int64),
        "tenant": pd.Categorical([f"tenant{r.tenant}" for r in reqs]),
        "category": pd.Categorical([str(r.category) for r in reqs]),
    }
    out_len = np.array([int(r.output_tokens) for r in reqs], dtype=np.int64)
    responses = [getattr(r, "response", ()) for r in reqs]
    if reqs and all(responses):
        outs = token_ids(tokenizer, ["".join(p.text for p in resp) for resp in responses])
        out_len = np.array([len(o) for o in outs], dtype=np.int64)
        columns["output_offsets"] = csr(out_len)
        columns["output_values"] = np.array([t for o in outs for t in o], dtype=np.int64)
    return columns, out_len


class TextPool:
    """Real text as one long token-id array (every pool text tokenised once, in a fixed order), to cut spans
    of an exact number of tokens from. ``texts`` are the pool's source texts (characters)."""

    def __init__(self, tokenizer: TextTokenizer, texts: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.texts = list(texts)
        ids = token_ids(tokenizer, [t + "\n\n" for t in self.texts])
        self.ids = np.array([i for row in ids for i in row], dtype=np.int64)
        if len(self.ids) < 2:  # every cut wraps around the pool: an empty one could never give n tokens
            raise ConfigError(f"TextPool: {len(self.texts)} texts encode to {len(self.ids)} tokens under tokenizer "
                              f"{getattr(tokenizer, 'name', type(tokenizer).__name__)!r}; a text pool needs at "
                              "least 2 (is the text folder or the tokenizer empty?)")

    def span(self, start: int, n: int) -> str:
        """Text of the ``n`` pool tokens from ``start`` (wrapping around the pool)."""
        idx = (start + np.arange(n)) % len(self.ids)
        return self.tokenizer.decode(self.ids[idx].tolist())

    def cut(self, rng: np.random.Generator, n: int) -> str:
        """Real text of ``n`` tokens at a random place of the pool ('' for n <= 0)."""
        if n <= 0:
            return ""
        return self.span(int(rng.integers(0, len(self.ids))), n)

    def count(self, text: str) -> int:
        """Tokens of ``text`` under the pool's tokenizer."""
        return len(token_ids(self.tokenizer, [text])[0])


@functools.lru_cache(maxsize=4)
def corpus(text_dir: str | None) -> dict:
    """The shared text (:func:`~kvlab.workload.sources.shared_corpus`), cached per folder."""
    from kvlab.workload.sources import shared_corpus

    return shared_corpus(text_dir)


@functools.lru_cache(maxsize=8)
def corpus_pool(spec: str, text_dir: str | None) -> TextPool:
    """The default pool: every distinct MuSiQue passage, then MT-Bench reference answers, in file order."""
    c = corpus(text_dir)
    seen: set[str] = set()
    texts = []
    for r in c["musique"]:
        for d in r.documents:
            if d.text not in seen:
                seen.add(d.text)
                texts.append(d.text)
    texts += [t.content for r in c["mt_bench"] for t in r.turns if t.role == "assistant"]
    return TextPool(length_tokenizer(spec), texts)


def questions(text_dir: str | None, source: str) -> list[str]:
    """Real user questions: ``sharegpt`` (500 first turns), ``mt_bench`` (first turns), ``musique`` or ``all``."""
    c = corpus(text_dir)
    pick = {
        "sharegpt": lambda: [r.user_turns[0] for r in c["sharegpt"] if r.user_turns],
        "mt_bench": lambda: [r.user_turns[0] for r in c["mt_bench"]],
        "musique": lambda: [r.user_turns[0] for r in c["musique"]],
    }
    if source == "all":
        return [q for k in ("sharegpt", "mt_bench", "musique") for q in pick[k]()]
    if source not in pick:
        raise ConfigError(f"question source {source!r} is not sharegpt, mt_bench, musique or all")
    return pick[source]()


def rng_of(config: FamilyConfig) -> np.random.Generator:
    """The family run's random stream."""
    return np.random.Generator(np.random.PCG64(config.seed))
