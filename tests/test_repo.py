"""The project's own promises: CI runs the README's test command, notebooks are executed and tagged."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command_verbatim():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    test_command = next(b for b in blocks if "pytest" in b)
    assert test_command in (ROOT / ".ci" / "run").read_text()


def test_notebooks_are_executed_and_have_checked_cells():
    notebooks = sorted((ROOT / "notebooks").glob("*.ipynb"))
    assert len(notebooks) >= 6
    for nb in notebooks:
        cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
        assert all(c.get("execution_count") for c in cells), f"{nb.name} has cells that were never run"
        assert any("nbval-check-output" in c.get("metadata", {}).get("tags", []) for c in cells), nb.name


def test_notebooks_store_the_kernel_name_ipykernel_installs():
    """Otherwise JupyterLab marks every notebook as modified the moment it opens it."""
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert json.loads(nb.read_text())["metadata"]["kernelspec"] == {
            "display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}, nb.name


def test_readme_commands_make_their_own_virtual_environment():
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    for command in (b for b in blocks if "minillm course" in b or "pytest" in b):
        assert command.startswith("python3 -m venv .venv && .venv/bin/python -m pip install"), command


def test_every_notebook_states_its_cost_and_ends_with_checked_exercises():
    """The course's rules for every notebook: run time and peak memory at the top (under 2 GiB, so it runs on
    a small laptop), and exercises whose learner cells are left unwritten and whose answers are collapsed."""
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        top = "".join(cells[0]["source"])
        stamp = re.search(r"\*On this machine \(.+\) it runs top to bottom in .+ and peaks at ([\d.]+) GiB", top)
        assert stamp, f"{nb.name}: no run time / peak memory line (python notebooks/execute.py {nb.name})"
        assert float(stamp.group(1)) < 2.0, f"{nb.name} peaks at {stamp.group(1)} GiB"
        code = [c for c in cells if c["cell_type"] == "code"]
        stubs = [c for c in code if "raise NotImplementedError  # your code here" in "".join(c["source"])]
        answers = [c for c in code if c["metadata"].get("jupyter", {}).get("source_hidden")]
        assert len(stubs) >= 1 and len(answers) == len(stubs), nb.name
        assert all("passed = check_" in "".join(c["source"]) for c in answers), nb.name
        assert all("nbval-check-output" in c["metadata"].get("tags", []) for c in answers), nb.name


def test_everything_the_notebooks_import_comes_with_the_course_install():
    """`pip install -e .` (the README's course command) must bring every package a notebook imports."""
    import sys
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}
    installed |= {"minillm", "ipywidgets", "IPython".lower()}        # (ipykernel comes with jupyterlab)
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for top in re.findall(r"^\s*(?:from|import)\s+(\w+)", "".join(cell["source"]), re.M):
                assert top in sys.stdlib_module_names or top.lower() in installed, \
                    f"{nb.name} imports {top}, which `pip install -e .` does not install: add it to dependencies"
