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
        for c in answers:   # an answer's output is checked, unless it predicts a number this run measured
            predicts = "check_prediction(" in "".join(c["source"])
            assert "nbval-check-output" in c["metadata"].get("tags", []) or predicts, nb.name


def test_everything_the_notebooks_import_comes_with_the_course_install():
    """`pip install -e ".[course]"` (the README's course command) must bring every package a notebook imports."""
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = project["dependencies"] + project["optional-dependencies"]["course"]
    installed = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower().replace("-", "_") for d in deps}
    installed |= {"minillm", "ipywidgets", "IPython".lower()}        # (ipykernel comes with jupyterlab)
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for top in re.findall(r"^\s*(?:from|import)\s+(\w+)", "".join(cell["source"]), re.M):
                assert top in sys.stdlib_module_names or top.lower() in installed, \
                    f"{nb.name} imports {top}, which `pip install -e .[course]` does not install: add it to the course extra"


# A number measured in a run is printed by the code that measured it, never typed into markdown: typed
# numbers drift from the outputs at the next rerun, or on the learner's machine. What looks measured: a
# time, a rate, a ratio ("2.1×"), a percentage, a size with decimals. Markdown keeps predictions (a
# paragraph that opens with "**Predict"), formulas ($...$ and products like 9 × 64), code, and the facts
# below, which no machine changes.
MEASURED = re.compile(
    r"(?<![\w.,$])~?\d[\d,]*(?:\.\d+)?\s?(?:"
    r"(?:ms|µs|us|s|min|seconds?|minutes?)(?![\w/])"                      # a time
    r"|(?:tok|tokens|req|requests|GB|GiB|MB|GFLOP|TFLOP)/s\b"              # a rate
    r"|(?<=\d)×(?!\d)|(?<=\d)x\b"                                         # a ratio (9 × 64 is a product)
    r"|%)"                                                                 # a share
    r"|(?<![\w.,$])\d+\.\d+\s?(?:GiB|MiB|KiB|GB|MB|KB)\b")                 # a size as measured
FACTS = {   # notebook -> phrases that hold on every machine, each with its reason
    "01": ["less than 16×"],         # the prediction of the cell before: 16 tokens for one read of the weights
    "03": ["99% of gaps"],           # what a p99 is
    "04": ["3× less cache",          # 9 query heads over 3 KV heads
           "cache 3× against MHA",
           "the 3× larger copy",
           "by ±10%"],               # the size of run-to-run noise, a caution and not a result
    "05": ["about **8×** less traffic", "(≈ 8× with 64-row blocks)", "The 8× counts only"],   # 8 × BLOCK_M / D with BLOCK_M = D = 64
    "06": ["95% of its memory",      # 200 tokens of 4,096 reserved
           "2–4× the throughput"],   # the PagedAttention paper's own result, cited
    "09": ["within 3%"],             # exercise 4's tolerance, a setting
    "10": ["40 % of the time", "10 %"],                     # the worked example's own probabilities
    "12": ["150 % off",              # what reading the other layout does to a weight, by construction
           "takes 31 %", "6 % for"],   # bytes per value of each format
    "11": ["30 s by default"],   # the server's settings
    "13": ["4.8 TB/s", "10 µs per collective", "450 GB/s"],   # an H200's and NVLink's data sheets, assumed
    "14": ["about 50× the bytes",    # a 7B layer against a 135M layer, at the same bits
           "more than 5% faster"],   # the margin the native backend's races require, a setting
}


def _prose(cell: dict) -> str:
    text = "".join(cell["source"])
    text = re.sub(r"\$\$.*?\$\$|\$[^$\n]*\$|`[^`]*`", "", text, flags=re.S)                # formulas, code
    text = re.sub(r"^\*On this machine \(.*", "", text, flags=re.M)                       # execute.py's stamp
    return "\n\n".join(p for p in text.split("\n\n") if not p.lstrip("#* ").startswith("Predict"))


def test_measured_numbers_are_printed_by_code_not_typed_into_markdown():
    typed = []
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        facts = FACTS.get(nb.name[:2], []) + ["within 1.3×"]   # every prediction exercise's tolerance
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            if cell["cell_type"] != "markdown":
                continue
            text = _prose(cell)
            for fact in facts:
                text = text.replace(fact, "")
            typed += [f"{nb.name} cell {i}: …{text[max(0, m.start() - 50):m.end() + 10]!r}…"
                      for m in MEASURED.finditer(text)]
    assert not typed, "typed numbers that look measured (print them from code):\n" + "\n".join(typed)


COURSE_ONLY = ("jupyterlab", "ipywidgets", "matplotlib", "psutil", "httpx", "openai")


def test_the_engine_installs_without_the_course():
    """`pip install minillm` (no extra) brings the engine, the server and the command line: none of them
    imports what only the course needs, and the course extra lists those packages."""
    import subprocess
    import sys
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    course = {re.split(r"[<>=!;\[ ]", d, maxsplit=1)[0].lower() for d in project["optional-dependencies"]["course"]}
    assert not core & set(COURSE_ONLY) and set(COURSE_ONLY) <= course
    code = f"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {COURSE_ONLY!r}:
            raise ImportError("not installed: " + name)
sys.meta_path.insert(0, Refuse())
import minillm, minillm.engine, minillm.server.app, minillm.cli, minillm.backends, minillm.generate
from minillm.config import ModelConfig
from minillm.model import Transformer
from minillm.sampling import SamplingParams
m = Transformer(ModelConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64, vocab_size=49152))
llm = minillm.LLM(m.eval().requires_grad_(False), minillm.load_tokenizer(), kv_cache_memory=8 << 20)
print(len(llm.generate(["hi"], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split()[-1] == "3", r.stderr[-2000:]


def test_every_benchmark_that_writes_a_result_records_machine_commit_and_date():
    """A committed number names the hardware it ran on (machine_info) and the code and day that made it
    (provenance: commit and date), so results from different machines or code are never read as one run."""
    missing = []
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        text = script.read_text()
        if "results" not in text and "--out" not in text:
            continue                                  # writes no result file
        if "machine_info()" not in text or "provenance()" not in text:
            missing.append(script.name)
    assert not missing, f"these benchmarks write results without machine_info() and provenance(): {missing}"


def test_every_notebook_predicts_a_number_before_measuring_it():
    """Each notebook has a prediction exercise whose answer is checked within 1.3x against a measurement
    made only after the learner's function has answered: check_prediction gets the function that measures
    (a lambda or a function the notebook defines), not a number printed earlier."""
    import ast

    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        defined = {n.name for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef)}
        defined |= {t.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Lambda)
                    for t in n.targets if isinstance(t, ast.Name)}
        good = []
        for c in cells:
            if c["cell_type"] != "code" or not c["metadata"].get("jupyter", {}).get("source_hidden"):
                continue
            for call in ast.walk(ast.parse("".join(c["source"]))):
                if not (isinstance(call, ast.Call) and getattr(call.func, "id", None) == "check_prediction"):
                    continue
                measure = call.args[2]
                factor = next((k.value.value for k in call.keywords if k.arg == "factor"), 1.3)
                after = isinstance(measure, ast.Lambda) or (isinstance(measure, ast.Name) and measure.id in defined)
                good.append(after and factor <= 1.3)
        assert any(good), f"{nb.name}: no prediction checked within 1.3x against a measurement made after it"


def test_every_notebook_names_its_machine_in_its_first_output():
    """A reader sees first which CPU every number below it came from."""
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        outputs = next(c["outputs"] for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code" and c["outputs"])
        first = outputs[0]
        text = "".join(first.get("text", "")) or "".join(first.get("data", {}).get("text/plain", ""))
        assert "this machine" in text or "'cpu':" in text or "cores" in text, f"{nb.name}: first output {text[:80]!r}"


def test_every_committed_result_records_machine_commit_and_date():
    """Each results JSON names its machine, the code that made it and when (results older than that
    record say so, with the commit that committed them), so runs from different machines, days or
    versions of the code are never read as one."""
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        result = json.loads(path.read_text())
        missing = [k for k in ("machine", "commit", "date") if not result.get(k)]
        assert not missing, f"{path.name} lacks {missing}"
