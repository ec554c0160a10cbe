"""The package's shape: imports point one way, with no cycle, and every patch of another library is
in one place, undoable and checked against the versions it was read for."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("megatron_plugin", "train_steps", "checkpoint_utils")

# bottom to top: a module may import from its own level and the levels below, never above
LEVELS = [
    ("megatron_plugin.errors", "megatron_plugin.fs", "megatron_plugin.quiet", "megatron_plugin.plugin",
     "megatron_plugin.launch_config", "megatron_plugin.layout", "megatron_plugin.placement"),
    ("megatron_plugin.layers",),
    ("megatron_plugin.patches",),
    ("megatron_plugin.models",),
    ("train_steps",),
    ("megatron_plugin.engine", "megatron_plugin.data", "megatron_plugin.generation"),
    ("megatron_plugin.resolve", "megatron_plugin.build"),
    ("megatron_plugin.accelerator", "megatron_plugin.cli", "checkpoint_utils", "megatron_plugin",
     "megatron_plugin.integrations"),
]


def level_of(module: str) -> int:
    best, level = -1, None
    for i, prefixes in enumerate(LEVELS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    assert level is not None, f"{module} sits on no level of LEVELS: add it"
    return level


def modules():
    """{module name: file path} of every module of our packages."""
    out = {}
    for pkg in PACKAGES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
                    out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(dirpath, f)
    return out


def imports_of(name: str, path: str, known) -> set:
    """Our modules that `name` imports, at module level or inside functions."""
    is_pkg = path.endswith("__init__.py")
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            root = base[: len(base) - node.level + 1] if node.level else []
            mod = ".".join(root + ([node.module] if node.module else []))
            # `from pkg import name` imports the submodule pkg.name where there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in known else mod for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def test_imports_point_down():
    upward = sorted(f"{a} -> {b}" for a, targets in graph().items() for b in targets if level_of(b) > level_of(a))
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_cycles():
    g = graph()
    state, cycles = {}, []

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(g[node]):
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(g):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_walk_sees_imports():
    """The checks above would pass on a walk that finds nothing: it must see known edges."""
    g = graph()
    assert "megatron_plugin.resolve" in g["megatron_plugin.accelerator"]
    assert "megatron_plugin.layers.rope" in g["megatron_plugin.patches"]  # inside a function
    assert "megatron_plugin.models" in g["megatron_plugin.models.modeling"]  # `from . import get_family`
    assert level_of("megatron_plugin.engine.checkpoint") > level_of("megatron_plugin.models.mapping")


def test_patches_were_checked_against_the_installed_versions():
    from megatron_plugin import patches

    assert patches.check_versions() == {}, (
        "installed library versions differ from those megatron_plugin/patches.py was checked against: re-read "
        "each patch's target in the new version, then update patches.CHECKED")


@pytest.mark.parametrize("name", ["foreach_clip", "wgrad_fusion", "rope_tables", "quiet_cuda_connections_warning",
                                  "cpu_sequence_parallel", "tp_grad_sums", "accelerate_megatron_hint"])
def test_each_patch_installs_once_and_undoes_exactly(name):
    from megatron_plugin import patches

    patch = patches.PATCHES[name]
    assert patch.library in patches.CHECKED and patch.why
    was_installed = name in patches.installed()
    patches.undo(name)
    targets = patch.targets()
    assert targets, f"{name} has nothing to patch in this environment"
    before = [(obj, attr, patches.current(obj, attr)) for obj, attr, _ in targets]
    assert patches.install(name) == [name]
    assert patches.install(name) == []  # once
    for obj, attr, value in targets:
        got = getattr(obj, attr)
        assert got is value or got == value or getattr(got, "__qualname__", None) == getattr(value, "__qualname__", 0)
    patches.undo(name)
    assert name not in patches.installed()
    for obj, attr, value in before:
        assert patches.current(obj, attr) is value
    if was_installed:
        patches.install(name)


def test_a_run_asks_for_the_patches_it_needs():
    from megatron_plugin import patches

    assert patches.for_run("cpu", wgrad_fusion=False, rotary=False) == ("quiet_cuda_connections_warning",
                                                                         "cpu_sequence_parallel")
    assert patches.for_run("cuda", wgrad_fusion=True, rotary=True) == ("foreach_clip", "tp_grad_sums", "wgrad_fusion",
                                                                       "rope_tables")
    assert patches.for_run("cuda", wgrad_fusion=False, rotary=False) == ("foreach_clip", "tp_grad_sums")


def test_a_model_built_without_its_patches_says_which():
    """Outside prepare/initialize, a rotary model's config needs the rope tables' patch: a clear error, not
    mcore's 'apply_rope_fusion is not available' from deep inside."""
    from megatron_plugin import MegatronLMPlugin, MegatronPluginConfigError, patches
    from megatron_plugin.models import get_family
    from megatron_plugin.models.gpt import build_transformer_config
    from tests.models import llama_config

    cfg = llama_config("llama")
    was_installed = "rope_tables" in patches.installed()
    patches.undo("rope_tables")
    try:
        with pytest.raises(MegatronPluginConfigError, match="rope_tables"):
            build_transformer_config(get_family(cfg), cfg, MegatronLMPlugin())
        patches.install("rope_tables")
        assert build_transformer_config(get_family(cfg), cfg, MegatronLMPlugin()).apply_rope_fusion
    finally:
        patches.undo("rope_tables")
        if was_installed:
            patches.install("rope_tables")
