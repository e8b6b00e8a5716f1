"""The layout study's configuration: a YAML or JSON file (``kvlab layout-study CONFIG``) or Python objects.

Fields (units: blocks, tokens, seconds; every one optional, defaults below)::

    tokenizer: kvlab-bpe              # a load_tokenizer spec
    block_size: 16                    # tokens per KV block
    cache_blocks: [4096, null]        # the cache sizes, blocks; null: the device's pool as vLLM sizes it
    model: llama-3-8b                 # simulator profiles
    hardware: h100
    policy: lru
    time_scale: 1.0                   # the simulator's arrival scaling
    seed: 0                           # transforms' random draws
    clock_start: "2024-07-26T23:59:30+00:00"   # wall clock of arrival 0 (timestamps, edits, dates)
    common_layouts: [as_generated, volatile_top, ...]   # applied to every family
    families:                         # name -> a family (or preset) name, its config fields, extra layouts
      rag: {family: rag, config: {n_requests: 160}, layouts: [documents_canonical, documents_reranked]}
      mine: {family: messages, config: {path: my_requests.jsonl}, common: false, layouts: [volatile_top]}
    boundary: {prompt_tokens: 1024, position_step: 8, block_sizes: [1, 16, 64, 256], requests: 4}   # null: none
    answers: {checkpoint: null, limit: 8}

A layout is a transform name (``"a+b"`` composes), ``{name: ..., <parameters>, label: ...}`` or ``{label: ...,
steps: [...]}`` (:func:`kvlab.layout.registry.make_layout`). A bad file or field is one ConfigError line naming the
file and the field.
"""

from __future__ import annotations

import re
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator, model_validator

from kvlab.errors import ConfigError
from kvlab.layout.base import Layout
from kvlab.layout.registry import make_layout
from kvlab.schema import BlockSize, CapacityBlocks, Schema, Seed
from kvlab.workload.tokenizer import TextTokenizer

DEFAULT_COMMON: list = [
    "as_generated", "volatile_top", "volatile_end",
    {"name": "system_edited", "period_minutes": 1.0},
    "date_fixed", "date_injected", "adapter_switch",
]
"""Layouts of every family: as generated; a per-second timestamp at the top / at the end; the system prompt edited
every minute (the study's workloads span minutes); the template's date fixed / the day of arrival; 4 adapters."""

DEFAULT_FAMILIES: dict[str, dict] = {
    "system_prompt": {"family": "system_prompt", "config": {"n_requests": 240, "system_tokens": [512, 1024, 2048]},
                      "layouts": ["volatile_after_system", {"name": "volatile_top", "what": "user_id"}]},
    "rag": {"family": "rag", "config": {"n_requests": 160},
            "layouts": ["volatile_after_system", "documents_canonical", "documents_reranked"]},
    "chat": {"family": "mt_bench_chat", "config": {"n_sessions": 40, "system_tokens": 300},
             "layouts": ["history_drop_oldest", "history_summarise"]},
    "agent": {"family": "agent", "config": {"n_sessions": 12, "reasoning": "keep"},
              "layouts": ["tools_canonical", "tools_shuffled", "tools_keys_unstable", "reasoning_stripped",
                          "reasoning_stripped_before_last_user"]},
}
"""The default study's families (kvlab.workload.families configs; the agents keep their reasoning so that the
reasoning layouts have something to strip)."""

MAX_FAMILY_REQUESTS = 100_000
"""The most requests one family of the study may generate. Generated requests hold their text (about 5 to 70 KB
each: a RAG request's documents, a chat's history), and every layout renders and tokenizes each of them, so
100,000 requests is already hours and gigabytes; a family config whose size fields allow more (``n_requests``,
``n_sessions`` times the turns or tasks and steps per session, a trace family's ``max_requests``) is refused when the
config is read, naming the field, and a family that still generates more is refused before it is laid out."""

RESERVED_NAMES = ("boundary",)
"""Folder names of the study's own results under OUT (the boundary sweep): no family may be named (or be made safe
as) one of them, and no two families may share a folder."""

QUICK_SIZES = {"system_prompt": {"n_requests": 40}, "rag": {"n_requests": 30}, "chat": {"n_sessions": 8},
               "agent": {"n_sessions": 3}}


class FamilySpec(Schema):
    """One family of the study: ``family`` (a :data:`~kvlab.workload.families.FAMILIES` or
    :data:`~kvlab.workload.families.PRESETS` name, ``trace``: :class:`TraceFamilyConfig`, or ``messages``:
    :class:`MessagesFamilyConfig`), its config fields, layouts besides the common ones."""

    label: ClassVar[str | None] = "family"
    family: str
    config: dict = Field(default_factory=dict)
    layouts: list = Field(default_factory=list)
    common: bool = True  # also the study's common_layouts (first)


class TraceFamilyConfig(Schema):
    """``family: trace``: a hash trace expanded into real text (:func:`kvlab.workload.expand_text.trace_requests`),
    the first ``max_requests`` requests; ``trace`` a registry name or a file path."""

    label: ClassVar[str | None] = "trace family"
    family: str = "trace"
    trace: str
    format: str | None = None
    max_requests: Annotated[int, Field(ge=1)] = 200
    pieces: Annotated[int, Field(ge=1)] | None = None
    seed: Seed = 0
    tokenizer: str = "kvlab-bpe"
    text_dir: str | None = None

    def generate(self) -> list:
        from kvlab.workload import load_trace
        from kvlab.workload.expand_text import trace_requests

        w = load_trace(self.trace, format=self.format)
        return trace_requests(w, tokenizer=self.tokenizer, seed=self.seed, text_dir=self.text_dir,
                              max_requests=self.max_requests, pieces=self.pieces)


class MessagesFamilyConfig(Schema):
    """``family: messages``: a researcher's own requests, a messages file (:mod:`kvlab.workload.messages`; ``path``
    relative to the current folder); ``output_tokens`` for requests without their own (tokens)."""

    label: ClassVar[str | None] = "messages family"
    family: str = "messages"
    path: str
    output_tokens: Annotated[int, Field(ge=0, le=1 << 28)] = 256

    def generate(self) -> list:
        from kvlab.workload.messages import load_messages

        return load_messages(self.path, output_tokens=self.output_tokens, max_requests=MAX_FAMILY_REQUESTS)


class BoundarySpec(Schema):
    """The seed-004 sweep: a real-text system prompt of ``prompt_tokens`` tokens, a volatile word at every
    ``position_step``-th token, replayed at each block size (tokens) with ``requests`` requests per position."""

    label: ClassVar[str | None] = "boundary"
    prompt_tokens: Annotated[int, Field(ge=16, le=1 << 16)] = 1024
    position_step: Annotated[int, Field(ge=1)] = 8
    block_sizes: Annotated[list[BlockSize], Field(min_length=1)] = [1, 16, 64, 256]
    requests: Annotated[int, Field(ge=2, le=20)] = 4
    question: str = "Which places does the passage above name?"
    text_dir: str | None = None

    def positions(self) -> list[int]:
        """Token positions of the stable text the volatile word is inserted before."""
        return list(range(0, self.prompt_tokens, self.position_step))


class AnswersSpec(Schema):
    """The optional answer-likelihood section: a local Hugging Face causal LM folder (None: skipped)."""

    label: ClassVar[str | None] = "answers"
    checkpoint: str | None = None
    limit: Annotated[int, Field(ge=1)] = 8  # requests with a reference answer per family and layout
    device: str = "cpu"


class LayoutStudyConfig(Schema):
    """What the layout study runs (module docstring)."""

    label: ClassVar[str | None] = "layout study"
    tokenizer: str = "kvlab-bpe"
    block_size: BlockSize = 16
    cache_blocks: Annotated[list[CapacityBlocks | None], Field(min_length=1)] = [4096, None]
    model: str = "llama-3-8b"
    hardware: str = "h100"
    policy: str = "lru"
    time_scale: Annotated[float, Field(gt=0)] = 1.0
    seed: Seed = 0
    clock_start: str = "2024-07-26T23:59:30+00:00"
    common_layouts: list = Field(default_factory=lambda: list(DEFAULT_COMMON))
    families: Annotated[dict[str, FamilySpec], Field(min_length=1)] = Field(
        default_factory=lambda: {k: FamilySpec(**v) for k, v in DEFAULT_FAMILIES.items()})
    boundary: BoundarySpec | None = Field(default_factory=BoundarySpec)  # None: no boundary sweep
    answers: AnswersSpec = Field(default_factory=AnswersSpec)

    @field_validator("cache_blocks", mode="before")
    @classmethod
    def _no_bool_blocks(cls, value: Any) -> Any:
        """A boolean is never a block count (``cache_blocks: [true]`` is not 1 block; kvlab.schema's rule,
        which covers top-level fields, applied to the list's items)."""
        if isinstance(value, list | tuple):
            bad = next((k for k, v in enumerate(value) if isinstance(v, bool)), None)
            if bad is not None:
                raise ValueError(f"item {bad} must be an integer (blocks) or null, got {value[bad]} (a boolean)")
        return value

    @model_validator(mode="after")
    def _resolves(self) -> LayoutStudyConfig:
        self.check()
        return self

    # ------------------------------------------------------------------ construction
    @classmethod
    def quick(cls, **changes: Any) -> LayoutStudyConfig:
        """The tests' study: the default families at a sixth of their size or less, a shorter boundary sweep."""
        fams = {k: {**v, "config": {**v["config"], **QUICK_SIZES[k]}} for k, v in DEFAULT_FAMILIES.items()}
        return cls(**{"families": fams, "boundary": {"prompt_tokens": 256, "position_step": 8,
                                                     "block_sizes": [1, 16, 64]}, **changes})

    @classmethod
    def load(cls, path: str | Path) -> LayoutStudyConfig:
        """Read a YAML or JSON file (:func:`kvlab.inputs.load_yaml`: a regular file, so a FIFO is refused at once;
        a key given twice or a NaN refused); one ConfigError line naming the file and the field for any problem."""
        from kvlab.inputs import load_yaml

        path = Path(path)
        data = load_yaml(path, "layout study config")
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the layout study config must be a mapping of fields, not {type(data).__name__}")
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: dict, source: str = "config") -> LayoutStudyConfig:
        """Validate ``data``; errors name ``source`` (a file) and the field: ``FILE: families.rag.config.k: ...``."""
        bad = next((k for k in data if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"{source}: {bad!r}: field names are strings")
        try:
            return cls(**data)
        except ConfigError as exc:  # kvlab.schema's one line, without the CLI flag names
            msg = re.sub(r" \(--[\w-]+\)", "", str(exc))
            raise ConfigError(f"{source}: {re.sub(r'^layout study[.:] ?', '', msg)}") from None

    def check(self) -> None:
        """Checks beyond the field types: the clock, every family config (and its size, at most
        :data:`MAX_FAMILY_REQUESTS` requests) and every layout resolve; each family has a folder of its own under
        OUT, none of them :data:`RESERVED_NAMES`."""
        _ = self.clock_start_s
        folders: dict[str, str] = {}
        for name in self.families:
            folder = family_folder(name).casefold()  # case-insensitive file systems: Rag and rag share one
            if folder in RESERVED_NAMES:
                raise ConfigError(f"families.{name}: the name {name!r} is reserved for the study's own "
                                  f"{folder} results (OUT/{folder}/); rename the family")
            if folder in folders:
                raise ConfigError(f"families.{name}: its results folder OUT/{folder}/ is also that of family "
                                  f"{folders[folder]!r}; rename one of them")
            folders[folder] = name
            check_family_size(self.family_config(name), f"families.{name}.config")
            self.layouts(name)

    # ------------------------------------------------------------------ resolved parts
    @property
    def clock_start_s(self) -> float:
        """``clock_start`` as POSIX seconds."""
        try:
            t = datetime.fromisoformat(self.clock_start.replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(f"clock_start: {self.clock_start!r} is not an ISO date and time "
                              "(e.g. 2024-07-26T23:59:30+00:00)") from None
        if t.tzinfo is None:
            raise ConfigError(f"clock_start: {self.clock_start!r} needs a time zone (e.g. +00:00)")
        return t.timestamp()

    def family_config(self, name: str) -> Any:
        """The family config of ``families[name]`` (its ``family`` a family or preset name)."""
        from kvlab.workload.families import FAMILIES, PRESETS, family_config

        spec = self.families[name]
        where = f"families.{name}"
        try:
            if spec.family == "trace":
                return TraceFamilyConfig(**spec.config)
            if spec.family == "messages":
                return MessagesFamilyConfig(**spec.config)
            if spec.family in FAMILIES:
                return family_config(spec.family, **spec.config)
            if spec.family in PRESETS:
                return PRESETS[spec.family](**spec.config)
        except ConfigError as e:
            msg = re.sub(r" \(--[\w-]+\)", "", str(e))  # the family's CLI flag names mean nothing in a file
            raise ConfigError(f"{where}.config: {msg}") from None
        known = ", ".join(sorted({*FAMILIES, *PRESETS, "trace", "messages"}))
        raise ConfigError(f"{where}.family: {spec.family!r} is not a workload family or preset (one of {known})")

    def layouts(self, name: str) -> list[Layout]:
        """The layouts of ``families[name]``: the common ones (if ``common``), then its own."""
        spec = self.families[name]
        specs = (list(self.common_layouts) if spec.common else []) + list(spec.layouts)
        if not specs:
            raise ConfigError(f"families.{name}.layouts: no layouts (and common: false)")
        n_common = len(self.common_layouts) if spec.common else 0
        try:
            return layouts_of(specs, "layouts")
        except ConfigError as e:
            m = re.match(r"layouts\[(\d+)\]: (.*)", str(e))
            if m is None:
                raise
            i = int(m.group(1))
            where = f"common_layouts[{i}]" if i < n_common else f"families.{name}.layouts[{i - n_common}]"
            raise ConfigError(f"{where}: {m.group(2)}") from None

    def generate(self, name: str) -> list:
        """The generated requests of ``families[name]``: at most :data:`MAX_FAMILY_REQUESTS` (ConfigError naming
        the family's config otherwise, also when generating them runs out of memory)."""
        from kvlab.workload.families import generate

        config = self.family_config(name)
        where = f"families.{name}.config"
        try:
            own = isinstance(config, TraceFamilyConfig | MessagesFamilyConfig)
            reqs = config.generate() if own else generate(config)
        except MemoryError:
            raise ConfigError(f"{where}: out of memory generating the family's requests (make it smaller: "
                              "n_requests, n_sessions, turns or token lengths)") from None
        if len(reqs) > MAX_FAMILY_REQUESTS:
            raise ConfigError(f"{where}: generates {len(reqs):,} requests, more than the layout study's limit of "
                              f"{MAX_FAMILY_REQUESTS:,} per family (docs/layout.md); make it smaller")
        return reqs

    def family_identity(self, name: str) -> dict:
        """What decides one family's numbers besides its generated requests and the tokenizer."""
        keep = ("block_size", "cache_blocks", "model", "hardware", "policy", "time_scale", "seed", "clock_start")
        return {**{k: getattr(self, k) for k in keep}, "family": name, "spec": self.families[name].to_dict(),
                "layouts": {lay.label: lay.identity() for lay in self.layouts(name)}}

    def boundary_text(self, tokenizer: TextTokenizer) -> str:
        """Real text of ``boundary.prompt_tokens`` tokens: MuSiQue passages in file order, cut at a token start."""
        from kvlab.workload.sources import musique_records

        b = self.boundary
        if b is None:
            raise ConfigError("boundary: null (no boundary sweep): there is no boundary text")
        path = None if b.text_dir is None else Path(b.text_dir)
        text = ""
        for rec in musique_records(path):
            text += "".join(d.text + "\n\n" for d in rec.documents)
            ids, spans = tokenizer.encode_offsets(text, add_special_tokens=False)
            if not ids:  # text that gives no tokens would be re-encoded, growing, over the whole corpus
                raise ConfigError(f"tokenizer {tokenizer.name!r}: encodes the MuSiQue text to no tokens")
            if len(ids) > b.prompt_tokens:
                return text[: spans[b.prompt_tokens][0]]
        raise ConfigError(f"boundary.prompt_tokens: the MuSiQue text has fewer than {b.prompt_tokens} tokens")


def family_folder(name: str) -> str:
    """The folder of family ``name`` under the study's OUT (:func:`kvlab.results.safe_name`)."""
    from kvlab.results import safe_name

    return safe_name(name)


def _dist_high(dist: Any) -> float:
    """The largest value a :class:`~kvlab.workload.families.base.LengthDist` draws (its ``max`` when set; a
    lognormal without one: mean plus 3 sigma in log space, which 99.9 % of draws stay below)."""
    import math

    from kvlab.workload.families.base import FITTED_OUTPUT_LENGTHS

    if dist.kind == "constant":
        high = float(dist.value)
    elif dist.kind == "uniform":
        high = float(dist.max if dist.max is not None else dist.min)
    elif dist.kind == "lognormal":
        if dist.average is not None:
            mu, sigma = math.log(dist.average * dist.median_ratio), math.sqrt(2 * math.log(1 / dist.median_ratio))
        else:
            mu, sigma = float(dist.mu or 0.0), float(dist.sigma or 0.0)
        high = math.exp(min(mu + 3 * sigma, 700.0))
    else:
        high = float(max(FITTED_OUTPUT_LENGTHS[dist.fit]["quantiles"]))
    return max(min(high, float(dist.max)) if dist.max is not None else high, float(dist.min), 1.0)


def family_requests(config: Any) -> tuple[float, list[str]]:
    """An upper bound of the requests a family config generates, and the fields it comes from: ``n_requests``;
    ``n_sessions`` times the turns per session (chat) or tasks times (steps + 1) (agent); a mix's components
    (each generated whole before the mix keeps its share); a trace family's ``max_requests``."""
    if isinstance(config, TraceFamilyConfig):
        return float(config.max_requests), ["max_requests"]
    components = getattr(config, "components", None)
    if components is not None:
        bounds = [family_requests(c.config) for c in components]
        total = sum(b for b, _ in bounds)
        worst = max(range(len(bounds)), key=lambda i: bounds[i][0])
        return total, [f"components[{worst}].config.{f}" for f in bounds[worst][1]]
    if getattr(config, "n_requests", None) is not None:
        return float(config.n_requests), ["n_requests"]
    sessions = getattr(config, "n_sessions", None)
    if sessions is None:
        return 0.0, []
    per, fields = 1.0, ["n_sessions"]
    if getattr(config, "turns", None) is not None:
        per, fields = _dist_high(config.turns), ["n_sessions", "turns"]
    elif getattr(config, "tasks", None) is not None and getattr(config, "steps", None) is not None:
        per, fields = _dist_high(config.tasks) * (_dist_high(config.steps) + 1), ["n_sessions", "tasks", "steps"]
    return float(sessions) * per, fields


def check_family_size(config: Any, where: str) -> None:
    """ConfigError naming ``where`` (``families.<name>.config``) and the field when ``config`` may generate more
    than :data:`MAX_FAMILY_REQUESTS` requests (:func:`family_requests`)."""
    bound, fields = family_requests(config)
    if bound > MAX_FAMILY_REQUESTS:
        named = f"{where}.{fields[0]}: " if len(fields) == 1 else f"{where}: {' x '.join(fields)} allow "
        raise ConfigError(f"{named}up to {bound:,.0f} requests, more than the layout study's limit of "
                          f"{MAX_FAMILY_REQUESTS:,} per family (docs/layout.md, 'Limits'); make it smaller")


def layouts_of(specs: list, where: str) -> list[Layout]:
    """Layouts from config specs (``where`` names the config field in errors); labels must be distinct."""
    out = [make_layout(s, f"{where}[{i}]") for i, s in enumerate(specs)]
    seen: set[str] = set()
    for i, lay in enumerate(out):
        if lay.label in seen:
            raise ConfigError(f"{where}[{i}]: layout {lay.label!r} appears twice (give one a 'label')")
        seen.add(lay.label)
    return out
