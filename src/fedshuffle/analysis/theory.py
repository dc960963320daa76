"""Theory made usable: smoothness constants and the papers' step sizes (the exact solution x* is
:mod:`fedshuffle.problems.solution`).

Smoothness of L2-regularized logistic regression, f_j(x) = log(1 + exp(−b_j a_jᵀx)) + (λ/2)‖x‖²:
∇²f_j(x) = σ_j(1−σ_j)a_ja_jᵀ + λI with σ_j(1−σ_j) ≤ 1/4, equality at x = 0. Hence the constants
below are exact (attained at x = 0), not just bounds:

* per sample   L_j = ‖a_j‖²/4 + λ,
* per client   L_m = λ_max(A_mᵀA_m/N_m)/4 + λ,
* global       L = λ_max(Σ_j s_j a_ja_jᵀ)/4 + λ   (s_j the objective's sample weights, Σ s_j = 1),
* strong convexity μ = λ (all of f, f_m, f_j).

For the quadratic f_j = ½‖x − e_j‖² all constants are 1.

**RR-CLI's κ ≈ 10⁴ for phishing** (Malinovsky, Horváth, Burlachenko & Richtárik 2023, §4.2, α = λ = 5e-4) is not
what these exact constants give on the LIBSVM file: LIBSVM one-hot encodes phishing's 30 attributes into 68 binary
features and scales every row to unit length (each stored value is 1/√30 = 0.18257), so ‖a_j‖² = 1 and
L_max = 1/4 + λ = 0.2505 (κ = L_max/μ = 501), L = 0.1631 (L/μ = 326). The paper's value is what the unscaled
0/1 one-hot rows (‖a_j‖² = 30, i.e. the file ×√30) give: L/μ = 30·0.16256/5e-4 + 1 ≈ 9.8·10³ and L_max/μ ≈ 1.5·10⁴,
both "≈ 10⁴"; on the unit-norm file one needs λ = 5e-4/30 for the same κ. The paper names the LIBSVM file and
α = 5e-4, so the presets keep both and report κ = 501; the κ the paper quotes belongs to data 30× larger in
‖a‖² (equivalently, a 30× smaller λ), and every theoretical step size changes with it.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedshuffle.data import FederatedDataset
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Entry, Registry, call_with
from fedshuffle.core.threads import operator_threads
from fedshuffle.problems import LogisticRegression, Problem, Quadratic


@dataclass(frozen=True)
class Smoothness:
    """Smoothness and strong-convexity constants of a problem on a federated dataset."""

    sample_max: float
    clients: np.ndarray
    global_: float
    mu: float

    @property
    def client_max(self) -> float:
        return float(self.clients.max())

    @property
    def kappa(self) -> float:
        """Condition number L_max/μ (the individual functions' constant, as RR-CLI's theorems use)."""
        return self.sample_max / self.mu if self.mu > 0 else math.inf

    def to_dict(self) -> dict[str, float]:
        return {
            "L_sample_max": self.sample_max,
            "L_client_max": self.client_max,
            "L_global": self.global_,
            "mu": self.mu,
            "kappa": self.kappa,
        }


def _largest_gram_eigenvalues(
    features: torch.Tensor, client_indices: Sequence[np.ndarray], chunk: int = 256
) -> torch.Tensor:
    """λ_max(A_iᵀA_i/n_i) of every client, the Gram matrices decomposed a chunk of clients per call."""
    tops = []
    for start in range(0, len(client_indices), chunk):
        grams = torch.stack(
            [
                features[ix].T @ features[ix] / len(ix)
                for ix in map(torch.as_tensor, client_indices[start : start + chunk])
            ]
        )
        tops.append(torch.linalg.eigvalsh(grams)[:, -1])
    return torch.cat(tops)


def smoothness(problem: Problem, data: FederatedDataset) -> Smoothness:
    """Exact constants for logistic regression and the quadratic; other problems have none.

    The eigendecompositions are small and run on one operator thread: fastest there, and not slowed by
    other processes (on two threads a busy machine made one call take up to seconds).
    """
    if isinstance(problem, Quadratic):
        return Smoothness(1.0, np.ones(data.num_clients), 1.0, 1.0)
    if not isinstance(problem, LogisticRegression):
        raise ConfigError(
            "problem.name",
            "theoretical step sizes need known smoothness constants (logistic or quadratic problems), not "
            f"{problem.name!r}",
        )
    a, lam = data.features.double(), problem.l2
    per_sample = float((a * a).sum(dim=1).max()) / 4 + lam
    s = data.sample_weights().double()
    with operator_threads(1):
        clients = np.array([float(top) / 4 + lam for top in _largest_gram_eigenvalues(a, data.client_indices)])
        global_ = float(torch.linalg.eigvalsh((a.T * s) @ a)[-1]) / 4 + lam * float(s.sum())
    return Smoothness(per_sample, clients, global_, lam)


# ----------------------------------------------------------------------------------------------
# Step sizes from the papers' theorems


@dataclass(frozen=True)
class Theorem(Entry):
    """A registered theorem: ``factory`` is its formula, whose parameters name what it reads (:data:`INPUTS`) and
    which returns the step sizes ``gives`` names, at their upper limits."""

    gives: tuple[str, ...] = ()

    @property
    def reads(self) -> tuple[str, ...]:
        """The constants and counts the formula reads (its parameters)."""
        return tuple(inspect.signature(self.factory).parameters)


#: what a theorem's formula may read, by parameter name: the smoothness constants (:class:`Smoothness`), N the
#: local steps of one pass (or K), R the rounds of a meta-epoch, and the step clients really take
INPUTS = ("L_sample_max", "L_client_max", "L_global", "mu", "kappa", "N", "R", "local_lr")


class TheoremRegistry(Registry):
    """Theorems by name (``server.theory_rule``): each a formula from :data:`INPUTS` to the step sizes it gives."""

    def add(
        self,
        name: str,
        factory: Callable[..., dict[str, float]],
        summary: str,
        citation: str = "",
        *,
        gives: Sequence[str] = (),
    ) -> Theorem:
        """Register theorem ``name``: ``factory`` its formula, ``gives`` the quantities it returns (the ``quantity``
        of the :class:`~fedshuffle.core.registry.StepSize` settings it sets)."""
        unknown = [k for k in inspect.signature(factory).parameters if k not in INPUTS]
        if unknown or not gives:
            raise ValueError(
                f"theorem {name!r}: {f'reads {unknown[0]!r}, not one of {INPUTS}' if unknown else 'gives no step size'}"
            )
        return self._store(Theorem(name, factory, summary, citation, {}, None, self.noun, tuple(gives)))


#: the theorems ``'theory'`` step sizes can come from; a method names those that cover it, its own first
#: (``theorems`` of :data:`fedshuffle.methods.METHODS`), and ``server.theory_rule`` picks one of them
THEOREMS = TheoremRegistry("server.theory_rule", noun="theorem")
#: how the server steps relate to the local step γ: ``local`` recomputes the relations a theorem states as
#: equalities from the step clients really take (γ × ``local.lr_multiplier``); ``fixed`` keeps them at ×1
THEORY_FOLLOWS = ("local", "fixed")

_RR_CLI = (
    "Malinovsky, Horváth, Burlachenko & Richtárik, Federated Learning with Regularized Client Participation, 2023, "
    "arXiv:2302.03662"
)


def rr_cli_c1(L_sample_max: float, N: int, local_lr: float | None) -> dict[str, float]:
    """Malinovsky, Horváth, Burlachenko & Richtárik (2023, arXiv:2302.03662), Theorem C.1 (each f_m^j μ-strongly
    convex): γ ≤ 1/L_max, η = γN. For RR-CLI, η = γN makes the server step the plain average of the cohort's models
    (§3); η = γN is an equality, so it follows the step clients take (``local_lr``) when given."""
    gamma = 1.0 / L_sample_max
    return {"lr": gamma, "server_lr": (gamma if local_lr is None else local_lr) * N}


def rr_cli_c2(L_sample_max: float, N: int, kappa: float) -> dict[str, float]:
    """The same paper's Theorem C.2 (f_m strongly convex, f_m^j convex): η ≤ 1/(4L_max), γ ≤ 1/(8N·L_max·√κ),
    κ = L_max/μ (bounds: they do not follow γ). Nastya's own theorems (Malinovsky, Mishchenko & Richtárik 2022) lack
    their formulas in the text we have, so this analysis of the same rounds by the same authors stands in for them."""
    return {"lr": 1.0 / (8 * N * L_sample_max * math.sqrt(kappa)), "server_lr": 1.0 / (4 * L_sample_max)}


def karimireddy_i(L_client_max: float, N: int) -> dict[str, float]:
    """Karimireddy et al. (SCAFFOLD, ICML 2020, arXiv:1910.06378), Theorem I (strongly convex) with η_g = 1 and the
    smallest dissimilarity constant B = 1: η_l = 1/(8(1+B²)·L·K) = 1/(16·L·K), L the largest client smoothness
    (RR-CLI §4.3 uses this FedAvg step)."""
    return {"lr": 1.0 / (16 * L_client_max * N), "server_lr": 1.0}


def yang_1(L_client_max: float, N: int) -> dict[str, float]:
    """Yang, Fang & Liu (ICLR 2021, arXiv:2101.11203), Theorem 1: η_L = 1/(8LK) and η·η_L = 1/(KL), so η = 8."""
    eta_l = 1.0 / (8 * L_client_max * N)
    return {"lr": eta_l, "server_lr": 1.0 / (eta_l * N * L_client_max)}


THEOREMS.add("rr_cli_c1", rr_cli_c1, "γ = 1/L_max, η = γN", f"{_RR_CLI}, Theorem C.1", gives=("lr", "server_lr"))
THEOREMS.add(
    "rr_cli_c2",
    rr_cli_c2,
    "η = 1/(4L_max), γ = 1/(8N·L_max·√κ)",
    f"{_RR_CLI}, Theorem C.2",
    gives=("lr", "server_lr"),
)
THEOREMS.add(
    "karimireddy_i",
    karimireddy_i,
    "η_l = 1/(16·L·K), η_g = 1",
    "Karimireddy, Kale, Mohri, Reddi, Stich & Suresh, SCAFFOLD, ICML 2020, arXiv:1910.06378, Theorem I",
    gives=("lr", "server_lr"),
)
THEOREMS.add(
    "yang_1",
    yang_1,
    "η_L = 1/(8LK), η = 1/(η_L·K·L) = 8",
    "Yang, Fang & Liu, Achieving Linear Speedup with Partial Worker Participation in Non-IID Federated Learning, "
    "ICLR 2021, Theorem 1",
    gives=("lr", "server_lr"),
)


def theory_rule(method: str, covering: Sequence[str], rule: str | None, setting: str) -> str:
    """The theorem ``'theory'`` means for ``method``: ``server.theory_rule`` (default: the method's own), one of those
    that cover it (``covering``, the method's ``theorems``); ``setting`` asked for ``'theory'``."""
    if rule is None:
        raise ConfigError(
            setting,
            f"no theoretical step size for {method!r} (it names no theorem, server.theory_rule); theorems: "
            f"{', '.join(THEOREMS)} (give a number instead)",
        )
    THEOREMS[rule]  # raises, naming server.theory_rule and the theorems
    if rule not in covering:
        raise ConfigError(
            "server.theory_rule",
            f"{rule} gives no step sizes for {method}; accepted for {method}: {', '.join(covering) or 'none'}",
        )
    return rule


def theoretical_step_sizes(
    rule: str,
    constants: Smoothness,
    local_steps: int,
    rounds_per_meta_epoch: int = 1,
    local_lr: float | None = None,
    meta_epoch: bool = False,
) -> dict[str, float]:
    """The step sizes theorem ``rule`` (:data:`THEOREMS`) allows, at their upper limits, by quantity
    (``lr``: γ, ``server_lr``: η, ``global_lr``: θ, or a plugin's own).

    ``local_steps`` is N (steps of one local pass) or K, R = ``rounds_per_meta_epoch``; L is the smoothness of the
    functions one local step samples (L_max of individual samples; a minibatch mean is no less smooth). With
    ``meta_epoch`` (RR-CLI's meta-epoch step, Algorithm 1, line 18) θ = ηR is added for every theorem that gives η:
    the step without extrapolation, which Theorem C.1 states and Theorem C.3 bounds (γNR ≤ ηR ≤ θ).

    ``local_lr`` is the step clients really take (a number, or the theory's γ times ``local.lr_multiplier``):
    given, the relations a theorem states as *equalities* are computed from it — C.1's η = γN, and θ = ηR — so
    that tuning γ moves the steps tied to it, as the RR-CLI paper's multiplier grids (§4.4–4.5, Figs. 7–10) do. A
    theorem's *bounds* (C.2's η ≤ 1/(4L), Theorem I's η_g = 1, Theorem 1's η·η_L ≤ 1/(KL)) do not follow γ.
    """
    theorem = THEOREMS[rule]
    offered = {**constants.to_dict(), "N": max(int(local_steps), 1), "R": rounds_per_meta_epoch, "local_lr": local_lr}
    values = dict(call_with(theorem.factory, **offered))
    if set(values) != set(theorem.gives):
        raise ValueError(f"theorem {rule!r} gave {', '.join(values)}; it declares {', '.join(theorem.gives)}")
    if meta_epoch and "server_lr" in values:
        values["global_lr"] = values["server_lr"] * rounds_per_meta_epoch
    return values
