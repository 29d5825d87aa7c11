"""Nothing the package reads from disk or the network is unpickled or evaluated as code."""
import glob
import os
import re

from conftest import REPO

FORBIDDEN = re.compile(r"\bimport pickle\b|\bpickle\.|\bcloudpickle\b|\bdill\b|(?<![.\w])eval\(|"
                       r"(?<![.\w])exec\(|allow_pickle\s*=\s*True|yaml\.load\(|marshal\.loads")


def test_no_unpickling_or_eval_in_the_package_examples_or_benchmarks():
    offenders = []
    for pattern in ("tf_nestpipe/**/*.py", "examples/*.py", "bench/*.py"):
        for path in glob.glob(os.path.join(REPO, pattern), recursive=True):
            for number, line in enumerate(open(path, encoding="utf-8"), 1):
                if FORBIDDEN.search(line):
                    offenders.append("%s:%d: %s" % (os.path.relpath(path, REPO), number, line.strip()))
    assert not offenders, "\n".join(offenders)
