"""Builds the benchmark's native helpers (`bench/native/*.c`) with gcc, once per source version:
the result is cached in the temp directory under a name carrying the source's mtime."""
import os
import subprocess
import tempfile

NATIVE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native")


def build(name, shared=False):
    """The path of `native/NAME.c` built (a shared library with `shared`, else an executable),
    compiling it first when this version of the source was not built yet."""
    source = os.path.join(NATIVE, name + ".c")
    mtime = int(os.path.getmtime(source))
    path = os.path.join(tempfile.gettempdir(), "nestpipe_%s_%d%s" % (name, mtime,
                                                                    ".so" if shared else ""))
    if not os.path.exists(path):
        partial = path + ".%d" % os.getpid()
        flags = ["-shared", "-fPIC", "-ldl"] if shared else ["-pthread"]
        subprocess.run(["gcc", "-O2", "-o", partial, source] + flags, check=True)
        os.replace(partial, path)
    return path
