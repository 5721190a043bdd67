"""Imports run one way: no module of fusepass imports, directly or through
others, a module that imports it back.  Read from the source (no import runs),
function-level imports included: an import moved into a function still closes
a circle, it only hides it until the function runs."""

from __future__ import annotations

import ast
from pathlib import Path

import fusepass

ROOT = Path(fusepass.__file__).resolve().parent

# Edges that close a circle today and are being removed (each with the change
# that removes it); a listed edge that no longer exists fails the test, so the
# list only shrinks.
PENDING: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _target(name: str, mods: dict[str, Path]) -> str | None:
    """The fusepass module an import of ``name`` loads (its longest prefix that is one)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported fusepass module: line of the first such import}."""
    mods = _modules()
    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        edges = graph.setdefault(mod, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import sub` loads pkg.sub; `from pkg import name` loads pkg.
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                target = _target(name, mods) if name.split(".")[0] == "fusepass" else None
                if target and target != mod:
                    edges.setdefault(target, node.lineno)
    return graph


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_of_every_kind():
    graph = import_graph()
    assert "fusepass.engine" in graph["fusepass.backend"]  # from .engine import FusePass
    assert "fusepass.options" in graph["fusepass.backend"]  # from . import options as _options
    assert "fusepass.kernels.dequant_matmul" in graph["fusepass.tune"]  # inside a function, absolute


def test_no_import_circle():
    graph = import_graph()
    for a, b in PENDING:
        assert b in graph[a], f"{a} no longer imports {b}: remove it from PENDING"
        del graph[a][b]
    groups = circles(graph)
    detail = [
        [f"{a} -> {b} (line {line})" for a in group for b, line in graph[a].items() if b in group]
        for group in groups
    ]
    assert not groups, f"import circles: {detail}"


def test_a_circle_is_found():
    assert circles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


_QUIET = """
import sys
import torch
import fusepass

def norm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

x, w = torch.randn(4, 64), torch.randn(64)
out = torch.compile(norm, backend="fusepass")(x, w)
torch.testing.assert_close(out, norm(x, w))
assert fusepass.last_report().hits, "the compile rewrote nothing"
sys.stdout.write(" ".join(sorted({m.split(".")[0] for m in sys.modules} & {"torchao", "transformers"})))
"""


def test_importing_and_compiling_print_nothing():
    """A fresh process imports fusepass and compiles a tiny function with the backend: nothing reaches
    stdout or stderr (no torchao extension failures, no pytree deprecations, no transformers advice), and
    neither torchao nor transformers was imported on the way."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _QUIET], capture_output=True, text=True, timeout=300,
                         cwd=ROOT.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == "", out.stderr[-3000:]
    assert out.stdout == "", f"imported: {out.stdout}"



def _is_jit(obj) -> bool:
    import triton

    kinds = (triton.runtime.JITFunction,)
    try:
        from triton.runtime.interpreter import InterpretedFunction  # what triton.jit makes under TRITON_INTERPRET

        kinds += (InterpretedFunction,)
    except ImportError:
        pass
    return isinstance(obj, kinds)


def _jit_functions(modules):
    """(module, name, jit function) for every ``@triton.jit`` function defined in ``modules``."""
    for mod in modules:
        for name, obj in vars(mod).items():
            if _is_jit(obj) and obj.fn.__module__ == mod.__name__:
                yield mod.__name__, name, obj


def _renamed_calls(modules) -> tuple[int, list[str]]:
    found, renamed = 0, []
    for module, name, jit in _jit_functions(modules):
        found += 1
        for ref in jit.fn.__code__.co_names:
            target = jit.fn.__globals__.get(ref)
            if _is_jit(target) and target.fn.__name__ != ref:
                renamed.append(f"{module}.{name} calls {target.fn.__module__}.{target.fn.__name__} as {ref}")
    return found, renamed


def test_kernels_call_jit_functions_by_their_own_names():
    """Inductor inlines a kernel by copying the source of each jit function it
    calls, under that function's own name: a kernel that calls one through
    another name (``import round_to as _to``) compiles on its own but fails with
    NameError inside Inductor's code on the GPU."""
    import importlib
    import pkgutil

    import fusepass.kernels

    modules = [importlib.import_module(i.name) for i in pkgutil.walk_packages(fusepass.kernels.__path__,
                                                                              "fusepass.kernels.")]
    found, renamed = _renamed_calls(modules)
    assert found > 30, found  # (the walk reached the kernels)
    assert not renamed, renamed


def test_a_renamed_jit_call_is_found(tmp_path, monkeypatch):
    import sys

    (tmp_path / "renamed_jit_probe.py").write_text(
        "import triton\nimport triton.language as tl\nfrom fusepass.kernels._common import round_to as _to\n\n"
        "@triton.jit\ndef k(x, DT: tl.constexpr):\n    return _to(x, DT, False)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import renamed_jit_probe as probe

    try:
        assert _renamed_calls([probe]) == (1, ["renamed_jit_probe.k calls fusepass.kernels._common.round_to as _to"])
    finally:
        sys.modules.pop("renamed_jit_probe", None)
