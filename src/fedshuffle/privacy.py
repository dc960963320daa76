"""Differential privacy of the clients' updates: clipping, Gaussian noise, adaptive clipping and ε(δ) per round.

The ``[privacy]`` section (:class:`PrivacySettings`) chooses one of two trust models, as Flower names them:

**Local DP** (``mode = "local"``): every member clips its update and adds noise before it leaves the
client; the server aggregates what it receives as it would the plain updates::

    Δ̃_i = clip_C(Δ_i) + σC·ξ_i,      clip_C(v) = v·min(1, C/‖v‖₂),   ξ_i ~ N(0, I)

**Central DP** (``mode = "central"``; DP-FedAvg, McMahan, Ramage, Talwar & Zhang, ICLR 2018, Algorithm 1 with
the fixed-denominator estimator f̃_f): members clip, the server noises the weighted sum it aggregates::

    d = Σ_{i∈S} ω_i·clip_C(Δ_i) + σ_Δ·S·ξ,      S = C·max_{i∈[n]} ω_i,   ξ ~ N(0, I)

S is the L2 sensitivity of the weighted sum to adding or removing one client. It needs weights that are fixed
per client before the round (``aggregation.normalization = "unbiased"``: ω_i = w̃_i/E[c_i] with w̃ the
objective weights, uniform ones or a given list): a cohort-normalized ω (``sum_one``) or one that depends on the
round's local work (FedNova's ``normalized`` weighting, ``mean_gradient``) has no such bound and is refused.
The max is over all n clients, not the cohort, so the noise does not depend on who takes part. With
non-uniform ω the clients with smaller ω_i get more protection than the ε reported (that of the largest).

**Adaptive clipping** (central only; Andrew, Thakkar, McMahan & Ramaswamy, NeurIPS 2021, Algorithm 1 with
the geometric update): each member also reports b_i = 1[‖Δ_i‖₂ ≤ C] for the round's C; the server releases
the noised count and moves C towards the γ-quantile of the update norms::

    b̃ = (Σ_{i∈S} b_i + σ_b·ζ)/m,     C ← C·exp(−η_C·(b̃ − γ)),     ζ ~ N(0, 1)

with m = Σ_i E[c_i] the expected cohort size and σ_b = m/20 unless given. The two releases together are one
Gaussian mechanism of noise multiplier σ (their Theorem 1) when the update noise is
σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2); this needs 2σ_b > σ. With fixed clipping σ_Δ = σ.

**Accountant.** ε(δ) after each round comes from Opacus's RDP accountant (Mironov, Talwar & Zhang 2019's
subsampled Gaussian mechanism): central DP is ``rounds`` steps of noise multiplier σ at sample rate
q = max_i Pr[i ∈ S]. Opacus assumes Poisson subsampling (each client independently) under add/remove
adjacency: for samplers that draw a fixed-size cohort without replacement this is the customary
approximation, not a proof; cyclic cohorts are not random draws and are accounted with q = 1 (no
amplification); samplers that can repeat a client are refused. Local DP is, for each client, one Gaussian
mechanism per round it takes part in, on any two inputs of that client (sensitivity 2C, noise multiplier
σ/2, q = 1: the server sees who took part, so no amplification by sampling); the ε reported is that of the
client that took part most often.

The client half is :class:`fedshuffle.methods.private.PrivateClients` (around the method, on every executor and
Flower node); the server half is :class:`PrivateAggregation` (in :class:`fedshuffle.simulation.Server`).

The noise comes from the run's seeded streams (:mod:`fedshuffle.core.streams`), keyed by (seed, round,
client, occurrence) on the client and (seed, round) on the server, so a Flower node and the in-process
simulation draw the same noise and a resumed run continues bit-exactly. Anyone who knows the seed can
subtract such noise: ``noise = "system"`` draws it from the operating system's entropy instead, as a
deployment must (the run is then not reproducible).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedshuffle.aggregation import Aggregator
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.streams import Stream, generator
from fedshuffle.samplers import Sampler

if TYPE_CHECKING:
    from fedshuffle.methods.base import RoundInfo

State = dict[str, torch.Tensor]

MODES = ("none", "local", "central")
CLIPPINGS = ("fixed", "adaptive")
NOISE_SOURCES = ("seeded", "system")
#: the broadcast entry holding the round's clip C (adaptive clipping)
CLIP = "clip"
#: the client result's extra holding the fraction of members with ‖Δ_i‖ ≤ C (adaptive clipping; never a metric)
UNCLIPPED = "unclipped"
#: the round's extra (and metric) holding adaptive clipping's C for the next round
ADAPTIVE_CLIP = "dp_clip"
_ADAPTIVE_ONLY = ("target_quantile", "clip_lr", "count_noise")
#: the noise multipliers σ > 0 the accountant evaluates: below, its arithmetic divides by 0 (σ² underflows);
#: above, ε stays at the floor its orders allow (≈ 0.1 at δ = 1e-5) and the evaluation slows
SIGMA_RANGE = (1e-100, 1e3)


class PrivacySettings(BaseModel):
    """The ``[privacy]`` section: see the module docstring for the math."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    mode: Literal[MODES] = Field(
        "none",
        description="none; local: each client noises its own clipped update; central: the server noises the clipped "
        "sum (DP-FedAvg)",
    )
    clip: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=True,
        description="C: the L2 bound on each client's update Δ_i (the initial C with adaptive clipping); inf = no "
        "clipping (only with noise_multiplier = 0)",
    )
    noise_multiplier: float = Field(
        0.0, ge=0, description="σ: the noise's standard deviation in units of the sensitivity"
    )
    delta: float = Field(
        1e-5, gt=0, lt=1, description="δ of the (ε, δ) guarantee reported per round (ε in metrics.csv)"
    )
    clipping: Literal[CLIPPINGS] = Field(
        "fixed",
        description="central: a fixed C, or adaptive (Andrew et al., NeurIPS 2021): C tracks the target quantile of "
        "the update norms",
    )
    target_quantile: float = Field(0.5, ge=0, le=1, description="adaptive: γ, the fraction of updates left unclipped")
    clip_lr: float = Field(0.2, gt=0, description="adaptive: η_C of C ← C·exp(−η_C(b̃ − γ))")
    count_noise: float | None = Field(
        None,
        gt=0,
        description="adaptive: σ_b, the noise on the count of unclipped updates (default: expected cohort / 20)",
    )
    noise: Literal[NOISE_SOURCES] = Field(
        "seeded",
        description="seeded: from the run's streams (reproducible, resumable; known to whoever knows the seed); "
        "system: the OS's entropy",
    )

    @model_validator(mode="after")
    def _consistent(self) -> PrivacySettings:
        if self.mode == "none":
            return self
        if self.clip is None:
            raise ConfigError(
                "clip",
                f"privacy.mode = {self.mode!r} needs the clip C (the L2 bound on each client's update), e.g. clip = "
                "1.0",
            )
        if self.noise_multiplier > 0 and math.isinf(self.clip):
            raise ConfigError("clip", "noise_multiplier > 0 needs a finite clip (the noise is σ·C)")
        low, high = SIGMA_RANGE
        if self.noise_multiplier > 0 and not low <= self.noise_multiplier <= high:
            why = (
                f"σ = {self.noise_multiplier:g} is outside what the privacy accountant evaluates; accepted: 0 "
                f"(no noise, ε = inf) or {low:g}..{high:g}"
            )
            raise ConfigError("noise_multiplier", why)
        if self.clipping == "adaptive" and self.mode != "central":
            raise ConfigError(
                "clipping",
                "adaptive clipping is central DP's (the server estimates the quantile); use privacy.mode = 'central' "
                "or clipping = 'fixed'",
            )
        if self.clipping == "adaptive" and math.isinf(self.clip):
            raise ConfigError("clip", "adaptive clipping needs a finite initial clip")
        given = [name for name in _ADAPTIVE_ONLY if getattr(self, name) != type(self).model_fields[name].default]
        if given and self.clipping != "adaptive":
            raise ConfigError(
                given[0], "a setting of adaptive clipping; set privacy.clipping = 'adaptive' or remove it"
            )
        return self

    @property
    def active(self) -> bool:
        return self.mode != "none"

    @property
    def adaptive(self) -> bool:
        return self.mode == "central" and self.clipping == "adaptive"


def clip_updates(deltas: torch.Tensor, clip: float) -> tuple[torch.Tensor, torch.Tensor]:
    """clip_C(Δ_i) = Δ_i·min(1, C/‖Δ_i‖₂) for each row, and b_i = 1[‖Δ_i‖₂ ≤ C]."""
    norms = torch.linalg.vector_norm(deltas, dim=1)
    factor = torch.clamp(clip / norms, max=1.0)  # C/0 = inf and inf/‖Δ‖ = inf: factor 1
    return deltas * factor.unsqueeze(1), norms <= clip


def gaussian(source: str, size: int, seed: int, stream: Stream, *keys: int) -> np.ndarray:
    """``size`` standard normal draws: from the run's stream at ``keys``, or (``source = "system"``) from fresh OS
    entropy."""
    rng = generator(seed, stream, *keys) if source == "seeded" else np.random.default_rng()
    return rng.standard_normal(size)


class Accountant:
    """ε(δ) after ``steps`` compositions of the Gaussian mechanism of noise multiplier ``noise_multiplier``, subsampled
    at ``sample_rate``: Opacus's RDP accountant (its orders and conversion), the per-step RDP computed once.

    Opacus is imported at the first ε asked for (a Flower node, which never asks, does without it); that it is
    installed is checked here, so a run without it stops before its first round."""

    def __init__(self, noise_multiplier: float, sample_rate: float, delta: float) -> None:
        if importlib.util.find_spec("opacus") is None:
            raise ConfigError("privacy.mode", "the privacy accountant needs Opacus: pip install 'fedshuffle[privacy]'")
        self.noise_multiplier, self.sample_rate, self.delta = noise_multiplier, sample_rate, delta
        self._per_step: np.ndarray | None = None

    def epsilon(self, steps: int) -> float:
        """ε after ``steps`` steps (0 before the first; inf without noise). The conversion from RDP can give a bound
        below 0 where δ is large; ε = 0 then holds too, and is reported."""
        if steps == 0:
            return 0.0
        if self.noise_multiplier == 0:
            return math.inf
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis import rdp

        if self._per_step is None:
            self._per_step = rdp.compute_rdp(
                q=self.sample_rate, noise_multiplier=self.noise_multiplier, steps=1, orders=RDPAccountant.DEFAULT_ALPHAS
            )
        eps, _ = rdp.get_privacy_spent(
            orders=RDPAccountant.DEFAULT_ALPHAS, rdp=self._per_step * steps, delta=self.delta
        )
        return max(float(eps), 0.0)


class PrivateAggregation:
    """The server half of DP: the broadcast clip, the noise on the aggregate (central), the adaptive clip's update and
    the accountant. Its state (C, each client's releases) is part of the server's checkpoint."""

    def __init__(
        self,
        privacy: PrivacySettings,
        aggregator: Aggregator,
        sampler: Sampler,
        objective_weights: np.ndarray,
        seed: int,
    ) -> None:
        self.privacy, self.seed = privacy, seed
        counts, inclusion = sampler.expected_counts(), sampler.inclusion_probabilities()
        self.num_clients = len(counts)
        self.expected_cohort = float(counts.sum())
        cyclic = getattr(sampler, "rounds_per_meta_epoch", None) is not None
        if privacy.mode == "central" and not np.allclose(counts, inclusion):
            raise ConfigError(
                "sampler.name",
                "privacy.mode = 'central' needs a sampler that takes a client at most once per round "
                f"({sampler.describe()} may repeat one)",
            )
        self.sample_rate = 1.0 if cyclic else float(min(1.0, inclusion.max()))
        fixed = (
            aggregator.fixed_weights(np.arange(len(counts)), objective_weights) if privacy.mode == "central" else None
        )
        self.max_weight = float(np.max(fixed / np.where(counts > 0, counts, np.inf))) if fixed is not None else None
        sigma = privacy.noise_multiplier
        self.count_noise = privacy.count_noise if privacy.count_noise is not None else self.expected_cohort / 20
        self.update_noise = sigma
        if privacy.adaptive and sigma > 0:
            if 2 * self.count_noise <= sigma:
                raise ConfigError(
                    "privacy.count_noise",
                    f"adaptive clipping with noise_multiplier σ = {sigma:g} needs 2σ_b > σ (Andrew et al., Theorem 1); "
                    f"σ_b = {self.count_noise:g}{' (expected cohort / 20)' if privacy.count_noise is None else ''}: "
                    f"give count_noise > {sigma / 2:g}",
                )
            self.update_noise = (sigma**-2 - (2 * self.count_noise) ** -2) ** -0.5
        if privacy.delta >= 1 / self.num_clients:
            why = (
                f"δ = {privacy.delta:g} is not below 1/n = 1/{self.num_clients} (n clients): a guarantee that may "
                f"fail for one client in n protects none; accepted: 0 < δ < {1 / self.num_clients:.3g}"
            )
            raise ConfigError("privacy.delta", why)
        if (
            privacy.mode == "local"
        ):  # any two inputs of one client: sensitivity 2C; every release seen, no amplification
            self.accountant = Accountant(sigma / 2, 1.0, privacy.delta)
        else:
            self.accountant = Accountant(sigma, self.sample_rate, privacy.delta)

    def init(self) -> State:
        return {
            "clip": torch.tensor(float(self.privacy.clip), dtype=torch.float64),
            "releases": torch.zeros(self.num_clients, dtype=torch.int64),
        }

    def broadcast(self, state: State, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """What members need besides the method's broadcast: the round's C, with adaptive clipping."""
        return (
            {CLIP: state["clip"].to(device=like.device, dtype=like.dtype).reshape(1)} if self.privacy.adaptive else {}
        )

    def release(
        self, rnd: RoundInfo, direction: torch.Tensor, extras: MutableMapping[str, float], state: State
    ) -> tuple[torch.Tensor, State, float]:
        """The aggregate as released (central: plus σ_Δ·C·max ω·ξ), the new state (adaptive C, releases) and ε after
        this round.
        Takes (pops) the members' unclipped fraction out of ``extras``: it is private, never a metric; puts the next
        round's adaptive C there instead (the ``dp_clip`` metric)."""
        p, clip = self.privacy, float(state["clip"])
        releases = state["releases"] + torch.from_numpy(np.bincount(rnd.cohort, minlength=self.num_clients))
        state = {**state, "releases": releases}
        unclipped = extras.pop(UNCLIPPED, 0.0) * len(rnd.cohort)
        if p.mode == "central" and p.noise_multiplier > 0:
            xi = gaussian(p.noise, direction.numel(), self.seed, Stream.SERVER_PRIVACY, rnd.index, 0)
            direction = direction + (self.update_noise * clip * self.max_weight) * torch.from_numpy(xi).to(
                direction.device, direction.dtype
            ).reshape(direction.shape)
        if p.adaptive:
            count = round(unclipped) + (
                self.count_noise * gaussian(p.noise, 1, self.seed, Stream.SERVER_PRIVACY, rnd.index, 1)[0]
                if p.noise_multiplier > 0
                else 0.0
            )
            state["clip"] = state["clip"] * math.exp(-p.clip_lr * (count / self.expected_cohort - p.target_quantile))
            extras[ADAPTIVE_CLIP] = float(state["clip"])  # released: a function of the noised count
        steps = int(releases.max()) if p.mode == "local" else rnd.index + 1
        return direction, state, self.accountant.epsilon(steps)

    def describe(self) -> dict[str, Any]:
        """What ``config.json`` records of the accounting."""
        out = {
            "mode": self.privacy.mode,
            "delta": self.privacy.delta,
            "accountant": "opacus.accountants.RDPAccountant (RDP of the subsampled Gaussian mechanism)",
            "accounted_noise_multiplier": self.accountant.noise_multiplier,
            "accounted_sample_rate": self.accountant.sample_rate,
        }
        if self.privacy.mode == "local":
            return {
                **out,
                "steps": "the rounds the most frequent member took part in",
                "sensitivity": "2C (any two inputs of one client)",
            }
        return {
            **out,
            "steps": "rounds",
            "sensitivity": "C·max_i ω_i",
            "max_weight": self.max_weight,
            "update_noise_multiplier": self.update_noise,
            **(
                {"count_noise": self.count_noise, "expected_cohort": self.expected_cohort}
                if self.privacy.adaptive
                else {}
            ),
        }
