"""The plugin manager: load plugins, validate their records, look them up by name.

Load order (documented contract):

1. kvcm's hook specifications (:mod:`kvcm_core.hookspecs`).
2. Unless ``KVCM_PLUGIN_AUTOLOAD`` is ``0`` (or ``false``, ``no``, ``off``: any other
   value but ``1``, ``true``, ``yes``, ``on`` or empty is an error), every entry point of
   the ``kvcm`` group, sorted by (distribution name, entry-point name) so the order never
   depends on the file system.
   Built-in plugins are found this way too: the core imports no plugin module.
3. Plugins registered by hand with :meth:`KvcmPluginManager.register` (tests, notebooks).

Names listed in ``KVCM_DISABLE_PLUGINS`` (comma separated) are blocked: an entry point of
that name is never imported, and a record of that name is ignored.

Records are collected once per kind, on first use, and cached. A plugin that fails to
import, implements a ``kvcm_*`` hook that does not exist, or whose hook raises or yields
something other than its kind's record gives a :class:`~kvcm_core.errors.PluginError`
that names it, its distribution, and says how to disable it. Two entry points of one name,
or two records of one kind with the same name, give a ``PluginError`` naming both
distributions. An unknown name gives a ``PluginError`` listing the available ones.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar, cast

import attrs
import pluggy

from kvcm_core import hookspecs
from kvcm_core.errors import ConfigError, PluginError
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


_AUTOLOAD_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                   "0": False, "false": False, "no": False, "off": False}


def autoload_from_env() -> bool:
    """``KVCM_PLUGIN_AUTOLOAD``: unset or empty loads the entry points; ``1``/``true``/
    ``yes``/``on`` load them, ``0``/``false``/``no``/``off`` do not (any case, spaces
    around ignored).

    Raises:
        ConfigError: any other value (naming the variable, the value and the rule).
    """
    raw = os.environ.get(AUTOLOAD_ENV, "")
    word = raw.strip().lower()
    if not word:
        return True
    if word not in _AUTOLOAD_WORDS:
        raise ConfigError(AUTOLOAD_ENV, raw, "must be 1, true, yes or on (load the entry "
                                             "points) or 0, false, no or off (any case)")
    return _AUTOLOAD_WORDS[word]


class KvcmPluginManager:
    """kvcm's typed facade over one :class:`pluggy.PluginManager`.

    Args:
        autoload: load the ``kvcm`` entry-point group (default: ``KVCM_PLUGIN_AUTOLOAD``
            unless it says no: :func:`autoload_from_env`).
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
            autoload = autoload_from_env()
        if autoload:
            self.load_entry_points()

    # -- loading -----------------------------------------------------------------------

    def load_entry_points(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Import and register every entry point of ``group`` not blocked, in order of
        (distribution name, entry-point name). Calling it again is harmless.

        Raises:
            PluginError: an entry point fails to import, implements an unknown hook, or
                has the name of a plugin from another distribution.
        """
        eps = importlib.metadata.entry_points(group=group)

        def dist_name(ep: importlib.metadata.EntryPoint) -> str:
            return ep.dist.name if ep.dist is not None else "<unknown>"

        for ep in sorted(eps, key=lambda e: (dist_name(e), e.name)):
            if ep.name in self.disabled:
                continue
            dist = dist_name(ep)
            version = ep.dist.version if ep.dist is not None else "?"
            if self._pm.has_plugin(ep.name):
                known = self._sources.get(ep.name)
                if known is not None and known.distribution == dist:
                    continue  # loaded already (load_entry_points called twice)
                where = f"{known.distribution} {known.version}" if known else "registered by hand"
                raise PluginError(
                    f"duplicate plugin name {ep.name!r}: entry point {ep.value!r} of "
                    f"distribution {dist} {version} and the plugin from {where}. Uninstall "
                    f"one, or block the name with {DISABLE_ENV}={ep.name}"
                )
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

        Args:
            plugin: the module or object carrying the hook implementations.
            name: its plugin name (default: pluggy's canonical name of the object).
            distribution: where it came from, named in errors and by ``kvcm plugins``.
            version: the distribution's version.

        Returns:
            The plugin's name in the manager.

        Raises:
            PluginError: the name is taken, or the plugin implements a hook that kvcm does
                not define (a misspelling) or with arguments its spec does not have.
        """
        label = repr(name) if name else repr(plugin)
        try:
            plugin_name = self._pm.register(plugin, name=name)
        except (ValueError, pluggy.PluginValidationError) as exc:
            raise PluginError(
                f"plugin {label} of distribution {distribution} could not be registered: "
                f"{exc}. Disable it with {DISABLE_ENV}={name or '<name>'}"
            ) from exc
        if plugin_name is None:  # blocked in pluggy
            raise PluginError(f"plugin {label} is blocked and was not registered")
        # A misspelt hook (``kvcm_teirs``) would otherwise be silently ignored.
        for hook_name in dir(self._pm.hook):
            caller = getattr(self._pm.hook, hook_name)
            if hook_name.startswith("_") or caller.spec is not None:
                continue
            if any(i.plugin_name == plugin_name for i in caller.get_hookimpls()):
                self._pm.unregister(name=plugin_name)
                known = ", ".join(_KINDS) + ", kvcm_event_sinks"
                raise PluginError(
                    f"plugin {plugin_name!r} of distribution {distribution} implements "
                    f"{hook_name}(), which is not a kvcm hook (known: {known}). Disable it "
                    f"with {DISABLE_ENV}={plugin_name}"
                )
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
            if impl.hookwrapper or impl.wrapper:
                continue  # wrappers observe other implementations; they register nothing
            source = self._sources.get(impl.plugin_name, _Source("<registered>", ""))
            blame = f"plugin {impl.plugin_name!r} of distribution {source.distribution}"
            disable = f"Disable it with {DISABLE_ENV}={impl.plugin_name}"
            try:
                result = impl.function()
                if isinstance(result, PluginSpec) or not isinstance(result, Iterable | None):
                    raise PluginError(
                        f"{blame} returned {type(result).__name__} from {hook_name}(); it "
                        f"must yield {record_type.__name__} records (or return a list). "
                        f"{disable}"
                    )
                records = list(result or ())
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"{blame} failed in {hook_name}(): {type(exc).__name__}: {exc}. {disable}"
                ) from exc
            for record in records:
                if not isinstance(record, record_type):
                    raise PluginError(
                        f"{blame} yielded {type(record).__name__} from {hook_name}(); "
                        f"expected {record_type.__name__}. {disable}"
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
                        f"one with {DISABLE_ENV}={first.plugin} or "
                        f"{DISABLE_ENV}={impl.plugin_name}"
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
        """Event sinks that plugins provide for one manager's ``config``, in load order."""
        sinks: list[Any] = []
        for impl in self._pm.hook.kvcm_event_sinks.get_hookimpls():  # load order
            if impl.hookwrapper or impl.wrapper:
                continue
            source = self._sources.get(impl.plugin_name, _Source("<registered>", ""))
            try:
                kwargs = {"config": config} if "config" in impl.argnames else {}
                batch = cast("Iterable[Any] | None", impl.function(**kwargs))
                got = list(batch or ())
            except Exception as exc:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} of distribution {source.distribution} "
                    f"failed in kvcm_event_sinks(): {type(exc).__name__}: {exc}. "
                    f"Disable it with {DISABLE_ENV}={impl.plugin_name}"
                ) from exc
            for sink in got:  # an instance with on_events (a class would lose every event)
                if isinstance(sink, type) or not callable(getattr(sink, "on_events", None)):
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} of distribution {source.distribution} "
                        f"gave kvcm_event_sinks() {sink!r}: each item must be an event sink "
                        "instance (an EventSink with on_events(events)), not a class or "
                        f"another object. Disable it with {DISABLE_ENV}={impl.plugin_name}")
            sinks.extend(got)
        return sinks

    # -- lookups -----------------------------------------------------------------------

    def _lookup(self, kind: str, table: Mapping[str, SpecT], name: str) -> SpecT:
        spec = table.get(name)
        if spec is None:
            known = ", ".join(sorted(table)) or "none"
            why = f" (blocked by {DISABLE_ENV})" if name in self.disabled else ""
            raise PluginError(f"unknown {kind} {name!r}{why}; available: {known}")
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

    def level_codec(self, name: str, field: str) -> CodecSpec:
        """The codec a level's configuration names in ``field`` (``levels[2].codec``): a
        :class:`ConfigError` naming the field, the name and the installed codecs when no
        codec has that name."""
        try:
            return self.codec(name)
        except PluginError as exc:
            raise ConfigError(field, name, str(exc)) from exc

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
            ok, reason = self.availability_of(spec)
            if not ok:
                raise PluginError(f"kernel backend {name!r} is unavailable: {reason}")
            return spec
        backends = self.kernel_backends()
        verdicts = {n: self.availability_of(s) for n, s in backends.items()}
        candidates = [s for n, s in backends.items() if verdicts[n][0]]
        if not candidates:
            why = "; ".join(f"{n}: {r}" for n, (_, r) in verdicts.items()) or "none installed"
            raise PluginError(f"no kernel backend is available ({why})")
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


def make_tier(spec: Any, backend: Any, options: Mapping[str, Any], level: int) -> Any:
    """``spec.factory(backend, options)`` for level ``level``: a :class:`ConfigError` the
    tier raises about one of its options names that option under the level
    (``levels[1].options.mode``), as the user wrote it, rather than under the tier's own
    name (``disk.options.mode``), which does not say which level."""
    try:
        return spec.factory(backend, options)
    except ConfigError as exc:
        if exc.field.startswith("levels["):
            raise
        _, dot, key = exc.field.partition(".options.")
        field = f"levels[{level}].options.{key}" if dot else \
            f"levels[{level}].options ({exc.field})"
        raise ConfigError(field, exc.value, f"{exc.rule} (tier {spec.name!r})") from exc


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
