"""Tokenizers for text workloads: kvlab's own BPE (committed), retrained or fetched ones, rank files, any
Hugging Face tokenizer (offline), or bytes.

:func:`load_tokenizer` returns a :class:`TextTokenizer`: token ids with character offsets (for segment
spans), a chat template (the model's own, else kvlab's plain ``USER:`` / ``ASSISTANT:`` layout) and the
hashes of both, which belong to a run's identity. Specs:

* ``"kvlab-bpe"`` (the default): a byte-level BPE (16,384 tokens, ChatML template) committed as
  ``kvlab/data/tokenizers/kvlab-bpe.json`` with the sha256s of the text it was trained on
  (:mod:`kvlab.workload.tokenizer_store`); its sha256 is checked at every load, nothing is trained, no text
  folder is needed: the name always means the same ids.
* ``"byte"``: UTF-8 bytes (:class:`~kvlab.workload.text.ByteTokenizer`), for tests.
* ``"tekken"``: Mistral NeMo's production vocabulary, once fetched with ``kvlab tokenizer fetch tekken``
  (:mod:`kvlab.workload.tokenizer_fetch`); absent, one line names that command.
* a name trained with ``kvlab tokenizer train --name NAME`` (the tokenizer folder, :func:`tokenizer_cache_dir`).
* a rank file (``*.tiktoken``, ``tekken*.json`` or ``"ranks:PATH"``): a real vocabulary published as token
  ranks, converted once (:mod:`kvlab.workload.rank_tokenizer`).
* anything else: a Hugging Face tokenizer name or local folder, loaded with ``local_files_only=True``
  (a local folder, or a name already in the Hugging Face cache; nothing is downloaded).

Chat templates that inject today's date (Llama-3.1-style ``date_string`` / ``strftime_now``) are given a
fixed ``date_string`` (:data:`DEFAULT_DATE_STRING`, or the one passed), so a rendering never depends on
the day it runs; pass another date to study what the injection costs.
"""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from kvlab.arguments import kind_of, require_text
from kvlab.errors import ConfigError
from kvlab.inputs import regular_file
from kvlab.workload._common import one_line
from kvlab.workload.text import ASSISTANT_PREFIX, USER_PREFIX, ByteTokenizer
from kvlab.workload.tokenizer_fetch import FETCHABLE
from kvlab.workload.tokenizer_files import BPE_VOCAB_SIZE, tokenizer_cache_dir
from kvlab.workload.tokenizer_store import committed_bpe, fetched_file, is_trained, trained_tokenizer

DEFAULT_TOKENIZER = "kvlab-bpe"
DEFAULT_DATE_STRING = "26 Jul 2024"  # Llama-3.1's template default; fixed so renderings are reproducible
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""The kvlab BPE's chat template (ChatML, as Qwen's models use): special tokens around every message."""
TOOL_PREFIX = "\nTOOL: "
PLAIN_TEMPLATE = "kvlab-plain-v1: system text, then '\\nUSER: ' / '\\nASSISTANT: ' / '\\nTOOL: ' + content"
"""Identity of the plain layout used for tokenizers without a chat template (kvlab.workload.text's)."""


PROBE_TEXT = "Hello, world! The cache holds 1024 blocks.\n"
"""Text every tokenizer must encode to at least one token (:func:`check_tokenizer`): a tokenizer that encodes
text to nothing (an empty vocabulary) would make every prompt empty and every text-filling loop endless."""


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def plain_chat(messages: Sequence[dict], *, add_generation_prompt: bool = True) -> str:
    """kvlab's plain layout (as :mod:`kvlab.workload.text`): system text, then ``USER:`` / ``ASSISTANT:`` lines."""
    out = []
    for k, m in enumerate(messages):
        role, content = m["role"], m["content"]
        if role == "system":
            out.append(content)
        elif role == "user":
            out.append((USER_PREFIX if k else USER_PREFIX.lstrip("\n")) + content)
        elif role == "assistant":
            out.append(ASSISTANT_PREFIX + " " + content)
        elif role == "tool":
            out.append((TOOL_PREFIX if k else TOOL_PREFIX.lstrip("\n")) + content)
        else:
            raise ConfigError(f"message {k}: role {role!r} is not system, user, assistant or tool")
    if add_generation_prompt:
        out.append(ASSISTANT_PREFIX)
    return "".join(out)


class TextTokenizer:
    """A tokenizer as text workloads need it: ids with character offsets, a chat template, hashes.

    ``encode(text, add_special_tokens=True)`` keeps the interface every kvlab text loader accepts.
    """

    name: str
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``."""
        return self.encode_offsets(text, add_special_tokens=add_special_tokens)[0]

    def encode_offsets(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids and each token's character span ``(start, end)`` in ``text`` (special tokens: ``(0, 0)``).

        ``text`` must be valid Unicode: a lone surrogate is one ConfigError naming the character
        (:func:`kvlab.arguments.require_text`), never a raw encoding error from the tokenizer."""
        return self._encode_offsets(require_text(text, "text"), add_special_tokens)

    def _encode_offsets(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        """:meth:`encode_offsets` of text already checked (subclasses implement this)."""
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids."""
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def injects_date(self) -> bool:
        """Whether the chat template writes a date into the prompt (Llama-3.1-style ``date_string``)."""
        t = self.chat_template or ""
        return "date_string" in t or "strftime_now" in t

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        date_string: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Prompt text of ``messages`` (``[{role, content}]``): the model's template, else :func:`plain_chat`.

        ``date_string`` (default :data:`DEFAULT_DATE_STRING`) fills date-injecting templates.
        """
        return plain_chat(messages, add_generation_prompt=add_generation_prompt)

    @property
    def special_tokens_in_template(self) -> bool:
        """True when the template writes the special tokens (BOS...) itself: encode its text without adding them."""
        return self.chat_template is not None

    @cached_property
    def sha256(self) -> str:
        """sha256 of the tokenizer's full definition (vocabulary, merges, normaliser, special tokens)."""
        raise NotImplementedError

    @property
    def template_sha256(self) -> str:
        """sha256 of the chat template in use (the plain layout's identity when there is none)."""
        return _sha256(self.chat_template if self.chat_template is not None else PLAIN_TEMPLATE)

    def identity(self) -> dict:
        """The tokenizer's part of a run's identity."""
        return {
            "tokenizer": self.name,
            "tokenizer_sha256": self.sha256,
            "template_sha256": self.template_sha256,
            "vocab_size": self.vocab_size,
        }


class ByteTextTokenizer(TextTokenizer):
    """UTF-8 bytes as token ids (:class:`~kvlab.workload.text.ByteTokenizer`) with offsets; no chat template."""

    def __init__(self, offset: int = 0) -> None:
        self.bytes = ByteTokenizer(offset)
        self.name = "byte" if offset == 0 else f"byte+{offset}"

    def _encode_offsets(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        ids = self.bytes.encode(text)
        offsets = [(k, k + 1) for k, ch in enumerate(text) for _ in range(len(ch.encode("utf-8", "surrogatepass")))]
        return ids, offsets

    def decode(self, ids: Sequence[int]) -> str:
        return self.bytes.decode(ids)

    @property
    def vocab_size(self) -> int:
        return self.bytes.vocab_size

    @cached_property
    def sha256(self) -> str:
        return _sha256(f"kvlab-byte-tokenizer offset={self.bytes.offset}")


class HFTokenizer(TextTokenizer):
    """A Hugging Face fast tokenizer (``PreTrainedTokenizerFast``: offsets need the Rust backend)."""

    def __init__(self, hf: Any, name: str) -> None:
        if getattr(hf, "backend_tokenizer", None) is None:
            raise ConfigError(f"tokenizer {name!r} is not a fast tokenizer (no tokenizer.json): offsets need one")
        self.hf = hf
        self.name = name
        template = hf.chat_template
        if isinstance(template, dict):  # several named templates: the default one
            template = template.get("default")
        self.chat_template = template

    def _encode_offsets(self, text: str, add_special_tokens: bool) -> tuple[list[int], list[tuple[int, int]]]:
        enc = self.hf(text, add_special_tokens=add_special_tokens, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids))

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        *,
        add_generation_prompt: bool = True,
        date_string: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        if self.chat_template is None:
            return plain_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.hf.apply_chat_template(
            [dict(m) for m in messages],
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            date_string=DEFAULT_DATE_STRING if date_string is None else date_string,
            **template_kwargs,
        )

    @cached_property
    def sha256(self) -> str:
        return _sha256(self.hf.backend_tokenizer.to_str())


# ------------------------------------------------------------------------------------------ kvlab BPE
def wrap_tokenizers(
    tok: Any, name: str, *, chat_template: str | None = None, eos_token: str | None = None
) -> HFTokenizer:
    """A :class:`TextTokenizer` around a ``tokenizers.Tokenizer`` (via ``PreTrainedTokenizerFast``)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError("text tokenizers need the 'transformers' package: pip install 'kvlab[engine]'") from None
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos_token)
    hf.chat_template = chat_template
    return HFTokenizer(hf, name)


def bpe_tokenizer(tok: Any, name: str) -> HFTokenizer:
    """A :class:`TextTokenizer` of a vocabulary trained with kvlab's recipe (:func:`train_bpe`): ChatML template,
    ``<|endoftext|>`` as end of sequence."""
    return wrap_tokenizers(tok, name, chat_template=CHATML_TEMPLATE, eos_token="<|endoftext|>")


def kvlab_bpe() -> HFTokenizer:
    """kvlab's BPE: the committed ``kvlab-bpe.json`` (sha256 checked; never trained here), named
    ``kvlab-bpe-16384`` in run identities as it always was."""
    return bpe_tokenizer(committed_bpe(), f"kvlab-bpe-{BPE_VOCAB_SIZE}")


# ------------------------------------------------------------------------------------------ one entry point
def check_tokenizer(tokenizer: TextTokenizer, source: str) -> TextTokenizer:
    """``tokenizer`` if it encodes :data:`PROBE_TEXT` to at least one token; ConfigError naming ``source`` (the
    spec or file) otherwise. :func:`load_tokenizer` calls it on every tokenizer before any work uses it."""
    ids, _ = tokenizer.encode_offsets(PROBE_TEXT, add_special_tokens=False)
    if not ids:
        raise ConfigError(f"tokenizer {source}: encodes the probe text {PROBE_TEXT!r} to no tokens (an empty or "
                          "broken vocabulary); kvlab needs a tokenizer that turns text into tokens")
    return tokenizer


def _check_folder_files(folder: Path) -> None:
    """Refuse a Hugging Face tokenizer folder holding a FIFO, socket or device (reading one could block)."""
    for entry in sorted(folder.iterdir()):
        try:
            mode = entry.stat().st_mode
        except OSError:
            continue  # a dangling link: transformers reports it if it needs the file
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            regular_file(entry, "tokenizer file")


def load_tokenizer(
    spec: str | os.PathLike | None = None, *, cache_dir: str | os.PathLike | None = None
) -> TextTokenizer:
    """A :class:`TextTokenizer` by spec: ``None``/``"kvlab-bpe"``, ``"byte"``, a fetched name (``"tekken"``), a
    name trained with ``kvlab tokenizer train``, a rank file, or a Hugging Face name or folder.

    ``"kvlab-bpe"`` is the committed file (sha256 checked; no text folder, no training). ``"tekken"`` is the
    file ``kvlab tokenizer fetch tekken`` placed in the tokenizer folder (absent: one ConfigError line naming
    that command). A trained name is ``NAME.json`` there, checked against ``NAME.provenance.json``; it wins
    over a file or folder of the same name in the current folder (give ``./NAME`` for those).
    A rank file is a ``*.tiktoken`` or ``tekken*.json`` path, or any file as ``"ranks:PATH"`` (e.g. Llama-3's
    original ``tokenizer.model``): see :mod:`kvlab.workload.rank_tokenizer`; no chat template (plain layout).
    Hugging Face tokenizers load offline (``local_files_only=True``): a folder with ``tokenizer.json``, or
    a name already in the Hugging Face cache. ``cache_dir`` is the tokenizer folder (default
    :func:`tokenizer_cache_dir`): trained and fetched tokenizers and rank-file conversions.

    Every tokenizer is checked before it is returned (:func:`check_tokenizer`: it must encode text to tokens);
    tokenizer files are read only when they are regular files (a FIFO or device is refused, never opened).
    """
    kind, name = resolve_spec(spec)
    folder = tokenizer_cache_dir(cache_dir)
    if kind == "kvlab-bpe":
        return check_tokenizer(kvlab_bpe(), repr(DEFAULT_TOKENIZER))
    if kind == "byte":
        return ByteTextTokenizer()
    if kind == "fetched":
        return check_tokenizer(_rank_tokenizer(fetched_file(name, folder), folder, name), repr(name))
    if kind == "ranks":
        rank_file = Path(name)
        return check_tokenizer(_rank_tokenizer(rank_file, folder, f"ranks:{rank_file.name}"), str(rank_file))
    trained = trained_tokenizer(name, folder)
    if trained is not None:
        return check_tokenizer(bpe_tokenizer(trained, name), repr(name))
    if Path(name).is_dir():
        _check_folder_files(Path(name))
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"tokenizer {name!r} needs the 'transformers' package: pip install 'kvlab[engine]'") from None
    try:
        hf = AutoTokenizer.from_pretrained(name, local_files_only=True)
    except Exception as e:  # OSError, ValueError, EnvironmentError... all mean "not available here"
        raise ConfigError(_not_found(name, one_line(str(e), 200) or type(e).__name__)) from None
    return check_tokenizer(HFTokenizer(hf, name), repr(name))


def resolve_spec(spec: str | os.PathLike | None) -> tuple[str, str]:
    """``(kind, name)`` of a tokenizer spec, without loading anything: kind ``kvlab-bpe``, ``byte``, ``fetched``
    (a :data:`~kvlab.workload.tokenizer_fetch.FETCHABLE` name), ``ranks`` (a rank file's path), or ``other``
    (a trained name, else a Hugging Face folder or name: :func:`load_tokenizer` tells them apart)."""
    if spec is not None and not isinstance(spec, str | os.PathLike):
        raise ConfigError(f"tokenizer: expected a tokenizer spec (a name or a path), got {kind_of(spec)}")
    if spec is None or spec == DEFAULT_TOKENIZER:
        return "kvlab-bpe", DEFAULT_TOKENIZER
    if spec == "byte":
        return "byte", "byte"
    name = os.fspath(spec)
    if name in FETCHABLE:
        return "fetched", name
    rank_file = Path(name.removeprefix("ranks:"))
    if name.startswith("ranks:") or rank_file.suffix == ".tiktoken" or (
        rank_file.suffix == ".json" and rank_file.name.startswith("tekken")
    ):
        return "ranks", str(rank_file)
    return "other", name


def _not_found(name: str, why: str) -> str:
    return (f"tokenizer {name!r}: not a kvlab tokenizer (kvlab-bpe, byte, {', '.join(FETCHABLE)}, or a name trained "
            f"with kvlab tokenizer train), a local folder, nor in the Hugging Face cache (offline, nothing "
            f"downloaded): {why}")


def check_spec(spec: str | os.PathLike | None, *, cache_dir: str | os.PathLike | None = None) -> None:
    """ConfigError (one line) unless ``spec`` names a tokenizer that is here, checked without loading it: a
    fetched name's file is present (else the line names ``kvlab tokenizer fetch``), a trained name's files,
    a rank file is a regular file, a folder exists, or a Hugging Face name has its tokenizer files in the
    Hugging Face cache. What only loading shows (a broken vocabulary) :func:`load_tokenizer` refuses later."""
    kind, name = resolve_spec(spec)
    folder = tokenizer_cache_dir(cache_dir)
    if kind in ("kvlab-bpe", "byte"):
        return
    if kind == "fetched":
        fetched_file(name, folder, check_sha256=False)
    elif kind == "ranks":
        regular_file(name, "tokenizer file")
    elif not (is_trained(name, folder) or Path(name).is_dir() or _in_hf_cache(name)):
        raise ConfigError(_not_found(name, "no such trained name, folder or cached Hugging Face tokenizer"))


def _in_hf_cache(name: str) -> bool:
    """Whether the Hugging Face cache holds a tokenizer file of repository ``name`` (nothing is downloaded)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    for filename in ("tokenizer.json", "tokenizer_config.json"):
        try:
            if isinstance(try_to_load_from_cache(name, filename), str):
                return True
        except Exception:  # an invalid repository id: not in the cache
            return False
    return False


def _rank_tokenizer(path: Path, folder: Path, name: str) -> HFTokenizer:
    """The rank file ``path`` as a :class:`TextTokenizer` named ``name`` (converted once, cached in ``folder``)."""
    from kvlab.workload.rank_tokenizer import rank_file_tokenizer

    return wrap_tokenizers(rank_file_tokenizer(path, cache_dir=folder), name)
