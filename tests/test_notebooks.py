"""The notebooks in ``examples/notebooks`` execute cleanly with a real notebook runner (nbclient,
the ``python3`` kernel that ipykernel installs) and each shows at least one plot.

Each notebook is re-executed from a copy in a temporary directory (so hypothesis' database and
any other files land there); a cell that raises fails the test with the cell's traceback. The
committed outputs are not compared (timings and plots vary), only that the run is clean.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the test extra: pip install -e '.[test]'")
nbclient = pytest.importorskip("nbclient", reason="needs the test extra: pip install -e '.[test]'")

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "examples" / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 300


def test_there_are_three_notebooks():
    assert [p.name[:3] for p in NOTEBOOKS] == ["01_", "02_", "03_"]


@pytest.mark.slow  # each notebook runs a kernel that compiles models
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    book = nbformat.read(path, as_version=4)
    assert book.metadata["kernelspec"]["name"] == "python3"
    root = str(path.parent.parent.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    client = nbclient.NotebookClient(book, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} shows no plot"
