"""The plugin manager: load plugins, validate their records, look them up by name.

Load order (documented contract):

1. kvcm's hook specifications (:mod:`kvcm_core.hookspecs`).
2. Unless ``KVCM_PLUGIN_AUTOLOAD=0``, every entry point of the ``kvcm`` group, sorted by
   (distribution name, entry-point name) so the order never depends on the file system.
   Built-in plugins are found this way too: the core imports no plugin module.
3. Plugins registered by hand with :meth:`KvcmPluginManager.register` (tests, notebooks).

Names listed in ``KVCM_DISABLE_PLUGINS`` (comma separated) are blocked: an entry point of
that name is never imported, and a record of that name is ignored.

Records are collected once per kind, on first use, and cached. A plugin that fails to
import or whose hook raises gives a :class:`~kvcm_core.errors.PluginError` that names it
and says how to disable it; two records of one kind with the same name give a
``PluginError`` naming both distributions.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import attrs
import pluggy

from kvcm_core import hookspecs
from kvcm_core.errors import PluginError
from kvcm_core.records import (
    CodecSpec,
    EvictionPolicySpec,
    KernelBackendSpec,
    PluginSpec,
    TierSpec,
)

__all__ = [
    "KvcmPluginManager",
    "RegisteredPlugin",
    "get_plugin_manager",
    "reset_plugin_manager",
]

ENTRY_POINT_GROUP = "kvcm"
AUTOLOAD_ENV = "KVCM_PLUGIN_AUTOLOAD"
DISABLE_ENV = "KVCM_DISABLE_PLUGINS"
BACKEND_ENV = "KVCM_KERNEL_BACKEND"

SpecT = TypeVar("SpecT", bound=PluginSpec)

# hook name -> (kind word used in messages, record type)
_KINDS: dict[str, tuple[str, type[PluginSpec]]] = {
    "kvcm_tiers": ("tier", TierSpec),
    "kvcm_kernel_backends": ("kernel backend", KernelBackendSpec),
    "kvcm_codecs": ("codec", CodecSpec),
    "kvcm_eviction_policies": ("eviction policy", EvictionPolicySpec),
}


@attrs.frozen
class RegisteredPlugin:
    """A record together with where it came from."""

    spec: PluginSpec
    plugin: str
    distribution: str
    version: str


@attrs.frozen
class _Source:
    distribution: str
    version: str


def _disabled_from_env() -> frozenset[str]:
    raw = os.environ.get(DISABLE_ENV, "")
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


class KvcmPluginManager:
    """kvcm's typed facade over one :class:`pluggy.PluginManager`.

    Args:
        autoload: load the ``kvcm`` entry-point group (default: ``KVCM_PLUGIN_AUTOLOAD``
            unless it is ``"0"``).
        disabled: names to block (default: ``KVCM_DISABLE_PLUGINS``).
    """

    def __init__(
        self, *, autoload: bool | None = None, disabled: Iterable[str] | None = None
    ) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self._pm.add_hookspecs(hookspecs)
        self._sources: dict[str, _Source] = {}
        self._cache: dict[str, dict[str, RegisteredPlugin]] = {}
        self.disabled = _disabled_from_env() if disabled is None else frozenset(disabled)
        if autoload is None:
            autoload = os.environ.get(AUTOLOAD_ENV, "1") != "0"
        if autoload:
            self.load_entry_points()

    # -- loading -----------------------------------------------------------------------

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Import and register every entry point of ``group`` not blocked."""
        eps = importlib.metadata.entry_points(group=group)

        def dist_name(ep: importlib.metadata.EntryPoint) -> str:
            return ep.dist.name if ep.dist is not None else "<unknown>"

        for ep in sorted(eps, key=lambda e: (dist_name(e), e.name)):
            if ep.name in self.disabled or self._pm.has_plugin(ep.name):
                continue
            dist = dist_name(ep)
            version = ep.dist.version if ep.dist is not None else "?"
            try:
                module = ep.load()
            except Exception as exc:
                raise PluginError(
                    f"plugin {ep.name!r} (entry point {ep.value!r} of distribution "
                    f"{dist} {version}) failed to load: {type(exc).__name__}: {exc}. "
                    f"Disable it with {DISABLE_ENV}={ep.name}"
                ) from exc
            self.register(module, name=ep.name, distribution=dist, version=version)

    def register(
        self,
        plugin: object,
        *,
        name: str | None = None,
        distribution: str = "<registered>",
        version: str = "",
    ) -> str:
        """Register a plugin object (usually a module with ``kvcm_*`` hookimpls).

        Returns:
            The plugin's name in the manager.
        """
        try:
            plugin_name = self._pm.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(
                f"plugin {name or plugin!r} of {distribution} could not be registered: {exc}"
            ) from exc
        assert plugin_name is not None
        self._sources[plugin_name] = _Source(distribution, version)
        self._cache.clear()
        return plugin_name

    def unregister(self, name: str) -> None:
        """Remove a plugin registered under ``name``."""
        self._pm.unregister(name=name)
        self._sources.pop(name, None)
        self._cache.clear()

    @property
    def pluggy_manager(self) -> pluggy.PluginManager:
        """The underlying pluggy manager (for advanced uses such as tracing)."""
        return self._pm

    # -- collecting --------------------------------------------------------------------

    def _collect(self, hook_name: str) -> dict[str, RegisteredPlugin]:
        cached = self._cache.get(hook_name)
        if cached is not None:
            return cached
        kind, record_type = _KINDS[hook_name]
        found: dict[str, RegisteredPlugin] = {}
        hook = getattr(self._pm.hook, hook_name)
        for impl in hook.get_hookimpls():
            source = self._sources.get(impl.plugin_name, _Source("<registered>", ""))
            try:
                records = list(impl.function() or ())
            except Exception as exc:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} of {source.distribution} failed in "
                    f"{hook_name}(): {type(exc).__name__}: {exc}. "
                    f"Disable it with {DISABLE_ENV}={impl.plugin_name}"
                ) from exc
            for record in records:
                if not isinstance(record, record_type):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} of {source.distribution} yielded "
                        f"{type(record).__name__} from {hook_name}(); expected "
                        f"{record_type.__name__}"
                    )
                if record.name in self.disabled:
                    continue
                if record.name in found:
                    first = found[record.name]
                    raise PluginError(
                        f"duplicate {kind} name {record.name!r}: provided by plugin "
                        f"{first.plugin!r} of distribution {first.distribution} "
                        f"{first.version} and by plugin {impl.plugin_name!r} of distribution "
                        f"{source.distribution} {source.version}. Uninstall one, or disable "
                        f"one with {DISABLE_ENV}=<plugin name>"
                    )
                found[record.name] = RegisteredPlugin(
                    record, impl.plugin_name, source.distribution, source.version
                )
        result = dict(sorted(found.items()))
        self._cache[hook_name] = result
        return result

    def registered(self, kind: str | None = None) -> list[RegisteredPlugin]:
        """Every record with its origin, for one kind (``"tier"``...) or all kinds."""
        out: list[RegisteredPlugin] = []
        for hook_name, (word, _) in _KINDS.items():
            if kind is None or kind in (word, word.replace(" ", "_")):
                out.extend(self._collect(hook_name).values())
        return out

    def tiers(self) -> dict[str, TierSpec]:
        """Storage tiers by name."""
        return {n: r.spec for n, r in self._collect("kvcm_tiers").items()}  # type: ignore[misc]

    def kernel_backends(self) -> dict[str, KernelBackendSpec]:
        """Kernel backends by name."""
        return {
            n: r.spec  # type: ignore[misc]
            for n, r in self._collect("kvcm_kernel_backends").items()
        }

    def codecs(self) -> dict[str, CodecSpec]:
        """Codecs (page and blob) by name."""
        return {n: r.spec for n, r in self._collect("kvcm_codecs").items()}  # type: ignore[misc]

    def eviction_policies(self) -> dict[str, EvictionPolicySpec]:
        """Eviction policies by name."""
        return {
            n: r.spec  # type: ignore[misc]
            for n, r in self._collect("kvcm_eviction_policies").items()
        }

    def event_sinks(self, config: Any) -> list[Any]:
        """Event sinks that plugins provide for one manager's ``config``."""
        sinks: list[Any] = []
        for batch in self._pm.hook.kvcm_event_sinks(config=config):
            sinks.extend(batch or ())
        return sinks

    # -- lookups -----------------------------------------------------------------------

    @staticmethod
    def _lookup(kind: str, table: Mapping[str, SpecT], name: str) -> SpecT:
        spec = table.get(name)
        if spec is None:
            known = ", ".join(sorted(table)) or "none"
            raise PluginError(f"unknown {kind} {name!r}; available: {known}")
        return spec

    def tier(self, name: str) -> TierSpec:
        """The tier called ``name``; ``PluginError`` listing the known ones otherwise."""
        return self._lookup("tier", self.tiers(), name)

    def kernel_backend(self, name: str) -> KernelBackendSpec:
        """The kernel backend called ``name``."""
        return self._lookup("kernel backend", self.kernel_backends(), name)

    def codec(self, name: str) -> CodecSpec:
        """The codec called ``name``."""
        return self._lookup("codec", self.codecs(), name)

    def eviction_policy(self, name: str) -> EvictionPolicySpec:
        """The eviction policy called ``name``."""
        return self._lookup("eviction policy", self.eviction_policies(), name)

    def select_kernel_backend(self, name: str = "auto") -> KernelBackendSpec:
        """Pick a kernel backend: an explicit name, then ``KVCM_KERNEL_BACKEND``, then the
        available backend of highest priority.

        Raises:
            PluginError: unknown or unavailable name, nothing available, or a tie at the
                top priority (kvcm refuses to guess).
        """
        if name == "auto":
            name = os.environ.get(BACKEND_ENV, "auto") or "auto"
        if name != "auto":
            spec = self.kernel_backend(name)
            avail = spec.availability()
            if not avail:
                raise PluginError(f"kernel backend {name!r} is unavailable: {avail.reason}")
            return spec
        candidates = [s for s in self.kernel_backends().values() if s.availability()]
        if not candidates:
            raise PluginError(
                "no kernel backend is available; installed: "
                + (", ".join(self.kernel_backends()) or "none")
            )
        top = max(s.priority for s in candidates)
        best = [s for s in candidates if s.priority == top]
        if len(best) > 1:
            raise PluginError(
                "kernel_backend='auto' found several available backends of priority "
                f"{top}: {', '.join(s.name for s in best)}; name one in the configuration "
                f"or set {BACKEND_ENV}"
            )
        return best[0]

    def availability_of(self, spec: PluginSpec) -> tuple[bool, str]:
        """``(available, reason)`` of a record, never raising."""
        try:
            avail = spec.availability()
        except Exception as exc:
            return False, f"availability check failed: {type(exc).__name__}: {exc}"
        return bool(avail), avail.reason


_manager: KvcmPluginManager | None = None


def get_plugin_manager() -> KvcmPluginManager:
    """The process-wide plugin manager, built on first use and cached."""
    global _manager
    if _manager is None:
        _manager = KvcmPluginManager()
    return _manager


def reset_plugin_manager() -> None:
    """Forget the cached manager (tests; after installing a plugin at run time)."""
    global _manager
    _manager = None


def cached_availability(check: Callable[[], Any]) -> Callable[[], Any]:
    """Decorate an availability check so it runs once per process."""
    return functools.cache(check)
