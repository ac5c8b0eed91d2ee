"""Every notebook runs top to bottom in a fresh kernel (nbclient) without an error, in the venv's
own Python, from the notebooks/ folder; the shipped files carry no outputs; every plot cell shows its
image inline (and saves it); notebooks use the public API only; every shell command a notebook
shows runs and exits 0."""
from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = sorted(p.name for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT = 300
#: a cell that draws: a parashift plot_* call, an explicit savefig, or a saved PNG shown with Image(...)
PLOT_CELL = re.compile(r"plots\.plot_\w+\(|\.savefig\(|Image\(")


def plot_cells(nb) -> list[int]:
    return [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and PLOT_CELL.search(c.source)]


def shell_commands(nb) -> list[str]:
    """The ``parashift ...`` commands of a notebook's markdown code blocks (continuations joined)."""
    out = []
    for c in nb.cells:
        if c.cell_type != "markdown":
            continue
        for block in re.findall(r"```\n(.*?)```", c.source, flags=re.S):
            for cmd in block.replace("\\\n", " ").splitlines():
                if cmd.strip().startswith("parashift "):
                    out.append(cmd.strip())
    return out


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
                     "04_replay_preemption.ipynb", "05_program_a_schedule.ipynb", "06_rl_phases.ipynb",
                     "07_deploy_real_data.ipynb"]


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
    def images(cell) -> int:
        return sum(1 for o in cell.outputs
                   if o.output_type in ("display_data", "execute_result") and "image/png" in o.get("data", {}))
    drawn = plot_cells(nb)
    assert len(drawn) >= 2
    for i in drawn:   # one image per plot cell: displayed inline, not only written to a file
        assert images(nb.cells[i]) == 1, f"{name} cell {i} shows {images(nb.cells[i])} images:\n{nb.cells[i].source}"
    assert sum(images(c) for c in nb.cells if c.cell_type == "code") == len(drawn)


@pytest.mark.parametrize("name", NAMES)
def test_notebook_uses_the_public_api_only(name):
    nb = nbformat.read(str(NOTEBOOKS / name), as_version=4)
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "parashift.demo" not in code and "matplotlib.use(" not in code
    assert not re.search(r"\b(LIVE|NODE_LOSS|REPLAY|replay_slice)\b", code), name   # the demo's settings


COMMANDS = [(name, cmd) for name in NAMES for cmd in shell_commands(nbformat.read(str(NOTEBOOKS / name), as_version=4))]


def test_every_notebook_shows_commands():
    assert {n for n, _ in COMMANDS} == set(NAMES)


@pytest.fixture(scope="module")
def shell_folders(tmp_path_factory):
    """Per notebook, one folder its commands run in, in order, and the commands that ran there: a later
    command reads what earlier ones wrote (search: calibrate's cost.json; run: search's plan.json), and
    each command runs once however many later ones need it."""
    return {name: (tmp_path_factory.mktemp(f"nb{name[:2]}"), []) for name in NAMES}


@pytest.mark.parametrize("name,cmd", COMMANDS, ids=[f"{n[:2]}-{c.split()[1]}" for n, c in COMMANDS])
def test_notebook_shell_command_runs(name, cmd, shell_folders, monkeypatch, capsys):
    from parashift.cli import main
    folder, ran = shell_folders[name]
    monkeypatch.chdir(folder)     # files the commands write (and read: plan.json, cost.json) stay here
    shown = shell_commands(nbformat.read(str(NOTEBOOKS / name), as_version=4))
    for prev in shown[:shown.index(cmd)]:   # earlier commands of the same notebook, when not run yet
        if prev not in ran:
            assert main(shlex.split(prev)[1:]) == 0, f"{name}: {prev}\n{capsys.readouterr().err[-2000:]}"
            ran.append(prev)
    assert main(shlex.split(cmd)[1:]) == 0, f"{name}: {cmd}\n{capsys.readouterr().err[-2000:]}"
    ran.append(cmd)


def test_notebooks_match_their_generator():
    import importlib.util
    spec = importlib.util.spec_from_file_location("make_notebooks", NOTEBOOKS / "_make.py")
    make = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make)
    assert sorted(make.NOTEBOOKS) == NAMES
    for name in NAMES:
        shipped = nbformat.read(str(NOTEBOOKS / name), as_version=4)
        assert shipped.cells == make.build(name).cells, f"{name} differs from notebooks/_make.py; rerun it"
