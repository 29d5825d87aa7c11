"""BUILD (Bazel) and setup.py name the same op sources and the package; every op source is built."""
import ast
import glob
import os
import re

from conftest import REPO


def setup_op_sources():
    tree = ast.parse(open(os.path.join(REPO, "setup.py")).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "OP_SOURCES":
            return sorted(ast.literal_eval(node.value))
    raise AssertionError("OP_SOURCES not found in setup.py")


def bazel_op_sources():
    build = open(os.path.join(REPO, "BUILD")).read()
    block = re.search(r'name\s*=\s*"_nestpipe_ops\.so".*?srcs\s*=\s*\[(.*?)\]', build, re.S)
    assert block, "BUILD has no _nestpipe_ops.so target"
    return sorted(re.findall(r'"([^"]+\.cc)"', block.group(1)))


def test_bazel_and_setup_build_the_same_op_sources():
    assert bazel_op_sources() == setup_op_sources()


def test_every_op_source_is_built():
    on_disk = sorted(os.path.relpath(p, REPO) for p in glob.glob(os.path.join(REPO, "ops", "*.cc")))
    assert on_disk == setup_op_sources()


def test_bazel_py_library_covers_the_package():
    build = open(os.path.join(REPO, "BUILD")).read()
    assert re.search(r'py_library\(\s*name\s*=\s*"tf_nestpipe"', build)
    assert 'glob(["tf_nestpipe/**/*.py"])' in build
    assert '":_nestpipe_ops.so"' in build
