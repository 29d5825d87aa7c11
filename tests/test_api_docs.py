"""The API reference covers every public symbol, and each one documents its arguments
(`Args:` / `Attributes:`) and, for functions, what it returns (`Returns:`), so the reference
generated from the docstrings (docs/reference/api.md) is complete."""
import dataclasses
import inspect
import os
import re

import pytest

import tf_nestpipe as tnp
from conftest import REPO

API_PAGE = os.path.join(REPO, "docs", "reference", "api.md")


def _parameters(function):
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return []
    return [name for name in signature.parameters if name not in ("self", "cls")]


def missing_sections(obj, name):
    """`(symbol, section)` pairs a public class or function lacks."""
    missing = []
    if inspect.isclass(obj):
        doc = (obj.__doc__ or "") + ((obj.__init__.__doc__ or "") if "__init__" in vars(obj)
                                     else "")
        if dataclasses.is_dataclass(obj):
            if "Attributes:" not in doc and "Args:" not in doc:
                missing.append((name, "Attributes"))
        elif ("__init__" in vars(obj) and _parameters(obj.__init__) and "Args:" not in doc
              and not issubclass(obj, BaseException)):
            missing.append((name, "Args"))
        for attribute, member in vars(obj).items():
            if attribute.startswith("_") or not inspect.isfunction(member):
                continue
            if any(attribute in vars(base) for base in obj.__mro__[1:]):
                continue  # overrides a base class's documented method (Keras, tf.distribute)
            if _parameters(member) and "Args:" not in (member.__doc__ or ""):
                missing.append(("%s.%s" % (name, attribute), "Args"))
    elif inspect.isfunction(obj):
        if _parameters(obj) and "Args:" not in (obj.__doc__ or ""):
            missing.append((name, "Args"))
        if "Returns:" not in (obj.__doc__ or ""):
            missing.append((name, "Returns"))
    return missing


def ours(name):
    return (getattr(getattr(tnp, name), "__module__", "") or "").startswith("tf_nestpipe")


def test_every_public_symbol_documents_its_arguments_and_results():
    missing = [m for name in tnp.__all__ if ours(name)
               for m in missing_sections(getattr(tnp, name), name)]
    assert missing == []


def test_the_section_check_sees_a_missing_section():
    """Positive control: an undocumented function and method are reported."""
    def loose(x):
        """Does something with x."""
        return x

    class Loose:
        """A class."""

        def __init__(self, size):
            self.size = size

        def grow(self, by):
            """Grows."""
            self.size += by

    assert missing_sections(loose, "loose") == [("loose", "Args"), ("loose", "Returns")]
    assert missing_sections(Loose, "Loose") == [("Loose", "Args"), ("Loose.grow", "Args")]


def test_the_api_page_lists_every_public_symbol():
    with open(API_PAGE) as f:
        page = f.read()
    listed = set(re.findall(r"^\.\. auto(?:class|function|exception):: tf_nestpipe\.(\w+)",
                            page, re.M))
    expected = {name for name in tnp.__all__ if ours(name)}
    assert expected <= listed, sorted(expected - listed)
    assert "CommunicationImplementation" in page  # TensorFlow's, re-exported: named, not autodoc


@pytest.mark.parametrize("name", ["NestPipeStrategy", "PipelineConfig", "ShardedEmbedding"])
def test_key_docstrings_say_what_is_refused(name):
    assert "Raises:" in (getattr(tnp, name).__doc__ or "")
