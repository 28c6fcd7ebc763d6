"""The shape of the code: the rules docs/architecture.md states, checked so that a change cannot drift from them."""

import ast
import io
import tokenize
from pathlib import Path

from model.contract import INPUT_NAMES, OUTPUT_NAMES
from tests.conftest import ROOT

PACKAGES = ("model", "export", "service", "bench")
MODULES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
MAX_LINES = 400


def _name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_the_contract_names_are_spelled_once():
    """No package module but model/contract.py writes "embeddings", "mask" or "encoded" as a string literal."""
    names = {repr(n) for n in (*INPUT_NAMES, *OUTPUT_NAMES)} | {
        f'"{n}"' for n in (*INPUT_NAMES, *OUTPUT_NAMES)
    }
    found = []
    for path in MODULES:
        if path == ROOT / "model" / "contract.py":
            continue
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
            if tok.type == tokenize.STRING and tok.string in names:
                found.append(f"{path.relative_to(ROOT)}:{tok.start[0]} {tok.string}")
    assert not found, found


def test_no_module_is_too_long():
    long = {
        str(p.relative_to(ROOT)): n for p in MODULES if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_formatting_is_rarely_overridden():
    skips = [str(p.relative_to(ROOT)) for p in MODULES if "fmt: skip" in p.read_text()]
    assert len(skips) <= 3, skips


def test_imports_go_one_way_and_have_no_cycles():
    """model <- export, model <- service (never export, never torch), and no import cycle anywhere."""
    ours = {_name(p) for p in MODULES}
    graph: dict[str, set[str]] = {}
    for path in MODULES:
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:  # "from pkg import mod" depends on pkg.mod
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in ours else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        graph[_name(path)] = (deps & ours) - {_name(path)}
    for mod, deps in graph.items():
        top = mod.split(".")[0]
        if top == "model":
            assert all(d.startswith("model") for d in deps), (mod, deps)
        if top == "service":
            assert not any(d.startswith(("export", "bench")) for d in deps), (mod, deps)

    def visit(mod: str, stack: list[str]) -> None:
        assert mod not in stack, "import cycle: " + " -> ".join([*stack[stack.index(mod) :], mod])
        for dep in graph.get(mod, ()):
            if dep not in done:
                visit(dep, [*stack, mod])
        done.add(mod)

    done: set[str] = set()
    for mod in graph:
        visit(mod, [])
