"""The `cluster` marker covers every session fixture of the suite: each one launches a cluster
(or many), so `-m "not cluster"` must deselect every test that uses one."""
import ast
import glob
import os

from conftest import CLUSTER_FIXTURES

TESTS = os.path.dirname(os.path.abspath(__file__))


def session_fixtures(paths):
    """Names of the functions decorated `@pytest.fixture(scope="session")` in `paths`."""
    names = set()
    for path in paths:
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef):
                continue
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and any(
                        k.arg == "scope" and getattr(k.value, "value", None) == "session"
                        for k in decorator.keywords):
                    names.add(node.name)
    return names


def test_every_session_fixture_is_a_cluster_fixture(tmp_path):
    found = session_fixtures(glob.glob(os.path.join(TESTS, "*.py")))
    assert found, "no session fixture found: the parser is broken"
    assert found <= CLUSTER_FIXTURES, sorted(found - CLUSTER_FIXTURES)
    # Positive control: a module with a new session fixture is caught.
    extra = tmp_path / "test_new.py"
    extra.write_text("import pytest\n\n@pytest.fixture(scope=\"session\")\ndef new_runs():\n"
                     "    return 1\n")
    assert session_fixtures([str(extra)]) - CLUSTER_FIXTURES == {"new_runs"}
