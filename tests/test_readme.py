"""The README's commands exist: every ``make`` target it names is one of the Makefile's, ``make check``
among them (the README's shell blocks run in tests/interop/test_doc_examples.py, its container
line in tests/image/test_readme_line.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.fast  # starts no process: `make check` (tests/process_guard.py)

ROOT = Path(__file__).resolve().parent.parent


def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return {name for line in re.findall(r"^([\w .-]+):(?!=)", text, flags=re.M) for name in line.split()}


def test_every_make_target_the_readme_names_is_the_makefiles() -> None:
    # in inline code (`make docs`) or as a command of a block (make run, ... && make image)
    named = set(re.findall(r"(?:`|^|&& )make (\w[\w-]*)", (ROOT / "README.md").read_text(), flags=re.M))
    assert {"run", "test", "check"} <= named, named
    assert named <= make_targets(), f"not in the Makefile: {sorted(named - make_targets())}"
