"""The package's import picture: no module imports, even lazily inside a function, a module that
imports it back (an import circle), and the config package reads no file but the YAML."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "areal_hpc"


def _modules(pkg: Path = PKG) -> dict[str, Path]:
    out = {}
    for p in pkg.rglob("*.py"):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
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
    0: ["config", "cpus", "random_models", "versions", "determinism", "preemption", "reaper", "progress", "checked", "stuck",
        "slurm_job"],
    1: ["data", "algo", "transport", "topology"],
    2: ["storage", "reward", "env"],
    3: ["rollout", "train", "plan"],
    4: ["launch", "analysis", "audit", "replay", "main", "preflight", "tiny_model", "tiny_native"],
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



# A name with a leading underscore is its module's own. One that another package module imports is
# shared, so it is public: named without the underscore (issue 41). An exception would be listed
# here as (importing module, imported module, name) with its reason; there is none (the config
# package's read_utf8 and rules.require were the last, renamed in 5ffb56b).
PRIVATE_OK: set[tuple[str, str, str]] = set()


def _private_imports(pkg: Path) -> list[tuple[str, str, str, str]]:
    """(file, importing module, imported module, name) for every `from X import _name` of a
    module X of the package `pkg` by another of its modules, relative imports resolved."""
    mods, found = _modules(pkg), []
    for name, path in sorted(mods.items()):
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                private = a.name.startswith("_") and not a.name.startswith("__")
                if private and mod in mods and mod != name:
                    found.append((path.relative_to(pkg.parent).as_posix(), name, mod, a.name))
    return found


def test_no_module_imports_a_private_name_of_another(tmp_path):
    found = _private_imports(PKG)
    hits = [h for h in found if h[1:] not in PRIVATE_OK]
    assert not hits, "\n".join(f"{f}: imports {n} from {m} (shared, so public: drop the "
                               f"underscore)" for f, _, m, n in hits)
    assert PRIVATE_OK <= {h[1:] for h in found}, "a PRIVATE_OK entry is gone: unlist it"
    # it sees one: relative (one and two dots) and absolute, not a module's own nor a dunder
    pkg = tmp_path / "pk"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .sub.b import _x, __version__\n")
    (pkg / "a.py").write_text("_own = 1\nfrom pk.a import _own\nfrom os import _exit\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..a import _own, public\nfrom . import _c\n")
    (pkg / "sub" / "_c.py").write_text("")
    assert sorted(_private_imports(pkg)) == [
        ("pk/__init__.py", "pk", "pk.sub.b", "_x"), ("pk/sub/b.py", "pk.sub.b", "pk.a", "_own"),
        ("pk/sub/b.py", "pk.sub.b", "pk.sub", "_c")]
