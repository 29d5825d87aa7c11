"""The environment variables: one registry, one parser, errors that name the variable."""
import ast
import glob
import os
import re
import subprocess
import sys
import warnings

import pytest

from conftest import REPO
from tf_nestpipe import settings

PACKAGE = os.path.join(REPO, "tf_nestpipe")
VARIABLE = re.compile(r"^(TF_)?NESTPIPE_[A-Z0-9_]+$")


def test_values_defaults_and_empty_text():
    env = {"TF_NESTPIPE_STARTUP_TIMEOUT": "7.5", "TF_NESTPIPE_LAUNCH_OUTPUT": "",
           "TF_NESTPIPE_RESTARTED_TASK": "1", "TF_NESTPIPE_CACHE": "~/x"}
    assert settings.STARTUP_TIMEOUT.value(env) == 7.5
    assert settings.LAUNCH_OUTPUT.value(env) == "first"  # empty is unset
    assert settings.RESTARTED_TASK.value(env) is True
    assert settings.RESTARTED_TASK.value({}) is False
    assert settings.CACHE.value(env) == os.path.join(os.path.expanduser("~"), "x")
    assert settings.EXIT_GRACE_SECONDS.value({}) == 15.0
    assert settings.BIND_PORT.value({}) is None


@pytest.mark.parametrize("name, text, message", [
    ("TF_NESTPIPE_STARTUP_TIMEOUT", "0", "must be a number of seconds > 0"),
    ("TF_NESTPIPE_STARTUP_TIMEOUT", "abc", "must be a number of seconds > 0"),
    ("TF_NESTPIPE_HEARTBEAT_TIMEOUT_SECONDS", "0.5", ">= 1 .how long a silent worker"),
    ("TF_NESTPIPE_EXIT_GRACE_SECONDS", "-1", ">= 0 .0 turns the exit guard off"),
    ("TF_NESTPIPE_EXIT_GRACE_SECONDS", "inf", ">= 0"),
    ("TF_NESTPIPE_EXIT_GRACE_SECONDS", "nan", ">= 0"),
    ("TF_NESTPIPE_LAUNCH_OUTPUT", "some", "must be one of first, all"),
    ("TF_NESTPIPE_RESTARTED_TASK", "yes", "must be 0 or 1"),
    ("TF_NESTPIPE_BIND_PORT", "70000", "TCP port"),
])
def test_a_bad_value_is_refused_naming_the_variable_and_the_value(name, text, message):
    with pytest.raises(settings.SettingError, match=re.escape(name + " must be ")) as error:
        settings.lookup(name).value({name: text})
    assert str(error.value).endswith(", got %r" % text)
    with pytest.raises(ValueError, match=message):
        settings.lookup(name).value({name: text})


def test_an_unknown_variable_is_refused_listing_the_known_ones():
    with pytest.raises(KeyError, match="TF_NESTPIPE_STARTUP_TIMEOUT"):
        settings.lookup("TF_NESTPIPE_NO_SUCH")


def test_a_variable_is_declared_once():
    with pytest.raises(ValueError, match="TF_NESTPIPE_CACHE is declared twice"):
        settings.register("CACHE", settings.path, None, "again")


def test_the_old_spelling_is_read_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match="NESTPIPE_BIND_PORT is deprecated.*set "
                                                "TF_NESTPIPE_BIND_PORT"):
        assert settings.BIND_PORT.value({"NESTPIPE_BIND_PORT": "2222"}) == 2222
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling wins, silently
        assert settings.BIND_PORT.value({"NESTPIPE_BIND_PORT": "1",
                                         "TF_NESTPIPE_BIND_PORT": "2"}) == 2
        # Variables that never had the old spelling do not read it.
        assert settings.STARTUP_TIMEOUT.value({"NESTPIPE_STARTUP_TIMEOUT": "5"}) == 30.0


def test_a_renamed_variable_reads_its_former_name():
    with pytest.warns(DeprecationWarning, match="NESTPIPE_SOCKET_STALL_SECONDS is deprecated.*"
                                                "TF_NESTPIPE_TRANSPORT_STALL_SECONDS"):
        assert settings.TRANSPORT_STALL_SECONDS.value(
            {"NESTPIPE_SOCKET_STALL_SECONDS": "3"}) == 3.0


def test_every_variable_is_under_the_one_prefix_and_in_the_table():
    table = settings.markdown_table()
    for name, setting in settings.REGISTRY.items():
        assert name.startswith("TF_NESTPIPE_") and setting.meaning.endswith(".")
        assert "| `%s` |" % name in table
    assert "| `TF_NESTPIPE_STARTUP_TIMEOUT` | seconds > 0 | 30.0 |" in table
    user_table = settings.markdown_table(set_by="user")
    assert "TF_NESTPIPE_CACHE" in user_table and "TF_NESTPIPE_BIND_HOST" not in user_table


def test_the_table_prints_without_tensorflow():
    """`python -m tf_nestpipe.settings` needs only the standard library (the docs build runs
    it)."""
    code = ("import sys, runpy; sys.argv = ['settings']; "
            "runpy.run_path('tf_nestpipe/settings.py', run_name='__main__'); "
            "assert 'tensorflow' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out == settings.markdown_table()


def variable_literals(path):
    """The string constants of a module (docstrings aside) that name a NestPipe variable."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    return {node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and id(node) not in docstrings and VARIABLE.match(node.value)}


def test_only_settings_names_the_variables():
    """Code reads a variable through its setting, never by spelling its name."""
    spelled = {}
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        relative = os.path.relpath(path, REPO)
        if relative == os.path.join("tf_nestpipe", "settings.py"):
            continue
        found = variable_literals(path)
        if found:
            spelled[relative] = found
    assert spelled == {}


def test_the_literal_check_sees_a_spelled_variable(tmp_path):
    """Positive control: a spelled name is found, a docstring's mention is not."""
    module = tmp_path / "m.py"
    module.write_text('"""Reads TF_NESTPIPE_X."""\nimport os\n'
                      'def f():\n    """TF_NESTPIPE_Y."""\n'
                      '    return os.environ.get("TF_NESTPIPE_STARTUP_TIMEOUT")\n')
    assert variable_literals(str(module)) == {"TF_NESTPIPE_STARTUP_TIMEOUT"}


def test_every_variable_the_package_mentions_is_declared():
    """A docstring or message naming a variable that does not exist misleads its reader."""
    mentioned = set()
    for path in glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True):
        with open(path) as f:
            mentioned |= set(re.findall(r"\bTF_NESTPIPE_[A-Z0-9_]*[A-Z0-9]\b", f.read()))
    assert mentioned - set(settings.REGISTRY) == set()
