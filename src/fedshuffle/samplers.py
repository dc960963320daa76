"""Client samplers: which clients take part in a round, and with which probabilities.

Every sampler knows its inclusion probabilities p_i = Pr[i ∈ S] (FedShuffle paper §3, "proper
sampling") and the expected number of times E[c_i] client i appears in a cohort (equal to p_i
except for sampling with replacement); unbiased aggregation divides by the latter. Small samplers
also give the exact distribution of one round's cohort, which :mod:`fedshuffle.analysis` enumerates.

``sample(round, seed)`` is a pure function of its arguments: no hidden state, so runs resume and
executors agree.
"""

from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Annotated, Literal

import numpy as np
from pydantic import Field, PositiveFloat

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.inputs import Summable
from fedshuffle.core.registry import Example, Registry
from fedshuffle.core.streams import Stream, generator

#: bytes a round keeps per cohort member besides its model update (ids, plan, counts), for the memory check
DRAW_BYTES = 256
#: Largest number of cohorts :meth:`Sampler.distribution` enumerates before refusing.
MAX_ENUMERATION = 200_000


class Sampler(ABC):
    """A distribution over cohorts S ⊆ [n] (a multiset for sampling with replacement)."""

    def __init__(self, num_clients: int) -> None:
        if num_clients < 1:
            raise ConfigError("data", "a federated dataset needs at least one client")
        self.num_clients = num_clients

    @abstractmethod
    def inclusion_probabilities(self) -> np.ndarray:
        """p_i = Pr[i ∈ S]."""

    def expected_counts(self) -> np.ndarray:
        """E[number of occurrences of i in S]; the divisor of unbiased (w_i/p_i) aggregation."""
        return self.inclusion_probabilities()

    @abstractmethod
    def sample(self, round_index: int, seed: int) -> np.ndarray:
        """The cohort of round ``round_index`` as an int64 array of client ids."""

    @abstractmethod
    def _outcomes(self) -> Iterator[tuple[float, tuple[int, ...]]]:
        """All (probability, cohort) pairs of one round."""

    def num_outcomes(self) -> int:
        """Number of outcomes :meth:`distribution` would enumerate."""
        return 1

    def distribution(self) -> list[tuple[float, tuple[int, ...]]]:
        """Exact distribution of one round's cohort; raises if it has more than MAX_ENUMERATION outcomes."""
        if self.num_outcomes() > MAX_ENUMERATION:
            raise ValueError(f"{type(self).__name__} has {self.num_outcomes():.3g} outcomes; use Monte Carlo")
        return list(self._outcomes())

    def describe(self) -> str:
        return type(self).__name__


class FullParticipation(Sampler):
    """S = [n] every round."""

    def inclusion_probabilities(self):
        return np.ones(self.num_clients)

    def sample(self, round_index, seed):
        return np.arange(self.num_clients, dtype=np.int64)

    def _outcomes(self):
        yield 1.0, tuple(range(self.num_clients))

    def describe(self):
        return "full participation"


def _check_cohort(cohort: int, num_clients: int, field: str = "cohort") -> None:
    if not 1 <= cohort <= num_clients:
        raise ConfigError(
            field, f"cohort size must be between 1 and the number of clients ({num_clients}), got {cohort}"
        )


class UniformWithoutReplacement(Sampler):
    """b of n clients uniformly without replacement (McMahan et al. 2017; FedShuffle Algorithm 2); p_i = b/n."""

    def __init__(self, num_clients: int, cohort: int) -> None:
        super().__init__(num_clients)
        _check_cohort(cohort, num_clients)
        self.cohort = cohort

    def inclusion_probabilities(self):
        return np.full(self.num_clients, self.cohort / self.num_clients)

    def sample(self, round_index, seed):
        rng = generator(seed, Stream.COHORT, round_index)
        return np.sort(rng.choice(self.num_clients, size=self.cohort, replace=False)).astype(np.int64)

    def num_outcomes(self):
        return math.comb(self.num_clients, self.cohort)

    def _outcomes(self):
        prob = 1.0 / math.comb(self.num_clients, self.cohort)
        for subset in itertools.combinations(range(self.num_clients), self.cohort):
            yield prob, subset

    def describe(self):
        return f"uniform {self.cohort} of {self.num_clients} without replacement"


class WithReplacement(Sampler):
    """b independent draws of a client with probabilities π (uniform or given); repeats allowed.

    This is sampling strategy 1 of Yang et al. (2021, §3.2). E[c_i] = b·π_i and p_i = 1 − (1 − π_i)^b.
    """

    def __init__(self, num_clients: int, cohort: int, probabilities: Sequence[float] | None = None) -> None:
        super().__init__(num_clients)
        if cohort < 1:
            raise ConfigError("cohort", f"must be >= 1, got {cohort}")
        limits.check_fits(limits.array_bytes(cohort, itemsize=DRAW_BYTES), "cohort", f"a cohort of {cohort:g} draws")
        self.cohort = cohort
        pi = (
            np.full(num_clients, 1.0 / num_clients)
            if probabilities is None
            else np.asarray(probabilities, dtype=np.float64)
        )
        if pi.shape != (num_clients,) or np.any(pi < 0) or pi.sum() <= 0:
            raise ConfigError("probabilities", "need one non-negative probability per client, not all zero")
        self.pi = pi / pi.sum()

    def inclusion_probabilities(self):
        return 1.0 - (1.0 - self.pi) ** self.cohort

    def expected_counts(self):
        return self.cohort * self.pi

    def sample(self, round_index, seed):
        rng = generator(seed, Stream.COHORT, round_index)
        return rng.choice(self.num_clients, size=self.cohort, replace=True, p=self.pi).astype(np.int64)

    def num_outcomes(self):
        return self.num_clients**self.cohort

    def _outcomes(self):
        for draws in itertools.product(range(self.num_clients), repeat=self.cohort):
            yield float(np.prod(self.pi[list(draws)])), draws

    def describe(self):
        return f"{self.cohort} draws with replacement"


def water_filling(values: Sequence[float], budget: float) -> np.ndarray:
    """Exact q_i = min(1, c·v_i) with Σ_i q_i = budget (Horváth & Richtárik 2019, §2.3).

    Sort v decreasingly, cap the k largest at 1 and set c = (budget − k)/Σ_{rest} v_j, using the
    smallest k for which c·v_(k+1) ≤ 1. This is the independent sampling minimizing Σ p_i²/q_i.
    """
    v = np.asarray(values, dtype=np.float64)
    positive = int(np.count_nonzero(v > 0))
    if np.any(v < 0) or positive == 0:
        raise ConfigError("sampler", "importance values must be non-negative and not all zero")
    if not 0 < budget <= positive:
        raise ConfigError(
            "cohort", f"expected cohort must be in (0, {positive}] (clients with positive weight), got {budget}"
        )
    order = np.argsort(-v, kind="stable")
    sorted_v = v[order]
    tail = np.cumsum(sorted_v[::-1])[::-1]  # tail[k] = Σ_{j ≥ k} v_(j)
    q = np.ones_like(v)
    for k in range(positive):
        c = (budget - k) / tail[k]
        if c * sorted_v[k] <= 1.0 + 1e-15:
            q[order[k:]] = np.minimum(1.0, c * sorted_v[k:])
            return q
    return q  # budget == positive: every client with v > 0 is always included


class Independent(Sampler):
    """Each client joins independently with probability q_i (a random cohort size, possibly zero)."""

    def __init__(self, num_clients: int, probabilities: Sequence[float], label: str = "independent") -> None:
        super().__init__(num_clients)
        q = np.asarray(probabilities, dtype=np.float64)
        if q.shape != (num_clients,) or np.any(q <= 0) or np.any(q > 1):
            raise ConfigError("probabilities", "need one probability in (0, 1] per client")
        self.q = q
        self.label = label

    @classmethod
    def importance(cls, weights: Sequence[float], cohort: float) -> Independent:
        """Importance sampling q_i = min(1, c·w_i) with Σ q_i = cohort (FedShuffle §4.2 and §5)."""
        w = np.asarray(weights, dtype=np.float64)
        return cls(len(w), water_filling(w, cohort), label=f"importance (expected cohort {cohort:g})")

    def inclusion_probabilities(self):
        return self.q.copy()

    def sample(self, round_index, seed):
        rng = generator(seed, Stream.COHORT, round_index)
        return np.flatnonzero(rng.random(self.num_clients) < self.q).astype(np.int64)

    def num_outcomes(self):
        return 2**self.num_clients

    def _outcomes(self):
        for mask in itertools.product((False, True), repeat=self.num_clients):
            m = np.array(mask)
            yield float(np.prod(np.where(m, self.q, 1 - self.q))), tuple(np.flatnonzero(m).tolist())

    def describe(self):
        return self.label


class Cyclic(Sampler):
    """Meta-epochs: a client permutation split into R = n/b consecutive cohorts of b.

    ``order``: ``"reshuffle"`` draws a new permutation every meta-epoch (client random reshuffling),
    ``"shuffle_once"`` draws one permutation for the whole run, ``"fixed"`` keeps 0..n−1 (a
    deterministic availability order). Used by RR-CLI (Malinovsky et al., Algorithm 1) and FedCDR.
    Marginally each round's cohort is uniform over b-subsets (random orders), so p_i = b/n.
    """

    ORDERS = ("reshuffle", "shuffle_once", "fixed")

    def __init__(self, num_clients: int, cohort: int, order: str = "reshuffle") -> None:
        super().__init__(num_clients)
        _check_cohort(cohort, num_clients)
        if num_clients % cohort:
            raise ConfigError(
                "cohort",
                f"cyclic sampling needs the cohort size to divide the number of clients ({num_clients}), got {cohort}",
            )
        if order not in self.ORDERS:
            raise ConfigError("order", f"unknown order {order!r}; accepted: {', '.join(self.ORDERS)}")
        self.cohort, self.order = cohort, order
        self.rounds_per_meta_epoch = num_clients // cohort
        self._last: tuple[tuple[int, int], np.ndarray] | None = None

    def permutation(self, meta_epoch: int, seed: int) -> np.ndarray:
        """The client order of meta-epoch ``meta_epoch`` (kept while the meta-epoch lasts)."""
        if self.order == "fixed":
            return np.arange(self.num_clients, dtype=np.int64)
        key = (seed, meta_epoch if self.order == "reshuffle" else 0)
        if self._last is None or self._last[0] != key:
            self._last = (
                key,
                generator(seed, Stream.CLIENT_ORDER, key[1]).permutation(self.num_clients).astype(np.int64),
            )
        return self._last[1]

    def inclusion_probabilities(self):
        return np.full(self.num_clients, self.cohort / self.num_clients)

    def sample(self, round_index, seed):
        meta_epoch, position = divmod(round_index, self.rounds_per_meta_epoch)
        perm = self.permutation(meta_epoch, seed)
        return np.sort(perm[position * self.cohort : (position + 1) * self.cohort])

    def num_outcomes(self):
        return self.rounds_per_meta_epoch if self.order == "fixed" else math.comb(self.num_clients, self.cohort)

    def _outcomes(self):
        if self.order == "fixed":
            for k in range(self.rounds_per_meta_epoch):
                yield 1.0 / self.rounds_per_meta_epoch, tuple(range(k * self.cohort, (k + 1) * self.cohort))
        else:
            yield from UniformWithoutReplacement(self.num_clients, self.cohort)._outcomes()

    def describe(self):
        return f"cyclic cohorts of {self.cohort} ({self.order}), {self.rounds_per_meta_epoch} rounds per meta-epoch"


def _cohort(cohort: float | None, name: str, integer: bool = True) -> float:
    if cohort is None:
        raise ConfigError("cohort", f"sampler {name!r} needs a cohort size")
    if integer and cohort != int(cohort):
        raise ConfigError("cohort", f"sampler {name!r} needs an integer cohort, got {cohort}")
    return int(cohort) if integer else float(cohort)


def _probabilities(kind: str | Sequence[float], weights: np.ndarray) -> np.ndarray | None:
    return None if kind == "uniform" else (weights if kind == "weights" else np.asarray(kind, dtype=np.float64))


#: the cohort size b (an expected size for independent sampling)
Cohort = Annotated[
    PositiveFloat | None, Field(description="cohort size b (the expected size for independent samplers)")
]
#: uniform, ∝ the objective weights, or one probability per client
Probabilities = Annotated[
    Literal["uniform", "weights"] | list[float],
    Summable,
    Field(description="uniform, proportional to the weights w_i, or one value per client"),
]


def full(weights: np.ndarray) -> Sampler:
    return FullParticipation(len(weights))


def uniform(weights: np.ndarray, cohort: Cohort = None) -> Sampler:
    return UniformWithoutReplacement(len(weights), _cohort(cohort, "uniform"))


def with_replacement(weights: np.ndarray, cohort: Cohort = None, probabilities: Probabilities = "uniform") -> Sampler:
    return WithReplacement(len(weights), _cohort(cohort, "with_replacement"), _probabilities(probabilities, weights))


def importance(weights: np.ndarray, cohort: Cohort = None) -> Sampler:
    return Independent.importance(weights, _cohort(cohort, "importance", integer=False))


def independent(weights: np.ndarray, cohort: Cohort = None, probabilities: Probabilities = "uniform") -> Sampler:
    n = len(weights)
    if not isinstance(probabilities, str):
        return Independent(n, probabilities)
    b = _cohort(cohort, "independent", integer=False)
    return Independent(n, np.full(n, b / n)) if probabilities == "uniform" else Independent.importance(weights, b)


def cyclic(
    weights: np.ndarray,
    cohort: Cohort = None,
    order: Annotated[
        Literal[Cyclic.ORDERS],
        Field(description="cohorts reshuffled every meta-epoch, shuffled once, or in index order"),
    ] = "reshuffle",
) -> Sampler:
    return Cyclic(len(weights), _cohort(cohort, "cyclic"), order)


#: Samplers by name; a factory takes the objective weights w (one per client) and the sampler's settings.
SAMPLERS = Registry("sampler.name", runtime=("weights",), noun="sampler")
SAMPLERS.add("full", full, "every client every round", example=Example())
SAMPLERS.add(
    "uniform",
    uniform,
    "b of n uniformly without replacement",
    "Horváth et al., FedShuffle, TMLR 2022, §4.2",
    example=Example(),
)
SAMPLERS.add(
    "with_replacement",
    with_replacement,
    "b draws with replacement, uniform or with given probabilities",
    "Yang, Fang & Liu, ICLR 2021, strategy 1",
    example=Example(),
)
SAMPLERS.add(
    "importance",
    importance,
    "independent sampling with p_i ∝ w_i (water-filling), expected cohort b",
    "Horváth et al., FedShuffle, TMLR 2022, §4.2",
    example=Example(),
)
SAMPLERS.add(
    "independent", independent, "independent Bernoulli sampling, uniform, importance or given p_i", example=Example()
)
SAMPLERS.add(
    "cyclic",
    cyclic,
    "cyclic cohorts over meta-epochs (client reshuffling, shuffle-once or fixed order)",
    "Malinovsky, Horváth, Burlachenko & Richtárik 2023 (RR-CLI)",
    example=Example(),
)
