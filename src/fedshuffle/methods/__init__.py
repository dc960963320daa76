"""Methods: the registry of every named method, each a :class:`~fedshuffle.methods.base.Method` with its defaults.

Most methods are one setting of FedShuffleGen (Horváth et al., TMLR 2022, Algorithm 4): the plain
:class:`Method` with local-planner, aggregation and server defaults, registered here. A stateful method is
one file, its class and its registration (:mod:`.scaffold`, :mod:`.fedcdr`, :mod:`.feddyn`), imported here
by discovery; global momentum wraps any of them (:mod:`.momentum`). A defaults entry is keyed by configuration section;
a method with theorems for its step sizes names them, its own first (``theorems``,
:data:`fedshuffle.analysis.theory.THEOREMS`); a setting of its own that is a step size says so in its declaration
(:class:`~fedshuffle.core.registry.StepSize`).
"""

from __future__ import annotations

import importlib
import pkgutil

from fedshuffle.core.registry import Example
from fedshuffle.methods.base import METHODS, ClientResult, Method, RoundInfo, Trainer

_FEDSHUFFLE = "Horváth, Sanjabi, Xiao, Richtárik & Rabbat, FedShuffle, TMLR 2022"
_WANG = "Wang, Liu, Liang, Joshi & Poor, FedNova, NeurIPS 2020"
_SUM_ONE = {"aggregation": {"normalization": "sum_one"}}
#: Wang et al.'s FedNova: w_i·τ_eff/‖a_i‖₁ with the constant τ_eff = Σ_i w_i E‖a_i‖₁ over all clients, divided by p_i
_NOVA = {"aggregation": {"weighting": "normalized", "normalization": "unbiased", "tau_eff": "planned"}}

METHODS.add(
    "fedavg",
    Method,
    "local SGD with replacement, sum-one aggregation",
    f"{_FEDSHUFFLE}, Algorithm 2 / Table 4",
    local={"order": "with_replacement"},
    theorems=("karimireddy_i",),
    **_SUM_ONE,
    example=Example(),
)
METHODS.add(
    "fedavg_rr",
    Method,
    "local epochs with random reshuffling, sum-one aggregation",
    f"{_FEDSHUFFLE}, Algorithm 2",
    local={"order": "reshuffle"},
    theorems=("karimireddy_i",),
    **_SUM_ONE,
    example=Example(),
)
METHODS.add(
    "fedavg_min",
    Method,
    "the same K for every client: the cohort's minimum of E·⌈|D_i|/B⌉",
    f"{_FEDSHUFFLE}, §4.1",
    local={"order": "with_replacement", "steps": "min"},
    **_SUM_ONE,
    example=Example(),
)
METHODS.add(
    "fedavg_mean",
    Method,
    "the same K for every client: the cohort's rounded mean",
    f"{_FEDSHUFFLE}, §4.1",
    local={"order": "with_replacement", "steps": "mean"},
    **_SUM_ONE,
    example=Example(),
)
METHODS.add(
    "fednova",
    Method,
    "normalized averaging x⁺ = x − τ_eff Σ (w_i/p_i) Δ_i/‖a_i‖₁, τ_eff = Σ_i w_i‖a_i‖₁; local SGD with replacement",
    f"{_WANG}, eq. (5); normalization = 'sum_one' gives the FedShuffle reference code's",
    local={"order": "with_replacement"},
    **_NOVA,
    example=Example(),
)
METHODS.add(
    "fednova_rr",
    Method,
    "FedNova with random reshuffling",
    f"{_FEDSHUFFLE}, Appendix E",
    local={"order": "reshuffle"},
    **_NOVA,
    example=Example(),
)
METHODS.add(
    "fedshuffle",
    Method,
    "random reshuffling, η_i ∝ 1/τ_i, unbiased w_i/p_i aggregation",
    f"{_FEDSHUFFLE}, Algorithm 1",
    local={"order": "reshuffle", "step_normalization": "max_local_work"},
    aggregation={"normalization": "unbiased"},
    example=Example(),
)
METHODS.add(
    "fedshuffle_gen",
    Method,
    "FedShuffleGen with free c, w̃, q; default the hybrid of Appendix F.1",
    f"{_FEDSHUFFLE}, Algorithm 4",
    local={"order": "reshuffle", "step_normalization": "max_local_work"},
    aggregation={"weighting": "normalized", "normalization": "unbiased"},
    example=Example(),
)
METHODS.add(
    "fedshuffle_mvr",
    Method,
    "FedShuffle with the MVR global momentum",
    f"{_FEDSHUFFLE}, §5.1, eqs. (12)–(14)",
    local={"order": "reshuffle", "step_normalization": "max_local_work"},
    aggregation={"normalization": "unbiased"},
    server={"global_momentum": 0.9, "momentum_estimator": "exact"},
    example=Example(),
)
#: Nastya's g = (1/C) Σ_{m∈S} g_m (Algorithm 1; objective (1/M) Σ_m f_m, eq. (1)) for any client sizes: ω_m =
#: 1/(C·γ_m·N_m)
#: with N_m the client's steps; aggregation.weighting = "data" gives the data-weighted Σ_S (w_m/p_m) g_m instead
METHODS.add(
    "nastya",
    Method,
    "one RR/SO pass with client step γ, x ← x − η·(1/C)Σ_{m∈S} g_m, g_m = (x − y_m)/(γN_m)",
    "Malinovsky, Mishchenko & Richtárik, Server-Side Stepsizes and Sampling Without Replacement Provably Help in "
    "Federated Optimization, 2022, Algorithm 1",
    local={"order": "reshuffle"},
    aggregation={"weighting": "uniform", "normalization": "unbiased", "direction": "mean_gradient"},
    theorems=("rr_cli_c2", "rr_cli_c1"),
    example=Example(),
)
METHODS.add(
    "rr_cli",
    Method,
    "Nastya rounds over cyclic cohorts, then x_{t+1} = x_t − θ(x_t − x_t^R)/(ηR)",
    "Malinovsky, Horváth, Burlachenko & Richtárik, Federated Learning with Regularized Client Participation, 2023, "
    "Algorithm 1",
    local={"order": "shuffle_once"},
    aggregation={"normalization": "unbiased", "direction": "mean_gradient"},
    server={"meta_epoch_step": True},
    theorems=("rr_cli_c1", "rr_cli_c2"),
    example=Example(),
)
METHODS.add(
    "fedprox",
    Method,
    "local epochs with the proximal term (μ/2)‖y − x‖², sample-weighted average",
    "Li, Sahu, Zaheer, Sanjabi, Talwalkar & Smith, FedProx, MLSys 2020",
    local={"order": "reshuffle", "prox_mu": 1.0},
    **_SUM_ONE,
    example=Example(),
)
METHODS.add(
    "generalized_fedavg",
    Method,
    "K local steps with η_L, x ← x + η·(1/|S|)Σ_{i∈S} Δ_i (uniform sampling; objective (1/m)Σ f_i)",
    "Yang, Fang & Liu, Achieving Linear Speedup with Partial Worker Participation in Non-IID Federated Learning, "
    "ICLR 2021, Algorithm 1",
    local={"order": "with_replacement"},
    aggregation={"weighting": "uniform", "normalization": "unbiased"},
    theorems=("yang_1",),
    example=Example(),
)

# Every other module of the package registers its own method(s) (a stateful method is one file: its class and
# its METHODS.add line), so a new method file needs no line here.
for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

# the modules are imported above; these names are re-exported
from fedshuffle.methods.fedcdr import FedCDR
from fedshuffle.methods.feddyn import FedDyn  # noqa: E402
from fedshuffle.methods.momentum import GlobalMomentum  # noqa: E402
from fedshuffle.methods.scaffold import Scaffold  # noqa: E402

__all__ = [
    "METHODS",
    "ClientResult",
    "FedCDR",
    "FedDyn",
    "GlobalMomentum",
    "Method",
    "RoundInfo",
    "Scaffold",
    "Trainer",
]
