"""Conformance base classes, one per plugin kind.

Each class sets ``kvcm_kind``; a subclass may set ``plugin_name`` to test one plugin,
otherwise the kvcm pytest plugin parametrises it over every registered plugin of that kind
(or those named with ``--kvcm-plugin``). Tests receive the plugin's record through the
``kvcm_plugin_spec`` fixture; unavailable plugins are skipped with their reason. Tests gate
on declared capabilities, never on names.
"""

from __future__ import annotations

from typing import ClassVar

__all__ = ["ConformanceBase"]


class ConformanceBase:
    """Common base: which plugin kind the class tests, and optionally which plugin."""

    kvcm_kind: ClassVar[str] = ""
    plugin_name: ClassVar[str | None] = None
