"""A clone that stands on its own (issue 25): the repository's files copied into an empty folder, so that
``<clone>/../shared`` does not exist, with no trace directory, an empty download cache and home, and no model host
(``HF_HUB_OFFLINE=1``). There ``kvlab demo`` works and prints its table (the README's ``make demo``), the example of
results/README.md loads what it wrote, every notebook either runs its first code cell on embedded data or stops
there with one line naming the ``kvlab download`` commands (:func:`kvlab.needs.require`), and
``kvlab figures --keep-going`` ends by naming, for each notebook, the downloads it needs. Every command runs in a
subprocess on the clone's own code (``PYTHONPATH=<clone>``)."""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

import kvlab
from kvlab.needs import AND, needs_line
from kvlab.workload.registry import download_command

REPO = Path(kvlab.__file__).resolve().parents[1]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))

#: what each notebook reads that a clone does not hold (registry names, in its require() order); [] = embedded data
#: only (generated workloads, the committed traces/text corpora and kvlab-bpe vocabulary)
NEEDS = {
    "00_quickstart": ["mooncake_conversation"],
    "01_lru_vs_frequency": ["mooncake_conversation", "mooncake_synthetic"],
    "02_engine_validation": [],
    "03_ttft_and_memory": ["mooncake_conversation"],
    "04_tiered_storage": ["mooncake_conversation"],
    "05_prompt_layout": ["cacheblend_musique", "cacheblend_inputs"],
    "06_block_size_and_hashing": ["mooncake_conversation", "cacheblend_musique", "cacheblend_inputs"],
    "07_published_numbers": [],
}
#: what a notebook on embedded data must never name: the development tree's shared folder
SHARED = re.compile(r"\.\./shared|shared/traces|shared_text_dir|search_dirs\(")
SUBPROCESS_TIMEOUT = 300


def first_code_cell(path: Path) -> str:
    return next(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")


def tracked_files() -> list[str]:
    """The files a clone has: tracked ones, and new ones git does not ignore (not yet committed here)."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: no list of the files a clone holds")
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name and (REPO / name).is_file()]


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """``(clone, env)``: ``<tmp>/clone`` holding the repository's files (``<tmp>/shared`` does not exist) and the
    environment of a user without any trace: no ``KVLAB_*`` variable, home, download and tokenizer caches in tmp,
    Hugging Face offline, kvlab imported from the clone."""
    root = tmp_path_factory.mktemp("standalone")
    repo = root / "clone"
    for name in tracked_files():
        target = repo / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    assert not (repo.parent / "shared").exists()
    (root / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAB_") and k not in ("PYTHONPATH", "HOME")}
    env.update({"PYTHONPATH": str(repo), "HOME": str(root / "home"), "KVLAB_CACHE": str(root / "cache"),
                "KVLAB_TOKENIZER_CACHE": str(root / "tokenizers"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                "HF_HOME": str(root / "hf"), "MPLBACKEND": "Agg", "PYTHONHASHSEED": "0"})
    import matplotlib  # its font cache, so that no subprocess rebuilds it (no trace is in there)

    env["MPLCONFIGDIR"] = matplotlib.get_cachedir()
    return repo, env


def run(clone: tuple[Path, dict[str, str]], *args: str) -> subprocess.CompletedProcess:
    repo, env = clone
    return subprocess.run([sys.executable, *args], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)


def test_every_notebook_is_in_the_table_and_declares_its_data_first():
    assert sorted(NEEDS) == [p.stem for p in NOTEBOOKS]
    for path in NOTEBOOKS:
        calls = [n for n in ast.walk(ast.parse(first_code_cell(path))) if isinstance(n, ast.Call)
                 and getattr(n.func, "id", getattr(n.func, "attr", None)) == "require"]
        assert len(calls) == 1, f"{path.name}: its first code cell must call kvlab.needs.require(...) once"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_notebook_on_embedded_data_names_no_shared_folder(path):
    cells = nbformat.read(path, as_version=4).cells
    hits = [(i, m.group()) for i, c in enumerate(cells, 1) for m in SHARED.finditer(c.source)
            if c.cell_type == "code" or not NEEDS[path.stem]]
    assert not hits, f"{path.name}: names the development tree's shared folder (cell, text): {hits}"


def test_the_clone_sees_no_trace_and_runs_the_demo(clone):
    repo, _ = clone
    probe = run(clone, "-c", "import kvlab; from kvlab.workload.registry import find_local; "
                             "print(kvlab.__file__); print(find_local('mooncake_conversation'))")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == [str(repo / "kvlab" / "__init__.py"), "None"]
    demo = run(clone, "-m", "kvlab.cli", "demo", "--quick", "--out", "results/demo")
    assert demo.returncode == 0, demo.stdout[-2000:] + demo.stderr[-2000:]
    table = demo.stdout.splitlines()
    assert table[0].split() == ["capacity_blocks", "token_hit_rate", "ideal_hit_rate", "rejected_requests"], table
    assert len(table) > 2 and "demo results written to" in table[-1], table
    assert (repo / "results" / "demo" / "summary.csv").is_file()
    # results/README.md's example loads what the demo wrote
    example = re.search(r"```python\n(.*?)```", (repo / "results" / "README.md").read_text(), re.S).group(1)
    loaded = run(clone, "-c", example)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "token_hit_rate" in loaded.stdout


def test_each_notebook_runs_its_first_cell_or_stops_there_with_one_line(clone):
    script = (
        "import json, pathlib, nbformat\n"
        "from kvlab.needs import DataNeeded\n"
        "out = {}\n"
        "for path in sorted(pathlib.Path('notebooks').glob('*.ipynb')):\n"
        "    cell = next(c for c in nbformat.read(path, as_version=4).cells if c.cell_type == 'code')\n"
        "    try:\n"
        "        exec(compile(cell.source, path.name, 'exec'), {'__name__': '__main__'})\n"
        "        out[path.stem] = None\n"
        "    except DataNeeded as exc:\n"
        "        out[path.stem] = {'line': str(exc), 'names': exc.names, 'commands': exc.commands}\n"
        "print(json.dumps(out))\n")
    done = run(clone, "-c", script)
    assert done.returncode == 0, done.stderr[-3000:]
    stops = json.loads(done.stdout.splitlines()[-1])
    for stem, names in NEEDS.items():
        if not names:
            assert stops[stem] is None, f"{stem}: claims embedded data but stopped: {stops[stem]}"
            continue
        commands = [download_command(n) for n in names]
        assert stops[stem] == {"line": needs_line(names, commands), "names": names, "commands": commands}, stem
        assert "\n" not in stops[stem]["line"]
        assert commands == [f"kvlab download {n}" for n in names]


def test_kvlab_figures_keep_going_names_each_notebooks_downloads(clone):
    repo, _ = clone
    needing = [stem for stem, names in NEEDS.items() if names]
    out = repo / "results" / "figures-standalone"
    done = run(clone, "-m", "kvlab.cli", "figures", "--quick", "--keep-going", "--only",
               ",".join(s.split("_")[0] for s in needing), "--out", str(out))
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    error = done.stderr.strip().splitlines()
    assert len(error) == 1 and error[0].startswith(
        f"kvlab: error: {len(needing)} of {len(needing)} notebooks did not run through: "), done.stderr
    index = (out / "index.md").read_text()
    for stem in needing:
        commands = [download_command(n) for n in NEEDS[stem]]
        assert f"{stem} needs: {AND.join(commands)}" in error[0]
        assert f"{stem}: stopped: " in done.stdout
        assert "`" + "`, `".join(commands) + "`" in index
        executed = nbformat.read(out / stem / f"{stem}.ipynb", as_version=4)
        errors = [o for c in executed.cells if c.cell_type == "code" for o in c.get("outputs", [])
                  if o.get("output_type") == "error"]
        assert [o["traceback"] for o in errors] == [[f"DataNeeded: {needs_line(NEEDS[stem], commands)}"]], stem
