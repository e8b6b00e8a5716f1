"""``kvlab figures``: notebooks run on a fresh kernel into OUT/<notebook>/, figure data byte-equal between two runs
(timing data excluded), an index of every figure, one clear line when a cell fails, nothing overwritten that kvlab
did not write."""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest
from _util import cli_error

from kvlab.cli import main
from kvlab.figures import build_index, caption_problems, data_digests, select_notebooks

pytestmark = pytest.mark.slow

#: a small notebook in the conventions of every kvlab notebook (notebooks/*.ipynb): a parameters cell, style.save
#: with data and caption, a figure of measured wall times (timing columns) and one whose trace is absent
CELLS = [
    ("markdown", "# tiny\nA replay of a generated chat trace."),
    ("parameters", 'import os\n\nQUICK = os.environ.get("KVLAB_QUICK") == "1"\nREQUESTS = 60 if QUICK else 200'),
    ("code", "import time\n\nimport matplotlib.pyplot as plt\nimport pandas as pd\n"
             "from IPython.display import Markdown, display\n\nfrom kvlab.plots import style\n"
             "from kvlab.sweep import grid, run_sweep\nfrom kvlab.workload import synthetic_chat\n\n"
             "style.apply()\nFIGURES = style.figure_folder('01_tiny')\n"
             "workload = synthetic_chat(REQUESTS, seed=5, n_tenants=2, system_tokens=(16, 48), n_docs=4, "
             "doc_tokens=(40, 120), user_median=12, answer_median=10)"),
    ("code", "config = {'capacities': [8, 32, 128], 'policy': 'lru'}\n"
             "start = time.perf_counter()\n"
             "table = run_sweep(workload, grid(config['capacities'], policies=['lru']), progress=False)\n"
             "elapsed = time.perf_counter() - start\n"
             "fig, ax = plt.subplots()\nax.plot(table['capacity_blocks'], table['token_hit_rate'], "
             "**style.series_style(0))\nax.set_xlabel('capacity (blocks)')\n"
             "ax.set_ylabel('token hit rate (fraction)')\n"
             "data = table[['capacity_blocks', 'token_hit_rate']]\n"
             "best = data['token_hit_rate'].max()\n"
             "cap = style.caption(f'LRU reaches {best:.1%}.', config=config, workload=workload, quick=QUICK)\n"
             "style.save(fig, FIGURES, 'hit_rate', data=data, caption=cap)\n"
             "display(Markdown(style.caption_markdown(cap)))\n"
             "fig, ax = plt.subplots()\nax.bar(['sweep'], [elapsed])\nax.set_ylabel('wall time (s)')\n"
             "style.save(fig, FIGURES, 'wall_time', data=pd.DataFrame({'phase': ['sweep'], 'seconds': [elapsed]}), "
             "caption=(wall := style.caption(f'{elapsed:.3f} s', config=config, timing=['seconds'])))\n"
             "display(Markdown(style.caption_markdown(wall)))\n"
             "fig, ax = plt.subplots()\nax.text(0.5, 0.5, 'needs download', ha='center')\n"
             "style.save(fig, FIGURES, 'absent_trace', caption=style.caption('not computed', "
             "needs_download='kvlab download mooncake_arxiv'))"),
]


def write_notebook(path: Path, cells: list[tuple[str, str]]) -> Path:
    nb = nbformat.v4.new_notebook()
    for kind, source in cells:
        if kind == "markdown":
            nb.cells.append(nbformat.v4.new_markdown_cell(source))
        else:
            cell = nbformat.v4.new_code_cell(source)
            if kind == "parameters":
                cell.metadata["tags"] = ["parameters"]
            nb.cells.append(cell)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)
    return path


@pytest.fixture
def notebooks(tmp_path: Path) -> Path:
    """``tmp/notebooks/01_tiny.ipynb``; the kernels run in ``tmp`` (the notebooks folder's parent)."""
    write_notebook(tmp_path / "notebooks" / "01_tiny.ipynb", CELLS)
    return tmp_path / "notebooks"


def index_of(out: Path) -> dict:
    return json.loads((out / "index.json").read_text())


def test_two_runs_write_byte_equal_data_and_an_index(notebooks, tmp_path, capsys):
    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        assert main(["figures", "--quick", "--notebooks", str(notebooks), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "01_tiny: 3 figures in" in printed and "total" in printed and "warning" not in printed
    first, second = (index_of(out) for out in outs)
    assert first["kind"] == "kvlab figures index" and first["quick"] is True
    figures = {f["name"]: f for f in first["notebooks"][0]["figures"]}
    assert set(figures) == {"hit_rate", "wall_time", "absent_trace"}
    hit = figures["hit_rate"]
    assert hit["files"] == ["hit_rate.png", "hit_rate.pdf", "hit_rate.parquet", "hit_rate.json"]
    assert hit["finding"].startswith("LRU reaches") and len(hit["config_hash"]) > 8 and hit["trace_sha256"]
    assert figures["wall_time"]["timing"] == ["seconds"]
    assert figures["absent_trace"]["needs_download"] == "kvlab download mooncake_arxiv"
    assert not any(f["stale"] for f in figures.values())
    # the data byte-equal (timing columns excluded), the figures too
    digests = data_digests(first)
    assert list(digests) == ["01_tiny/hit_rate", "01_tiny/wall_time"] and digests == data_digests(second)
    for name in ("hit_rate.parquet", "hit_rate.png", "hit_rate.pdf"):
        assert (outs[0] / "01_tiny" / name).read_bytes() == (outs[1] / "01_tiny" / name).read_bytes(), name
    # the executed copy has outputs and the run record; the stored notebook is untouched
    executed = nbformat.read(outs[0] / "01_tiny" / "01_tiny.ipynb", as_version=4)
    assert executed.metadata["kvlab_figures"]["quick"] is True and any(c.get("outputs") for c in executed.cells)
    assert not any(c.get("outputs") for c in nbformat.read(notebooks / "01_tiny.ipynb", as_version=4).cells)
    md = (outs[0] / "index.md").read_text()
    assert "| hit_rate | LRU reaches" in md and "needs download: `kvlab download mooncake_arxiv`" in md
    # a rerun that no longer draws a figure: its old files stay (kvlab deletes nothing) and are marked stale
    cells = CELLS[:-1] + [(CELLS[-1][0], CELLS[-1][1].split("fig, ax = plt.subplots()\nax.text")[0])]
    write_notebook(notebooks / "01_tiny.ipynb", cells)
    executed = tmp_path / "executed"
    assert main(["figures", "--quick", "--notebooks", str(notebooks), "--out", str(outs[0]),
                 "--executed", str(executed)]) == 0
    assert "01_tiny: 3 figures" in capsys.readouterr().out and (executed / "01_tiny.ipynb").is_file()
    third = index_of(outs[0])["notebooks"][0]
    assert third["executed"] == "../executed/01_tiny.ipynb"
    assert {f["name"]: f["stale"] for f in third["figures"]} == {"hit_rate": False, "wall_time": False,
                                                                  "absent_trace": True}
    assert "(stale: not written by the last run)" in (outs[0] / "index.md").read_text()


def test_a_failing_cell_is_one_line_naming_notebook_and_cell(notebooks, tmp_path, capsys):
    write_notebook(notebooks / "02_broken.ipynb", [("parameters", "QUICK = False"), ("code", "x = 1"),
                                                   ("code", "raise ValueError('boom\\nsecond line')")])
    out = tmp_path / "figs"
    line = cli_error(capsys, ["figures", "--quick", "--notebooks", str(notebooks), "--out", str(out), "--only", "02"])
    executed = out / "02_broken" / "02_broken.ipynb"
    assert "02_broken.ipynb: cell 3 (\"raise ValueError('boom" in line and "raised ValueError: boom" in line
    assert str(executed) in line
    assert any(o.get("output_type") == "error" for c in nbformat.read(executed, as_version=4).cells
               for o in c.get("outputs", []))
    assert index_of(out)["notebooks"][0]["error"].startswith("cell 3")
    write_notebook(notebooks / "03_dies.ipynb", [("code", "x = 1"), ("code", "import os\nos._exit(3)")])
    line = cli_error(capsys, ["figures", "--notebooks", str(notebooks), "--out", str(out), "--only", "03"])
    assert '03_dies.ipynb: cell 2 ("import os"): DeadKernelError' in line


def test_never_overwrites_what_kvlab_did_not_write(notebooks, tmp_path, capsys):
    out = tmp_path / "figs"
    (out / "01_tiny").mkdir(parents=True)
    (out / "01_tiny" / "01_tiny.ipynb").write_text("{}")
    assert "is not empty and was not written by kvlab" in cli_error(capsys, ["figures", "--notebooks",
                                                                             str(notebooks), "--out", str(out)])
    assert (out / "01_tiny" / "01_tiny.ipynb").read_text() == "{}"
    (out / "01_tiny" / "01_tiny.ipynb").unlink()
    (out / "01_tiny").rmdir()
    (out / "index.md").write_text("my notes\n")
    assert "is not empty and was not written by kvlab (holds index.md)" in cli_error(
        capsys, ["figures", "--notebooks", str(notebooks), "--out", str(out)])
    assert (out / "index.md").read_text() == "my notes\n" and sorted(p.name for p in out.iterdir()) == ["index.md"]
    line = cli_error(capsys, ["figures", "--notebooks", str(notebooks), "--executed", str(notebooks)])
    assert "is the notebook itself" in line
    assert "no notebook '09'" in cli_error(capsys, ["figures", "--notebooks", str(notebooks), "--only", "09"])
    assert "name at least one notebook" in cli_error(capsys, ["figures", "--notebooks", str(notebooks), "--only", ","])
    assert "no such notebooks folder" in cli_error(capsys, ["figures", "--notebooks", str(tmp_path / "none")])


def test_only_selects_by_number_or_stem(notebooks):
    write_notebook(notebooks / "02_other.ipynb", [("code", "x = 1")])
    assert [p.stem for p in select_notebooks(notebooks, "02")] == ["02_other"]
    assert [p.stem for p in select_notebooks(notebooks, "02_other,01")] == ["01_tiny", "02_other"]


def test_check_stripped(notebooks, capsys):
    assert main(["figures", "--check-stripped", "--notebooks", str(notebooks)]) == 0
    nb = nbformat.read(notebooks / "01_tiny.ipynb", as_version=4)
    nb.metadata["widgets"] = {"state": {}}
    nb.cells[1].metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    nbformat.write(nb, notebooks / "01_tiny.ipynb")
    line = cli_error(capsys, ["figures", "--check-stripped", "--notebooks", str(notebooks)])
    assert "1 notebook(s) stored with outputs or volatile metadata" in line
    assert main(["figures", "--strip", "--notebooks", str(notebooks)]) == 0
    assert "1 of 1 notebooks stripped" in capsys.readouterr().out
    assert main(["figures", "--check-stripped", "--notebooks", str(notebooks)]) == 0
    stripped = nbformat.read(notebooks / "01_tiny.ipynb", as_version=4)
    assert stripped.cells[1].metadata == {"tags": ["parameters"]} and "widgets" not in stripped.metadata


def test_caption_problems(tmp_path):
    folder = tmp_path / "01_x"
    folder.mkdir()
    (folder / "fig.png").write_bytes(b"png")
    (folder / "fig.json").write_text(json.dumps({"finding": "LRU wins.", "config_hash": "abc123"}))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("show()")])
    nbformat.write(nb, folder / "01_x.ipynb")
    assert caption_problems(folder) == ["01_x/fig: no cell output shows its caption (config hash, trace)"]
    nb.cells[0].outputs = [nbformat.v4.new_output("display_data", {"text/markdown": "LRU wins. config `abc123`."})]
    nbformat.write(nb, folder / "01_x.ipynb")
    assert caption_problems(folder) == []
    (folder / "fig.json").write_text(json.dumps({"finding": "LRU wins."}))
    assert caption_problems(folder) == ["01_x/fig: caption without a finding or config hash"]


def test_timing_data_is_left_out_of_the_digests(tmp_path):
    import pandas as pd

    folder = tmp_path / "out" / "01_x"
    folder.mkdir(parents=True)
    for name, timing in (("all", True), ("cols", ["seconds"]), ("none", False)):
        pd.DataFrame({"x": [1, 2], "seconds": [0.1, 0.2]}).to_parquet(folder / f"{name}.parquet", index=False)
        (folder / f"{name}.json").write_text(json.dumps({"finding": "f", "config_hash": "h", "timing": timing}))
    first = build_index(tmp_path / "out", quick=True)
    assert sorted(data_digests(first)) == ["01_x/cols", "01_x/none"]
    for name in ("all", "cols", "none"):
        pd.DataFrame({"x": [1, 2], "seconds": [0.3, 0.4]}).to_parquet(folder / f"{name}.parquet", index=False)
    second = data_digests(build_index(tmp_path / "out", quick=True))
    assert second["01_x/cols"] == data_digests(first)["01_x/cols"] and second["01_x/none"] != data_digests(first)[
        "01_x/none"]


def test_keep_going_runs_every_notebook_lists_the_failures_and_records_times(notebooks, tmp_path, capsys):
    write_notebook(notebooks / "00_broken.ipynb", [("code", "raise ValueError('boom')")])
    out = tmp_path / "figs"
    line = cli_error(capsys, ["figures", "--quick", "--keep-going", "--notebooks", str(notebooks), "--out", str(out)])
    assert "1 of 2 notebooks did not run through: 00_broken failed" in line, line
    assert (out / "01_tiny" / "hit_rate.png").is_file()  # run after the failure
    index = index_of(out)
    runs = {nb["notebook"]: nb for nb in index["notebooks"]}
    assert runs["00_broken"]["error"].startswith("cell 1") and runs["01_tiny"]["error"] is None
    assert index["machine"]["cores"] >= 1 and runs["01_tiny"]["seconds"] > 0
    md = (out / "index.md").read_text()
    assert f"measured on {index['machine']['cores']} cores" in md and "| 01_tiny | " in md
    # kvlab's tqdm.auto in a kernel without ipywidgets: no "IProgress not found" warning in any output
    executed = nbformat.read(out / "01_tiny" / "01_tiny.ipynb", as_version=4)
    assert "IProgress" not in json.dumps([c.get("outputs", []) for c in executed.cells])
    # without --keep-going the first failure stops the run
    line = cli_error(capsys, ["figures", "--quick", "--notebooks", str(notebooks), "--out", str(tmp_path / "b")])
    assert "00_broken.ipynb: cell 1" in line and not (tmp_path / "b" / "01_tiny" / "hit_rate.png").exists()
