"""Runs the README's Python examples as written: every ```python block of one session, in order,
in one namespace (each block continues the session of the blocks before it).

A block belongs to the default session "main" unless the Markdown line just above its fence is
`<!-- readme-test: SESSION (why) -->` (e.g. `ps`: run on a parameter-server cluster) or
`<!-- readme-test: skip (why) -->` (never run; the reason must say what runs it instead).

    python readme_examples.py README.md SESSION WORKDIR

runs the blocks of SESSION with WORKDIR as the working directory, prints `README_BLOCK <line>` as
each block starts and `README_OK <n> blocks` at the end; a failing block exits non-zero with its
README line in the traceback. Imports nothing itself (so a positive control runs without
TensorFlow).
"""
import os
import re
import sys
import types
from typing import List, NamedTuple

_MARKER = re.compile(r"^<!--\s*readme-test:\s*(\S+)\s*(.*?)\s*-->\s*$")


class Block(NamedTuple):
    """One ```python block: the README line of its first code line, its session, its code."""
    line: int
    session: str
    reason: str
    code: str


def python_blocks(text: str) -> List[Block]:
    """Every ```python block of Markdown `text`, with the session its marker names."""
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
            blocks.append(Block(i + 2, session, reason, "\n".join(lines[i + 1:end]) + "\n"))
            i = end
        i += 1
    return blocks


def run_session(path: str, session: str) -> int:
    """Executes the blocks of `session` of the Markdown file `path` in one namespace; returns
    how many ran."""
    with open(path) as f:
        blocks = [b for b in python_blocks(f.read()) if b.session == session]
    if not blocks:
        raise SystemExit("%s has no python block of session %r" % (path, session))
    # A real module, so AutoGraph finds the blocks' functions' module (it converts them).
    module = types.ModuleType("__readme__")
    sys.modules[module.__name__] = module
    namespace = module.__dict__
    for block in blocks:
        print("README_BLOCK %d" % block.line, flush=True)
        # Padding with newlines makes the traceback name the block's own README lines.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, os.path.abspath(path), "exec"), namespace)  # pylint: disable=exec-used
    return len(blocks)


def main():
    path, session, workdir = sys.argv[1:4]
    path = os.path.abspath(path)
    os.makedirs(workdir, exist_ok=True)
    os.chdir(workdir)
    count = run_session(path, session)
    print("README_OK %d blocks" % count, flush=True)


if __name__ == "__main__":
    main()
