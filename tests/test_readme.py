"""README's code runs as written: the integration example, and the set-up commands name
what exists."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).parents[1] / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), re.S)


def test_readme_integration_example_runs_and_gives_page_indices() -> None:
    example = next(b for b in _blocks("python") if "KVCacheManager(" in b)
    namespace: dict[str, object] = {}
    exec(compile(example, str(README), "exec"), namespace)
    pages = np.asarray(namespace["pages"])
    assert pages.shape == (7,)  # ceil(101 / 16) blocks
    assert (pages >= 0).all()


@pytest.mark.parametrize("needle", ["pip install -e .", "python -m pytest"])
def test_readme_gives_both_set_up_commands(needle: str) -> None:
    (setup,) = [b for b in _blocks("bash") if "pip install" in b]
    assert needle in setup
