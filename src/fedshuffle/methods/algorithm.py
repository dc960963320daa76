"""An algorithm: a method with its local planner, server optimizer and step-size schedule, built by name.

:func:`build_algorithm` takes the settings of each part (the configuration sections ``method``,
``local``, ``aggregation``, ``server``, ``schedule``) over the method's registered defaults. Each
part validates its own parameters; errors name the section and the parameter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedshuffle.aggregation import Aggregator
from fedshuffle.core.errors import ConfigError, section
from fedshuffle.core.registry import Entry
from fedshuffle.core.validation import validate
from fedshuffle.local.plan import LocalPlanner
from fedshuffle.methods import METHODS
from fedshuffle.methods.base import Method
from fedshuffle.methods.momentum import GlobalMomentum
from fedshuffle.methods.private import private_method
from fedshuffle.privacy import PrivacySettings
from fedshuffle.samplers import Sampler
from fedshuffle.schedules import SCHEDULES, Schedule
from fedshuffle.server import SERVER_OPTIMIZERS, MetaEpochExtrapolation, ServerOptimizer, chosen_optimizer

PARTS = ("method", "local", "aggregation", "server", "schedule", "privacy")


@dataclass(frozen=True)
class Algorithm:
    """A method and the parts around it: the local planner that plans its clients' work, the server
    optimizer (x ← x − step(d)), RR-CLI's meta-epoch step, the schedule scaling every step size, and the
    differential privacy of the updates (:mod:`fedshuffle.privacy`: the method's client half clips and noises them,
    the server's :class:`~fedshuffle.privacy.PrivateAggregation` noises the aggregate and accounts ε)."""

    method: Method
    local: LocalPlanner
    server: ServerOptimizer
    schedule: Schedule = field(default_factory=Schedule)
    meta_epoch_step: bool = False
    global_lr: float | None = None
    privacy: PrivacySettings = field(default_factory=PrivacySettings)

    @property
    def name(self) -> str:
        return self.method.name

    @property
    def aggregator(self) -> Aggregator:
        return self.method.aggregator

    @property
    def needs_cycles(self) -> bool:
        """RR-CLI and FedCDR are defined over meta-epochs of cyclic cohorts."""
        return self.meta_epoch_step or self.method.needs_cycles

    def server_for(self, sampler: Sampler) -> ServerOptimizer:
        """The server optimizer, wrapped in RR-CLI's meta-epoch step when the method has one (θ = ηR by default)."""
        rounds = getattr(sampler, "rounds_per_meta_epoch", None)
        if self.needs_cycles and rounds is None:
            raise ConfigError(
                "sampler.name", f"{self.name} needs meta-epochs: use sampler.name = 'cyclic' (got {sampler.describe()})"
            )
        if not self.meta_epoch_step:
            return self.server
        theta = self.global_lr if self.global_lr is not None else self.server.lr * rounds
        with section("server"):
            return MetaEpochExtrapolation(self.server, theta, rounds)

    def planned_tau_eff(self, weights: np.ndarray, sizes: np.ndarray) -> float | None:
        """τ_eff = Σ_i w_i E[η_i‖a_i‖₁/η_l] when the aggregator needs it (see :mod:`fedshuffle.aggregation`)."""
        if not self.aggregator.needs_planned_tau_eff:
            return None
        with section("aggregation"):
            return float(weights @ self.local.expected_progress(sizes))


def method_defaults(name: str) -> dict[str, dict[str, Any]]:
    """The registered defaults of method ``name``, by section."""
    return {part: dict(values) for part, values in METHODS[name].defaults.items()}


def _given(values: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in (values or {}).items() if v is not None}


def build_algorithm(name: str, settings: Mapping[str, Mapping[str, Any]] | None = None, rounds: int = 1) -> Algorithm:
    """Method ``name`` with ``settings`` (by section) over its registered defaults; ``rounds`` is the run
    length the step schedule's milestones refer to. ``None`` values mean "default"."""
    entry = METHODS[name]
    settings = settings or {}
    unknown = set(settings) - set(PARTS)
    if unknown:
        raise ConfigError(sorted(unknown)[0], f"not a part of an algorithm; accepted: {', '.join(PARTS)}")
    merged = {part: {**entry.defaults.get(part, {}), **_given(settings.get(part))} for part in PARTS}
    theory = [f"{part}.{k}" for part, values in merged.items() for k, v in values.items() if _is_theory(v)]
    if theory:  # only a step size may be 'theory' (fedshuffle.experiments.schema)
        raise ConfigError(theory[0], "'theory' needs the problem and data; resolve it with resolve_step_sizes first")
    local = build_planner(merged["local"])
    with section("aggregation"):
        aggregator = Aggregator(**merged["aggregation"])
    with section("method"):
        method = _method(entry, aggregator, merged["method"])
    server_settings = dict(merged["server"])
    for key in (
        "theory_rule",
        "theory_follows",
    ):  # how 'theory' steps were resolved (resolve_step_sizes), not a part's setting
        server_settings.pop(key, None)
    beta = server_settings.pop("global_momentum", 0.0)
    estimator = server_settings.pop("momentum_estimator", "exact")
    meta = bool(server_settings.pop("meta_epoch_step", False))
    global_lr = server_settings.pop("global_lr", None)
    kind = chosen_optimizer(server_settings)
    server_settings.pop("optimizer", None)
    if global_lr is not None and not meta:
        raise ConfigError("server.global_lr", f"a global (meta-epoch) step size applies to rr_cli only, not to {name}")
    with section("server"):
        server = SERVER_OPTIMIZERS[kind].build(server_settings)
        if beta:
            method = GlobalMomentum(method, beta, estimator)
    if local.prox_mu and method.sets_own_prox:
        raise ConfigError(
            "local.prox_mu",
            f"{name}'s local objective sets its own proximal term: set its method settings, not local.prox_mu",
        )
    with section("schedule"):
        schedule_settings = dict(merged["schedule"])
        schedule = SCHEDULES[schedule_settings.pop("name", "constant")].build(schedule_settings, total_rounds=rounds)
    with section("privacy"):
        privacy = validate(PrivacySettings, merged["privacy"])
    return Algorithm(private_method(method, privacy), local, server, schedule, meta, global_lr, privacy)


def _is_theory(value: Any) -> bool:
    return isinstance(value, str) and value == "theory"


def build_planner(settings: Mapping[str, Any]) -> LocalPlanner:
    """The local planner of the ``[local]`` settings: η_l = ``lr`` × ``lr_multiplier`` (errors name ``local.*``)."""
    settings = _given(settings)
    multiplier = settings.pop("lr_multiplier", 1.0)
    if "lr" not in settings:
        raise ConfigError("local.lr", "a local step size is required (e.g. lr = 0.01, or lr = 'theory')")
    with section("local"):
        return LocalPlanner(**{**settings, "lr": settings["lr"] * multiplier})


def _method(entry: Entry, aggregator: Aggregator, settings: Mapping[str, Any]) -> Method:
    """The method object with its own settings (errors name the setting and what the method takes)."""
    method = entry.build(settings, aggregator=aggregator)
    method.name = entry.name
    return method
