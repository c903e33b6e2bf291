"""Small shared value types: strong integer ids, reuse policies and reuse scopes."""

from __future__ import annotations

import enum
from typing import NewType

import attrs

from kvcm_core.errors import ArgumentTypeError, InvalidArgumentError

__all__ = [
    "BlockOrdinal",
    "CacheGroupId",
    "LayerGroupId",
    "LevelId",
    "PoolGroupId",
    "PoolId",
    "ReusePolicy",
    "ReuseScope",
    "SlotId",
    "pool_reuse_policy",
]

#: A life cycle (cache group): pages allocated, kept and freed together.
CacheGroupId = NewType("CacheGroupId", int)
#: Alias of :data:`CacheGroupId` kept for the layer-level API.
LayerGroupId = CacheGroupId
PoolGroupId = NewType("PoolGroupId", int)
PoolId = NewType("PoolId", int)
SlotId = NewType("SlotId", int)
LevelId = NewType("LevelId", int)
BlockOrdinal = NewType("BlockOrdinal", int)


class ReusePolicy(enum.Enum):
    """How a buffer's pages take part in prefix reuse (docs/semantics.md)."""

    REQUIRED = "required"
    OPTIONAL = "optional"
    PRIVATE = "private"
    SINK_REQUIRED_ONLY = "sink_required_only"

    @property
    def order(self) -> int:
        """Position in the deterministic registration order."""
        return _POLICY_ORDER[self]


_POLICY_ORDER = {p: i for i, p in enumerate(ReusePolicy)}


def pool_reuse_policy(policy: ReusePolicy) -> ReusePolicy:
    """The policy a pool group is keyed by: SINK_REQUIRED_ONLY pools with REQUIRED."""
    return ReusePolicy.REQUIRED if policy is ReusePolicy.SINK_REQUIRED_ONLY else policy


def _check_encodable(field: str, value: object) -> None:
    """A scope field :meth:`ReuseScope.encode` can encode, refused when the scope is made
    rather than at its first use: a str that is not valid Unicode (a lone surrogate) or an
    int too long to write in decimal."""
    try:
        if isinstance(value, str):
            value.encode("utf-8")
        elif isinstance(value, int):
            str(value)
    except (UnicodeEncodeError, ValueError) as exc:
        if isinstance(value, int):  # (its repr is what failed)
            shown = f"<an int of {value.bit_length()} bits>"
        else:
            shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:40]}..."
        raise InvalidArgumentError(f"ReuseScope.{field}={shown}: must encode as UTF-8 text "
                                   f"or a decimal int ({type(exc).__name__}: {exc})") from exc


@attrs.frozen
class ReuseScope:
    """Separates tenants and adapters: the same tokens under two scopes never match.

    ``None`` and ``0`` are different values (``lora_id=None`` is "no adapter").
    """

    lora_id: int | None = attrs.field(default=None)
    salt: str | bytes | int | None = attrs.field(default=None)

    @lora_id.validator
    def _check_lora(self, attribute: attrs.Attribute[object], value: object) -> None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ArgumentTypeError(f"ReuseScope.lora_id={value!r}: must be an int or None")
        _check_encodable("lora_id", value)

    @salt.validator
    def _check_salt(self, attribute: attrs.Attribute[object], value: object) -> None:
        if value is not None and (isinstance(value, bool)
                                  or not isinstance(value, str | bytes | int)):
            raise ArgumentTypeError(f"ReuseScope.salt={value!r}: must be a str, bytes, int or None")
        _check_encodable("salt", value)

    def encode(self) -> bytes:
        """A canonical, unambiguous byte encoding (hashed into the scope root key, where
        every block key starts)."""
        parts = []
        for value in (self.lora_id, self.salt):
            if value is None:
                parts.append(b"N")
            elif isinstance(value, bool):
                raise ArgumentTypeError(f"ReuseScope field is a bool ({value!r}); use an int or "
                                        "str")
            elif isinstance(value, int):
                parts.append(b"I" + str(value).encode())
            elif isinstance(value, str):
                parts.append(b"S" + value.encode("utf-8"))
            else:
                parts.append(b"B" + bytes(value))
        return b"kvcm-scope-v1\x00" + b"\x00".join(
            len(p).to_bytes(4, "little") + p for p in parts
        )
