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
