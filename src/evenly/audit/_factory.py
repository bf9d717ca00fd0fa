"""Factories: find the callable a ``"module.path:attribute"`` names, and name one.

>>> resolve("os.path:join")("a", "b")
'a/b'
>>> import functools, os.path
>>> describe(functools.partial(os.path.join, "a"))
"posixpath:join('a')"
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

from ._types import AuditError

__all__ = ["Factory", "describe", "resolve"]

#: What an audit accepts as a factory: a picklable callable or ``"module.path:attribute"``.
Factory = str | Callable[[], Any]


def resolve(spec: str) -> Callable[..., Any]:
    """Import ``"module.path:attribute"`` and return the callable it names.

    >>> resolve("os.path:join")("a", "b")
    'a/b'
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise AuditError(
            f"factory {spec!r} must look like 'module.path:attribute', "
            f"e.g. 'examples.talk_attempts:naive'"
        )
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise AuditError(
            f"cannot import module {module_name!r} named in {spec!r}: {exc}. "
            f"Run from the folder that holds it, or add that folder to PYTHONPATH"
        ) from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise AuditError(f"module {module_name!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise AuditError(f"{spec!r} is a {type(obj).__name__}, not a callable factory")
    return obj  # type: ignore[no-any-return]


def describe(factory: Factory) -> str:
    """A name for a factory in messages and reports."""
    if isinstance(factory, str):
        return factory
    if isinstance(factory, functools.partial):
        args = [repr(a) for a in factory.args]
        args += [f"{k}={v!r}" for k, v in factory.keywords.items()]
        return f"{describe(factory.func)}({', '.join(args)})"
    name = getattr(factory, "__qualname__", None)
    module = getattr(factory, "__module__", None)
    return f"{module}:{name}" if name and module else repr(factory)
