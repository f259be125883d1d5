"""The package's shape (issue 31): no import cycle among dpmem's modules, and a per-sample package that knows
nothing of FSDP or torchrun. Module-level and function-level imports both count."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "dpmem"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """dpmem module -> the dpmem modules it imports (a name imported from a module counts as that module)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}

    def resolve(name):
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            deps |= {dep for t in targets if t.split(".")[0] == "dpmem" and (dep := resolve(t)) and dep != mod}
        graph[mod] = deps
    return graph


def cycles(graph) -> list[list[str]]:
    """Modules on a cycle, one list per strongly connected component of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                found.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_dpmem():
    assert cycles(import_graph()) == []


def test_the_per_sample_package_knows_nothing_of_fsdp_or_torchrun():
    graph = import_graph()
    reached = {dep for mod, deps in graph.items() if mod.startswith("dpmem.persample") for dep in deps}
    assert not reached & {"dpmem.sharding", "dpmem.distributed"}


def test_config_is_schema_only():
    assert import_graph()["dpmem.config"] == set()


def test_the_suite_fails_past_its_ceiling_and_only_when_it_runs_whole():
    import suite_time

    root = str(Path(__file__).resolve().parents[1])
    assert suite_time.whole_suite([], "", "", root) and suite_time.whole_suite([f"{root}/tests"], "", "", root)
    assert not suite_time.whole_suite([f"{root}/tests/test_cli.py"], "", "", root)
    assert not suite_time.whole_suite([], "signal", "", root) and not suite_time.whole_suite([], "", "cuda", root)
    assert suite_time.verdict(suite_time.SUITE_CEILING_S, suite_time.SUITE_CEILING_S) is None
    assert "over its ceiling of 2.0 min" in suite_time.verdict(121, 120)
    assert suite_time.verdict(10 ** 6, 0) is None  # DPMEM_SUITE_CEILING_S=0: no ceiling
