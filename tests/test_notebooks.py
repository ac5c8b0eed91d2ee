"""Every notebook runs top to bottom in a fresh kernel (nbclient) without an error, in the venv's
own Python, from the notebooks/ folder; the shipped files carry no outputs."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 300


def _client(nb, **kw):
    """A client on kernel ``python3`` run by THIS interpreter (the venv's ipykernel): jupyter_client
    replaces a kernelspec's ``python`` with ``sys.executable``; the first cell checks it."""
    check = nbformat.v4.new_code_cell(f"import sys\nassert sys.executable == {sys.executable!r}, sys.executable")
    check["id"] = "check-python"
    nb.cells.insert(0, check)
    return nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                                   resources={"metadata": {"path": str(NOTEBOOKS)}}, **kw)


def test_the_four_notebooks_are_there():
    assert NAMES == ["01_explore_strategies.ipynb", "02_switch_plans.ipynb", "03_autotune_and_deploy.ipynb",
                     "04_replay_preemption.ipynb", "06_rl_phases.ipynb"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_is_stripped_and_valid(name):
    nb = nbformat.read(str(NOTEBOOKS / name), as_version=4)
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{name}: strip outputs before committing"


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name):
    nb = nbformat.read(str(NOTEBOOKS / name), as_version=4)
    client = _client(nb)
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(e))          # the traceback without terminal colours
        pytest.fail(f"{name} failed:\n{plain[-3000:]}")
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.outputs
                 if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {}))
    assert images >= 2, f"{name} drew {images} picture(s)"


def test_notebooks_match_their_generator():
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS / "_make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    assert sorted(make.NOTEBOOKS) == NAMES
    for name in NAMES:
        shipped = nbformat.read(str(NOTEBOOKS / name), as_version=4)
        assert shipped.cells == make.build(name).cells, f"{name} differs from notebooks/_make.py; rerun it"
