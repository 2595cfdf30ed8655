"""quantobs' observers inside llm-compressor 0.14 (`oneshot`, `QuantizationModifier`).

Importing this module is the whole set-up: every observer of quantobs'
registry is registered in llm-compressor's own `Observer` registry as
`quantobs_<name>` (`quantobs_static_mse`, `quantobs_histogram`,
`quantobs_percentile`, ...), so a recipe only names it::

    import quantobs.integrations.llmcompressor  # noqa: F401

    QuantizationModifier(
        targets="Linear", scheme="W4A16", weight_observer="quantobs_static_mse"
    )

Importing (or calling `register_observers`) again is harmless: a name that
is already registered is left as it is, so observers added to quantobs'
registry later are registered by the next call.

Each registered class is a subclass of `llmcompressor.observers.Observer`
speaking its 0.14 contract on quantobs' engine (a `quantobs.Observer`, the
*core*, holds the statistic):

=================================  ==========================================
llm-compressor calls               what happens
=================================  ==========================================
`Observer.load_from_registry(      options validated by the observer's typed
name, base_name=, args=)`          model (a bad one raises `ValueError` naming
                                   the observer and the option); the core
                                   built from compressed-tensors' args
`observer(value)` (`forward`)      the value folded into the core's statistic
                                   (a weight only once); returns the observer
`update_statistics_from_observed`  a value already in the canonical layout
                                   `(N, *qparam_shape, G)` folded in
`has_statistics`,                  the core's statistic (its state tensors),
`get_statistics`,                  forgotten (cooperatively within a fused
`delete_statistics`                group, as llm-compressor's)
`get_qparams()`                    `{"scale", "zero_point", "global_scale"}`
                                   from the core's selected range, through
                                   compressed-tensors' rule; then the
                                   statistics are deleted
`get_global_scale()`               NVFP4 (`tensor_group`): from the largest
                                   global amax over the fused group
                                   (`FusionHandler`); else None
`sync_activation_stats()`          DDP: the core's statistic combined across
                                   ranks as each field declares
                                   (`quantobs.calibration.distributed.
                                   sync_observers`); returns `[]` (done)
`attach(module)`,                  passed on to the core where it has them
`detach(module)`                   (with a gate following llm-compressor's
                                   hook switch where the core takes one)
=================================  ==========================================

Distributed (DDP). llm-compressor's own observers all-reduce their ranges
with AVG (moving averages) or MIN / MAX; ours combine exactly as each
statistic declares (MIN / MAX, histograms re-aligned then summed, sums of
candidate errors, counts), and ranks that saw no data for an observer take
part with an empty statistic instead of waiting. The sync is synchronous
(one object gather and a few all-reduces per observer), so the returned
list of pending works is empty. A weight's own statistic is not synced
(weights are the same on every rank, and llm-compressor observes each on one
rank only); engines its core holds for activations are (the importance of
`quantobs_imatrix_mse`, summed as llm-compressor sums `_imatrix_sum`).

`quantobs_static_mse` scores candidates of a reference range taken from the
first batch; under DDP its activation statistics can be combined only where
every rank has the same reference, which llm-compressor's flow does not
arrange: the sync then raises `ValueError` on every rank (use
`quantobs_histogram_mse` or `quantobs_static_minmax` for DDP activations).

Differences from llm-compressor's observers, on purpose: no data flattened
with `g_idx` (as llm-compressor 0.14), non-finite values raise under the
default `nan_policy="raise"` (llm-compressor propagates them), and options
are validated instead of read with `.get(default)`.

(A little over 500 lines: one plug-in, llm-compressor's observer contract
implemented around ours.)

(Over 500 lines: one plug-in class mirroring llm-compressor's Observer
contract method by method.)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch

try:
    from compressed_tensors.registry.registry import standardize_lookup_name
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from llmcompressor.observers import Observer as LCObserver
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "quantobs.integrations.llmcompressor needs llm-compressor 0.14 and "
        "compressed-tensors 0.19; install them with "
        "pip install 'quantobs[llmcompressor]'"
    ) from err

from quantobs import native
from quantobs.calibration.distributed import is_distributed, sync_observers
from quantobs.core.args import QuantizationArgs
from quantobs.core.qparams import (
    amax_to_global_scale,
    calculate_qparams,
    in_observed_dtype,
)
from quantobs.core.registry import validate_options
from quantobs.observers.base import Observer
from quantobs.observers.engine import ObserverEngine
from quantobs.observers.mse import (
    MemorylessMSEObserver,
    MovingAverageMSEObserver,
    StaticMSEObserver,
)
from quantobs.stats.base import Reduce

__all__ = [
    "PREFIX",
    "QuantobsObserver",
    "register_observers",
    "registered_observers",
]

#: Prefix of quantobs' observers in llm-compressor's registry.
# Observers whose search scores candidates with the MSE kernel.
_MSE_SEARCHES = (MemorylessMSEObserver, MovingAverageMSEObserver, StaticMSEObserver)

PREFIX = "quantobs_"

# The fused-group statistic our observers add to `get_statistics()` for
# `tensor_group` args: the `(1,)` largest |value| the global scale uses.
_GLOBAL_AMAX = "global_amax"


class QuantobsObserver(LCObserver):
    """Base of quantobs' observers in llm-compressor's registry.

    A subclass per quantobs observer (`core_cls`) is made and registered by
    `register_observers`; construct them through llm-compressor
    (`Observer.load_from_registry("quantobs_static_mse", base_name=...,
    args=...)`) or directly.

    Args:
        base_name: `weight`, `input`, `output`, `q`, `k` or `v`.
        args: compressed-tensors' `QuantizationArgs` (their
            `observer_kwargs` are updated with `observer_kwargs`, as
            llm-compressor's observers do).
        **observer_kwargs: options of the observer, validated by its typed
            options model.

    Raises:
        ValueError: an unknown or invalid option (the message names the
            observer, the option and the valid options), or args the
            observer does not support for `base_name`.
    """

    #: The quantobs observer this class runs on (set per subclass).
    core_cls: ClassVar[type[Observer]] = Observer
    #: The name this class is registered under (`quantobs_<name>`).
    registered_name: ClassVar[str] = PREFIX + "observer"

    # The base's `_act_sync_dict` (per-attribute all-reduce ops) stays empty:
    # `sync_activation_stats` below combines the core's statistic as each of
    # its fields declares.

    def __init__(self, base_name: str, args: Any, **observer_kwargs: Any) -> None:
        if self.core_cls is Observer:
            raise TypeError(
                "QuantobsObserver is the base of the registered observers; load "
                f"one by name, e.g. Observer.load_from_registry('{PREFIX}static_mse',"
                " base_name=..., args=...)"
            )
        super().__init__(base_name, args, **observer_kwargs)
        owner = f"observer {self.registered_name!r}"
        validate_options(self.core_cls.Options, owner, self.args.observer_kwargs)
        ours = QuantizationArgs.from_compressed_tensors(args)
        core = self.core_cls(base_name, ours, **_peer_search(self.core_cls, ours))
        # Kept outside the module tree, as llm-compressor keeps its observers'
        # statistics (plain attributes): not in the model's `state_dict`, and
        # never matched by a recipe's targets (compressed-tensors skips only
        # `InternalModule`s, not their children).
        object.__setattr__(self, "_core", core)

    @property
    def core(self) -> Observer:
        """The quantobs observer holding the statistic."""
        core: Observer = self.__dict__["_core"]
        return core

    # ---------------------------------------------------------- statistics

    @property
    def has_statistics(self) -> bool:
        """Whether anything was observed since construction or deletion."""
        return self.core.has_statistics

    @contextmanager
    def _arithmetic(self) -> Iterator[None]:
        """llm-compressor's float32 arithmetic for the MSE searches: torch's
        kernels, whose errors are theirs to the last bit. (The native MSE
        kernel's own `|err| ** 2.4` and float64 sums differ by about 1e-6;
        the native search re-scores near ties with torch and decides as
        llm-compressor does, `quantobs.solvers.mse_ties`, but torch keeps
        every error theirs.) Other observers are exact either way and keep
        the native kernels."""
        if not isinstance(self.core, _MSE_SEARCHES):
            yield
            return
        previous = native.set_enabled(False)
        try:
            yield
        finally:
            native.set_enabled(previous)

    @torch.no_grad()
    def update_statistics_from_observed(self, observed: torch.Tensor) -> None:
        """Fold a value in the canonical layout into the statistic.

        Args:
            observed: `(num_observations, *qparam_shape, group_size)`.
        """
        with self._arithmetic():
            self.core.observe_flat(observed)  # counts what it keeps

    # llm-compressor decorates `forward` and `get_qparams` with a bare
    # `@torch.no_grad`, which mypy types as a `no_grad` object rather than a
    # method (and without llm-compressor installed the base is `Any`).
    @torch.no_grad()
    def forward(  # type: ignore[override, unused-ignore]
        self, observed: torch.Tensor
    ) -> QuantobsObserver:
        """Fold a weight, activation or attention state into the statistic.

        A weight is observed once (until its statistics are deleted); the
        fused partners of a weight (NVFP4 q/k/v, gate/up) are observed with
        it, as llm-compressor's observers do.

        Args:
            observed: the value, in its own shape (e.g. `(out, in)` for a
                weight, `(batch, seq, hidden)` for an input).

        Returns:
            This observer.
        """
        if observed.numel() == 0:
            return self
        if self.is_weight_obs and self.has_statistics:
            return self
        with self._arithmetic():
            self.core.update(observed)
        if self.fusion_handler.is_fused:
            self.fusion_handler.get_fused_statistics()
        return self

    def get_statistics(self) -> dict[str, torch.Tensor]:
        """The statistic's state tensors by field name (e.g. `min_vals`,
        `max_vals` of a min-max statistic, `counts` of a histogram); for
        `tensor_group` args also `global_amax`, the `(1,)` largest |value|
        the global scale derives from.

        Raises:
            RuntimeError: nothing observed yet.
        """
        stat = self.core.statistic()
        if stat is None:
            raise RuntimeError(
                f"observer {self.registered_name!r} for {self.base_name!r} has no "
                "statistics; call observer(value) with a non-empty tensor first"
            )
        found = dict(stat.state())
        if self.args.strategy == "tensor_group":
            found[_GLOBAL_AMAX] = self.core.global_amax()
        return found

    def delete_statistics(self, check_fused: bool = True) -> None:
        """Forget the statistic.

        Args:
            check_fused: delete cooperatively: within a fused group, only once
                every member asked (llm-compressor's rule); False deletes now.
        """
        if check_fused:
            self.fusion_handler.maybe_delete_statistics()
        else:
            self.core.reset()

    # -------------------------------------------------------------- qparams

    @torch.no_grad()
    def get_global_scale(self) -> torch.Tensor | None:
        """The `(1,)` float32 NVFP4 global scale from the largest global amax
        of this observer and its fused partners (None unless `tensor_group`).

        Partners that are llm-compressor's own observers count with the
        absmax of their `min_vals` / `max_vals`.
        """
        if self.args.strategy != "tensor_group":
            return None
        amaxes = []
        for stats in self.fusion_handler.get_fused_statistics():
            if _GLOBAL_AMAX in stats:
                amax = stats[_GLOBAL_AMAX]
            else:
                amax = torch.maximum(-stats["min_vals"].min(), stats["max_vals"].max())
            amaxes.append(amax.float().reshape(1))
        # (k, 1) -> (1,): the group's largest, rounded as compressed-tensors
        # rounds it for bfloat16 / float16 values
        return amax_to_global_scale(
            torch.stack(amaxes).amax(0), observed_dtype=self.core.arithmetic_dtype
        )

    @torch.no_grad()
    def get_qparams(  # type: ignore[override, unused-ignore]
        self,
    ) -> dict[str, torch.Tensor | None]:
        """Quantization parameters from the statistic, which is then deleted
        (cooperatively within a fused group).

        Returns:
            `{"scale": (*qparam_shape,), "zero_point": (*qparam_shape,),
            "global_scale": (1,) or None}`, through compressed-tensors' rule;
            the scale in llm-compressor's dtype (`Observer.get_qparams`).

        Raises:
            RuntimeError: nothing observed yet.
        """
        if not self.has_statistics:
            raise RuntimeError(
                f"observer {self.registered_name!r} for {self.base_name!r} has no "
                "statistics; call observer(value) with a non-empty tensor first"
            )
        global_scale = self.get_global_scale()
        min_vals, max_vals = self.core.get_range()  # each (*qparam_shape,)
        scale, zero_point = calculate_qparams(
            min_vals,
            max_vals,
            self.core.args,
            global_scale,
            empty_as_zero=True,
            observed_dtype=self.core.arithmetic_dtype,
        )
        # in the observed bfloat16 / float16, as llm-compressor's own scales
        scale = in_observed_dtype(scale, self.core.rounding_dtype(), global_scale)
        self.delete_statistics()
        return {"scale": scale, "zero_point": zero_point, "global_scale": global_scale}

    # ------------------------------------------------------------ lifecycle

    def attach(self, module: torch.nn.Module) -> None:
        """Called by llm-compressor once the observer is on `module`: passed on
        to the core's `attach(module)` where it has one (e.g. a forward
        pre-hook gathering the importance of a weight's input channels).

        A core whose `attach` takes a `gate` gets one that is false while
        llm-compressor disables its modifiers' hooks (the sequential
        pipeline's propagation passes), as llm-compressor's own hooks do.
        """
        hook = getattr(self.core, "attach", None)
        if not callable(hook):
            return
        if "gate" in inspect.signature(hook).parameters:
            hook(module, gate=_hooks_enabled)
        else:
            hook(module)

    def detach(self, module: torch.nn.Module) -> None:
        """Called by llm-compressor before the observer is removed from
        `module`: passed on to the core's `detach(module)` where it has one."""
        hook = getattr(self.core, "detach", None)
        if callable(hook):
            hook(module)

    # ---------------------------------------------------------- distributed

    def sync_activation_stats(self) -> list[Any]:
        """Combine this observer's activation statistic across DDP ranks.

        Every rank must call it for the same observers in the same order (as
        llm-compressor's `sync_obs_act_stats` does). Afterwards each rank
        holds the statistic one process observing every rank's batches would
        hold: exactly for exact statistics, as each field declares
        (`quantobs.calibration.distributed`). A weight observer syncs only
        the engines its core holds for activations (e.g. the importance of
        `imatrix_mse`): every rank has the same weights.

        Returns:
            `[]`: the collectives are complete when it returns.

        Raises:
            ValueError (on every rank alike): the ranks' statistics cannot be
                combined (different shapes, or different `static_mse`
                reference ranges).
        """
        if not is_distributed():
            return []
        engines = self._activation_engines()
        if not engines:
            return []
        try:
            sync_observers(engines)
        except ValueError as err:
            stype = self.core.statistic_type()
            fields = () if stype is None else stype.fields
            if any(f.reduce == Reduce.EQUAL for f in fields):
                raise ValueError(
                    f"{err}. Observer {self.registered_name!r} for "
                    f"{self.base_name!r} scores candidates of a reference range "
                    "that each rank took from its own first batch; under DDP use "
                    f"{PREFIX}histogram_mse or {PREFIX}static_minmax for "
                    "activations"
                ) from err
            raise
        return []

    def _activation_engines(self) -> list[ObserverEngine]:
        """The engines whose statistics come from activations, in module
        order (the same on every rank): the core and its child engines, or
        only the children for a weight."""
        return [
            engine
            for engine in self.core.modules()
            if isinstance(engine, ObserverEngine)
            and not (self.is_weight_obs and engine is self.core)
        ]

    def extra_repr(self) -> str:
        return f"{self.registered_name!r}, core={self.core.extra_repr()}"


def _hooks_enabled() -> bool:
    """Whether llm-compressor's modifier hooks run now (they are off while
    its sequential pipeline propagates a calibrated layer's outputs)."""
    return not HooksMixin._HOOKS_DISABLED


# ---------------------------------------------------------------- registry

# quantobs class -> its llm-compressor class (one per process, whatever the
# number of imports or calls).
_WRAPPERS: dict[type[Observer], type[QuantobsObserver]] = {}


def _core_classes() -> dict[type[Observer], list[str]]:
    """quantobs' observer classes, each with its names (its own first)."""
    found: dict[type[Observer], list[str]] = {}
    for label in Observer.registered_names():
        cls = Observer.get_class(label)
        names = found.setdefault(cls, [cls.name])
        if label not in names:
            names.append(label)
    return found


def _wrapper_for(core_cls: type[Observer]) -> type[QuantobsObserver]:
    """The llm-compressor class running `core_cls` (made once)."""
    wrapper = _WRAPPERS.get(core_cls)
    if wrapper is None:
        name = PREFIX + core_cls.name
        wrapper = type(
            f"Quantobs{core_cls.__name__}",
            (QuantobsObserver,),
            {
                "core_cls": core_cls,
                "registered_name": name,
                "__module__": __name__,
                "__doc__": (
                    f"quantobs' `{core_cls.name}` observer in llm-compressor's "
                    f"registry as `{name}`.\n\n{core_cls.__doc__ or ''}"
                ),
            },
        )
        _WRAPPERS[core_cls] = wrapper
    return wrapper


def _taken(name: str) -> bool:
    """Whether llm-compressor's registry already has `name` (as a name or an
    alias: compressed-tensors raises on registering either twice)."""
    key = standardize_lookup_name(name)
    return key in LCObserver.registered_names() or key in (
        LCObserver.registered_aliases()
    )


def register_observers() -> dict[str, type[QuantobsObserver]]:
    """Register every observer of quantobs' registry in llm-compressor's, as
    `quantobs_<name>` (its aliases as `quantobs_<alias>`).

    Idempotent: names already registered are left as they are, so calling
    it again registers only observers added to quantobs since.

    Returns:
        Every quantobs observer's llm-compressor name and class.
    """
    registered: dict[str, type[QuantobsObserver]] = {}
    for core_cls, names in _core_classes().items():
        wrapper = _wrapper_for(core_cls)
        name, aliases = PREFIX + names[0], [PREFIX + a for a in names[1:]]
        if not _taken(name):
            fresh = [a for a in aliases if not _taken(a)]
            LCObserver.register_value(wrapper, name=name, alias=fresh or None)
        # What the registry holds (a module reloaded keeps the first classes).
        registered[name] = LCObserver.get_value_from_registry(name)
    return registered


def registered_observers() -> list[str]:
    """The names of quantobs' observers in llm-compressor's registry, as a
    recipe spells them (`quantobs_static_mse`, ...)."""
    return sorted(
        PREFIX + cls.name for cls in _core_classes() if _taken(PREFIX + cls.name)
    )


register_observers()


def _peer_search(core_cls: type[Observer], args: QuantizationArgs) -> dict[str, Any]:
    """The plug-in searches bfloat16 / float16 as llm-compressor does (its
    observers' choice bit for bit): `search_arithmetic="observed"` for the
    MSE observers, unless the recipe's `observer_kwargs` say otherwise."""
    fields = getattr(core_cls.Options, "model_fields", {})
    given = args.observer_kwargs or {}
    if "search_arithmetic" not in fields or "search_arithmetic" in given:
        return {}
    return {"search_arithmetic": "observed"}
