"""Fixtures shared by the runtime tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def keep_torch_threads() -> Iterator[None]:
    """An actor ``run`` in the test process sets torch to one thread; later tests get theirs back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
