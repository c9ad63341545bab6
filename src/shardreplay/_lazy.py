"""Public names that load on first use (PEP 562), for a package's ``__init__``: importing
the package stays cheap (no torch, no numba) until a name that needs them is used."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(package: str, namespace: dict[str, Any],
                 homes: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: a name in ``homes`` is imported
    from its module on first use and cached in ``namespace`` (the package's globals).

    The returned ``__getattr__`` raises AttributeError for a name not in ``homes``.
    """

    def getattr_(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted({*namespace, *homes})

    return getattr_, dir_
