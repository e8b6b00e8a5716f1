"""``kvlab download``: fetch a registered trace or text corpus (``traces/registry.json``) and verify it.

``kvlab download NAME`` prints the local path of ``NAME`` (found by the registry's search order, else
downloaded into ``<repo>/traces/<group>/``, or into ``--cache-dir`` when given); ``kvlab download --list``
prints the registry as a table (name, kind, size, where it is found or the download command).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def cmd_download(args: argparse.Namespace) -> int:
    """Print the registry table (``--list`` or no name), or the verified local path of ``args.name``."""
    from kvlab.workload.registry import download, registry_table

    if args.list or not args.name:
        print(registry_table())
        return 0
    path = download(args.name, cache_dir=args.cache_dir, force=args.force)
    print(path)
    return 0


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``download`` on kvlab's subcommands."""
    dl = sub.add_parser("download", parents=[common],
                        help="fetch a public trace or text corpus into traces/<group>/ (--list: the registry)")
    dl.add_argument("name", nargs="?", help="a registry name (kvlab download --list)")
    dl.add_argument("--list", action="store_true", help="print every registered trace and corpus")
    dl.add_argument("--cache-dir", type=Path, default=None,
                    help="download into this folder instead of the repository's traces/<group>/")
    dl.add_argument("--force", action="store_true",
                    help="download again even if a local copy exists (e.g. after a checksum error)")
    dl.set_defaults(func=cmd_download)
