"""Metrics, each declared once: name, label, how it is computed, and how results treat it.

A metric is one :func:`metric` call. :data:`METRICS` is what ``metrics.csv``, the summaries, the
plots, the tables, ``--pick`` and ``--target`` read, so a metric declared here (or by a method for
its own diagnostic, as FedCDR does for its prox residual) reaches all of them, and a value that no
declaration names is an error, never silently dropped. A method's module declares its diagnostics when
it is imported; :mod:`fedshuffle.experiments` imports every method first, so the columns of
``metrics.csv`` never depend on the order of imports.

Kinds: ``cost`` (counters of the run, usable as x-axes), ``model`` (the global model evaluated on
the data), ``method`` (a method's per-round diagnostic). ``measured`` metrics (wall time) differ
between two runs of the same config; they are kept in ``timing.csv`` so that ``metrics.csv`` stays
byte-identical across executors and resumes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from fedshuffle.problems.solution import solution
from fedshuffle.core.registry import Registry

#: bytes per element on the wire (fp32 payloads, as Yang, Fang & Liu, ICLR 2021, Table 2 counts them)
WIRE_BYTES = 4
MIB = float(1 << 20)

Kind = Literal["cost", "model", "method"]
METRICS = Registry("metric")


def metric(
    name: str,
    label: str,
    compute: Callable[[Evaluation], Any],
    *,
    kind: Kind,
    better: Literal["min", "max"] = "min",
    integer: bool = False,
    measured: bool = False,
    citation: str = "",
) -> None:
    """Declare a metric: ``compute(evaluation)`` gives its value at an evaluation (``None`` where it does not apply)."""
    METRICS.add(name, compute, label, citation, kind=kind, better=better, integer=integer, measured=measured)


def names(*, measured: bool = False) -> tuple[str, ...]:
    """Metric names in declaration order: the deterministic ones (``metrics.csv``) or the measured ones
    (``timing.csv``)."""
    return tuple(e.name for e in METRICS.entries() if e.defaults["measured"] == measured)


def of_kind(*kinds: Kind) -> tuple[str, ...]:
    return tuple(e.name for e in METRICS.entries() if e.defaults["kind"] in kinds)


def label(name: str) -> str:
    return METRICS[name].summary if name in METRICS else name


@dataclass
class Evaluation:
    """What a metric is computed from: the run's counters, the global model and the data it is scored on."""

    counters: Any
    num_samples: int
    bandwidth_mib_s: float
    extras: Mapping[str, float]
    model: Mapping[str, float | None]

    def __getitem__(self, name: str) -> Any:
        return self.model.get(name)


def evaluate(evaluation: Evaluation) -> dict[str, Any]:
    """Every declared metric at one evaluation; a method diagnostic that no declaration names is an error."""
    undeclared = sorted(set(evaluation.extras) - set(METRICS))
    if undeclared:
        raise KeyError(
            f"the method reports undeclared metrics {undeclared}; declare them with fedshuffle.metrics.metric(...)"
        )
    return {e.name: e.factory(evaluation) for e in METRICS.entries()}


class ModelScores:
    """Scores of the global model: f(x), f − f*, ‖x − x*‖², ‖∇f(x)‖², accuracies, test loss.

    f is the training objective Σ_j s_j f_j(x) with the dataset's sample weights (Σ_i w_i f_i). The train accuracy is
    the fraction of the samples that clients hold that the model classifies right, each counted once whatever its
    client's weight (rows that no client holds are not scored); the test accuracy that of every test sample.
    x* and f* come from :func:`fedshuffle.problems.solution.solution` where the problem has them (cached under
    ``solution_key``, :func:`~fedshuffle.problems.solution.solution_key` of the run's settings, when given).
    """

    def __init__(self, problem, data, solution_key: str | None = None, gradient: bool = True) -> None:
        self.problem, self.data, self.gradient = problem, data, gradient
        self.sample_weights = data.sample_weights()
        held = data.held_rows()
        self.rows = None if held is None else torch.from_numpy(held).to(data.features.device)
        solved = solution(problem, data, solution_key)
        self.x_star = solved[0].to(data.features.device, data.features.dtype) if solved else None
        self.f_star = solved[1] if solved else None
        test = data.test_features
        self.test_weights = (
            None
            if test is None
            else torch.full((test.shape[0],), 1.0 / test.shape[0], dtype=self.sample_weights.dtype, device=test.device)
        )

    def __call__(self, params: torch.Tensor) -> dict[str, float | None]:
        """One pass over the held training rows (f, ‖∇f‖² unless ``gradient`` is off, accuracy:
        :meth:`~fedshuffle.problems.Problem.scores`)
        and one over the test data (mean loss, accuracy: the same with weights 1/n and no gradient)."""
        held = {} if self.rows is None else {"rows": self.rows}  # a problem's own scores() may not take rows
        data = self.data
        train = self.problem.scores(
            params, data.features, data.labels, self.sample_weights, gradient=self.gradient, **held
        )
        out: dict[str, float | None] = {"loss": train.loss, "grad_norm_sq": train.grad_norm_sq}
        out["f_gap"] = train.loss - self.f_star if self.f_star is not None else None
        out["dist_sq"] = float((params - self.x_star).pow(2).sum()) if self.x_star is not None else None
        out["train_accuracy"] = train.accuracy
        if self.test_weights is not None:
            test = self.problem.scores(
                params, self.data.test_features, self.data.test_labels, self.test_weights, gradient=False
            )
            out["test_loss"], out["test_accuracy"] = test.loss, test.accuracy
        return out


def local_model_scores(sim: Any) -> dict[str, float | None]:
    """The clients' own models on their own data, for methods that keep one per client (``local_model_field``).

    With x_i client i's stored model (FedCDR's x_i = prox_{ηf_i}(y_i); FedDyn's θ_i) and f_i its mean loss
    over its own samples D_i (regularizer included):

        local_loss         = Σ_i (|D_i|/|D|) f_i(x_i)     (pooled: every training sample once)
        local_loss_uniform = (1/n) Σ_i f_i(x_i)
        local_accuracy     = Σ_i correct_i(x_i) / |D|,   local_accuracy_uniform = (1/n) Σ_i acc_i(x_i)

    and, where each client has its own test samples T_i (``FederatedDataset.test_client_sizes``: FedProx's
    Synthetic devices), the same on them: local_test_loss = Σ_i Σ_{j∈T_i} ℓ_j(x_i) / |T| and local_test_accuracy
    (pooled), local_test_accuracy_uniform (the mean over clients with test samples).

    A method with the default halves keeps its clients' models under ``run.score_client_models``
    (:class:`fedshuffle.methods.client_models.ClientModels`: y_i = x − Δ_i after the client's last local training).

    This is where the public FedDR code (Tran-Dinh, Pham, Phan & Nguyen, NeurIPS 2021) scores its
    Douglas–Rachford methods: every client's current local model on that client's data. A client that has
    not taken part yet holds the model the run started from, x⁰ (FedCDR counts x̂_i = x⁰ for it; FedDyn's
    clients start there), so every client counts from the first evaluation. SCAFFOLD keeps control
    variates, not models (a client's y_i lives for one round), so it has none. Empty for other methods.
    """
    method, state = sim.method, sim.method_state
    while getattr(method, "local_model_field", None) is None and hasattr(method, "inner"):
        method, state = (
            method.inner,
            state["inner"],
        )  # a wrapper (global momentum) keeps the method's state under "inner"
    field = getattr(method, "local_model_field", None)
    if field is None or sim.store is None:
        return {}
    data, problem = sim.data, sim.problem
    test_rows = data.client_test_rows()
    losses, correct, sizes = [], [], np.asarray(data.sizes, dtype=np.float64)
    test_scores = []
    for client, indices in enumerate(data.client_indices):
        own = (
            sim.store.get(field, np.array([client]), data.features.device)[0].to(sim.params.dtype)
            if sim.store.created[client]
            else state["x0"]
        )
        loss, hits = _own_scores(problem, own, data.features, data.labels, indices)
        losses.append(loss)
        correct.append(hits)
        if test_rows is not None and data.test_client_sizes[client]:
            test_scores.append(_own_scores(problem, own, data.test_features, data.test_labels, test_rows[client]))
    loss = np.array(losses)
    out: dict[str, float | None] = {
        "local_loss": float(sizes @ loss / sizes.sum()),
        "local_loss_uniform": float(loss.mean()),
    }
    if None not in correct:
        hits = np.array(correct)
        out |= {
            "local_accuracy": float(hits.sum() / sizes.sum()),
            "local_accuracy_uniform": float((hits / sizes).mean()),
        }
    if test_scores:
        held = data.test_client_sizes[data.test_client_sizes > 0].astype(np.float64)
        out["local_test_loss"] = float(held @ np.array([t[0] for t in test_scores]) / held.sum())
        if all(t[1] is not None for t in test_scores):
            hits = np.array([t[1] for t in test_scores])
            out |= {
                "local_test_accuracy": float(hits.sum() / held.sum()),
                "local_test_accuracy_uniform": float((hits / held).mean()),
            }
    return out


def _own_scores(
    problem: Any, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, rows: np.ndarray
) -> tuple[float, float | None]:
    """A client's mean loss over ``rows`` at its own model, and how many of them it classifies right (None: no
    classes)."""
    ix = torch.as_tensor(rows, device=features.device)
    X, Y = features[ix], labels[ix]
    accuracy = problem.accuracy(params, X, Y)
    return float(problem.losses(params, X, Y).mean()), None if accuracy is None else accuracy * len(rows)


def _mib(elements: int) -> float:
    return elements * WIRE_BYTES / MIB


_YANG = "Yang, Fang & Liu, ICLR 2021, Table 2"

metric("round", "communication rounds", lambda e: e.counters.rounds, kind="cost", integer=True)
metric("sample_gradients", "gradient evaluations", lambda e: e.counters.sample_gradients, kind="cost", integer=True)
metric("epochs", "epochs of data", lambda e: e.counters.sample_gradients / e.num_samples, kind="cost")
metric("bytes_up", "bytes uploaded (all clients, run dtype)", lambda e: e.counters.bytes_up, kind="cost", integer=True)
metric(
    "bytes_down",
    "bytes downloaded (all clients, run dtype)",
    lambda e: e.counters.bytes_down,
    kind="cost",
    integer=True,
)
metric(
    "mib_up",
    "MiB uploaded per participating worker (fp32)",
    lambda e: _mib(e.counters.worker_elements_up),
    kind="cost",
    citation=_YANG,
)
metric(
    "mib_down",
    "MiB downloaded per participating worker (fp32)",
    lambda e: _mib(e.counters.worker_elements_down),
    kind="cost",
    citation=_YANG,
)
metric(
    "dropped",
    "members dropped so far (no answer within the round's timeout, on devices)",
    lambda e: e.extras.get("dropped"),
    kind="cost",
    integer=True,
)
metric(
    "epsilon",
    "ε(δ) of differential privacy spent so far ([privacy]: Opacus's RDP accountant; δ in config.json)",
    lambda e: getattr(e.counters, "epsilon", None),
    kind="cost",
    citation="Mironov, Talwar & Zhang 2019, arXiv:1908.10530",
)
metric("loss", "f(x)", lambda e: e["loss"], kind="model")
metric("f_gap", "f(x) − f*", lambda e: e["f_gap"], kind="model")
metric("dist_sq", "‖x − x*‖²", lambda e: e["dist_sq"], kind="model")
metric("grad_norm_sq", "‖∇f(x)‖²", lambda e: e["grad_norm_sq"], kind="model")
metric("train_accuracy", "train accuracy", lambda e: e["train_accuracy"], kind="model", better="max")
metric("test_loss", "test loss", lambda e: e["test_loss"], kind="model")
metric("test_accuracy", "test accuracy", lambda e: e["test_accuracy"], kind="model", better="max")
_FEDERATED = "scored by the nodes on their clients beside the server's (Flower, run config evaluation = 'both')"
metric("federated_loss", f"f(x), {_FEDERATED}", lambda e: e["federated_loss"], kind="model")
metric("federated_grad_norm_sq", f"‖∇f(x)‖², {_FEDERATED}", lambda e: e["federated_grad_norm_sq"], kind="model")
metric(
    "federated_train_accuracy",
    f"train accuracy, {_FEDERATED}",
    lambda e: e["federated_train_accuracy"],
    kind="model",
    better="max",
)
_LOCAL = "clients' own models on their own data (FedDR's evaluation point; FedCDR, FedDyn)"
metric("local_loss", f"Σ (|D_i|/|D|) f_i(x_i), {_LOCAL}", lambda e: e["local_loss"], kind="model")
metric("local_loss_uniform", f"(1/n) Σ f_i(x_i), {_LOCAL}", lambda e: e["local_loss_uniform"], kind="model")
metric(
    "local_accuracy",
    f"train accuracy pooled over clients, {_LOCAL}",
    lambda e: e["local_accuracy"],
    kind="model",
    better="max",
)
metric(
    "local_accuracy_uniform",
    f"mean of the clients' train accuracies, {_LOCAL}",
    lambda e: e["local_accuracy_uniform"],
    kind="model",
    better="max",
)
metric(
    "local_test_loss",
    f"mean test loss pooled over clients' own test samples, {_LOCAL}",
    lambda e: e["local_test_loss"],
    kind="model",
)
metric(
    "local_test_accuracy",
    f"test accuracy pooled over clients' own test samples, {_LOCAL}",
    lambda e: e["local_test_accuracy"],
    kind="model",
    better="max",
)
metric(
    "local_test_accuracy_uniform",
    f"mean of the clients' test accuracies, {_LOCAL}",
    lambda e: e["local_test_accuracy_uniform"],
    kind="model",
    better="max",
)
metric(
    "dp_clip",
    "adaptive clipping's C for the next round ([privacy] clipping = 'adaptive')",
    lambda e: e.extras.get("dp_clip"),
    kind="method",
    citation="Andrew, Thakkar, McMahan & Ramaswamy, NeurIPS 2021",
)
metric(
    "compute_seconds",
    "local computation per worker (s, measured)",
    lambda e: e.counters.worker_compute_seconds,
    kind="cost",
    measured=True,
    citation=_YANG,
)
metric(
    "wallclock_seconds",
    "simulated wall-clock (s): computation + communication at run.bandwidth_mib_s",
    lambda e: (
        e.counters.worker_compute_seconds
        + _mib(e.counters.worker_elements_up + e.counters.worker_elements_down) / e.bandwidth_mib_s
    ),
    kind="cost",
    measured=True,
    citation=_YANG,
)
