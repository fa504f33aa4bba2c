"""The notebooks run top to bottom (on CPU in CI) and are stored without outputs."""

from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path):
    nbformat = pytest.importorskip("nbformat", reason="the notebooks extra is not installed")
    nbclient = pytest.importorskip("nbclient", reason="the notebooks extra is not installed")
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, f"{path.name} has no code"
    assert all(not c.outputs and c.execution_count is None for c in code), f"{path.name} is stored with outputs"
    # The kernel starts in notebooks/, so `import jax_kimi_mla` finds the installed package rather
    # than the source folder at the repository root.
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    client.execute()
