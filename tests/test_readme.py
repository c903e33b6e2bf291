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


def _example() -> str:
    return next(b for b in _blocks("python") if "KVCacheManager(" in b)


def test_readme_example_commits_what_follows_a_reused_prefix() -> None:
    """Rule: commit() takes the tokens after those the cache knows; the example must work
    when the prompt's prefix is already cached (committing the whole prompt is refused)."""
    from kvcm_core import KVCacheManager, ReuseScope

    class Warm(KVCacheManager):  # the same prompt already went through this manager
        def __init__(self, config: object) -> None:
            super().__init__(config)  # type: ignore[arg-type]
            with self.create_kv_cache(ReuseScope(), []) as c:
                assert c.resume() and c.resize(100)
                c.commit(list(range(100)))

    code = _example().replace("KVCacheManager(config)", "Warm(config)")
    assert code != _example()
    namespace: dict[str, object] = {"Warm": Warm}
    exec(compile(code, str(README), "exec"), namespace)
    cache = namespace["cache"]
    assert cache.num_committed_tokens == 100  # type: ignore[attr-defined]
    assert "cache.commit(prompt[cache.history_length:])" in _example()


def test_readme_example_writes_kv_into_pages_and_says_what_size_means() -> None:
    example = _example()
    assert "manager.backend.write(region.buffer" in example  # how KV gets into a page
    assert "get_mem_pool_base_address" in example and "get_page_stride" in example
    assert "size: bytes of ONE PAGE of the buffer" in example


def test_readme_says_png_plots_need_the_plot_extra() -> None:
    text = README.read_text()
    (setup,) = [b for b in _blocks("bash") if "pip install" in b]
    assert "pip install -e '.[plot]'" in setup  # said where the quick start promises plots
    assert "PNG plots" in text and "the `plot` extra" in text


def test_readme_quick_start_is_two_commands() -> None:
    (setup,) = [b for b in _blocks("bash") if "pip install" in b]
    commands = [line for line in setup.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2, commands
    assert "kvcm simulate" in commands[0] and "python -m pytest" in commands[1]


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md",
                                 *sorted(f"docs/{p.name}" for p in
                                         (README.parent / "docs").glob("*.md"))])
def test_readme_and_docs_stand_on_the_repository_alone(doc: str) -> None:
    """Rule: no pointer to files outside the repository (the specification's pages)."""
    text = (README.parent / doc).read_text()
    found = re.findall(r"(?:\.\./|/work/)shared|\bshared/\w|\b(?:concepts|api|quality|"
                       r"architecture|scenarios)\.md", text)
    assert not found, found


def test_the_engine_pages_model_declaration_runs_and_its_window_rule_holds() -> None:
    """docs/engine.md: its configuration is valid as written, and a window of W keeps the
    sink blocks and the blocks from (H + 1 - W) // tokens_per_block on, as it says."""
    doc = README.parent / "docs" / "engine.md"
    block = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)[0]
    namespace: dict[str, object] = {}
    exec(compile(block, str(doc), "exec"), namespace)
    assert namespace["config"].layers[1].sliding_window_size == 4096
    from kvcm_core import (
        AttentionLayerConfig,
        BufferConfig,
        KVCacheManager,
        KVCacheManagerConfig,
        LevelConfig,
    )
    tpb, window, sinks = 16, 40, 5
    cfg = KVCacheManagerConfig(
        tokens_per_block=tpb, kernel_backend="numpy",
        layers=[AttentionLayerConfig(layer_id=0, sliding_window_size=window,
                                     num_sink_tokens=sinks,
                                     buffers=[BufferConfig(role="key", size=64)])],
        levels=[LevelConfig(tier="gpu", quota="1MiB")])
    with KVCacheManager(cfg) as m:
        cache = m.create_kv_cache(None, [])
        assert cache.resume()
        for history in range(1, 120):
            assert cache.resize(history)
            cache.commit([history])
            table = cache.get_base_page_indices(0).tolist()
            sink_blocks = -(-sinks // tpb)
            first = max(sink_blocks, (history + 1 - window) // tpb)
            kept = [b for b, p in enumerate(table) if p >= 0]
            assert kept == [b for b in range(len(table)) if b < sink_blocks or b >= first]
        cache.close()


def test_readme_toml_configuration_reads_with_from_toml(tmp_path) -> None:
    """The TOML example is what from_toml reads: top-level fields, an SSM layer by its
    type, sizes as strings."""
    from kvcm_core import KVCacheManagerConfig
    from kvcm_core.config import SsmLayerConfig

    path = tmp_path / "kvcm.toml"
    path.write_text(_blocks("toml")[0])
    cfg = KVCacheManagerConfig.from_toml(path)
    assert isinstance(cfg.layers[1], SsmLayerConfig)
    assert cfg.levels[1].quota == 1 << 30
