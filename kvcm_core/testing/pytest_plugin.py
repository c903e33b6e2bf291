"""kvcm's pytest plugin (registered through the ``pytest11`` entry point).

- ``--kvcm-plugin NAME`` (repeatable) restricts conformance classes to those plugins.
- Conformance classes (:class:`~kvcm_core.testing.conformance.ConformanceBase`) are
  parametrised by plugin name through the ``kvcm_plugin_name`` fixture.
- ``kvcm_plugin_spec`` gives the record, skipping unavailable plugins with their reason.
- Tests a plugin declares in ``known_gaps`` run as strict xfail with the declared reason.
- Tests marked ``gpu`` are skipped cleanly when no CUDA device is usable.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvcm_core.plugins import get_plugin_manager
from kvcm_core.records import PluginSpec

_KIND_TABLES = {
    "tier": "tiers",
    "kernel_backend": "kernel_backends",
    "codec": "codecs",
    "eviction_policy": "eviction_policies",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvcm")
    group.addoption(
        "--kvcm-plugin",
        action="append",
        default=[],
        metavar="NAME",
        help="run kvcm conformance classes only for these plugins",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "kvcm_conformance: a kvcm plugin conformance test")


def plugins_of_kind(kind: str) -> dict[str, PluginSpec]:
    """Registered records of one kind, by name."""
    return getattr(get_plugin_manager(), _KIND_TABLES[kind])()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    cls = metafunc.cls
    kind = getattr(cls, "kvcm_kind", "") if cls is not None else ""
    if not kind or "kvcm_plugin_name" not in metafunc.fixturenames:
        return
    wanted = metafunc.config.getoption("--kvcm-plugin") or []
    if getattr(cls, "plugin_name", None):
        names = [cls.plugin_name]  # type: ignore[union-attr]
    else:
        names = sorted(n for n, spec in plugins_of_kind(kind).items() if cls.applies_to(spec))
    if wanted:
        names = [n for n in names if n in wanted]
    if not names:
        metafunc.parametrize(
            "kvcm_plugin_name",
            [pytest.param(None, marks=pytest.mark.skip(reason=f"no {kind} plugin selected"))],
        )
        return
    metafunc.parametrize("kvcm_plugin_name", names, ids=names, scope="class")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        cls = getattr(item, "cls", None)
        kind = getattr(cls, "kvcm_kind", "") if cls is not None else ""
        if not kind:
            continue
        item.add_marker(pytest.mark.kvcm_conformance)
        callspec = getattr(item, "callspec", None)
        name = callspec.params.get("kvcm_plugin_name") if callspec else None
        if name is None:
            continue
        spec = plugins_of_kind(kind).get(name)
        test_name = getattr(item, "originalname", item.name)
        if spec is not None and test_name in spec.known_gaps:
            item.add_marker(pytest.mark.xfail(strict=True, reason=spec.known_gaps[test_name]))


@pytest.fixture(scope="class")
def kvcm_plugin_spec(request: pytest.FixtureRequest, kvcm_plugin_name: str) -> Any:
    """The record of the plugin under test; skips unavailable plugins with the reason."""
    kind = request.cls.kvcm_kind  # type: ignore[union-attr]
    spec = plugins_of_kind(kind).get(kvcm_plugin_name)
    if spec is None:
        pytest.fail(f"no {kind} plugin named {kvcm_plugin_name!r} is registered")
    avail = spec.availability()
    if not avail:
        pytest.skip(f"{kind} {kvcm_plugin_name!r} unavailable: {avail.reason}")
    return spec


def _gpu_usable() -> tuple[bool, str]:
    pm = get_plugin_manager()
    for spec in pm.kernel_backends().values():
        if spec.capabilities.has_device and spec.availability():
            return True, ""
    return False, "no GPU kernel backend is available (no CUDA device or package)"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None:
        ok, why = _gpu_usable()
        if not ok:
            pytest.skip(why)
