"""Every output kvlab writes is owned (issue 23): the rule of kvlab.results.owned (a listing of what kvlab wrote
with each file's sha256; edited, foreign and symlinked targets refused; atomic, nothing half-written on refusal),
and the surfaces built on it: style.save and figure_from_experiment, kvlab figures, kvlab layout-study, and kvlab
download's --cache-dir. One test per case of ../shared/cases/new-surfaces-2026-12-05.tsv in the classes
"figures", "layout-study" and "download"."""

from __future__ import annotations

import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from _util import cli_error  # noqa: E402

from kvlab.errors import ConfigError, ResultsLocationError  # noqa: E402
from kvlab.plots import style  # noqa: E402
from kvlab.results.owned import (  # noqa: E402
    LISTING,
    check_folder,
    is_owned_file,
    prepare_folder,
    read_listing,
    write_owned,
    write_owned_text,
)


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes): what a refusal must leave exactly as it was."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------- the rule itself (kvlab.results.owned)
def test_write_owned_lists_each_file_with_its_sha256_and_replaces_only_its_own(tmp_path):
    out = tmp_path / "out"
    write_owned_text(out / "a.txt", "one\n")
    listing = read_listing(out)
    assert set(listing) == {"a.txt"} and is_owned_file(out / "a.txt")
    write_owned_text(out / "a.txt", "two\n")  # kvlab's own, unchanged: replaced
    assert (out / "a.txt").read_text() == "two\n" and read_listing(out)["a.txt"] != listing["a.txt"]
    assert json.loads((out / LISTING).read_text())["kind"] == "kvlab-outputs"


def test_an_edited_file_is_the_users_and_refused(tmp_path):
    out = tmp_path / "out"
    write_owned_text(out / "a.txt", "kvlab\n")
    (out / "a.txt").write_text("my edit\n")
    assert not is_owned_file(out / "a.txt")
    with pytest.raises(ResultsLocationError, match="a.txt: was written by kvlab but changed since"):
        write_owned_text(out / "a.txt", "again\n")
    with pytest.raises(ResultsLocationError, match="changed since"):
        check_folder(out)
    assert (out / "a.txt").read_text() == "my edit\n"


def test_a_symlinked_folder_is_refused(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ResultsLocationError, match="is a symbolic link"):
        write_owned_text(tmp_path / "link" / "a.txt", "x")
    with pytest.raises(ResultsLocationError, match="is a symbolic link"):
        check_folder(tmp_path / "link", flag="--out")
    assert list((tmp_path / "real").iterdir()) == []


def test_a_foreign_non_empty_folder_and_a_foreign_file_are_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("thesis\n")
    with pytest.raises(ResultsLocationError, match=r"--out .*mine: is not empty and was not written by kvlab "
                                                   r"\(holds thesis.tex\)"):
        prepare_folder(mine, flag="--out")
    assert tree(mine) == {"thesis.tex": b"thesis\n"}
    out = prepare_folder(tmp_path / "out")  # an owned folder holding a file kvlab did not write
    (out / "b.txt").write_text("mine\n")
    with pytest.raises(ResultsLocationError, match="b.txt: exists and was not written by kvlab"):
        write_owned_text(out / "b.txt", "kvlab\n")
    with pytest.raises(ResultsLocationError, match="b.txt: exists and was not written by kvlab"):
        check_folder(out, names=["b.txt"])
    assert (out / "b.txt").read_text() == "mine\n"


def test_nothing_is_half_written(tmp_path):
    out = prepare_folder(tmp_path / "out")
    write_owned_text(out / "a.txt", "whole\n")
    before = tree(out)

    def fails(path: Path) -> None:
        Path(path).write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_owned(out / "a.txt", fails)
    with pytest.raises(RuntimeError, match="disk full"):
        write_owned(out / "new.txt", fails)
    assert tree(out) == before and sorted(os.listdir(out)) == sorted([LISTING, ".kvlab-outputs.lock", "a.txt"])


# ---------------------------------------------------------------------- figures: style.save, figure_from_experiment
def _figure() -> plt.Figure:
    fig, ax = plt.subplots(figsize=style.SINGLE)
    ax.plot([1, 2, 3], [0.1, 0.2, 0.3])
    return fig


def test_style_save_writes_owned_files_and_refuses_a_users_figure(tmp_path):
    data = pd.DataFrame({"x": [1, 2, 3], "y": [0.1, 0.2, 0.3]})
    fig = _figure()
    paths = style.save(fig, tmp_path / "figures" / "nb", "f", data=data, caption={"shows": "y"})
    assert [p.name for p in paths] == style.save_names("f")
    assert set(read_listing(tmp_path / "figures" / "nb")) == set(style.save_names("f"))
    assert read_listing(tmp_path / "figures") == {}  # the figures root it created is kvlab's too
    again = style.save(fig, tmp_path / "figures" / "nb", "f", data=data, caption={"shows": "y"})
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]  # replaced, same bytes
    user = tmp_path / "user"
    user.mkdir()
    (user / "f.png").write_text("MY PNG")
    with pytest.raises(ResultsLocationError, match="is not empty and was not written by kvlab"):
        style.save(fig, user, "f", data=data)
    assert tree(user) == {"f.png": b"MY PNG"}
    (tmp_path / "figures" / "nb" / "g.png").write_text("MY OTHER PNG")  # a user's file in kvlab's folder
    with pytest.raises(ResultsLocationError, match="g.png: exists and was not written by kvlab"):
        style.save(fig, tmp_path / "figures" / "nb", "g", data=data)
    assert (tmp_path / "figures" / "nb" / "g.png").read_text() == "MY OTHER PNG"
    assert not (tmp_path / "figures" / "nb" / "g.parquet").exists()
    plt.close(fig)


@pytest.fixture(scope="module")
def tiny_experiment(tmp_path_factory) -> tuple[Path, str]:
    """A results folder holding experiment ``tiny``: LRU at two capacities on 60 generated chat requests."""
    from kvlab.experiment.backends import run_experiment
    from kvlab.experiment.config import Experiment
    from kvlab.workload import synthetic_chat
    from kvlab.workload.native_jsonl import save_jsonl

    root = tmp_path_factory.mktemp("exp")
    trace = save_jsonl(synthetic_chat(60, seed=1), root / "nat60.jsonl")
    exp = Experiment(name="tiny", trace={"path": str(trace)}, cache={"capacity_blocks": 64, "policy": "lru"},
                     sweep={"grid": {"cache.capacity_blocks": [16, 64]}}, analysis={"windows": 2})
    results = root / "results"
    run_experiment(exp, results, progress=False)
    return results, "tiny"


def test_run_figure_refuses_a_users_file_in_the_experiments_figure_folder(tiny_experiment):
    """TSV "user's own file RESULTS/figures/<name>/hit_rate_vs_capacity.png before kvlab run": the figure is
    refused (one line naming the file), not replaced; figure_files names what will be written, for a pre-run
    check."""
    from kvlab.plots.figures import experiment_figure_folder, figure_files, figure_from_experiment

    results, name = tiny_experiment
    folder = experiment_figure_folder(results, name)
    assert figure_files("hit_rate_vs_capacity") == [f"hit_rate_vs_capacity.{s}" for s in
                                                    ("png", "pdf", "parquet", "json")]
    folder.mkdir(parents=True)
    (folder / "hit_rate_vs_capacity.png").write_text("MY PNG")
    with pytest.raises(ResultsLocationError, match="hit_rate_vs_capacity.png"):
        check_folder(folder, names=figure_files("hit_rate_vs_capacity"))
    with pytest.raises(ResultsLocationError, match="is not empty and was not written by kvlab"):
        figure_from_experiment(name, results=results)
    assert tree(folder) == {"hit_rate_vs_capacity.png": b"MY PNG"}
    (folder / "hit_rate_vs_capacity.png").unlink()
    folder.rmdir()
    paths = figure_from_experiment(name, results=results)  # its own folder: written, then replaced
    assert set(read_listing(folder)) == {p.name for p in paths}
    assert [p.read_bytes() for p in figure_from_experiment(name, results=results)] == [p.read_bytes()
                                                                                        for p in paths]


# ---------------------------------------------------------------------- kvlab figures
GOOD_NOTEBOOK = {"cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {}, "outputs": [],
                            "source": "x = 1"}],
                 "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
                 "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def nbs(tmp_path: Path) -> Path:
    folder = tmp_path / "nbs"
    folder.mkdir()
    (folder / "01_tiny.ipynb").write_text(json.dumps(GOOD_NOTEBOOK))
    return folder


def test_figures_out_onto_a_users_folder_is_refused_before_any_notebook_runs(nbs, tmp_path, capsys):
    mine = tmp_path / "mine"
    (mine / "01_tiny").mkdir(parents=True)
    (mine / "thesis.tex").write_text("thesis\n")
    (mine / "01_tiny" / "hit_rate.png").write_text("MY PNG\n")
    (mine / "01_tiny" / "hit_rate.parquet").write_text("my data\n")
    before = tree(mine)
    line = cli_error(capsys, ["figures", "--notebooks", str(nbs), "--out", str(mine), "--quick"])
    assert f"--out {mine}: is not empty and was not written by kvlab" in line
    assert tree(mine) == before and not (mine / LISTING).exists()


def test_figures_refuses_a_users_file_inside_a_kvlab_notebook_folder(nbs, tmp_path, capsys):
    out = prepare_folder(tmp_path / "out")
    prepare_folder(out / "01_tiny")
    (out / "01_tiny" / "hit_rate.png").write_text("MY PNG\n")
    line = cli_error(capsys, ["figures", "--notebooks", str(nbs), "--out", str(out), "--quick"])
    assert "01_tiny/hit_rate.png: exists and was not written by kvlab" in line
    assert (out / "01_tiny" / "hit_rate.png").read_text() == "MY PNG\n"


def test_figures_truncated_notebook_is_one_line_naming_it_before_any_runs(nbs, tmp_path, capsys):
    (nbs / "02_broken.ipynb").write_text('{"cells": [\n')
    out = tmp_path / "f06"
    line = cli_error(capsys, ["figures", "--notebooks", str(nbs), "--out", str(out), "--quick"])
    assert "02_broken.ipynb: not a notebook: invalid JSON at line 2" in line
    assert not out.exists()  # 01_tiny did not run either


def test_figures_strip_with_a_truncated_notebook_is_one_line(nbs, capsys):
    (nbs / "02_broken.ipynb").write_text('{"cells": [\n')
    line = cli_error(capsys, ["figures", "--notebooks", str(nbs), "--strip"])
    assert "02_broken.ipynb: not a notebook" in line
    assert (nbs / "02_broken.ipynb").read_text() == '{"cells": [\n'
    (nbs / "02_broken.ipynb").write_text("[]")
    assert "02_broken.ipynb: not a notebook" in cli_error(capsys, ["figures", "--notebooks", str(nbs),
                                                                   "--check-stripped"])


def test_figures_out_an_existing_file_is_one_clear_line(nbs, tmp_path, capsys):
    outfile = tmp_path / "outfile"
    outfile.write_text("x\n")
    line = cli_error(capsys, ["figures", "--notebooks", str(nbs), "--out", str(outfile), "--quick"])
    assert f"--out {outfile}: is a file, not a folder" in line and "Errno" not in line
    assert outfile.read_text() == "x\n"


def test_figures_out_a_symlink_is_refused(nbs, tmp_path, capsys):
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("keep\n")
    (tmp_path / "linkout").symlink_to(other)
    line = cli_error(capsys, ["figures", "--notebooks", str(nbs), "--out", str(tmp_path / "linkout"), "--quick"])
    assert "linkout: is a symbolic link" in line
    assert tree(other) == {"keep.txt": b"keep\n"}


# ---------------------------------------------------------------------- kvlab layout-study
BASE = """\
block_size: 16
cache_blocks: [512]
common_layouts: [as_generated, volatile_top]
families:
  rag:
    family: rag
    config: {n_requests: 12, k: 3}
boundary: {prompt_tokens: 64, position_step: 16, block_sizes: [16, 32], requests: 2}
"""


@pytest.fixture
def no_study_work(monkeypatch):
    """Any work of the study (loading the tokenizer comes first) fails the test: refusals come before it."""
    from kvlab.layout import study

    def work(*a, **k):
        raise AssertionError("the study started working")

    monkeypatch.setattr(study, "load_tokenizer", work)


def test_layout_config_fifo_is_refused_at_once(tmp_path, capsys):
    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    line = cli_error(capsys, ["layout-study", str(fifo), "--out", str(tmp_path / "l09")])
    assert "cfg.fifo: is a FIFO (named pipe), not a regular layout study config" in line
    assert not (tmp_path / "l09").exists()


def test_layout_out_a_users_folder_is_refused_before_any_work(tmp_path, capsys, no_study_work):
    (tmp_path / "base.yaml").write_text(BASE)
    mydata = tmp_path / "mydata"
    mydata.mkdir()
    (mydata / "thesis.tex").write_text("thesis\n")
    line = cli_error(capsys, ["layout-study", str(tmp_path / "base.yaml"), "--out", str(mydata)])
    assert f"--out {mydata}: is not empty and was not written by kvlab (holds thesis.tex)" in line
    assert tree(mydata) == {"thesis.tex": b"thesis\n"}
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    assert "is a symbolic link" in cli_error(capsys, ["layout-study", str(tmp_path / "base.yaml"), "--out",
                                                      str(tmp_path / "link")])


def test_layout_out_accepts_kvlab_folders(tmp_path):
    """Empty, owned (kvlab's listing) and, from before listings, holding only kvlab results: accepted."""
    from kvlab.layout.config import LayoutStudyConfig
    from kvlab.layout.study import check_out, prepare_out
    from kvlab.results import build_manifest, write_results

    config = LayoutStudyConfig.parse(__import__("yaml").safe_load(BASE))
    out = prepare_out(tmp_path / "new", config)
    assert read_listing(out) == {}
    old = tmp_path / "old"
    write_results(old / "rag", {"requests": pd.DataFrame({"x": [1]})}, {},
                  build_manifest({"a": 1}, trace=None, seed=0, driver="layout-study"))
    assert check_out(old, config) == old and prepare_out(old, config) == old
    (old / "notes.txt").write_text("mine\n")
    with pytest.raises(ResultsLocationError, match="is not empty and was not written by kvlab"):
        check_out(old, config)


def test_layout_family_named_boundary_is_refused(tmp_path, capsys, no_study_work):
    (tmp_path / "l27.yaml").write_text(BASE.replace("  rag:\n", "  boundary:\n"))
    line = cli_error(capsys, ["layout-study", str(tmp_path / "l27.yaml"), "--out", str(tmp_path / "l27")])
    assert "l27.yaml: families.boundary: the name 'boundary' is reserved" in line
    assert not (tmp_path / "l27").exists()
    from kvlab.layout.config import LayoutStudyConfig

    with pytest.raises(ConfigError, match="families.Rag: its results folder OUT/rag/ is also that of family 'rag'"):
        LayoutStudyConfig.parse({"families": {"rag": {"family": "rag"}, "Rag": {"family": "rag"}}})


def test_layout_family_size_is_bounded_naming_the_field(tmp_path, capsys, no_study_work):
    from kvlab.layout.config import MAX_FAMILY_REQUESTS, LayoutStudyConfig

    (tmp_path / "l16.yaml").write_text(BASE.replace("n_requests: 12", "n_requests: 1000000000"))
    line = cli_error(capsys, ["layout-study", str(tmp_path / "l16.yaml"), "--out", str(tmp_path / "l16")])
    assert "l16.yaml: families.rag.config.n_requests: up to 1,000,000,000 requests" in line
    assert f"limit of {MAX_FAMILY_REQUESTS:,} per family" in line and "--limit" not in line
    with pytest.raises(ConfigError, match=r"families.c.config: n_sessions x turns allow up to"):
        LayoutStudyConfig.parse({"families": {"c": {"family": "chat", "config": {"n_sessions": 100_000}}}})


def test_layout_config_duplicate_key_is_refused(tmp_path):
    from kvlab.layout.config import LayoutStudyConfig

    (tmp_path / "dup.yaml").write_text(BASE + "block_size: 32\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: line 9: key 'block_size' is given twice"):
        LayoutStudyConfig.load(tmp_path / "dup.yaml")


# ---------------------------------------------------------------------- kvlab download
def test_download_cache_dir_an_existing_file_is_one_clear_line(tmp_path, capsys, monkeypatch):
    from kvlab.workload import registry

    def fetch(*a, **k):
        raise AssertionError("downloaded")

    monkeypatch.setattr(registry, "_fetch", fetch)
    monkeypatch.setattr(registry, "find_local", fetch)
    cdfile = tmp_path / "cdfile"
    cdfile.write_text("x\n")
    line = cli_error(capsys, ["download", "alibaba_traceA", "--cache-dir", str(cdfile)])
    assert f"--cache-dir (cache_dir=) {cdfile}: is a file, not a folder" in line and "Errno" not in line
    assert cdfile.read_text() == "x\n"
    line = cli_error(capsys, ["download", "alibaba_traceA", "--cache-dir", str(cdfile / "sub")])
    assert f"cannot be created: {cdfile} is a file" in line
