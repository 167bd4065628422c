"""The image both files of this folder run: built once per test process (or reused)."""

from __future__ import annotations

import pytest

from tests.image.podman import build_image


@pytest.fixture(scope="session")
def image() -> str:
    """The image's id, from `make image`'s script (``build_image``)."""
    return build_image()
