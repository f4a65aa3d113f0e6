"""The package's import picture: no module imports, even lazily inside a function, a module that
imports it back (an import circle), and the config package reads no file but the YAML."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "areal_hpc"


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Package modules `name` imports anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.update(f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names)
    return {m for m in found if m in mods and m != name}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    mods = _modules()
    edges = {m: _imports(m, p, mods) for m, p in mods.items()}
    assert _circles(edges) == []
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]   # it sees one


def test_config_reads_no_file_but_the_yaml():
    """Every file access of the config package is the YAML's (load checks it exists, read_utf8
    reads it); the model directory, datasets and the rest are preflight.py's."""
    trees = [ast.parse(f.read_text()) for f in sorted((PKG / "config").glob("*.py"))]
    assert len(trees) == 3                  # __init__ (loading), schema, rules
    io = ("read_text", "read_bytes", "open", "is_file", "is_dir", "exists", "glob", "iterdir", "stat")
    where = {}
    for fn in (f for tree in trees for f in ast.walk(tree)):
        if isinstance(fn, ast.FunctionDef):
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) in io
                                                   or getattr(node.func, "id", None) == "open"):
                    where.setdefault(fn.name, []).append(node.lineno)
    assert sorted(where) == ["load", "read_utf8"] and len(where["load"]) == 1, where


# The package's floors, bottom to top (docs/architecture.md "Floors"): a module imports from its
# own floor or below. An import that runs back up is listed in UP with its reason.
FLOORS = {
    0: ["config", "cpus", "random_models", "versions", "determinism", "preemption", "reaper", "progress",
        "slurm_job"],
    1: ["data", "algo", "transport", "topology"],
    2: ["storage", "reward", "env"],
    3: ["rollout", "train", "plan"],
    4: ["launch", "analysis", "audit", "replay", "main", "preflight", "tiny_model"],
}
UP = {
    ("areal_hpc.config.rules", "areal_hpc.data.answers"):
        "reward.extractor must be one of the extractors' names, defined once with the parsers the "
        "rewards use (data/answers.py: pure, no I/O, imports nothing of the package)",
    ("areal_hpc.plan.__main__", "areal_hpc.launch.placement"):
        "`python -m areal_hpc.plan placement` is a front door: it prints the placement that "
        "launch/placement.py computes and checks, not a copy of it",
}


def _floor(module: str) -> int:
    part = module.split(".")[1] if "." in module else ""
    return next(f for f, names in FLOORS.items() if part in names)


def test_imports_run_down_the_floors_but_the_listed_ones():
    mods = _modules()
    up = {(m, d) for m, p in mods.items() if m != "areal_hpc"
          for d in _imports(m, p, mods) if d != "areal_hpc" and _floor(d) > _floor(m)}
    assert up == set(UP), (sorted(up - set(UP)), sorted(set(UP) - up))


# Package files over MAX_LINES, each with its reason (issue: no file over ~600 lines without one).
MAX_LINES = 600
LONG = {
    "rollout/vllm_engine.py": "everything the project asks of vLLM's engine (requests, seeds, "
                              "aborts, weight loads, its child processes) behind one class",
    "storage/checkpoint.py": "the checkpoint format in one file: staging, sealing and swapping a "
                             "save (synchronous or asynchronous), the manifest and its CRC-32s, "
                             "and the choice of the newest valid one, which read each other's "
                             "private names (a split is issue 41's, with the private-name rule)",
}


def test_no_package_file_is_long_without_a_reason():
    lengths = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    long = {f for f, n in lengths.items() if n > MAX_LINES}
    assert long <= set(LONG), sorted((f, lengths[f]) for f in long - set(LONG))
    assert all(lengths.get(f, 0) > MAX_LINES for f in LONG), "a listed file is short now: unlist it"


def test_the_suite_runs_every_test_file():
    """tools/test.sh names the suite's folders and files one by one: a new test file outside
    them would never run in CI."""
    root = Path(__file__).resolve().parents[1]
    script = (root / "tools" / "test.sh").read_text()
    named = [w.rstrip("\\") for w in script.split() if w.startswith("tests/")]
    files = sorted(p.relative_to(root).as_posix() for p in (root / "tests").rglob("test_*.py"))
    missed = [f for f in files if not any(f == n or f.startswith(n.rstrip("/") + "/")
                                          for n in named)]
    assert not missed, f"tools/test.sh does not run {missed}"


def test_tests_build_real_objects():
    """No SimpleNamespace or object.__new__ standing in for a project object: a test builds the
    real one, or a typed double of its protocol (tests/train/one_rank.py), so that a changed
    interface fails the test instead of passing it."""
    root = Path(__file__).resolve().parents[1]
    files = [p for p in sorted((root / "tests").rglob("*.py")) if p != Path(__file__).resolve()]
    hits = [f"{p.relative_to(root)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if "SimpleNamespace" in line or "object.__new__" in line]
    assert not hits, hits
