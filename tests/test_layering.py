"""Dependencies point one way: strategy -> pipeline -> sharding -> collectives -> ops (see
docs/design). Every package and top-level module of tf_nestpipe lists what it may import; a
new one must be listed here before it passes. `tf_nestpipe.settings` (the environment
variables) may be imported from everywhere and imports only the standard library; only
`tf_nestpipe/tf_private.py` imports TensorFlow's and tf_keras' private modules."""
import ast
import glob
import os
import sys

import pytest

from conftest import REPO

PACKAGE = os.path.join(REPO, "tf_nestpipe")
# Imported by every layer: the environment variables, the private-API gateway, trace names, the
# cluster description (TF_CONFIG) and the transport's configuration (no TensorFlow in either).
EVERYWHERE = {"settings", "tf_private", "tracing", "tf_config", "transport_config"}
# Each package or top-level module (a file's name without .py) and the parts of tf_nestpipe it
# may import besides itself and EVERYWHERE. The planner (plan) sits above the layers it plans:
# the strategy asks it, the layers never do. The launcher imports no TensorFlow layer (only the
# Horovod install hint from collectives); data (input pipelines) needs no distribution layer.
ALLOWED = {
    "settings": set(),
    "tf_config": set(),
    "transport_config": set(),
    "tf_private": set(),
    "tracing": set(),
    "ops": set(),
    "launch": {"collectives"},
    "data": set(),
    "collectives": {"ops", "launch"},
    "sharding": {"collectives", "ops", "launch", "data"},
    "pipeline": {"sharding", "collectives", "ops", "launch", "data"},
    "plan": {"sharding", "collectives", "ops", "launch", "data"},
    "strategy": {"plan", "pipeline", "sharding", "collectives", "ops", "launch", "data",
                 "server", "keras_hooks"},
    "server": {"launch", "ops"},
    "keras_hooks": {"strategy", "pipeline", "sharding", "collectives", "ops", "launch", "data"},
    # Keras 3's layers and hooks, beside tf_keras' (keras_hooks, whose saving helpers it shares).
    "keras3": {"keras_hooks", "strategy", "pipeline", "sharding", "collectives", "ops", "launch",
               "data"},
}
# What each part may never import (everything of tf_nestpipe it is not allowed).
def imported_names(path):
    """Every module name a module imports, at any depth of the file (`from m import x` gives
    `m` and `m.x`)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update("%s.%s" % (node.module, a.name) for a in node.names)
    return names


def imported_packages(path):
    """The tf_nestpipe subpackages a module imports (at any depth of the file)."""
    return {name.split(".")[1] for name in imported_names(path)
            if name.startswith("tf_nestpipe.")}


def parts():
    """Every package (directory) and top-level module (file, without .py) of tf_nestpipe, but
    its __init__."""
    names = set()
    for entry in os.listdir(PACKAGE):
        full = os.path.join(PACKAGE, entry)
        if os.path.isdir(full) and os.path.exists(os.path.join(full, "__init__.py")):
            names.add(entry)
        elif entry.endswith(".py") and entry != "__init__.py":
            names.add(entry[:-3])
    return names


def modules_of(part):
    """The source files of a package, or the one file of a top-level module."""
    directory = os.path.join(PACKAGE, part)
    if os.path.isdir(directory):
        return sorted(glob.glob(os.path.join(directory, "**", "*.py"), recursive=True))
    return [directory + ".py"]


def violations(part, allowed=ALLOWED):
    """`(module, part it must not import)` pairs of `part`."""
    out = []
    for path in modules_of(part):
        for imported in sorted(imported_packages(path) - allowed[part] - EVERYWHERE - {part}):
            out.append((os.path.relpath(path, REPO), imported))
    return out


def test_every_part_of_the_package_is_covered():
    """A new package or top-level module must say what it may import."""
    assert parts() == set(ALLOWED), sorted(parts() ^ set(ALLOWED))


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_lower_layers_never_import_higher_ones(part):
    assert violations(part) == []


def test_settings_imports_only_the_standard_library():
    """Every layer imports tf_nestpipe.settings, so it must import nothing that could import a
    layer (or TensorFlow)."""
    path = os.path.join(PACKAGE, "settings.py")
    top_level = {name.split(".")[0] for name in imported_names(path)}
    assert top_level and top_level <= set(sys.stdlib_module_names), top_level


def test_the_layer_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """Positive control: a launcher module importing the strategy is reported."""
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", str(tmp_path))
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "__init__.py").write_text("")
    (tmp_path / "launch" / "bad.py").write_text(
        "from tf_nestpipe import settings\nfrom tf_nestpipe.collectives import wire\n"
        "def f():\n    from tf_nestpipe.strategy import nestpipe_strategy\n")
    found = violations("launch")
    assert [imported for _, imported in found] == ["strategy"], found


PRIVATE_TF = ("tensorflow.python", "tf_keras.src", "keras.src", "keras_rs.src")
PRIVATE_TF_MODULE = os.path.join("tf_nestpipe", "tf_private.py")


def private_tf_imports(path):
    """The private TensorFlow / tf_keras / Keras 3 modules (`PRIVATE_TF`) a module imports, at any
    depth."""
    return {name for name in imported_names(path) if name.startswith(PRIVATE_TF)}


def test_only_tf_private_imports_private_tensorflow_apis():
    """One module (tf_nestpipe/tf_private.py) reaches TensorFlow's and tf_keras' private APIs."""
    importers = {}
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        imported = private_tf_imports(path)
        if imported:
            importers[os.path.relpath(path, REPO)] = imported
    assert set(importers) == {PRIVATE_TF_MODULE}, importers


def test_the_private_api_check_sees_a_private_import(tmp_path):
    """Positive control: private imports at any depth are found, public ones are not."""
    module = tmp_path / "bad.py"
    module.write_text("import tensorflow as tf\nfrom tensorflow.python.ops import array_ops\n"
                      "def f():\n    import tf_keras.src.engine.training\n")
    assert private_tf_imports(str(module)) == {"tensorflow.python.ops",
                                               "tensorflow.python.ops.array_ops",
                                               "tf_keras.src.engine.training"}


def test_the_check_sees_an_upward_import(tmp_path):
    """Positive control: a module importing upwards is reported."""
    module = tmp_path / "bad.py"
    module.write_text("def f():\n    from tf_nestpipe.strategy import nestpipe_strategy\n"
                      "import tf_nestpipe.pipeline.auto\n")
    assert imported_packages(str(module)) == {"strategy", "pipeline"}
