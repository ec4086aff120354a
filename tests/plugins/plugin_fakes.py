"""Fake backends, plugins and distributions for the plugin tests (no packaging needed)."""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import pagedcore
from pagedcore.attention import AttentionBackend, AttentionImpl, MetadataBuilder, MultipleOf
from pagedcore.plugins.hookspecs import ENTRY_POINT_GROUP


class FakeBuilder(MetadataBuilder[None]):
    def build(self, common: Any, *, common_prefix_len: int = 0) -> None:
        return None


class FakeImpl(AttentionImpl[None]):
    def do_kv_cache_update(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        return None

    def forward(self, query: Any, key: Any, value: Any, kv_cache: Any, metadata: None,
                *, output: Any = None) -> Any:
        return query


class IncompleteImpl(AttentionImpl[None]):
    """Leaves `forward` abstract."""

    def do_kv_cache_update(self, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        return None


class FakeBackendBase(AttentionBackend):
    supported_devices = ("cpu",)

    @classmethod
    def get_builder_cls(cls) -> type[MetadataBuilder[Any]]:
        return FakeBuilder

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl[Any]]:
        return FakeImpl

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype: str = "auto") -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)


def make_backend(name: str, *, priority: int = 100, devices: Sequence[str] = ("cpu",),
                 head_sizes: Sequence[int] | None = None,
                 block_sizes: Sequence[int | MultipleOf] = (MultipleOf(1),),
                 base: type = FakeBackendBase, **extra: Any) -> type[AttentionBackend]:
    """A concrete backend class named `name`."""
    namespace = {
        "name": name,
        "priority": priority,
        "supported_devices": tuple(devices),
        "supported_head_sizes": None if head_sizes is None else tuple(head_sizes),
        "supported_block_sizes": tuple(block_sizes),
        **extra,
    }
    return type(f"Fake_{name}", (base,), namespace)


def make_plugin(*backends: Any) -> types.SimpleNamespace:
    """A plugin object whose hook returns `backends`."""

    @pagedcore.hookimpl
    def pagedcore_register_backends() -> list[Any]:
        return list(backends)

    return types.SimpleNamespace(pagedcore_register_backends=pagedcore_register_backends)


class FakeDistribution:
    def __init__(self, name: str, version: str = "1.0") -> None:
        self.name = name
        self.version = version
        self.metadata = {"Name": name}


class FakeEntryPoint:
    """Duck-types `importlib.metadata.EntryPoint`; `target` is returned (or raised) by load()."""

    def __init__(self, name: str, target: Any, dist: FakeDistribution,
                 group: str = ENTRY_POINT_GROUP) -> None:
        self.name = name
        self.value = f"fake_{name}.plugin"
        self.group = group
        self.dist = dist
        self._target = target

    def load(self) -> Any:
        if isinstance(self._target, BaseException):
            raise self._target
        return self._target


def install_entry_points(monkeypatch: Any, *eps: FakeEntryPoint) -> None:
    """Make `importlib.metadata.entry_points` return exactly `eps` (filtered by group)."""

    def entry_points(*, group: str | None = None, **_: Any) -> list[FakeEntryPoint]:
        return [ep for ep in eps if group is None or ep.group == group]

    monkeypatch.setattr("importlib.metadata.entry_points", entry_points)
