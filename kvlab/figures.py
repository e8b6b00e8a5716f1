"""``kvlab figures``: rerun every notebook on a fresh kernel (papermill) and index the figures they wrote.

Layout (docs/figures.md): ``OUT/<notebook>/<figure>.{png,pdf,parquet,json}`` written by the notebooks
(:func:`kvlab.plots.style.save`), ``OUT/<notebook>/<notebook>.ipynb`` the executed copy (outputs kept; the git
copy is never touched) and ``OUT/index.json`` + ``OUT/index.md``: every figure with its caption's finding,
config hash and trace checksum. A caption with ``"needs_download": "<command>"`` marks a figure whose data is
absent; ``"timing": true`` marks data that holds measured wall times (not byte-stable between runs), ``"timing":
["col", ...]`` the columns that do (the rest must repeat byte for byte).

Every file is an owned output (:mod:`kvlab.results.owned`, docs/figures.md "Owned outputs"): each folder holds
a listing of what kvlab wrote there with its sha256, and the whole tree is checked before any notebook runs
(:func:`check_targets`): a symbolic link, a file, a folder kvlab did not write, or a file in it that kvlab did not
write (or wrote and somebody changed since) is refused with one line, nothing replaced.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvlab.errors import ConfigError, KvlabError, printable
from kvlab.figures_index import (  # noqa: F401 - the index, re-exported (kvlab.figures is its public home)
    FIGURE_SUFFIXES,
    INDEX_FILES,
    INDEX_KIND,
    MD_MARK,
    build_index,
    caption_problems,
    data_digests,
    executed_path,
    figure_records,
    index_markdown,
    machine,
    machine_text,
    write_index,
)
from kvlab.inputs import read_text
from kvlab.needs import AND, DataNeeded, commands_in
from kvlab.results import atomic_write_file

#: metadata a stored notebook must not carry (widget state, execution timing, papermill's run record)
VOLATILE_NOTEBOOK_METADATA = ("widgets", "papermill", "kvlab_figures")
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "papermill")
#: the kernel logs nothing on the terminal (its TCP notice and the interrupt at shutdown); cell output is kept
KERNEL_ARGUMENTS = ["--IPKernelApp.log_level=CRITICAL"]


#: progress bars in a kernel without ipywidgets: tqdm.auto falls back to the plain bar after warning "IProgress
#: not found" into the executed notebook; the warning is ignored and bars that do not ask for one are off
NO_WIDGET_PROGRESS = {"PYTHONWARNINGS": "ignore:IProgress not found", "TQDM_DISABLE": "1"}


class NotebookError(KvlabError, RuntimeError):
    """A notebook failed while ``kvlab figures`` ran it (names the notebook, the cell and the executed copy)."""


class NotebookNeedsData(NotebookError):
    """A notebook stopped because registry data is not here (:class:`kvlab.needs.DataNeeded`, raised by the
    ``require(...)`` of its first code cell): ``commands`` are the ``kvlab download`` commands that fetch it."""

    def __init__(self, message: str, commands: list[str]) -> None:
        super().__init__(message)
        self.commands = list(commands)


@dataclass
class NotebookRun:
    """One executed notebook: its source, executed copy, wall time and the figures its folder holds."""

    notebook: Path
    executed: Path
    seconds: float
    figures: list[dict[str, Any]] = field(default_factory=list)


def select_notebooks(folder: Path, only: str | None = None) -> list[Path]:
    """The notebooks ``folder/*.ipynb`` in name order; ``only`` (``"01,03"``) keeps those whose stem or
    number prefix is listed."""
    if not folder.is_dir():
        raise ConfigError(f"{folder}: no such notebooks folder (run kvlab figures from the repository root, "
                          "or give --notebooks DIR)")
    paths = sorted(p for p in folder.glob("*.ipynb") if not p.name.startswith("."))
    if not paths:
        raise ConfigError(f"{folder}: holds no notebooks (*.ipynb)")
    if only is None:
        return paths
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    if not wanted:
        raise ConfigError("--only: name at least one notebook (e.g. --only 01,03)")
    chosen = []
    for w in wanted:
        hits = [p for p in paths if w in (p.stem, p.stem.split("_", 1)[0])]
        if not hits:
            names = ", ".join(p.stem for p in paths)
            raise ConfigError(f"--only: no notebook '{printable(w)}' in {folder} (have: {names})")
        chosen += [p for p in hits if p not in chosen]
    return sorted(chosen)


def default_out(quick: bool) -> Path:
    """``results/figures``, or ``results/figures/quick`` for quick runs (:func:`kvlab.plots.style.figures_root`)."""
    from kvlab.plots.style import figures_root

    return figures_root(quick)


def read_notebook(path: Path) -> Any:
    """The notebook ``path`` (nbformat 4) after checking it is a regular file of notebook JSON; one ConfigError line
    naming the file otherwise (a truncated or hand-broken ``.ipynb`` is refused before anything runs)."""
    import nbformat

    text = read_text(path, "notebook")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not a notebook: invalid JSON at line {exc.lineno}, column {exc.colno} "
                          f"({exc.msg}; a truncated file?)") from None
    except RecursionError:
        raise ConfigError(f"{path}: not a notebook: nested too deeply") from None
    if not isinstance(data, dict) or not isinstance(data.get("cells", []), list):
        raise ConfigError(f"{path}: not a notebook: the JSON is not a notebook object with a list of cells")
    try:
        return nbformat.reads(text, as_version=4)
    except Exception as exc:  # nbformat's validation and conversion errors have no common base class
        first = printable(str(exc).strip().split("\n")[0])[:200]
        raise ConfigError(f"{path}: not a valid notebook ({type(exc).__name__}: {first})") from None


def check_targets(notebooks: list[Path], out: Path, executed_dir: Path | None = None) -> None:
    """Refuse, before anything runs, every target kvlab figures could not write without replacing a file it did
    not write (docs/figures.md, "Owned outputs"); creates nothing.

    ``out`` (``--out``) and its tree two levels deep (:func:`kvlab.results.owned.check_folder`): a symbolic link, a
    file, a non-empty folder without kvlab's listing, or a listed file edited since are refused; so are an
    ``index.json`` / ``index.md`` and, in each selected notebook's folder ``OUT/<notebook>/``, any file kvlab did
    not write there (the notebook writes its figures and executed copy into it). ``executed_dir``
    (``--executed``): the same rules, and never the notebooks folder itself."""
    from kvlab.results.owned import check_folder

    for nb in notebooks:
        target = executed_path(nb, out, executed_dir)
        if target.resolve() == nb.resolve():
            raise ConfigError(f"{target}: is the notebook itself; give another --executed folder")
    check_folder(out, flag="--out", depth=2, names=INDEX_FILES)
    for nb in notebooks:
        folder = out / nb.stem
        check_folder(folder, flag="--out", depth=1, names=_visible_files(folder))
    if executed_dir is not None:
        check_folder(executed_dir, flag="--executed", names=[nb.name for nb in notebooks])


def prepare_targets(notebooks: list[Path], out: Path, executed_dir: Path | None = None) -> None:
    """:func:`check_targets`, then create ``out``, every ``OUT/<notebook>/`` and ``executed_dir`` as owned output
    folders (each with its listing), so that the kernels' :func:`kvlab.plots.style.save` writes into them."""
    from kvlab.plots.style import prepare_figure_folder

    check_targets(notebooks, out, executed_dir)
    prepare_figure_folder(out, flag="--out")
    for nb in notebooks:
        prepare_figure_folder(out / nb.stem, flag="--out")
    if executed_dir is not None:
        prepare_figure_folder(executed_dir, flag="--executed")


def _visible_files(folder: Path) -> list[str]:
    """The names of the files in ``folder`` not starting with a dot (kvlab's listing, locks and temporaries do)."""
    try:
        return sorted(e.name for e in os.scandir(folder) if not e.name.startswith(".") and not e.is_dir())
    except OSError:
        return []


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables (the kernel inherits them) and restore the old values afterwards."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # errors come back as one NotebookError line
    try:
        yield
    finally:
        logger.setLevel(level)


def kernel_environment(out: Path, quick: bool) -> dict[str, str]:
    """What a notebook's kernel sees: the figures root, quick mode, a headless backend, a fixed hash seed
    (set and dict orders of strings repeat between runs) and no notebook progress widgets
    (:data:`NO_WIDGET_PROGRESS`)."""
    return {"KVLAB_FIGURES_DIR": str(out.resolve()), "KVLAB_QUICK": "1" if quick else "0", "MPLBACKEND": "Agg",
            "PYTHONHASHSEED": "0", **NO_WIDGET_PROGRESS}


def run_notebook(notebook: Path, out: Path, *, quick: bool, executed_dir: Path | None = None,
                 cwd: Path | None = None, timeout: float | None = None) -> NotebookRun:
    """Execute ``notebook`` top to bottom on a fresh kernel (cwd: ``cwd``, default the notebooks folder's
    parent, i.e. the repository root) with :func:`kernel_environment`; the executed copy (papermill writes it
    into a scratch folder) is then written as an owned output (:func:`kvlab.results.owned.write_owned`: atomic,
    listed, also when a cell fails; a file kvlab did not write is refused, not replaced). The target folders are
    prepared first (:func:`prepare_targets`). Raises :class:`NotebookError` naming the failing cell."""
    import nbformat
    try:
        import papermill
        from papermill.exceptions import PapermillExecutionError
    except ImportError:
        raise ConfigError("kvlab figures needs papermill: pip install 'kvlab[notebooks]'") from None
    from jupyter_client.kernelspec import NoSuchKernel
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    from kvlab.results.owned import write_owned

    target = executed_path(notebook, out, executed_dir)
    prepare_targets([notebook], out, executed_dir)
    cwd = Path(cwd) if cwd is not None else notebook.resolve().parent.parent
    source = read_notebook(notebook)
    tagged = any("parameters" in c.get("metadata", {}).get("tags", []) for c in source.cells)
    started = time.time()
    failure: str | None = None
    needs: list[str] = []  # the downloads a notebook that stopped with kvlab.needs.DataNeeded asks for

    def execute(tmp: Path) -> None:
        nonlocal failure, needs
        try:
            # papermill's notices: the temporary's name does not end in .ipynb; QUICK is computed, not a literal
            with warnings.catch_warnings(), _quiet_logger("papermill"):
                warnings.filterwarnings("ignore", message="The specified file .* does not end in")
                papermill.execute_notebook(str(notebook.resolve()), str(Path(tmp).resolve()),
                                           parameters={"QUICK": quick} if tagged else None,
                                           progress_bar=False, log_output=False, cwd=str(cwd),
                                           execution_timeout=timeout, extra_arguments=KERNEL_ARGUMENTS)
        except PapermillExecutionError as exc:
            failure = f"{_cell_name(source, exc.source, exc.exec_count)} raised {exc.ename}: {printable(exc.evalue)}"
            if exc.ename == DataNeeded.__name__:
                needs = commands_in(exc.evalue)
        except (CellTimeoutError, DeadKernelError) as exc:  # the kernel hung or died: papermill marked the cell
            failure = f"{type(exc).__name__}: {printable(str(exc).strip().split(chr(10))[0])}"
        except NoSuchKernel as exc:
            raise ConfigError(f"{notebook}: no Jupyter kernel '{exc.args[0] if exc.args else exc}' "
                              "(pip install ipykernel)") from None
        if not Path(tmp).exists() or Path(tmp).stat().st_size == 0:  # nothing executed: keep any old copy
            raise NotebookError(f"{notebook}: {failure or 'papermill wrote no executed notebook'}")
        nb = nbformat.read(tmp, as_version=4)
        if failure is not None and not failure.startswith("cell"):
            ran = [c for c in nb.cells if c.cell_type == "code"
                   and c.metadata.get("papermill", {}).get("status", "pending") != "pending"]
            cell = next((c for c in ran if c.metadata["papermill"].get("exception")), ran[-1] if ran else None)
            if cell is not None:  # the cell that raised, else the last one started
                failure = f"{_cell_name(source, cell.source, cell.get('execution_count'))}: {failure}"
        nb.metadata["kvlab_figures"] = {"notebook": notebook.name, "quick": quick,
                                        "seconds": round(time.time() - started, 3), "started": started,
                                        "error": failure, "needs_download": needs or None}
        nbformat.write(nb, tmp)

    # papermill writes into a scratch folder, not the notebook's folder: the kernel's style.save takes that
    # folder's listing lock while it runs; the finished copy is then written like every owned output
    with tempfile.TemporaryDirectory(prefix="kvlab-figures-") as scratch:
        executed = Path(scratch) / notebook.name
        with _environment(kernel_environment(out, quick)):
            execute(executed)
        write_owned(target, lambda p: shutil.copyfile(executed, p), flag="--executed" if executed_dir else "--out")
    seconds = time.time() - started
    if needs:
        raise NotebookNeedsData(f"{notebook}: {(failure or '').replace(f' raised {DataNeeded.__name__}:', '')}", needs)
    if failure is not None:
        raise NotebookError(f"{notebook}: {failure} (after {seconds:.0f} s; the executed notebook with the "
                            f"traceback: {target})")
    return NotebookRun(notebook, target, seconds, figure_records(out / notebook.stem, since=started))


def _cell_name(source: Any, text: Any, exec_count: int | None) -> str:
    """``cell 5 ("table = run_sweep(...")``: the number (1-based) in the stored notebook of the cell whose source
    is ``text``, and its first line."""
    text = text if isinstance(text, str) else "".join(text or [])
    number = next((i for i, c in enumerate(source.cells, 1) if c.source == text), None)
    first = next((line for line in text.splitlines() if line.strip()), "")
    first = printable(first if len(first) <= 60 else first[:57] + "...")
    where = f"cell {number}" if number is not None else f"cell In [{exec_count}]"
    return f'{where} ("{first}")'


def stripped_problems(path: Path) -> list[str]:
    """What keeps a stored notebook from being clean: outputs, execution counts, volatile metadata."""
    nb = read_notebook(path)
    problems = [f"notebook metadata '{k}'" for k in VOLATILE_NOTEBOOK_METADATA if k in nb.metadata]
    for i, cell in enumerate(nb.cells, 1):
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            problems.append(f"cell {i}: outputs or execution count")
        problems += [f"cell {i}: metadata '{k}'" for k in VOLATILE_CELL_METADATA if k in cell.metadata]
    return problems


def strip_notebook(path: Path) -> bool:
    """Clear ``path``'s outputs, execution counts and volatile metadata in place (atomically, only if any);
    True if it changed. Cell sources, tags and the kernelspec are kept."""
    import nbformat

    if not stripped_problems(path):
        return False
    nb = read_notebook(path)
    for k in VOLATILE_NOTEBOOK_METADATA:
        nb.metadata.pop(k, None)
    for cell in nb.cells:
        for k in VOLATILE_CELL_METADATA:
            cell.metadata.pop(k, None)
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    atomic_write_file(path, lambda p: nbformat.write(nb, str(p)))
    return True


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register ``figures`` on kvlab's subcommands."""
    p = sub.add_parser("figures", parents=[common],
                       help="rerun every notebook (fresh kernel) into results/figures/<notebook>/ (docs/figures.md)")
    p.add_argument("--quick", action="store_true", help="quick mode (KVLAB_QUICK=1): small traces, seconds each")
    p.add_argument("--only", default=None, metavar="01,03", help="only these notebooks (number prefix or stem)")
    p.add_argument("--out", type=Path, default=None,
                   help="figures root (default results/figures, or results/figures/quick with --quick)")
    p.add_argument("--executed", type=Path, default=None, metavar="DIR",
                   help="executed notebooks go to DIR/<notebook>.ipynb (default OUT/<notebook>/<notebook>.ipynb)")
    p.add_argument("--notebooks", type=Path, default=Path("notebooks"), metavar="DIR",
                   help="the notebooks folder (default notebooks; the kernels run in its parent folder)")
    p.add_argument("--keep-going", action="store_true",
                   help="run every selected notebook even when one fails; end with the list of failures (exit 2)")
    p.add_argument("--check-stripped", action="store_true",
                   help="run nothing: check the notebooks are stored without outputs or volatile metadata")
    p.add_argument("--strip", action="store_true",
                   help="run nothing: clear the notebooks' outputs and volatile metadata in place (make strip)")
    p.set_defaults(func=cmd_figures)


def cmd_figures(args: argparse.Namespace) -> int:
    """Run the selected notebooks in order, print each one's wall time and a summary, write the index (with the
    machine the times were measured on). A failing notebook stops the run, or with ``--keep-going`` is listed
    at the end (NotebookError naming every one that failed) after the others ran."""
    notebooks = select_notebooks(args.notebooks, args.only)
    for nb in notebooks:  # every selected notebook readable before any is run or stripped
        read_notebook(nb)
    if args.strip:
        changed = [nb for nb in notebooks if strip_notebook(nb)]
        for nb in changed:
            print(f"{nb}: stripped")
        print(f"{len(changed)} of {len(notebooks)} notebooks stripped")
        return 0
    if args.check_stripped:
        bad = {nb: stripped_problems(nb) for nb in notebooks}
        for nb, problems in bad.items():
            for problem in problems:
                print(f"{nb}: {problem}")
        if any(bad.values()):
            raise ConfigError(f"{sum(map(bool, bad.values()))} notebook(s) stored with outputs or volatile metadata "
                              "(make strip)")
        print(f"{len(notebooks)} notebooks stored without outputs")
        return 0
    out = args.out if args.out is not None else default_out(args.quick)
    prepare_targets(notebooks, out, args.executed)
    runs: list[NotebookRun] = []
    failures: dict[str, list[str]] = {}  # notebook -> the downloads it needs ([]: it failed otherwise)
    try:
        for nb in notebooks:
            print(f"{nb.stem}: running ({'quick' if args.quick else 'full'} mode) ...", flush=True)
            try:
                run = run_notebook(nb, out, quick=args.quick, executed_dir=args.executed)
            except NotebookError as exc:
                if not args.keep_going:
                    raise
                failures[nb.stem] = exc.commands if isinstance(exc, NotebookNeedsData) else []
                print(f"{nb.stem}: {'stopped' if failures[nb.stem] else 'failed'}: {exc}", flush=True)
                continue
            runs.append(run)
            print(f"{nb.stem}: {len(run.figures)} figures in {run.seconds:.1f} s", flush=True)
            for problem in caption_problems(out / nb.stem, run.executed):
                print(f"warning: {problem}", flush=True)
    finally:
        write_index(out, args.quick, args.executed)
    _print_summary(runs, out)
    if failures:
        raise NotebookError(failures_line(failures, len(notebooks), out))
    return 0


def failures_line(failures: dict[str, list[str]], total: int, out: Path) -> str:
    """The closing line of ``kvlab figures --keep-going``: every notebook that did not run through, each with the
    downloads it needs (``00_quickstart needs: kvlab download mooncake_conversation``) or ``failed``."""
    parts = [f"{nb} needs: {AND.join(cmds)}" if cmds else f"{nb} failed" for nb, cmds in failures.items()]
    return (f"{len(failures)} of {total} notebooks did not run through: {'; '.join(parts)} "
            f"(each one's error above and in {out / 'index.md'})")


def _print_summary(runs: list[NotebookRun], out: Path) -> None:
    width = max([len(r.notebook.stem) for r in runs] + [8])
    print(f"\n{'notebook':<{width}}  figures  needs download  stale  time (s)")
    for r in runs:
        fresh = [f for f in r.figures if not f["stale"]]
        print(f"{r.notebook.stem:<{width}}  {len(fresh):>7}  {sum(bool(f['needs_download']) for f in fresh):>14}  "
              f"{len(r.figures) - len(fresh):>5}  {r.seconds:>8.1f}")
    print(f"{'total':<{width}}  {sum(not f['stale'] for r in runs for f in r.figures):>7}  {'':>14}  {'':>5}  "
          f"{sum(r.seconds for r in runs):>8.1f}")
    print(f"index: {out / 'index.md'}")


__all__ = ["INDEX_FILES", "INDEX_KIND", "NotebookError", "NotebookNeedsData", "NotebookRun", "add_parser",
           "build_index", "caption_problems", "check_targets", "data_digests", "default_out", "executed_path",
           "failures_line", "figure_records", "kernel_environment", "machine", "machine_text", "prepare_targets",
           "read_notebook", "run_notebook", "select_notebooks", "strip_notebook", "stripped_problems", "write_index"]
