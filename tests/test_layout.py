"""The shape of the code: the rules docs/architecture.md states, checked so that a change cannot drift from them."""

import ast
import io
import re
import tokenize
from pathlib import Path

from addnorm.model.contract import INPUT_NAMES, OUTPUT_NAMES
from tests.conftest import ROOT

PACKAGES = ("model", "export", "service", "bench")
MODULES = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _name(path: Path) -> str:
    """The module's import name: model/, export/ and service/ install under addnorm (setup.py); bench/ is not
    installed."""
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts) if parts[0] == "bench" else ".".join(("addnorm", *parts))


def _folder(mod: str) -> str:
    """The repository folder a module name lives in (addnorm.service.cli -> service)."""
    return mod.removeprefix("addnorm.").split(".")[0]


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


def test_formatting_is_rarely_overridden():
    skips = [str(p.relative_to(ROOT)) for p in MODULES if "fmt: skip" in p.read_text()]
    assert len(skips) <= 3, skips


def test_imports_go_one_way_and_have_no_cycles():
    """model <- export, model <- service (never export, never torch), and no import cycle anywhere."""
    ours = {_name(p) for p in MODULES}
    graph: dict[str, set[str]] = {}
    torch_users = []
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
        if any(d == "torch" or d.startswith("torch.") for d in deps):
            torch_users.append(_name(path))
    assert torch_users and not [m for m in torch_users if _folder(m) == "service"], torch_users
    for mod, deps in graph.items():
        top = _folder(mod)
        if top == "model":
            assert all(_folder(d) == "model" for d in deps), (mod, deps)
        if top == "service":
            assert not any(_folder(d) in ("export", "bench") for d in deps), (mod, deps)

    def visit(mod: str, stack: list[str]) -> None:
        assert mod not in stack, "import cycle: " + " -> ".join([*stack[stack.index(mod) :], mod])
        for dep in graph.get(mod, ()):
            if dep not in done:
                visit(dep, [*stack, mod])
        done.add(mod)

    done: set[str] = set()
    for mod in graph:
        visit(mod, [])
    # service/'s rooms (docs/architecture.md), each importing only the rooms below it. The modules every room uses
    # (settings, errors, logs, metrics, tracing, the guard) may be imported from anywhere and import no room above
    # the models; the entry points (cli, ray_serve) import anything.
    rooms = ["front", "protocols", "core", "models", "batching", "backend"]
    entry = {
        "addnorm.service",
        "addnorm.service.cli",
        "addnorm.service.ray_serve",
        "addnorm.service.__main__",
    }

    def rank(mod: str) -> int | None:
        parts = mod.removeprefix("addnorm.").split(".")
        return rooms.index(parts[1]) if len(parts) >= 2 and parts[1] in rooms else None

    upward = []
    for mod, deps in graph.items():
        if _folder(mod) != "service" or mod in entry:
            continue
        floor = rank(mod) if rank(mod) is not None else rooms.index("models")
        upward += [f"{mod} -> {d}" for d in deps if (r := rank(d)) is not None and r < floor]
    assert not upward, upward
    assert {m.split(".")[2] for m in graph if m.startswith("addnorm.service.") and m.count(".") >= 3} >= set(
        rooms
    )


TESTS = sorted((ROOT / "tests").rglob("*.py"))
CHECKS = {"raises", "warns", "fail"}  # pytest.raises / pytest.warns / pytest.fail


def _asserts(node: ast.AST, helpers: set[str]) -> bool:
    """Whether ``node``'s body asserts: an ``assert``, ``pytest.raises``/``warns``/``fail``, ``raise
    AssertionError``, a library's ``assert_*`` (numpy.testing, torch.testing), or a call of a function known to
    assert (``helpers``, by name)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Assert):
            return True
        if isinstance(sub, ast.Raise) and "AssertionError" in ast.unparse(sub.exc or sub):
            return True
        if isinstance(sub, ast.Call):
            f = sub.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if (
                name in helpers
                or name.startswith("assert_")
                or (name in CHECKS and isinstance(f, ast.Attribute))
            ):
                return True
    return False


def test_every_test_asserts_something():
    """Each ``test_*`` function asserts, or calls a function of tests/ (or bench/server.py) that does: a test
    that only runs code passes whatever the code does, unless the code raises."""
    functions: dict[str, list[ast.AST]] = {}
    tests = []
    for path in TESTS + [ROOT / "bench" / "server.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.setdefault(node.name, []).append(node)
                if node.name.startswith("test_") and path in TESTS:
                    tests.append((path, node))
    helpers: set[str] = set()
    while True:  # a helper that calls a helper that asserts asserts too
        more = {
            n for n, defs in functions.items() if n not in helpers and any(_asserts(d, helpers) for d in defs)
        }
        if not more:
            break
        helpers |= more
    empty = [f"{p.relative_to(ROOT)}:{n.lineno} {n.name}" for p, n in tests if not _asserts(n, helpers)]
    assert len(tests) > 300 and not empty, empty


def test_every_module_is_listed_in_the_architecture_doc():
    """docs/architecture.md names every module of model/, export/, service/ and bench/ (its one job beside it): a
    new module without a line there fails here. Generated code and package markers aside."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    missing = [
        str(path.relative_to(ROOT))
        for package in ("model", "export", "service", "bench")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.name not in ("__init__.py", "__main__.py")
        and not path.name.endswith("_pb2.py")
        and path.name not in doc
    ]
    assert not missing, f"modules docs/architecture.md does not name: {missing}"


def test_the_architecture_doc_names_no_module_that_is_gone():
    """The other way round: every module the doc's map names (first in a line, or in a list) exists, so a module
    merged or renamed leaves no stale line behind."""
    block = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    named = set()
    for line in block.splitlines():
        first = re.match(r"^(?:\w+/)?\s+(\w+\.py)\b", line)
        named |= {first[1]} if first else set()
        named |= set(re.findall(r"[;,(]\s*(\w+\.py)\b", line))
    have = {p.name for pkg in (*PACKAGES, "deploy", "tests") for p in (ROOT / pkg).rglob("*.py")}
    assert len(named) > 60 and not named - have, sorted(named - have)


def test_the_server_is_used_through_its_public_interface():
    """No module reaches into uvicorn's private modules (its protocol classes, flow control): every HTTP protection
    is a documented option, the app's front or the front proxy (docs/reliability.md), and the options the server
    relies on exist in the pinned uvicorn (a release that drops one fails here, not in production)."""
    import inspect

    import uvicorn

    private = []
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            private += [f"{path.relative_to(ROOT)}: {n}" for n in names if n and n.startswith("uvicorn.")]
    assert not private, private
    options = inspect.signature(uvicorn.Config).parameters
    assert {"limit_concurrency", "timeout_keep_alive", "ws", "http", "proxy_headers"} <= set(options)
    pin = re.search(r'"uvicorn\[standard\]([^"]*)"', (ROOT / "pyproject.toml").read_text())
    assert pin and "<" in pin.group(1), "uvicorn is pinned to a tested range"


def test_the_app_only_assembles():
    """service/front/app.py builds the app from the other modules (at most 120 lines): a state change, a policy or a
    process-wide step goes to the module that owns it (state.py, registry.py, ...)."""
    lines = (ROOT / "service" / "front" / "app.py").read_text().splitlines()
    assert len(lines) <= 120, len(lines)


def test_a_served_model_is_reached_through_the_backend_interface():
    """service/backend/interface.py declares what a served model offers the layers above (``Backend``): the
    onnxruntime engine has every member it declares; the only module above the backend that names the engine is
    the one place a model is built (service/models/state.py); no module probes a backend with ``getattr``."""
    import typing

    from addnorm.service.backend.engine import Engine
    from addnorm.service.backend.interface import Backend

    declared = set(typing.get_type_hints(Backend, localns={"Manifest": object, "TextFront": object}))
    methods = {
        n
        for n, v in vars(Backend).items()
        if not n.startswith("_") and (callable(v) or isinstance(v, property))
    }
    assert {"run", "release", "verify", "name", "on_cpu"} <= methods and {
        "manifest",
        "packed",
        "threads",
    } <= declared
    assert [m for m in sorted(methods) if not hasattr(Engine, m)] == []
    engine = next(
        n
        for n in ast.walk(ast.parse((ROOT / "service" / "backend" / "engine.py").read_text()))
        if isinstance(n, ast.ClassDef) and n.name == "Engine"
    )
    assigned = {  # the instance attributes Engine's methods set (self.x = ..., self.x, self.y = ...)
        t.attr
        for n in ast.walk(engine)
        if isinstance(n, ast.Assign)
        for target in n.targets
        for t in (target.elts if isinstance(target, ast.Tuple) else [target])
        if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"
    }
    assert sorted(declared - assigned) == []
    builders, probes = [], []
    for path in MODULES:
        rel = path.relative_to(ROOT)
        if rel.parts[0] != "service" or rel.parts[:2] == ("service", "backend"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "addnorm.service.backend.engine":
                builders += [str(rel) for a in node.names if a.name == "Engine"]
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "getattr":
                target = ast.unparse(node.args[0]) if node.args else ""
                probes += [f"{rel}: {ast.unparse(node)}" for word in ("model", "engine") if word in target]
    assert builders == ["service/models/state.py"], builders
    assert probes == [], probes


def test_the_checkout_tools_arrow_runs_from_tests_to_bench():
    """bench/ (what a user runs) never imports tests/: the server launcher both use is bench/server.py, and the
    default artifact is named once (addnorm.commands.DEFAULT_ARTIFACT)."""
    wrong, spelled = [], []
    for path in MODULES:
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            names = [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            wrong += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] == "tests"]
        if '"artifacts" / "default"' in text or '"artifacts/default"' in text:
            spelled.append(str(path.relative_to(ROOT)))
    assert wrong == [], wrong
    assert spelled == [], spelled


def test_one_first_party_package():
    """Tools see one package: ruff sorts every ``addnorm.*`` import as first-party, wherever its folder sits, and in a
    checkout only what installs is under ``addnorm`` (model, export, service; not bench, tests or deploy)."""
    import subprocess
    import sys
    import tomllib

    isort = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]["isort"]
    assert "addnorm" in isort["known-first-party"]
    probe = (
        "import importlib.util as u; "
        "print([n for n in ('model', 'export', 'service', 'bench', 'tests', 'deploy') if u.find_spec('addnorm.' + n)])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['model', 'export', 'service']", out.stdout + out.stderr


def test_the_request_core_knows_requests_not_text():
    """service/core/inference.py runs any decoded request through its ``Decoded`` interface (rows, its deadline,
    ``run``): it imports nothing of text and reads no request's ``text`` (core/text.py is the text APIs' and V2's
    shared step; each request type runs its own: protocols/common.py's ``Tensors``, core/text.py's ``TextRequest``)."""
    tree = ast.parse((ROOT / "service" / "core" / "inference.py").read_text())
    runtime = [
        node
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("addnorm.")
    ]
    assert runtime and not [n.module for n in runtime if n.module.endswith(".text")]
    assert not [
        n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "text"
    ]  # no branch on it
