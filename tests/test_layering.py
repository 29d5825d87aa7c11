"""Dependencies point one way: strategy -> pipeline -> sharding -> collectives, ops (DESIGN.md
section 10). A lower package never imports a higher one, and production code never reads the
benchmarks' environment switches; only `tf_nestpipe/tf_private.py` imports
TensorFlow's and tf_keras' private modules."""
import ast
import glob
import os

import pytest

from conftest import REPO

PACKAGE = os.path.join(REPO, "tf_nestpipe")
# Each package and the packages it must never import.
# The planner (plan) sits above the layers it plans: the strategy asks it, the layers never do.
FORBIDDEN = {
    "sharding": {"pipeline", "strategy", "plan"},
    "pipeline": {"strategy", "plan"},
    "collectives": {"sharding", "pipeline", "strategy", "plan"},
    "ops": {"collectives", "sharding", "pipeline", "strategy", "plan"},
}


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


def violations(package):
    """`(module, forbidden package)` pairs of `package`."""
    out = []
    for path in sorted(glob.glob(os.path.join(PACKAGE, package, "*.py"))):
        for imported in imported_packages(path) & FORBIDDEN[package]:
            out.append((os.path.relpath(path, REPO), imported))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_layers_never_import_higher_ones(package):
    assert violations(package) == []


PRIVATE_TF = ("tensorflow.python", "tf_keras.src")
PRIVATE_TF_MODULE = os.path.join("tf_nestpipe", "tf_private.py")


def private_tf_imports(path):
    """The private TensorFlow / tf_keras modules (`PRIVATE_TF`) a module imports, at any depth."""
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
