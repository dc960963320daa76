"""Problems: a per-sample loss f_ij(x) on a flat parameter vector x ∈ R^d.

Every problem works on one flat vector so that clients, aggregators and server optimizers see the
same object whatever the model, and so that a cohort can later be stacked as a (C, d) tensor.
Convex problems also give their minimizer x* in high precision (for f − f* and ‖x − x*‖²).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
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


class ChunkScores(NamedTuple):
    """One chunk's share of :class:`Scores`, left on the device: Σ_j s_j f_j(x) and its gradient over the chunk's
    rows, and how many of its labels are predicted right and how many are scored (``right`` None: no classes)."""

    loss: torch.Tensor
    gradient: torch.Tensor | None
    right: torch.Tensor | None
    scored: int


#: bytes of one evaluation chunk's working set (its samples and what is computed from them) by device type: on a CPU
#: a quarter of an 8 MiB last-level cache, so that a layer's output is still in cache when the next layer reads it
#: (``benchmarks/evaluation.py``: the 2NN preset's evaluation in chunks of 326 rows at 1.09× the bare forward pass
#: of its rows, in one chunk at 1.40×); on a GPU large enough to keep the device busy
CHUNK_BYTES = {"cpu": 2 << 20, "cuda": 256 << 20}
#: the fewest rows of a chunk (smaller products run below the machine's rate whatever the cache)
MIN_CHUNK_ROWS = 64


def evaluation_chunks(count: int, rows: torch.Tensor | None, size: int) -> Iterator[slice | torch.Tensor]:
    """Indices of consecutive chunks of at most ``size`` samples: slices of ``range(count)`` (views, no copy), or
    pieces of ``rows`` (the samples to score, a gather each) when given."""
    if rows is None:
        for k in range(0, count, size):
            yield slice(k, min(k + size, count))
    else:
        for k in range(0, rows.shape[0], size):
            yield rows[k : k + size]


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

    def batched_gradient(
        self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Row c: Σ_b v_cb ∇f(y_c; a_cb) — one weighted minibatch per client.

        ``params`` is ``(C, d)``, ``features`` ``(C, B, ...)``, ``labels`` and ``weights`` ``(C, B)``;
        v_cb = 1/n_c on the n_c real rows of client c's minibatch and 0 on padding, so a row is that
        client's minibatch mean gradient. The default maps :func:`torch.func.grad` over clients with
        :func:`torch.func.vmap`; linear models override it with batched closed forms.
        """

        def client(p, f, y, v):
            return grad(lambda q: (self.losses(q, f, y) * v).sum())(p)

        return vmap(client)(params, features, labels, weights)

    def local_gradient(
        self,
        params: torch.Tensor,
        features: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        seeds: list[int] | None = None,
    ) -> torch.Tensor:
        """The gradients of one local step, as :meth:`batched_gradient`; networks run in train mode here, with
        ``seeds[c]`` (:func:`fedshuffle.core.streams.step_seed`) seeding client c's dropout masks."""
        return self.batched_gradient(params, features, labels, weights)

    def descend(
        self,
        params: torch.Tensor,
        features: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        lrs: torch.Tensor,
        seeds: list[int] | None = None,
    ) -> None:
        """One plain local SGD step in place, y_c ← y_c − η_c·g_c with g = :meth:`local_gradient` (``lrs`` is ``(C,
        1)``).

        The local loop calls it when the step chain is empty; problems whose gradient comes in pieces
        (modules) override it to apply the step piece by piece, without assembling g as one vector.
        """
        params.addcmul_(lrs, self.local_gradient(params, features, labels, weights, seeds), value=-1.0)

    def weighted_loss(
        self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Σ_j s_j f_j(x) — the objective f(x) when ``weights`` are the dataset's sample weights."""
        return (self.losses(params, features, labels) * weights).sum()

    def weighted_gradient(
        self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """∇ Σ_j s_j f_j(x)."""
        return grad(lambda p: self.weighted_loss(p, features, labels, weights))(params)

    def accuracy(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Fraction of correct predictions, or ``None`` for non-classification problems."""
        return None

    def row_bytes(self, features: torch.Tensor) -> int:
        """Bytes one sample takes in an evaluation chunk: its features and a product of the same size (problems whose
        activations are wider say so)."""
        return 2 * features[0].numel() * features.element_size()

    def chunk_rows(self, features: torch.Tensor) -> int:
        """Samples per evaluation chunk: :data:`CHUNK_BYTES` of the features' device over :meth:`row_bytes`."""
        budget = CHUNK_BYTES.get(features.device.type, CHUNK_BYTES["cuda"])
        return max(MIN_CHUNK_ROWS, budget // max(1, self.row_bytes(features)))

    def chunk_scores(
        self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, gradient: bool
    ) -> ChunkScores:
        """One chunk's Σ_j s_j f_j(x), ∇ of it when ``gradient`` (regularizer included: it is in every f_j) and right
        predictions. The default asks :meth:`weighted_loss`, :meth:`weighted_gradient` and :meth:`accuracy` in turn;
        classifiers override it to score a chunk from one forward pass (and the gradient from the same pass in
        closed form, or from one backward)."""
        loss = self.weighted_loss(params, features, labels, weights).detach()
        norm = self.weighted_gradient(params, features, labels, weights) if gradient else None
        accuracy = self.accuracy(params, features, labels)
        right = None if accuracy is None else params.new_tensor(round(accuracy * features.shape[0]))
        return ChunkScores(loss, norm, right, features.shape[0])

    def scores(
        self,
        params: torch.Tensor,
        features: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor,
        gradient: bool = True,
        rows: torch.Tensor | None = None,
    ) -> Scores:
        """f(x) = Σ_j s_j f_j(x) (``weights`` s), ‖∇f(x)‖² when ``gradient``, and the accuracy: the fraction of the
        scored labels predicted right, every sample counted once whatever its weight.

        Only ``rows`` are scored when given (the samples that clients hold); the samples go in chunks of
        :meth:`chunk_rows` (:meth:`chunk_scores` each), whose sums are added on the device and read once at the end.
        """
        loss, norm, right, scored = params.new_zeros(()), torch.zeros_like(params) if gradient else None, None, 0
        for index in evaluation_chunks(features.shape[0], rows, self.chunk_rows(features)):
            part = self.chunk_scores(params, features[index], labels[index], weights[index], gradient)
            loss += part.loss
            if norm is not None:
                norm += part.gradient
            if part.right is not None:
                right = part.right if right is None else right + part.right
            scored += part.scored
        accuracy = None if right is None else float(right) / max(scored, 1)
        return Scores(float(loss), None if norm is None else float(norm.pow(2).sum()), accuracy)

    def prox(self, centers: torch.Tensor, data, clients: np.ndarray, eta: float) -> torch.Tensor | None:
        """prox_{ηf_i}(center_i) for each listed client in closed form, or ``None`` where there is none."""
        return None

    def minimizer(self, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """argmin_x Σ_j s_j f_j(x) when it can be computed reliably, else ``None``."""
        return None
