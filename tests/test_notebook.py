"""notebooks/colab_tpu.ipynb runs end to end on CPU (nbclient), with its parameter cell set to
the tiny test flagfile and no install step (the package is installed already)."""

import os

import pytest

pytestmark = pytest.mark.slow   # subprocess runs: CI's second step (see .ci/run)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "colab_tpu.ipynb")


def test_colab_notebook_runs_on_cpu(tmp_path):
    # Imported here, not at the module's top: every pytest worker collects this module, also in
    # the fast step that deselects it, and nbclient brings jupyter_client with it.
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(NOTEBOOK, as_version=4)
    params = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1
    params[0].source = (f"INSTALL = False\nREPO = {REPO!r}\nEXTRA = 'cpu'\n"
                        f"FLAGFILE = 'tests/tiny.flags'\nEXTRA_FLAGS = ['--tensorboard=no']\n"
                        f"OUT = {str(tmp_path / 'run')!r}\nTHETA, SEED = 0.5, 1")
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": REPO}})
    client.execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []) if o.get("output_type") == "stream")
    assert "cpu" in text and "served theta=0.5, seed=1" in text
    assert "projected run" in text          # the --estimate cell's block
    images = [o for c in nb.cells for o in c.get("outputs", [])
              if "image/png" in o.get("data", {})]
    assert images, "the report's figures are shown"
    # The report goes beside the run, which stays a run (a run's folder holds only what a run
    # writes), so that the notebook's cells can be run again.
    assert os.path.exists(tmp_path / "run_report" / "report.md")
    from deltafl_jax.outputs.directory import inspect_dir
    assert inspect_dir(str(tmp_path / "run")).kind == "run"
