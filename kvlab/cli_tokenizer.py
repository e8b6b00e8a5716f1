"""``kvlab tokenizer``: list the named tokenizers, fetch a production vocabulary, retrain kvlab's BPE under a new name.

``kvlab tokenizer list`` prints every named tokenizer (the committed kvlab-bpe, byte, the fetchable ones, the
trained ones) and whether it is here; ``kvlab tokenizer fetch tekken`` gets Mistral NeMo's vocabulary through
the package index (:mod:`kvlab.workload.tokenizer_fetch`); ``kvlab tokenizer train --name NAME`` trains
kvlab's recipe on a text folder into ``NAME.json`` (:func:`kvlab.workload.tokenizer_store.train_named`). The
tokenizer folder is :func:`kvlab.workload.tokenizer_files.tokenizer_cache_dir` (``$KVLAB_TOKENIZER_CACHE``...).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Annotated

from pydantic import Field

VOCAB_SIZE = Annotated[int, Field(ge=512, le=1 << 20)]
"""``--vocab-size``: tokens (at least the 256 bytes, the special tokens and some merges)."""


def cmd_list(args: argparse.Namespace) -> int:
    """One line per named tokenizer: name, here or not, what it is, its file."""
    from kvlab.workload.tokenizer_store import known_tokenizers

    rows = known_tokenizers()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        state = "present" if r["present"] else "absent "
        where = f"  {r['path']}" if r["path"] else ""
        print(f"{r['name']:<{width}}  {state}  {r['what']}{where}")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """Fetch ``args.name`` into the tokenizer folder (pip download, or ``--wheel``); checksums checked first."""
    from kvlab.workload.tokenizer_fetch import FETCHABLE, fetch

    if args.name not in FETCHABLE:
        from kvlab.errors import ConfigError

        raise ConfigError(f"tokenizer fetch: {args.name!r} is not a fetchable tokenizer (known: "
                          f"{', '.join(FETCHABLE)})")
    if args.wheel is not None:
        from kvlab.inputs import regular_file

        regular_file(args.wheel, "--wheel")
    path, fetched = fetch(args.name, wheel=args.wheel, progress=print)
    print(f"{args.name}: {'fetched to' if fetched else 'already present at'} {path}")
    print(f"use it: --tokenizer {args.name} (kvlab replay, simulate, sweep, trace stats, layout-study), "
          f"trace.tokenizer: {args.name} in experiment files")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """Train kvlab's BPE recipe into NAME.json + NAME.provenance.json (refused for a reserved or taken name)."""
    from kvlab.schema import validate_fields
    from kvlab.workload.tokenizer_store import train_named

    validate_fields("tokenizer train", vocab_size=(VOCAB_SIZE | None, args.vocab_size))
    if args.text_dir is not None and not args.text_dir.is_dir():
        from kvlab.errors import ConfigError

        raise ConfigError(f"--text-dir: {args.text_dir} is not a folder (expected one laid out like "
                          "../shared/traces/text)")
    path = train_named(args.name, text_dir=args.text_dir, vocab_size=args.vocab_size, progress=print)
    print(f"{args.name}: written to {path} (and {path.with_name(args.name + '.provenance.json').name})")
    return 0


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``tokenizer`` (``list``, ``fetch``, ``train``) on kvlab's subcommands."""
    tk = sub.add_parser("tokenizer", parents=[common], help="named tokenizers: list, fetch tekken, train a new BPE")
    tsub = tk.add_subparsers(dest="tokenizer_command", required=True, parser_class=type(tk))
    ls = tsub.add_parser("list", parents=[common], help="every named tokenizer and whether it is here")
    ls.set_defaults(func=cmd_list)
    fe = tsub.add_parser("fetch", parents=[common],
                         help="get a production vocabulary through the package index (tekken: Mistral NeMo's)")
    fe.add_argument("name", help="the tokenizer to fetch (tekken)")
    fe.add_argument("--wheel", type=Path, default=None, metavar="PATH",
                    help="a local copy of the pinned wheel instead of pip download (its sha256 is checked)")
    fe.set_defaults(func=cmd_fetch)
    tr = tsub.add_parser("train", parents=[common],
                         help="train kvlab's BPE recipe on a text folder under a new name (never kvlab-bpe)")
    tr.add_argument("--name", required=True, help="the new tokenizer's name (refused if reserved or taken)")
    tr.add_argument("--text-dir", type=Path, default=None, metavar="DIR",
                    help="a folder laid out like ../shared/traces/text (default: kvlab's text corpora, registry)")
    tr.add_argument("--vocab-size", type=int, default=None, metavar="N", help="tokens (default 16384)")
    tr.set_defaults(func=cmd_train)
