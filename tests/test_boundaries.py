"""The one-way rules between the product, benchmarks/ and experiments/ (experiments/README.md), read from
every module's own imports."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("infra", "training", "eval", "tasks", "flows")


def imports(path: Path) -> set[str]:
    """Every absolute module name a file imports, wherever in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def importing(folders: tuple[str, ...], package: str) -> dict[str, set[str]]:
    """{file: the modules of `package` it imports} over the Python files under `folders`."""
    found = {}
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            hits = {name for name in imports(path) if name == package or name.startswith(package + ".")}
            if hits:
                found[str(path.relative_to(ROOT))] = hits
    return found


def test_the_product_imports_neither_benchmarks_nor_experiments():
    assert importing(PRODUCT, "benchmarks") == {}
    assert importing(PRODUCT, "experiments") == {}


def test_tests_import_no_experiment_and_of_benchmarks_only_the_two_host_namespaces():
    assert importing(("tests",), "experiments") == {}
    found = importing(("tests",), "benchmarks")
    assert list(found) == ["tests/test_multinode.py"], found
    assert all(name.startswith("benchmarks.netns") for name in found["tests/test_multinode.py"]), found


def test_benchmarks_import_no_experiment_and_no_campaign_imports_another():
    assert importing(("benchmarks",), "experiments") == {}
    campaigns = sorted(p.name for p in (ROOT / "experiments").iterdir() if (p / "__init__.py").exists())
    assert {"quality", "honest", "size_scaling", "transport_quality"} <= set(campaigns)
    for campaign in campaigns:
        for path, names in importing((f"experiments/{campaign}",), "experiments").items():
            assert all(name.startswith(f"experiments.{campaign}") for name in names), (path, names)


# What sits below what inside training/: a package imports only its own kind and those listed.
TRAINING_LAYERS = {"events": set(), "data": set(), "model": {"data"}, "exchange": {"events"},
                   "learner": {"events", "data", "model", "exchange"}}
MODES = ("butterfly", "allreduce", "hierarchical", "Butterfly", "AllReduce", "Hierarchical")


def test_no_product_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for folder in PRODUCT for p in (ROOT / folder).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_no_package_of_training_imports_one_above_it():
    for package, below in TRAINING_LAYERS.items():
        folder = ROOT / "training" / package
        paths = [folder.with_suffix(".py")] if folder.with_suffix(".py").exists() else sorted(folder.rglob("*.py"))
        for path in paths:
            used = {name.split(".")[1] for name in imports(path) if name.startswith("training.")}
            assert used <= below | {package}, (str(path.relative_to(ROOT)), used - below - {package})


def test_only_the_modes_module_tells_one_sync_mode_from_another():
    """Code asks the run's mode object (training/exchange/modes.py); the spec's schema alone names them."""
    allowed = {"training/exchange/modes.py", "infra/spec/sync.py"}
    for folder in PRODUCT:
        for path in (ROOT / folder).rglob("*.py"):
            if str(path.relative_to(ROOT)) in allowed:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance":
                    assert not any(isinstance(n, ast.Name) and n.id in MODES for n in ast.walk(node)), path
                if isinstance(node, ast.Compare):
                    constants = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
                    assert not constants & set(MODES), (str(path.relative_to(ROOT)), node.lineno)
