"""The plugin manager: loading through entry points, the environment switches, errors that
name the plugin and its distribution, lookups by name and kernel-backend selection.

Fake distributions live in ``tests/fixtures/dists/<scenario>/`` (see its README); each test
puts one scenario on ``sys.path`` and builds a fresh manager, never the cached global one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcm_core import (
    Availability,
    CodecCapabilities,
    CodecKind,
    CodecSpec,
    KernelBackendCapabilities,
    KernelBackendSpec,
    KvcmPluginManager,
    Medium,
    PluginError,
    TierCapabilities,
    TierSpec,
    get_plugin_manager,
    hookimpl,
    reset_plugin_manager,
)

DISTS = Path(__file__).parent / "fixtures" / "dists"
ENV = ("KVCM_PLUGIN_AUTOLOAD", "KVCM_DISABLE_PLUGINS", "KVCM_KERNEL_BACKEND")
HOST = TierCapabilities(device_accessible=False, medium=Medium.HOST)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No KVCM_* variable of the caller's shell leaks in; the global manager is rebuilt
    afterwards so fakes put on sys.path here never stay in it."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    yield
    for name in [m for m in sys.modules if m.startswith("kvcm_fake_")]:
        del sys.modules[name]
    reset_plugin_manager()


@pytest.fixture
def use_dists(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Put fake distribution scenarios on sys.path."""

    def use(*scenarios: str) -> None:
        for scenario in scenarios:
            monkeypatch.syspath_prepend(str(DISTS / scenario))

    return use


def _factory(*args: Any, **kwargs: Any) -> None:
    return None


class Plugin:
    """A plugin object registered by hand, yielding the given records."""

    def __init__(self, *, tiers: Any = (), backends: Any = (), codecs: Any = ()) -> None:
        self._tiers, self._backends, self._codecs = tiers, backends, codecs
        self.calls = 0

    @hookimpl
    def kvcm_tiers(self) -> Any:
        self.calls += 1
        return self._tiers

    @hookimpl
    def kvcm_kernel_backends(self) -> Any:
        return self._backends

    @hookimpl
    def kvcm_codecs(self) -> Any:
        return self._codecs


def tier(name: str) -> TierSpec:
    return TierSpec(name=name, factory=_factory, capabilities=HOST)


def backend(name: str, priority: int, availability: Callable[[], Availability] | None = None):
    extra = {"availability": availability} if availability is not None else {}
    return KernelBackendSpec(
        name=name,
        factory=_factory,
        capabilities=KernelBackendCapabilities(has_device=priority > 0),
        priority=priority,
        **extra,
    )


def unavailable(reason: str) -> Callable[[], Availability]:
    return lambda: Availability(False, reason)


def bare(*plugins: object) -> KvcmPluginManager:
    """A manager without entry points, with ``plugins`` registered by hand."""
    pm = KvcmPluginManager(autoload=False)
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"hand{i}", distribution=f"dist-{i}", version="9.9")
    return pm


# -- loading ------------------------------------------------------------------------------


def test_builtin_plugins_are_found_through_entry_points_of_the_kvcm_distribution() -> None:
    pm = KvcmPluginManager()
    origin = {(r.spec.kind, r.spec.name): r.distribution for r in pm.registered()}
    for key in [
        ("kernel_backend", "numpy"),
        ("tier", "gpu"),
        ("tier", "host"),
        ("tier", "disk"),
        ("codec", "raw"),
        ("eviction_policy", "lru"),
    ]:
        assert origin[key] == "kvcm"


def test_installed_plugin_reports_its_distribution_and_version(use_dists: Any) -> None:
    use_dists("good")
    pm = KvcmPluginManager()
    (record,) = [r for r in pm.registered("tier") if r.spec.name == "faketier"]
    assert (record.plugin, record.distribution, record.version) == (
        "fakegood",
        "kvcm-fake-good",
        "1.2.3",
    )
    assert pm.tier("faketier").description == "a tier from an installed distribution"


def test_entry_points_load_in_order_of_distribution_then_name(use_dists: Any) -> None:
    use_dists("good")
    pm = KvcmPluginManager()
    loaded = [name for name, _ in pm.pluggy_manager.list_name_plugin()]
    origin = {r.plugin: r.distribution for r in pm.registered()}
    ours = [n for n in loaded if n in origin]
    assert ours == sorted(ours, key=lambda n: (origin[n], n))
    assert ours.index("fakegood") > ours.index("numpy")  # "kvcm" < "kvcm-fake-good"


def test_broken_plugin_is_refused_naming_it_its_distribution_and_the_switch_to_disable_it(
    use_dists: Any,
) -> None:
    use_dists("broken")
    with pytest.raises(PluginError) as info:
        KvcmPluginManager()
    message = str(info.value)
    assert "'fakebroken'" in message
    assert "kvcm-fake-broken 1.0" in message
    assert "KVCM_DISABLE_PLUGINS=fakebroken" in message
    assert "broken on purpose" in message  # the cause is shown, not swallowed
    assert isinstance(info.value.__cause__, RuntimeError)


def test_disabled_plugin_is_never_imported_and_the_others_load(
    use_dists: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_dists("broken", "good")
    monkeypatch.setenv("KVCM_DISABLE_PLUGINS", " other , fakebroken")
    pm = KvcmPluginManager()
    assert "kvcm_fake_broken" not in sys.modules
    assert "faketier" in pm.tiers()
    assert "numpy" in pm.kernel_backends()


def test_disabled_names_may_also_be_given_to_the_manager(use_dists: Any) -> None:
    use_dists("broken")
    pm = KvcmPluginManager(disabled=["fakebroken"])
    assert pm.disabled == frozenset({"fakebroken"})


def test_disabling_a_record_name_hides_that_record_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCM_DISABLE_PLUGINS", "slow")
    pm = KvcmPluginManager(autoload=False)
    pm.register(Plugin(tiers=[tier("slow"), tier("fast")]), name="mine")
    assert list(pm.tiers()) == ["fast"]
    with pytest.raises(PluginError, match=r"unknown tier 'slow' \(blocked by KVCM_DISABLE"):
        pm.tier("slow")


def test_autoload_zero_loads_no_entry_point(
    use_dists: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_dists("broken", "good")
    monkeypatch.setenv("KVCM_PLUGIN_AUTOLOAD", "0")
    pm = KvcmPluginManager()  # the broken plugin would raise if it were imported
    assert pm.registered() == []
    assert pm.tiers() == {} and pm.kernel_backends() == {}
    assert "kvcm_fake_broken" not in sys.modules


def test_two_distributions_with_the_same_tier_name_are_refused_naming_both(
    use_dists: Any,
) -> None:
    use_dists("duplicate")
    pm = KvcmPluginManager()
    with pytest.raises(PluginError) as info:
        pm.tiers()
    message = str(info.value)
    assert "duplicate tier name 'twin'" in message
    assert "kvcm-fake-twin-a 1.0" in message and "kvcm-fake-twin-b 2.0" in message
    assert "KVCM_DISABLE_PLUGINS=twin_a" in message


def test_disabling_one_of_two_duplicates_resolves_the_conflict(
    use_dists: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    use_dists("duplicate")
    monkeypatch.setenv("KVCM_DISABLE_PLUGINS", "twin_a")
    (record,) = [r for r in KvcmPluginManager().registered("tier") if r.spec.name == "twin"]
    assert record.distribution == "kvcm-fake-twin-b"


def test_same_entry_point_name_in_two_distributions_is_refused_naming_both(
    use_dists: Any,
) -> None:
    use_dists("same_entry_point")
    with pytest.raises(PluginError) as info:
        KvcmPluginManager()
    message = str(info.value)
    assert "duplicate plugin name 'samename'" in message
    assert "kvcm-fake-same-a 1.0" in message and "kvcm-fake-same-b 2.0" in message


def test_loading_entry_points_twice_is_harmless() -> None:
    pm = KvcmPluginManager()
    before = pm.registered()
    pm.load_entry_points()
    assert pm.registered() == before


def test_same_name_in_two_kinds_is_not_a_duplicate() -> None:
    codec = CodecSpec(
        name="x", factory=_factory, capabilities=CodecCapabilities(kind=CodecKind.BLOB)
    )
    pm = bare(Plugin(tiers=[tier("x")], codecs=[codec]))
    assert pm.tier("x").kind == "tier" and pm.codec("x").kind == "codec"


# -- records ------------------------------------------------------------------------------


def test_hook_yielding_the_wrong_record_type_is_refused_naming_the_plugin(
    use_dists: Any,
) -> None:
    use_dists("wrong_record")
    pm = KvcmPluginManager()
    with pytest.raises(PluginError) as info:
        pm.tiers()
    message = str(info.value)
    assert "plugin 'fakewrong' of distribution kvcm-fake-wrong" in message
    assert "yielded CodecSpec from kvcm_tiers(); expected TierSpec" in message
    assert "KVCM_DISABLE_PLUGINS=fakewrong" in message


def test_hook_returning_one_record_instead_of_yielding_is_refused() -> None:
    pm = bare(Plugin(tiers=tier("solo")))
    with pytest.raises(PluginError, match=r"returned TierSpec from kvcm_tiers\(\); it must yield"):
        pm.tiers()


def test_hook_that_raises_is_reported_with_its_plugin_and_how_to_disable_it() -> None:
    class Crashing:
        @hookimpl
        def kvcm_codecs(self) -> Any:
            raise OSError("libzstd.so not found")

    pm = bare(Crashing())
    with pytest.raises(PluginError) as info:
        pm.codecs()
    assert "plugin 'hand0' of distribution dist-0 failed in kvcm_codecs()" in str(info.value)
    assert "libzstd.so not found" in str(info.value)
    assert "KVCM_DISABLE_PLUGINS=hand0" in str(info.value)


def test_record_with_an_invalid_name_is_reported_naming_the_plugin() -> None:
    class BadName:
        @hookimpl
        def kvcm_tiers(self) -> Any:
            yield tier("Not A Name")

    with pytest.raises(PluginError, match=r"plugin 'hand0' .* failed in kvcm_tiers\(\)"):
        bare(BadName()).tiers()


def test_misspelt_hook_is_refused_at_load_naming_the_plugin(use_dists: Any) -> None:
    use_dists("misspelt_hook")
    with pytest.raises(PluginError) as info:
        KvcmPluginManager()
    message = str(info.value)
    assert "plugin 'faketypo' of distribution kvcm-fake-typo implements kvcm_teirs()" in message
    assert "KVCM_DISABLE_PLUGINS=faketypo" in message


def test_hook_taking_arguments_its_spec_does_not_have_is_refused_at_registration() -> None:
    class TooMany:
        @hookimpl
        def kvcm_tiers(self, backend: Any) -> Any:
            return []

    pm = KvcmPluginManager(autoload=False)
    with pytest.raises(PluginError, match=r"(?s)plugin 'greedy' of distribution d .*'backend'"):
        pm.register(TooMany(), name="greedy", distribution="d")
    assert pm.registered() == []


def test_records_are_collected_once_until_a_plugin_is_registered() -> None:
    first = Plugin(tiers=[tier("a")])
    pm = bare(first)
    assert list(pm.tiers()) == ["a"]
    pm.tiers()
    pm.tier("a")
    assert first.calls == 1
    pm.register(Plugin(tiers=[tier("b")]), name="later")
    assert list(pm.tiers()) == ["a", "b"]
    pm.unregister("later")
    assert list(pm.tiers()) == ["a"]


class _TaggedSink:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def on_events(self, events: Any) -> None:
        pass


def test_event_sinks_are_gathered_from_every_plugin_with_the_config() -> None:
    seen: list[Any] = []

    class Sinks:
        def __init__(self, tag: str) -> None:
            self.tag = tag

        @hookimpl
        def kvcm_event_sinks(self, config: Any) -> Any:
            seen.append(config)
            yield _TaggedSink(self.tag)

    pm = bare(Sinks("first"), Sinks("second"))
    assert [s.tag for s in pm.event_sinks(config="cfg")] == ["first", "second"]
    assert seen == ["cfg", "cfg"]


@pytest.mark.parametrize("item", [_TaggedSink, "a sink", None, object()],
                         ids=["a class", "a str", "None", "no on_events"])
def test_an_event_sink_that_is_not_a_sink_instance_is_a_plugin_error_naming_the_plugin(
        item: Any) -> None:
    class Sinks:
        @hookimpl
        def kvcm_event_sinks(self, config: Any) -> Any:
            yield item

    pm = bare(Sinks())
    with pytest.raises(PluginError, match="must be an event sink instance") as info:
        pm.event_sinks(config="cfg")
    assert "plugin 'hand0' of distribution dist-0" in str(info.value)


# -- lookups --------------------------------------------------------------------------------


def test_unknown_tier_name_is_refused_listing_the_available_ones() -> None:
    pm = bare(Plugin(tiers=[tier("host"), tier("gpu")]))
    with pytest.raises(PluginError, match=r"unknown tier 'hots'; available: gpu, host$"):
        pm.tier("hots")


def test_unknown_codec_name_is_refused_listing_the_available_ones() -> None:
    codec = CodecSpec(
        name="raw", factory=_factory, capabilities=CodecCapabilities(kind=CodecKind.PAGE)
    )
    pm = bare(Plugin(codecs=[codec]))
    with pytest.raises(PluginError, match=r"unknown codec 'fp8'; available: raw$"):
        pm.codec("fp8")
    with pytest.raises(PluginError, match=r"unknown eviction policy 'lfu'; available: none"):
        pm.eviction_policy("lfu")


def test_get_plugin_manager_is_cached_until_reset() -> None:
    first = get_plugin_manager()
    assert get_plugin_manager() is first
    reset_plugin_manager()
    assert get_plugin_manager() is not first


# -- kernel backend selection --------------------------------------------------------------


def test_explicit_backend_name_wins_over_environment_and_priority(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVCM_KERNEL_BACKEND", "fast")
    pm = bare(Plugin(backends=[backend("slow", 0), backend("fast", 100)]))
    assert pm.select_kernel_backend("slow").name == "slow"


def test_auto_follows_the_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCM_KERNEL_BACKEND", "slow")
    pm = bare(Plugin(backends=[backend("slow", 0), backend("fast", 100)]))
    assert pm.select_kernel_backend().name == "slow"
    assert pm.select_kernel_backend("auto").name == "slow"


def test_auto_picks_the_available_backend_of_highest_priority() -> None:
    pm = bare(
        Plugin(
            backends=[
                backend("cpu", 0),
                backend("gpu_a", 50),
                backend("gpu_b", 100, unavailable("no CUDA device")),
            ]
        )
    )
    assert pm.select_kernel_backend().name == "gpu_a"


def test_named_backend_that_is_unavailable_is_refused_with_its_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pm = bare(
        Plugin(
            backends=[backend("cpu", 0), backend("cupy", 100, unavailable("cupy not installed"))]
        )
    )
    with pytest.raises(PluginError, match="kernel backend 'cupy' is unavailable: cupy not inst"):
        pm.select_kernel_backend("cupy")
    monkeypatch.setenv("KVCM_KERNEL_BACKEND", "cupy")
    with pytest.raises(PluginError, match="cupy not installed"):
        pm.select_kernel_backend()


def test_tie_at_the_top_priority_is_refused_rather_than_guessed() -> None:
    pm = bare(Plugin(backends=[backend("cpu", 0), backend("one", 100), backend("two", 100)]))
    with pytest.raises(PluginError) as info:
        pm.select_kernel_backend()
    assert "several available backends of priority 100: one, two" in str(info.value)
    assert "KVCM_KERNEL_BACKEND" in str(info.value)


def test_tie_below_the_top_priority_does_not_matter() -> None:
    pm = bare(Plugin(backends=[backend("a", 0), backend("b", 0), backend("top", 10)]))
    assert pm.select_kernel_backend().name == "top"


def test_no_available_backend_is_refused_with_every_reason() -> None:
    pm = bare(Plugin(backends=[backend("cupy", 100, unavailable("no GPU"))]))
    with pytest.raises(PluginError, match=r"no kernel backend is available \(cupy: no GPU\)"):
        pm.select_kernel_backend()


def test_availability_check_that_crashes_counts_as_unavailable() -> None:
    def explode() -> Availability:
        raise ImportError("libcuda.so.1: cannot open shared object file")

    pm = bare(Plugin(backends=[backend("cpu", 0), backend("cuda", 100, explode)]))
    assert pm.select_kernel_backend().name == "cpu"
    ok, reason = pm.availability_of(pm.kernel_backend("cuda"))
    assert not ok and "libcuda.so.1" in reason
    with pytest.raises(PluginError, match="'cuda' is unavailable: availability check failed"):
        pm.select_kernel_backend("cuda")


def test_unknown_backend_name_is_refused_listing_the_available_ones() -> None:
    pm = bare(Plugin(backends=[backend("numpy", 0)]))
    with pytest.raises(PluginError, match=r"unknown kernel backend 'cuda'; available: numpy"):
        pm.select_kernel_backend("cuda")
