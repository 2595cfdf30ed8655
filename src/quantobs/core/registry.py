"""Names: registries, enum values and typed options, for every face.

Names are looked up ignoring case, `-`, `_` and spaces (compressed-tensors'
`RegistryMixin` rule); a miss lists every registered name. Enum values are
accepted as members, as members of a peer's enum of the same values, or as
any capitalisation of their value or name (`coerce_enum`). Options are
pydantic models with `extra="forbid"`: a typo or an out-of-range value is an
error that names the option, the value and the valid options.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from enum import Enum
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ValidationError

__all__ = ["Registered", "Registry", "coerce_enum", "validate_options"]

T = TypeVar("T", bound=type)
M = TypeVar("M", bound=BaseModel)
E = TypeVar("E", bound=Enum)


def coerce_enum(enum: type[E], value: Any, field: str) -> E:
    """A member of `enum` from a member, a peer's enum member with the same
    value, the value itself, or any capitalisation of a member's value or name.

    Raises:
        ValueError: no member matches; the message lists the valid values.
    """
    if isinstance(value, enum):
        return value
    raw = value.value if isinstance(value, Enum) else value
    for member in enum:
        if member.value == raw and type(raw) is type(member.value):
            return member
    if isinstance(raw, str):
        key = raw.strip().lower()
        for member in enum:
            if str(member.value).lower() == key or member.name.lower() == key:
                return member
    labels = [m.value if isinstance(m.value, str) else m.name for m in enum]
    valid = ", ".join(repr(label) for label in labels)
    raise ValueError(f"{field}={value!r} is not valid; use one of {valid}")


def _key(name: str) -> str:
    return re.sub(r"[-_\s]", "", name).lower()


class Registry(Generic[T]):
    """Classes by name (and aliases).

    Args:
        kind: what is registered, for messages (e.g. "observer").
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._classes: dict[str, T] = {}
        self._names: dict[str, str] = {}

    def register(
        self, name: str, alias: str | list[str] | None = None
    ) -> Callable[[T], T]:
        """Class decorator registering `name` and its aliases; sets `cls.name`.

        Raises:
            ValueError: a name already registered to another class.
        """
        aliases = [alias] if isinstance(alias, str) else list(alias or [])

        def decorator(cls: T) -> T:
            keys = [(label, _key(label)) for label in (name, *aliases)]
            for label, key in keys:
                taken = self._classes.get(key)
                if taken is not None and taken is not cls:
                    raise ValueError(
                        f"{self.kind} name {label!r} is already registered to "
                        f"{taken.__name__}; choose another name"
                    )
            cls.name = name  # type: ignore[attr-defined]
            for label, key in keys:
                self._classes[key] = cls
                self._names[key] = label
            return cls

        return decorator

    def names(self) -> list[str]:
        """Every registered name and alias."""
        return sorted(self._names.values())

    def get(self, name: str) -> T:
        """The class registered as `name`.

        Raises:
            KeyError: unknown name; the message lists every registered name.
        """
        found = self._classes.get(_key(name)) if isinstance(name, str) else None
        if found is None:
            raise KeyError(
                f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}"
            )
        return found


C = TypeVar("C", bound=type)


class Registered:
    """Class methods of a family of classes registered by name, backed by the
    family's `registry` (compressed-tensors' `RegistryMixin` API)."""

    registry: ClassVar[Registry[Any]]

    @classmethod
    def register(
        cls, name: str, alias: str | list[str] | None = None
    ) -> Callable[[C], C]:
        """Class decorator: register a class under `name` (and aliases)."""
        return cls.registry.register(name, alias)

    @classmethod
    def registered_names(cls) -> list[str]:
        """Every registered name and alias."""
        return cls.registry.names()

    @classmethod
    def get_value_from_registry(cls, name: str) -> Any:
        """The class registered as `name` (case, `-` and `_` are ignored).

        Raises:
            KeyError: no class has that name; the message lists them all.
        """
        return cls.registry.get(name)

    @classmethod
    def load_from_registry(cls, name: str, **constructor_kwargs: Any) -> Any:
        """Construct the class registered as `name` with `constructor_kwargs`."""
        return cls.get_value_from_registry(name)(**constructor_kwargs)


def validate_options(options: type[M], owner: str, *sources: Mapping[str, Any]) -> M:
    """Build an options model from dicts (later ones win), with clear errors.

    Raises:
        ValueError: unknown option or invalid value; names the option, the
            value and the valid options of `owner`.
    """
    merged: dict[str, Any] = {}
    for source in sources:
        merged.update(source)
    try:
        return options(**merged)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}"
            for e in err.errors()
        )
        raise ValueError(
            f"invalid options for {owner}: {problems} "
            f"(valid options: {', '.join(options.model_fields)})"
        ) from None
