"""Runs the Python examples of the README and the docs as written: every ```python block of one
session, file after file (`DOCUMENTS`), in order, in one namespace (each block continues the
session of the blocks before it).

A block belongs to the default session "main" unless the Markdown line just above its fence is
`<!-- readme-test: SESSION (why) -->` (e.g. `ps`: run on a parameter-server cluster) or
`<!-- readme-test: skip (why) -->` (never run; the reason must say what runs it instead).

        python readme_examples.py FILES SESSION WORKDIR

runs the blocks of SESSION of FILES (Markdown paths joined by os.pathsep) with WORKDIR as the
working directory, prints `README_BLOCK <line>` as
each block starts and `README_OK <n> blocks` at the end; a failing block exits non-zero with its
README line in the traceback. Imports nothing itself (so a positive control runs without
TensorFlow).
"""
import os
import re
import sys
import types
from typing import List, NamedTuple

# The Markdown files with examples, relative to the repository, in the order their blocks run:
# the README's example first, then the guides that continue its session.
DOCUMENTS = ("README.md", "docs/guides/keras3.md", "docs/guides/checkpoints.md", "docs/concepts/pipelines.md",
             "docs/concepts/placement.md", "docs/guides/compressed_exchanges.md",
             "docs/concepts/ps_mode.md", "docs/guides/dynamic_tables.md",
             "docs/concepts/transport.md")

_MARKER = re.compile(r"^<!--\s*readme-test:\s*(\S+)\s*(.*?)\s*-->\s*$")


class Block(NamedTuple):
    """One ```python block: the line of its first code line, its session, its code, its file."""
    line: int
    session: str
    reason: str
    code: str
    path: str = ""


def python_blocks(text: str, path: str = "") -> List[Block]:
    """Every ```python block of Markdown `text` (from the file `path`), with the session its
    marker names."""
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            match = _MARKER.match(lines[i - 1].strip()) if i else None
            session, reason = (match.group(1), match.group(2)) if match else ("main", "")
            end = i + 1
            while end < len(lines) and lines[end].strip() != "```":
                end += 1
            if end == len(lines):
                raise ValueError("the ```python block at line %d is never closed" % (i + 1))
            blocks.append(Block(i + 2, session, reason, "\n".join(lines[i + 1:end]) + "\n", path))
            i = end
        i += 1
    return blocks


def document_blocks(paths: List[str]) -> List[Block]:
    """Every ```python block of the Markdown files `paths`, file after file."""
    blocks = []
    for path in paths:
        with open(path) as f:
            blocks.extend(python_blocks(f.read(), os.path.abspath(path)))
    return blocks


def run_session(paths: List[str], session: str) -> int:
    """Executes the blocks of `session` of the Markdown files `paths` in one namespace; returns
    how many ran."""
    blocks = [b for b in document_blocks(paths) if b.session == session]
    if not blocks:
        raise SystemExit("%s have no python block of session %r" % (paths, session))
    # A real module, so AutoGraph finds the blocks' functions' module (it converts them).
    module = types.ModuleType("__readme__")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    for block in blocks:
        print("README_BLOCK %s:%d" % (os.path.basename(block.path), block.line), flush=True)
        # Padding with newlines makes the traceback name the block's own lines of its file.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, block.path, "exec"), namespace)  # pylint: disable=exec-used
    return len(blocks)


def main():
    files, session, workdir = sys.argv[1:4]
    paths = [os.path.abspath(p) for p in files.split(os.pathsep)]
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    count = run_session(paths, session)
    print("README_OK %d blocks" % count, flush=True)


if __name__ == "__main__":
    main()
