"""The core imports no plugin, ever: plugins reach it only through the ``kvcm`` entry-point
group (architecture.md §1)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvcm_core

CORE = Path(kvcm_core.__file__).parent
PLUGIN_PREFIXES = ("kvcm_tier_", "kvcm_kernels_", "kvcm_codec_", "kvcm_eviction_")


def _is_plugin_module(name: str) -> bool:
    top = name.split(".")[0]
    return top.startswith(PLUGIN_PREFIXES)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module named by an import statement (anywhere, also inside functions), and
    every constant string given to importlib.import_module / __import__."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if called in ("import_module", "__import__") and isinstance(arg, ast.Constant):
                found.append((node.lineno, str(arg.value)))
    return found


def test_the_scan_recognises_plugin_imports() -> None:
    assert _is_plugin_module("kvcm_tier_example.tier")
    assert _is_plugin_module("kvcm_kernels_numpy")
    assert not _is_plugin_module("kvcm_core.tier")


def test_no_file_of_the_core_imports_a_plugin_module() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10  # the scan really looks at the core
    offenders = [
        f"{path.relative_to(CORE.parent)}:{line}: {name}"
        for path in files
        for line, name in _imports(path)
        if _is_plugin_module(name)
    ]
    assert offenders == []


_PROBE = """
import json, sys
import kvcm_core
import kvcm_core.testing
prefixes = {prefixes!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0].startswith(prefixes))))
"""


@pytest.mark.parametrize("autoload", ["0", None], ids=["autoload_off", "autoload_default"])
def test_importing_the_core_leaves_no_plugin_module_loaded(autoload: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCM_")}
    if autoload is not None:
        env["KVCM_PLUGIN_AUTOLOAD"] = autoload
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(prefixes=PLUGIN_PREFIXES)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout) == []
