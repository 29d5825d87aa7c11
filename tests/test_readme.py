"""The Python examples of the README and the docs run as written: their ```python blocks,
extracted by `tests/programs/readme_examples.py` and executed in order (README first, then the
docs pages of `readme_examples.DOCUMENTS`) as one session on one local worker and on 2 workers
(each block continuing the session of the blocks before it), the parameter-server block on a
chief + worker + ps cluster. A block that cannot run here must say why in a
`<!-- readme-test: skip (...) -->` marker, which this test lists."""
import os
import re
import subprocess
import sys

import pytest

from conftest import PROGRAMS, REPO, run_command

sys.path.insert(0, PROGRAMS)
import readme_examples  # noqa: E402  pylint: disable=wrong-import-position

README = os.path.join(REPO, "README.md")
DOCS = os.path.join(REPO, "docs")
RUNNER = os.path.join(PROGRAMS, "readme_examples.py")


def _blocks():
    return readme_examples.document_blocks(
        [os.path.join(REPO, path) for path in readme_examples.DOCUMENTS])


def test_every_readme_block_is_run_or_says_why_not():
    blocks = _blocks()
    sessions = {b.session for b in blocks}
    assert sessions <= {"main", "ps", "skip"}, sessions
    main = [b for b in blocks if b.session == "main"]
    assert len(main) >= 5 and main[0].path == README and main[0].line < 40, main[0]  # example first
    skipped = [b for b in blocks if b.session == "skip"]
    assert all("tests/test_" in b.reason for b in skipped), skipped  # names what runs it instead
    for block in skipped:  # ... and that test exists
        named = re.search(r"tests/(test_\w+\.py)", block.reason).group(1)
        assert os.path.exists(os.path.join(REPO, "tests", named)), block
    # Skipped: the one Horovod line (its own launcher) and the dynamic-table fragment (its model
    # under fit is tests/test_dynamic_embedding.py's); every other block runs in some session.
    assert len(skipped) <= 2, skipped
    assert all("horovod" in b.code or "DynamicEmbedding" in b.code for b in skipped), skipped


def test_every_python_example_of_the_docs_is_in_a_session():
    """A docs page with a ```python block must be one of the documents whose blocks run."""
    with_examples = set()
    for folder, _, files in os.walk(DOCS):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".md") and "_build" not in path:
                with open(path) as f:
                    if readme_examples.python_blocks(f.read()):
                        with_examples.add(os.path.relpath(path, REPO))
    assert with_examples <= set(readme_examples.DOCUMENTS), with_examples - set(
        readme_examples.DOCUMENTS)
    assert with_examples, "the docs' guides have no python example"


def test_readme_is_a_front_door():
    """The README stays short: the rest lives in docs/."""
    with open(README) as f:
        assert len(f.read().splitlines()) <= 250


def test_block_extraction_positive_control(tmp_path):
    """The runner fails, naming the README line, on a block that does not run, and a marker
    moves a block out of the main session (what would catch a stale README)."""
    markdown = tmp_path / "R.md"
    markdown.write_text("text\n\n```python\nx = 1\n```\n\n<!-- readme-test: skip (tests/test_x.py) -->\n"
                        "```python\nraise SystemExit(3)\n```\n\n```python\ny = x + undefined_name\n```\n")
    blocks = readme_examples.python_blocks(markdown.read_text())
    assert [(b.line, b.session) for b in blocks] == [(4, "main"), (9, "skip"), (13, "main")]
    result = subprocess.run([sys.executable, RUNNER, str(markdown), "main", str(tmp_path / "w")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    assert result.returncode != 0 and "README_BLOCK R.md:13" in result.stdout, result.stdout
    assert "NameError" in result.stdout and 'R.md", line 13' in result.stdout, result.stdout
    assert "README_OK" not in result.stdout
    with pytest.raises(ValueError, match="never closed"):
        readme_examples.python_blocks("```python\nx = 1\n")


def _assert_session_ran(output, tasks):
    count = len([b for b in _blocks() if b.session == "main"])
    for task in tasks:
        assert "[%s] README_OK %d blocks" % (task, count) in output, output[-5000:]


def test_readme_runs_on_one_local_worker(readme_runs):
    result = readme_runs["one"]
    assert result.returncode == 0, result.stdout[-5000:]
    count = len([b for b in _blocks() if b.session == "main"])
    assert "README_OK %d blocks" % count in result.stdout, result.stdout[-5000:]


def test_readme_runs_on_two_workers(readme_runs):
    result = readme_runs["two"]
    assert result.returncode == 0, result.stdout[-5000:]
    _assert_session_ran(result.stdout, ["worker:0", "worker:1"])


def test_readme_parameter_server_block_runs(readme_runs):
    result = readme_runs["ps"]
    assert result.returncode == 0, result.stdout[-5000:]
    assert "[chief:0] README_OK 1 blocks" in result.stdout, result.stdout[-5000:]
