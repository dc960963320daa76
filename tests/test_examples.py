"""The examples run: every notebook of examples/notebooks/ is its script of examples/ (tools/notebooks.py writes
them), and each runs here, in a Jupyter kernel of this Python, with the smaller settings of :data:`SMALL` put
after its ``parameters`` cell (papermill's convention). The examples' own ``assert`` lines check what each shows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
import notebooks  # noqa: E402

#: the settings each example runs with here, in place of its own (a few seconds of work each)
SMALL = {
    "01_first_comparison": "ROUNDS = 100\nSEEDS = [0, 1]",
    "02_reproduce_a_figure": "ROUNDS = 300",
    "03_your_own_method": "SEEDS = [0]",
    "04_sweep_with_replicas": "ROUNDS = 60\nSTEPS = [0.008, 0.004]\nSEEDS = [0, 1]",
    "05_to_flower": "ROUNDS = 3",
}
#: a file each example writes, relative to its working folder
WRITES = {
    "01_first_comparison": "results/first-comparison/f_gap-by-epochs.png",
    "02_reproduce_a_figure": "results/fedshuffle-fig1-sum-one/f_gap.png",
    "03_your_own_method": "results/damped/summary.json",
    "04_sweep_with_replicas": "results/lr-sweep/sweep.json",
    "05_to_flower": "flower-app/pyproject.toml",
}
SCRIPTS = notebooks.scripts()


def test_every_example_is_a_script_and_a_notebook_and_runs_here():
    assert [s.stem for s in SCRIPTS] == sorted(SMALL) == sorted(WRITES)
    assert sorted(p.stem for p in (ROOT / "examples" / "notebooks").glob("*.ipynb")) == sorted(SMALL)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_the_notebook_is_its_script(script):
    """Cell by cell, the committed notebook holds the script's code and text (``python tools/notebooks.py``)."""
    nbformat = pytest.importorskip("nbformat")
    committed = nbformat.read(notebooks.notebook_path(script), as_version=4)
    assert [(c.cell_type, c.source, c.metadata.get("tags", [])) for c in committed.cells] == [
        (c["cell_type"], c["source"], c["tags"]) for c in notebooks.cells(script.read_text())
    ], "run python tools/notebooks.py"
    assert all(not c.get("outputs") for c in committed.cells), "notebooks are committed without outputs"
    assert sum("parameters" in c.metadata.get("tags", []) for c in committed.cells) == 1
    compile(script.read_text(), str(script), "exec")  # the script runs as it is, too


def test_a_percent_script_reads_as_cells():
    script = '# %% [markdown]\n# # Title\n#\n# text\n\n# %% tags=["parameters"]\nN = 3\n\n# %%\nprint(N)\n'
    assert notebooks.cells(script) == [
        {"cell_type": "markdown", "source": "# Title\n\ntext", "tags": []},
        {"cell_type": "code", "source": "N = 3", "tags": ["parameters"]},
        {"cell_type": "code", "source": "print(N)", "tags": []},
    ]
    with pytest.raises(ValueError, match="must start with a '# %%' line"):
        notebooks.cells("import os\n# %%\n")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.stem)
def test_the_example_runs_in_a_kernel(script, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    if script.stem == "05_to_flower":
        pytest.importorskip("flwr", reason="the Flower example needs flwr (pip install 'fedshuffle[flower]')")
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    book = nbformat.read(notebooks.notebook_path(script), as_version=4)
    where = next(k for k, c in enumerate(book.cells) if "parameters" in c.metadata.get("tags", []))
    book.cells.insert(where + 1, nbformat.v4.new_code_cell(SMALL[script.stem]))
    monkeypatch.setenv("MPLBACKEND", "Agg")  # the kernel's figures are drawn, not shown
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    kernel = KernelManager(
        kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[])
    )  # this Python's ipykernel
    client = nbclient.NotebookClient(book, km=kernel, timeout=600, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # an error in a cell, its assert lines included, raises here naming the cell
    assert (tmp_path / WRITES[script.stem]).is_file()
    shown = [o for c in book.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in shown if o.output_type == "error"] and json.dumps(shown)
