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
    boundary: {prompt_tokens: 1024, position_step: 8, block_sizes: [1, 16, 64, 256], requests: 4}
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

from pydantic import Field, model_validator

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

QUICK_SIZES = {"system_prompt": {"n_requests": 40}, "rag": {"n_requests": 30}, "chat": {"n_sessions": 8},
               "agent": {"n_sessions": 3}}


class FamilySpec(Schema):
    """One family of the study: ``family`` (a :data:`~kvlab.workload.families.FAMILIES` or
    :data:`~kvlab.workload.families.PRESETS` name, or ``trace``: :class:`TraceFamilyConfig`), its config fields,
    layouts besides the common ones."""

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
    boundary: BoundarySpec = Field(default_factory=BoundarySpec)
    answers: AnswersSpec = Field(default_factory=AnswersSpec)

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
        """Read a YAML or JSON file; one ConfigError line naming the file and the field for any problem."""
        import yaml

        path = Path(path)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the layout study config ({e.strerror or e})") from None
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            where = getattr(e, "problem_mark", None)
            at = f" (line {where.line + 1})" if where is not None else ""
            raise ConfigError(f"{path}: not valid YAML or JSON{at}") from None
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
        """Checks beyond the field types: the clock, every family config and every layout resolve."""
        _ = self.clock_start_s
        for name in self.families:
            self.family_config(name)
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
            if spec.family in FAMILIES:
                return family_config(spec.family, **spec.config)
            if spec.family in PRESETS:
                return PRESETS[spec.family](**spec.config)
        except ConfigError as e:
            msg = re.sub(r" \(--[\w-]+\)", "", str(e))  # the family's CLI flag names mean nothing in a file
            raise ConfigError(f"{where}.config: {msg}") from None
        known = ", ".join(sorted({*FAMILIES, *PRESETS, "trace"}))
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
        """The generated requests of ``families[name]``."""
        from kvlab.workload.families import generate

        config = self.family_config(name)
        return config.generate() if isinstance(config, TraceFamilyConfig) else generate(config)

    def family_identity(self, name: str) -> dict:
        """What decides one family's numbers besides its generated requests and the tokenizer."""
        keep = ("block_size", "cache_blocks", "model", "hardware", "policy", "time_scale", "seed", "clock_start")
        return {**{k: getattr(self, k) for k in keep}, "family": name, "spec": self.families[name].to_dict(),
                "layouts": {lay.label: lay.identity() for lay in self.layouts(name)}}

    def boundary_text(self, tokenizer: TextTokenizer) -> str:
        """Real text of ``boundary.prompt_tokens`` tokens: MuSiQue passages in file order, cut at a token start."""
        from kvlab.workload.sources import musique_records

        b = self.boundary
        path = None if b.text_dir is None else Path(b.text_dir)
        text = ""
        for rec in musique_records(path):
            text += "".join(d.text + "\n\n" for d in rec.documents)
            ids, spans = tokenizer.encode_offsets(text, add_special_tokens=False)
            if len(ids) > b.prompt_tokens:
                return text[: spans[b.prompt_tokens][0]]
        raise ConfigError(f"boundary.prompt_tokens: the MuSiQue text has fewer than {b.prompt_tokens} tokens")


def layouts_of(specs: list, where: str) -> list[Layout]:
    """Layouts from config specs (``where`` names the config field in errors); labels must be distinct."""
    out = [make_layout(s, f"{where}[{i}]") for i, s in enumerate(specs)]
    seen: set[str] = set()
    for i, lay in enumerate(out):
        if lay.label in seen:
            raise ConfigError(f"{where}[{i}]: layout {lay.label!r} appears twice (give one a 'label')")
        seen.add(lay.label)
    return out
