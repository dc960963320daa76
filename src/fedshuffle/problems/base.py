"""Problems: a per-sample loss f_ij(x) on a flat parameter vector x ∈ R^d.

Every problem works on one flat vector so that clients, aggregators and server optimizers see the
same object whatever the model, and so that a cohort can later be stacked as a (C, d) tensor.
Convex problems also give their minimizer x* in high precision (for f − f* and ‖x − x*‖²).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import numpy as np
import torch
from torch.func import grad, vmap


class Scores(NamedTuple):
    """The model scored on a dataset: f(x) = Σ_j s_j f_j(x), ‖∇f(x)‖² (``None`` when not asked for) and the
    fraction of correct predictions (``None`` for problems that do not classify)."""

    loss: float
    grad_norm_sq: float | None
    accuracy: float | None


class Problem(ABC):
    """A per-sample loss on flat parameters.

    Subclasses define :meth:`losses`; :meth:`gradient` defaults to autograd of the batch mean and is
    overridden in closed form where that is faster (quadratic, logistic regression).
    """

    name: str = "problem"
    convex: bool = False
    #: local steps draw random numbers (dropout): :meth:`local_gradient` needs each client's step seed
    stochastic: bool = False
    #: each row of :meth:`local_gradient` is the same floating-point number whatever rows are stacked with it (one
    #: row alone included), so a client's local work gives the same numbers in any chunk (replicas share chunks)
    independent_rows: bool = False

    @property
    @abstractmethod
    def dim(self) -> int:
        """Number of parameters d."""

    @abstractmethod
    def losses(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-sample losses f_ij(x), shape ``(B,)``, regularizer included."""

    def encode_labels(self, labels: np.ndarray) -> torch.Tensor:
        """The problem's targets for integer class labels (identity unless the loss wants another coding)."""
        return torch.as_tensor(labels)

    def init_params(self, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
        """Initial model x⁰ (zeros unless the model needs symmetry breaking)."""
        return torch.zeros(self.dim, dtype=dtype)

    def gradient(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean gradient over the batch, (1/B) Σ_j ∇f_ij(x)."""
        return grad(lambda p: self.losses(p, features, labels).mean())(params)

    def batched_gradient(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Row c: Σ_b v_cb ∇f(y_c; a_cb) — one weighted minibatch per client.

        ``params`` is ``(C, d)``, ``features`` ``(C, B, ...)``, ``labels`` and ``weights`` ``(C, B)``;
        v_cb = 1/n_c on the n_c real rows of client c's minibatch and 0 on padding, so a row is that
        client's minibatch mean gradient. The default maps :func:`torch.func.grad` over clients with
        :func:`torch.func.vmap`; linear models override it with batched closed forms.
        """

        def client(p, f, y, v):
            return grad(lambda q: (self.losses(q, f, y) * v).sum())(p)

        return vmap(client)(params, features, labels, weights)

    def local_gradient(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, seeds: list[int] | None = None) -> torch.Tensor:
        """The gradients of one local step, as :meth:`batched_gradient`; networks run in train mode here, with
        ``seeds[c]`` (:func:`fedshuffle.core.streams.step_seed`) seeding client c's dropout masks."""
        return self.batched_gradient(params, features, labels, weights)

    def descend(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, lrs: torch.Tensor, seeds: list[int] | None = None) -> None:
        """One plain local SGD step in place, y_c ← y_c − η_c·g_c with g = :meth:`local_gradient` (``lrs`` is ``(C, 1)``).

        The local loop calls it when the step chain is empty; problems whose gradient comes in pieces
        (modules) override it to apply the step piece by piece, without assembling g as one vector.
        """
        params.addcmul_(lrs, self.local_gradient(params, features, labels, weights, seeds), value=-1.0)

    def weighted_loss(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_j s_j f_j(x) — the objective f(x) when ``weights`` are the dataset's sample weights."""
        return (self.losses(params, features, labels) * weights).sum()

    def weighted_gradient(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """∇ Σ_j s_j f_j(x)."""
        return grad(lambda p: self.weighted_loss(p, features, labels, weights))(params)

    def accuracy(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Fraction of correct predictions, or ``None`` for non-classification problems."""
        return None

    def scores(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, gradient: bool = True) -> Scores:
        """f(x) = Σ_j s_j f_j(x) (``weights`` s), ‖∇f(x)‖² when ``gradient``, and the (unweighted) accuracy.

        The default asks :meth:`weighted_loss`, :meth:`weighted_gradient` and :meth:`accuracy` in turn;
        classifiers override it to score a dataset from one forward pass (and the gradient from the
        same pass in closed form, or from one backward).
        """
        loss = float(self.weighted_loss(params, features, labels, weights))
        norm = float(self.weighted_gradient(params, features, labels, weights).pow(2).sum()) if gradient else None
        return Scores(loss, norm, self.accuracy(params, features, labels))

    def prox(self, centers: torch.Tensor, data, clients: np.ndarray, eta: float) -> torch.Tensor | None:
        """prox_{ηf_i}(center_i) for each listed client in closed form, or ``None`` where there is none."""
        return None

    def minimizer(self, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """argmin_x Σ_j s_j f_j(x) when it can be computed reliably, else ``None``."""
        return None
