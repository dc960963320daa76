"""Which objective does a configuration really minimize?

To first order in the step sizes, a round moves the server model by
η_g Σ_{i∈S} ω_i η_i‖a_i‖₁ ∇f_i(x), so client i's weight in the objective actually minimized is

    ŵ_i ∝ E[ Σ_{occurrences of i in S} ω_i · η_i‖a_i‖₁ ],

FedShuffle paper eq. (31) (ŵ_i ∝ w̃_i|D_i|E_i/(q_ic_i), with 1/q_i = E[1{i∈S}/q_i^S]) extended to
minibatches, local momentum and unfinished work through FedNova's ‖a_i‖₁. The expected aggregation
weight Ω_i = E[Σ ω_i] is the factor that sampling and normalization contribute (§4.2).

Expectations are exact — by enumerating the sampler's cohorts — when the local work is a
deterministic function of the cohort, and Monte Carlo over the run's own random streams otherwise
(or when there are too many cohorts), with standard errors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedshuffle.methods.algorithm import Algorithm
from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.local.plan import ClientPlan
from fedshuffle.samplers import MAX_ENUMERATION, Sampler


@dataclass
class ObjectiveReport:
    """Result of :func:`inspect_objective`; every array has one entry per client."""

    sizes: np.ndarray
    weights: np.ndarray
    inclusion_probabilities: np.ndarray
    expected_counts: np.ndarray
    expected_aggregation_weights: np.ndarray
    effective_weights: np.ndarray
    step_sizes: np.ndarray
    local_steps: np.ndarray
    method: str
    aggregation_stderr: np.ndarray | None = None
    effective_stderr: np.ndarray | None = None
    samples: int | None = None

    @property
    def exact(self) -> bool:
        return self.samples is None

    @property
    def max_deviation(self) -> float:
        """max_i |ŵ_i − w_i|."""
        return float(np.max(np.abs(self.effective_weights - self.weights)))

    @property
    def biased(self) -> bool:
        """ŵ ≠ w beyond round-off (exact) or beyond 4 standard errors (Monte Carlo)."""
        tolerance = 1e-9 if self.exact else 4 * float(np.max(self.effective_stderr)) + 1e-12
        return self.max_deviation > tolerance

    def to_dict(self) -> dict:
        out = {
            "method": self.method,
            "mode": "exact" if self.exact else "monte_carlo",
            "sizes": self.sizes.tolist(),
            "weights": self.weights.tolist(),
            "inclusion_probabilities": self.inclusion_probabilities.tolist(),
            "expected_counts": self.expected_counts.tolist(),
            "expected_aggregation_weights": self.expected_aggregation_weights.tolist(),
            "effective_weights": self.effective_weights.tolist(),
            "step_sizes": self.step_sizes.tolist(),
            "local_steps": self.local_steps.tolist(),
            "max_deviation": self.max_deviation,
            "biased": self.biased,
        }
        if not self.exact:
            out.update(
                samples=self.samples,
                expected_aggregation_weights_stderr=self.aggregation_stderr.tolist(),
                effective_weights_stderr=self.effective_stderr.tolist(),
            )
        return out


def _deterministic_work(algorithm: Algorithm) -> bool:
    local = algorithm.local
    return local._epoch_range[0] == local._epoch_range[1] and local.straggler_probability == 0


#: seconds one planned local step costs in :func:`round_expectation` (measured on a 2-core CPU: 9 µs), and one cohort
#: member
SECONDS_PER_STEP, SECONDS_PER_CLIENT = 8e-6, 2e-5


def _check_duration(algorithm: Algorithm, sampler: Sampler, sizes: np.ndarray, rounds: int, exact: bool) -> None:
    """Refuse (naming ``sizes``, or ``rounds`` for Monte Carlo) an expectation that would plan more local steps than fit
    the time allowed:
    every outcome (a cohort enumerated, or a Monte Carlo round) plans each member's steps."""
    local = algorithm.local
    tau = (
        np.full(len(sizes), float(local.steps))
        if isinstance(local.steps, int)
        else local._epoch_range[1] * local.epoch_steps(sizes).astype(np.float64)
    )
    counts = sampler.expected_counts()
    outcomes = (float(sampler.num_outcomes()) if exact else float(rounds)) + 1  # + the first round's plan of the report
    estimate = outcomes * (SECONDS_PER_STEP * float(np.dot(counts, tau)) + SECONDS_PER_CLIENT * float(np.sum(counts)))
    how = "enumerating the sampler's cohorts" if exact else f"{rounds} Monte Carlo rounds"
    limits.check_seconds(
        estimate, "sizes" if exact else "rounds", f"{how} of about {np.dot(counts, tau):.3g} planned local steps each"
    )


def _outcomes(
    algorithm: Algorithm, sampler: Sampler, client_indices: list[np.ndarray], rounds: int, seed: int, exact: bool
) -> Iterator[tuple[float, list[ClientPlan]]]:
    if exact:
        for prob, cohort in sampler.distribution():
            yield prob, algorithm.local.plan(client_indices, np.array(cohort, dtype=np.int64), 0, seed)
    else:
        for r in range(rounds):
            yield 1.0 / rounds, algorithm.local.plan(client_indices, sampler.sample(r, seed), r, seed)


def round_expectation(
    algorithm: Algorithm,
    sampler: Sampler,
    sizes: np.ndarray,
    weights: np.ndarray,
    per_client,
    *,
    exact: bool | None = None,
    rounds: int = 20_000,
    seed: int = 0,
):
    """E over one round of Σ_{i∈S} ω_i·per_client(plan_i), accumulated per client.

    Returns ``(mean, stderr, samples)`` arrays of shape (n, k) for ``per_client`` returning k numbers;
    ``stderr`` and ``samples`` are ``None`` when the expectation is exact.
    """
    sizes = np.asarray(sizes)
    client_indices = [np.arange(s) for s in sizes]  # only the counts matter for ω, η_i and ‖a_i‖₁
    if exact is None:
        exact = _deterministic_work(algorithm) and sampler.num_outcomes() <= MAX_ENUMERATION
    _check_duration(algorithm, sampler, sizes, rounds, exact)
    counts = sampler.expected_counts()
    tau_eff = algorithm.planned_tau_eff(weights, sizes)
    n = len(sizes)
    total, total_sq = None, None
    for prob, plans in _outcomes(algorithm, sampler, client_indices, rounds, seed, exact):
        omega = algorithm.aggregator.weights(plans, weights, counts, algorithm.local.lr, tau_eff)
        contribution = None
        for w_i, plan in zip(omega, plans):
            value = w_i * np.atleast_1d(np.asarray(per_client(plan), dtype=np.float64))
            if contribution is None:
                contribution = np.zeros((n, value.size))
            contribution[plan.client] += value
        if contribution is None:
            continue
        if total is None:
            total, total_sq = np.zeros_like(contribution), np.zeros_like(contribution)
        total += prob * contribution
        total_sq += prob * contribution**2
    if total is None:
        raise ValueError("the sampler never selects a client")
    if exact:
        return total, None, None
    stderr = np.sqrt(np.maximum(total_sq - total**2, 0.0) / rounds)
    return total, stderr, rounds


def _check_arguments(
    algorithm: Any, sampler: Any, sizes: Any, weights: Any, rounds: Any
) -> tuple[np.ndarray, np.ndarray]:
    """``sizes`` and ``weights`` as arrays; bad arguments are :class:`ConfigError` naming the argument."""
    if not isinstance(algorithm, Algorithm):
        raise ConfigError(
            "algorithm", f"expected an Algorithm (fedshuffle.build_algorithm(...)), got {type(algorithm).__name__}"
        )
    if not isinstance(sampler, Sampler):
        raise ConfigError(
            "sampler",
            f"expected a Sampler (e.g. fedshuffle.UniformWithoutReplacement(n, b)), got {type(sampler).__name__}",
        )
    try:
        size_array = np.asarray(sizes, dtype=np.float64)
    except (TypeError, ValueError):
        raise ConfigError("sizes", f"expected one positive integer per client (|D_i|), got {sizes!r}") from None
    if (
        size_array.ndim != 1
        or size_array.size == 0
        or np.any(size_array < 1)
        or np.any(size_array != np.round(size_array))
    ):
        raise ConfigError("sizes", f"expected one positive integer per client (|D_i|), got {sizes!r}")
    n = size_array.size
    if sampler.num_clients != n:
        raise ConfigError("sizes", f"{n} clients, but the sampler draws from {sampler.num_clients}")
    if weights is None:
        weight_array = size_array / size_array.sum()
    else:
        try:
            weight_array = np.asarray(weights, dtype=np.float64)
        except (TypeError, ValueError):
            weight_array = np.array([np.nan])
        if (
            weight_array.shape != (n,)
            or not np.all(np.isfinite(weight_array))
            or np.any(weight_array < 0)
            or not weight_array.sum() > 0
        ):
            raise ConfigError(
                "weights",
                f"expected the objective weights w_i: {n} numbers >= 0 with a positive sum (or None for w_i = "
                f"|D_i|/|D|), got {weights!r}",
            )
    if isinstance(rounds, bool) or not isinstance(rounds, (int, np.integer)) or rounds < 1:
        raise ConfigError("rounds", f"expected a positive number of Monte Carlo rounds, got {rounds!r}")
    return size_array.astype(np.int64), weight_array / weight_array.sum()


def inspect_objective(
    algorithm: Algorithm,
    sampler: Sampler,
    sizes: Sequence[int],
    weights: Sequence[float] | None = None,
    *,
    exact: bool | None = None,
    rounds: int = 20_000,
    seed: int = 0,
) -> ObjectiveReport:
    """Which objective does ``algorithm`` with ``sampler`` minimize on clients of ``sizes``?

    Parameters
    ----------
    algorithm
        The method and its parts (:func:`fedshuffle.methods.algorithm.build_algorithm`); stateless methods only.
    sampler
        The client sampler, over ``len(sizes)`` clients.
    sizes
        |D_i|, the number of samples of each client.
    weights
        w_i, the weights of the objective f = Σ_i w_i f_i that one wants minimized: any non-negative
        numbers with a positive sum, normalized to sum 1; ``None``: w_i = |D_i|/Σ_j |D_j|.
    exact
        Enumerate the sampler's cohorts (``True``) or sample ``rounds`` rounds (``False``); ``None``
        enumerates when the local work is deterministic and the cohorts are few.
    rounds
        Monte Carlo rounds.
    seed
        The seed of the Monte Carlo rounds' streams.

    Returns
    -------
    ObjectiveReport
        w, the inclusion probabilities p_i, the expected aggregation weights Ω_i = E[Σ ω_i], and the
        effective weights ŵ_i ∝ E[Σ ω_i η_i‖a_i‖₁] (eq. (31)), normalized to sum 1.

    Raises
    ------
    ConfigError
        Naming the argument (``algorithm``, ``sampler``, ``sizes``, ``weights``, ``rounds``) that is not
        what is described above, or ``method.name`` for a method with client state.
    """
    sizes, weights = _check_arguments(algorithm, sampler, sizes, weights, rounds)
    if algorithm.method.state_fields:
        raise ConfigError(
            "method.name",
            f"{algorithm.name} keeps client state, so its fixed point is not set by the aggregation weights this "
            "inspects "
            "(SCAFFOLD's and FedCDR's is x* itself); inspect covers the stateless methods",
        )
    base_lr = algorithm.local.lr
    with np.errstate(
        invalid="ignore", over="ignore", divide="ignore"
    ):  # a diverging step size is refused below, in words
        mean, stderr, samples = round_expectation(
            algorithm,
            sampler,
            sizes,
            weights,
            lambda p: (1.0, p.lr * p.a_l1 / base_lr),
            exact=exact,
            rounds=rounds,
            seed=seed,
        )
        effective = mean[:, 1] / mean[:, 1].sum()
    if not np.all(np.isfinite(mean)) or not np.all(np.isfinite(effective)):
        raise ConfigError(
            "local.lr",
            f"η_l = {base_lr:g}: the local steps diverge numerically (the weights η_i‖a_i‖₁ overflow to inf or NaN), "
            "so no objective is minimized; use a smaller step size",
        )
    first = algorithm.local.plan([np.arange(s) for s in sizes], np.arange(len(sizes)), 0, seed)
    report = ObjectiveReport(
        sizes=sizes,
        weights=weights,
        inclusion_probabilities=sampler.inclusion_probabilities(),
        expected_counts=sampler.expected_counts(),
        expected_aggregation_weights=mean[:, 0],
        effective_weights=effective,
        step_sizes=np.array([p.lr for p in first]),
        local_steps=np.array([p.planned_steps for p in first]),
        method=algorithm.name,
    )
    if stderr is not None:
        report.aggregation_stderr = stderr[:, 0]
        report.effective_stderr = stderr[:, 1] / mean[:, 1].sum()
        report.samples = samples
    return report


def unit_quadratic_fixed_point(
    algorithm: Algorithm, sampler: Sampler, sizes, weights, client_means: np.ndarray, *, exact: bool | None = None
) -> np.ndarray:
    """Stationary mean of the server iterate for f_ij(x) = ½‖x − e_ij‖² (unit Hessian), plain local SGD.

    One client round is affine in x in expectation: E[y_i] = (1−η_i)^{τ_i}x + s_i c_i with
    s_i = 1 − (1 − η_i)^{τ_i} and c_i the mean target of client i (any permutation or minibatch
    order). With server step η_g the mean iterate moves by η_g E[Σ ω_i s_i (c_i − x)], so

        x̂ = E[Σ_S ω_i s_i c_i] / E[Σ_S ω_i s_i]      (independent of η_g).

    For full participation and FedAvg (ω = w, η_i = η, τ_i = E|D_i|) this is
    x̂ = Σ w_i[1−(1−η)^{E|D_i|}]c_i / Σ w_i[1−(1−η)^{E|D_i|}], which tends to
    Σ|D_i|²c_i/Σ|D_i|² as η → 0 (FedShuffle §4.1). Valid without local momentum, prox, weight decay,
    clipping, or a term of the method's own in the local steps (global momentum's drift, SCAFFOLD's offset:
    ``Method.plain_local_steps``).
    """
    local = algorithm.local
    if (
        local.momentum
        or local.prox_mu
        or local.weight_decay
        or local.clip_norm is not None
        or not algorithm.method.plain_local_steps
    ):
        raise ValueError("the closed form holds for plain local SGD only")
    client_means = np.asarray(client_means, dtype=np.float64)

    def stats(plan: ClientPlan):
        s = 1.0 - (1.0 - plan.lr) ** plan.steps
        return np.concatenate([[s], s * client_means[plan.client]])

    mean, _, _ = round_expectation(algorithm, sampler, sizes, weights, stats, exact=exact)
    return mean[:, 1:].sum(axis=0) / mean[:, 0].sum()
