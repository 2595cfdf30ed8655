"""Gathering the input importance of linear layers (llm-compressor's imatrix).

`ImportanceObserver` keeps an `Importance` statistic (`E[x ** 2]` per input
channel, `quantobs.stats.importance`) in two buffers named as llm-compressor
0.14 names its attributes, `_imatrix_sum` (`(in_features,)` float32) and
`_imatrix_count` (`()` int64), and gathers it as llm-compressor does:
`attach(module)` starts a fresh, zero importance of the module's
`in_features` and registers a forward pre-hook that folds each call's first
positional input `(..., in_features)` in (non-tensor inputs are skipped);
`detach()` removes the hook. `update(x)` folds inputs in by hand.

Being an `ObserverEngine`, it moves with `.to()`, travels in `state_dict`
(buffers take the saved shapes), merges exactly (sums) and is synced across
processes by `quantobs.calibration.distributed.sync_observers` from its
declared SUM fields. A copy (`copy.deepcopy`, `torch.save`) keeps the
importance but not the hook.

`ImportanceGatherer` does the same for every linear layer of a model at
once, without quantization observers::

    with ImportanceGatherer(model) as gathered:  # every module with in_features
        for batch in batches:
            model(batch)
    observer.set_importance(gathered["model.layers.0.mlp.up_proj"])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, ClassVar

import torch
from torch.utils.hooks import RemovableHandle

from quantobs.observers.engine import ObserverEngine
from quantobs.stats.importance import Importance

__all__ = ["ImportanceGatherer", "ImportanceObserver"]


def _first_input(args: Any) -> torch.Tensor | None:
    """The tensor a forward pre-hook's positional args carry first, if any
    (llm-compressor's rule: `args[0]`, or its first element if a tuple)."""
    x = args[0] if isinstance(args, tuple) and args else args
    if isinstance(x, tuple):
        x = x[0] if x else None
    return x if isinstance(x, torch.Tensor) else None


class ImportanceObserver(ObserverEngine):
    """`E[x ** 2]` per input channel of one linear layer's inputs.

    The statistic (`statistic()`, an `Importance`) is None until a fresh
    `attach` or the first `update`.
    """

    statistic_cls = Importance
    buffer_names: ClassVar[Mapping[str, str]] = {
        "sum": "_imatrix_sum",
        "count": "_imatrix_count",
    }

    def __init__(self) -> None:
        super().__init__()
        self._hook: RemovableHandle | None = None
        self._gate: Callable[[], bool] | None = None

    # ---------------------------------------------------------------- data

    def importance(self) -> Importance | None:
        """The gathered statistic (None before any data or `attach`)."""
        stat = self.statistic()
        return stat if isinstance(stat, Importance) else None

    def mean(self) -> torch.Tensor | None:
        """`(in_features,)` float32 `E[x ** 2]`, None before any token."""
        stat = self.importance()
        return None if stat is None else stat.mean()

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold a batch of the layer's inputs `(..., in_features)` in.

        Raises:
            TypeError: `x` is not a floating tensor.
            ValueError: `x` does not end with the gathered `in_features`.
        """
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise TypeError(
                "the importance is gathered from floating inputs, got "
                f"{getattr(x, 'dtype', type(x).__name__)}"
            )
        if x.numel() == 0:
            return
        if x.ndim == 0:
            raise ValueError("inputs must be at least 1-D (..., in_features)")
        stat = self.importance()
        if stat is None:
            stat = Importance.empty((x.shape[-1],), x.device)
        self._store(stat.of_inputs(x))

    def set(self, importance: torch.Tensor | Importance) -> None:
        """Replace the statistic: an `Importance`, or `E[x ** 2]` itself as a
        `(in_features,)` tensor (kept as a sum over one token).

        Raises:
            TypeError, ValueError: not a 1-D floating tensor or `Importance`.
        """
        if isinstance(importance, Importance):
            self._store(importance)
            return
        if (
            not isinstance(importance, torch.Tensor)
            or not importance.dtype.is_floating_point
            or importance.ndim != 1
        ):
            raise TypeError(
                "importance must be an Importance or a 1-D floating tensor "
                "(E[x ** 2] per input channel), got "
                f"{getattr(importance, 'shape', type(importance).__name__)}"
            )
        count = torch.ones((), dtype=torch.int64, device=importance.device)
        self._store(Importance(importance.detach().float().clone(), count))

    # --------------------------------------------------------------- hooks

    @property
    def hook(self) -> RemovableHandle | None:
        """The forward pre-hook's handle while attached (else None)."""
        return self._hook

    def attach(
        self, module: torch.nn.Module, gate: Callable[[], bool] | None = None
    ) -> None:
        """Gather the importance of `module`'s inputs (llm-compressor's
        `IMatrixMSEObserver.attach`): a fresh zero statistic of the module's
        `in_features`, then a forward pre-hook. A module without
        `in_features` gets no hook (as in llm-compressor).

        Args:
            module: the layer (e.g. an `nn.Linear`).
            gate: optional; the hook gathers only while `gate()` is true
                (e.g. llm-compressor's `HooksMixin` switch).
        """
        self.detach()
        in_features = getattr(module, "in_features", None)
        if not isinstance(in_features, int):
            return
        param = next(module.parameters(), None)
        device = param.device if param is not None else torch.device("cpu")
        self._store(Importance.empty((in_features,), device))
        self._gate = gate
        self._hook = module.register_forward_pre_hook(self._pre_hook)

    def detach(self, module: torch.nn.Module | None = None) -> None:
        """Remove the hook (the importance gathered so far is kept)."""
        if self._hook is not None:
            self._hook.remove()
        self._hook, self._gate = None, None

    def _pre_hook(self, module: torch.nn.Module, args: Any) -> None:
        if self._gate is not None and not self._gate():
            return
        x = _first_input(args)
        if x is not None:
            self.update(x)

    def __getstate__(self) -> dict[str, Any]:
        # Copies keep the statistic, not the hook (whose handle refers to the
        # module's hook table).
        state = dict(self.__dict__)
        state["_hook"], state["_gate"] = None, None
        return state

    def extra_repr(self) -> str:
        stat = self.importance()
        found = "none" if stat is None else f"{stat.qparam_shape[0]} channels"
        return f"importance={found}, attached={self._hook is not None}"


class ImportanceGatherer:
    """Gathers the importance of many layers' inputs, without observers.

    Use as a context manager (hooks removed on exit) or call `attach` /
    `detach`; index by module name for each layer's `Importance`.

    Args:
        modules: a model (every submodule with an integer `in_features`,
            such as each `nn.Linear`, by qualified name) or a mapping
            name -> module.
    """

    def __init__(self, modules: torch.nn.Module | Mapping[str, torch.nn.Module]):
        if isinstance(modules, torch.nn.Module):
            modules = {
                name: m
                for name, m in modules.named_modules()
                if isinstance(getattr(m, "in_features", None), int)
            }
        self.modules = dict(modules)
        self.observers = {name: ImportanceObserver() for name in self.modules}

    def attach(self) -> None:
        """Start gathering (fresh, zero importances)."""
        for name, module in self.modules.items():
            self.observers[name].attach(module)

    def detach(self) -> None:
        """Stop gathering (the importances are kept)."""
        for observer in self.observers.values():
            observer.detach()

    def __enter__(self) -> ImportanceGatherer:
        self.attach()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.detach()

    def __getitem__(self, name: str) -> Importance:
        """The importance gathered for the module `name`.

        Raises:
            KeyError: no such module, or nothing gathered for it.
        """
        observer = self.observers.get(name)
        found = None if observer is None else observer.importance()
        if found is None:
            raise KeyError(
                f"no importance gathered for {name!r}; gathered for: "
                f"{', '.join(self.observers) or 'no module'}"
            )
        return found

    def __iter__(self) -> Iterator[str]:
        return iter(self.observers)

    def __len__(self) -> int:
        return len(self.observers)
