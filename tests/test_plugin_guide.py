"""docs/plugins.md against the example plugin it tells authors to copy."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from kvcm_core.records import Medium, TierCapabilities

ROOT = Path(__file__).resolve().parents[1]


def _example() -> object:
    path = ROOT / "examples" / "kvcm-tier-example" / "kvcm_tier_example" / "__init__.py"
    spec = importlib.util.spec_from_file_location("_guide_kvcm_tier_example", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_guides_mmap_record_declares_the_capabilities_of_the_example_plugin() -> None:
    """The guide's first record is the example's ``mmap`` tier: the same capabilities, so
    that copying it passes the conformance suite (file and directory modes would make the
    suite look for files under a directory the options name; this tier takes none)."""
    text = (ROOT / "docs" / "plugins.md").read_text()
    found = re.search(r"capabilities=(TierCapabilities\([^)]*\))", text)
    assert found, "docs/plugins.md: no capabilities=TierCapabilities(...) in a record"
    declared = eval(found.group(1), {"TierCapabilities": TierCapabilities,
                                     "Medium": Medium})
    assert declared == _example().CAPABILITIES
