"""Aggregation: the weights ω_i with which the server combines the client updates, Δ = Σ_{i∈S} ω_iΔ_i.

FedShuffleGen (FedShuffle paper, Algorithm 4, line 15) writes ω_i = w̃_i / q_i^S with aggregation
weights w̃ and a normalization q^S that may depend on the cohort:

* ``normalization="unbiased"``: q_i^S = E[c_i] (= p_i, the inclusion probability, for samplers without
  repeats), so E[Σ_{i∈S} ω_i·(·)_i] = Σ_i w̃_i(·)_i (§4.2: "use w_i/p_i").
* ``normalization="sum_one"``: q_i^S = Σ_{j∈S} w̃_j, the practice of Algorithm 2 line 15 (we drop
  its constant n/b, which only rescales η_g). Biased under partial participation with unequal
  weights: for sizes (1, 2, 3) and 2-of-3 uniform sampling E[ω_i 1{i∈S}] = (7/36, 16/45, 9/20).

and w̃ from ``weighting``:

* ``"data"``: w̃_i = w_i (FedAvg, FedShuffle).
* ``"uniform"``: w̃_i = 1/n, whatever the objective weights — Yang, Fang & Liu (ICLR 2021) minimize
  f = (1/m) Σ_i F_i (their eq. (1)) and aggregate (1/|S|) Σ_{i∈S} Δ_i with p_i = 1/m (Algorithm 1,
  both sampling strategies): with ``normalization="unbiased"`` and uniform sampling, ω_i = 1/|S|.
* ``"normalized"``: w̃_i = w_i·τ_eff/π_i with π_i = η_i‖a_i‖₁/η_l the client's progress in units of
  the base step. With c_i = 1 this is FedNova, x⁺ = x − τ_eff Σ w_i (x − y_i)/‖a_i‖₁ (Wang et al.
  2020, eq. (5)); with FedShuffle's step sizes it is the hybrid of FedShuffle Appendix F.1, which
  undoes unfinished local work.
* explicit per-client values (FedShuffleGen's free parameter w̃).

and, with ``direction="mean_gradient"``, each update is first turned into the mean gradient along
the client's path, g_i = Δ_i/(η_iτ_i) (Nastya, Malinovsky, Mishchenko & Richtárik 2022, Algorithm 1; RR-CLI, Malinovsky
et al. 2023, Algorithm 1 line 12:
g = (x − x^N)/(γN)), so that the server step size η is on the scale of a gradient step. With
η = γN and equal τ_i this gives back the model average.

τ_eff convention (``tau_eff``): ``"planned"`` — τ_eff = Σ_{i∈[n]} w_i·E[π_i], Wang et al.'s
Σ_i p_i‖a_i‖₁ over all clients with planned (expected) local work; a constant, so it rescales the
server step without touching the fixed point. ``"cohort"`` — the same sum estimated on the cohort
with the normalization's weights, as the FedShuffle reference code does. Under ``sum_one`` the
constant cancels either way. With a prox term (``local.prox_mu``, FedNova over FedProx's solver) ‖a_i‖₁ carries the
prox term's shrinkage, so τ_eff = Σ w_i‖a_i‖₁, where Wang et al.'s code uses the raw step counts Σ p_iτ_i: a constant
factor on the server step, the same fixed point.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fedshuffle.core.errors import ConfigError
from fedshuffle.local.plan import ClientPlan, CohortPlan

WEIGHTINGS = ("data", "uniform", "normalized")
NORMALIZATIONS = ("unbiased", "sum_one")
TAU_EFF = ("planned", "cohort")
DIRECTIONS = ("model_delta", "mean_gradient")


@dataclass(frozen=True)
class Aggregator:
    """ω_i = w̃_i / q_i^S; see the module docstring for the options."""

    weighting: str | tuple[float, ...] = "data"
    normalization: str = "unbiased"
    tau_eff: str = "planned"
    direction: str = "model_delta"

    def __post_init__(self) -> None:
        if isinstance(self.weighting, str) and self.weighting not in WEIGHTINGS:
            raise ConfigError(
                "weighting",
                f"unknown {self.weighting!r}; accepted: {', '.join(WEIGHTINGS)} or a list of per-client values",
            )
        if not isinstance(self.weighting, str) and any(not (v >= 0 and math.isfinite(v)) for v in self.weighting):
            raise ConfigError("weighting", "per-client aggregation weights must be finite and >= 0")
        if not isinstance(self.weighting, str) and not any(v > 0 for v in self.weighting):
            raise ConfigError(
                "weighting", "per-client aggregation weights must not all be 0 (no client would move the model)"
            )
        if self.normalization not in NORMALIZATIONS:
            raise ConfigError("normalization", f"unknown {self.normalization!r}; accepted: {', '.join(NORMALIZATIONS)}")
        if self.tau_eff not in TAU_EFF:
            raise ConfigError("tau_eff", f"unknown {self.tau_eff!r}; accepted: {', '.join(TAU_EFF)}")
        if self.tau_eff != "planned" and not (self.weighting == "normalized" and self.normalization == "unbiased"):
            raise ConfigError(
                "tau_eff",
                f"{self.tau_eff!r} chooses FedNova's τ_eff, which only weighting = 'normalized' with normalization = "
                f"'unbiased' uses (here weighting = {self.weighting!r}, normalization = {self.normalization!r}): "
                "leave tau_eff out",
            )
        if self.direction not in DIRECTIONS:
            raise ConfigError("direction", f"unknown {self.direction!r}; accepted: {', '.join(DIRECTIONS)}")

    @property
    def needs_planned_tau_eff(self) -> bool:
        return self.weighting == "normalized" and self.tau_eff == "planned" and self.normalization == "unbiased"

    def fixed_weights(self, clients: np.ndarray, objective_weights: np.ndarray) -> np.ndarray:
        """w̃_i of ``clients`` for the weightings fixed before the round: ``"data"`` (w_i), ``"uniform"`` (1/n) or the
        given values (FedNova's ``"normalized"`` depends on the round's local work: :meth:`weights`)."""
        if not isinstance(self.weighting, str):
            if len(self.weighting) != len(objective_weights):
                raise ConfigError(
                    "weighting", f"expected {len(objective_weights)} values (one per client), got {len(self.weighting)}"
                )
            return np.asarray(self.weighting, dtype=np.float64)[clients]
        if self.weighting == "data":
            return np.asarray(objective_weights, dtype=np.float64)[clients]
        if self.weighting == "uniform":
            return np.full(len(clients), 1.0 / len(objective_weights))
        raise ValueError(f"weighting {self.weighting!r} is not fixed before the round")

    def weights(
        self,
        plans: Sequence[ClientPlan],
        objective_weights: np.ndarray,
        expected_counts: np.ndarray,
        base_lr: float,
        planned_tau_eff: float | None = None,
    ) -> np.ndarray:
        """ω for each member of the cohort, in the order of ``plans``."""
        if not len(plans):
            return np.zeros(0)
        columns = CohortPlan.of(plans)
        clients = columns.clients
        w = objective_weights[clients]
        if self.weighting != "normalized":
            base = self.fixed_weights(clients, objective_weights)
        else:
            progress = columns.a_l1 * columns.lrs / base_lr
            if self.normalization == "sum_one":
                tau = 1.0  # cancels
            elif self.tau_eff == "planned":
                if planned_tau_eff is None:
                    raise ValueError("planned τ_eff is required for normalized weighting with tau_eff='planned'")
                tau = planned_tau_eff
            else:
                tau = float(np.sum(w / expected_counts[clients] * progress))
            base = w * tau / progress
        if self.normalization == "unbiased":
            omega = base / expected_counts[clients]
        else:
            total = base.sum()
            omega = base / total if total > 0 else base
        if self.direction == "mean_gradient":
            omega = omega / (columns.lrs * columns.steps)
        return omega
