"""Neural networks on flat parameters in closed form: the MLP (batched backpropagation written out).

Other networks are ``torch.nn.Module`` s run by :class:`~fedshuffle.problems.modules.ModuleProblem`."""

from __future__ import annotations

import math
from abc import abstractmethod
from collections.abc import Sequence

import torch
from torch.func import grad, vmap

from ..core.errors import ConfigError
from .base import ChunkScores, Problem


def _flat(pieces: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([q.reshape(-1) for q in pieces])


class Network(Problem):
    """A neural network on flat parameters, cross-entropy loss and an optional (λ/2)‖x‖² term.

    The flat vector is cut into views of the layers' tensors (``shapes``). Gradients are taken with
    respect to those pieces and concatenated: differentiating through the slicing of one flat vector
    would, in backward, fill a full-size zero gradient per piece — the dominant cost for a cohort of
    vmap-ed CNNs.
    """

    shapes: list[tuple[int, ...]]
    l2: float = 0.0

    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    def split(self, params: torch.Tensor) -> list[torch.Tensor]:
        pieces, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            pieces.append(params[offset : offset + size].view(shape))
            offset += size
        return pieces

    @abstractmethod
    def logits(self, pieces: Sequence[torch.Tensor], features: torch.Tensor) -> torch.Tensor:
        """Class scores ``(B, classes)`` of a batch."""

    def piece_losses(
        self, pieces: Sequence[torch.Tensor], features: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        ce = torch.nn.functional.cross_entropy(self.logits(pieces, features), labels, reduction="none")
        return ce + 0.5 * self.l2 * sum((q * q).sum() for q in pieces) if self.l2 else ce

    def losses(self, params, features, labels):
        return self.piece_losses(self.split(params), features, labels)

    def gradient(self, params, features, labels):
        return _flat(grad(lambda ps: self.piece_losses(ps, features, labels).mean())(self.split(params)))

    def weighted_gradient(self, params, features, labels, weights):
        return _flat(grad(lambda ps: (self.piece_losses(ps, features, labels) * weights).sum())(self.split(params)))

    def batched_gradient(self, params, features, labels, weights):
        def client(p, f, y, v):
            return _flat(grad(lambda ps: (self.piece_losses(ps, f, y) * v).sum())(self.split(p)))

        return vmap(client)(params, features, labels, weights)

    def accuracy(self, params, features, labels):
        return float((self.logits(self.split(params), features).argmax(dim=-1) == labels).double().mean())


class MLP(Network):
    """Fully connected network with ReLU hidden layers and a cross-entropy loss (non-convex)."""

    name = "mlp"
    independent_rows = (
        True  # batched matmuls and elementwise steps; tests/test_replicas.py checks stacks of 1 to 80 rows
    )

    def __init__(self, num_features: int, hidden: Sequence[int], num_classes: int, l2: float = 0.0) -> None:
        if not hidden or any(h < 1 for h in hidden):
            raise ConfigError("hidden", f"hidden layer sizes must be positive integers, got {list(hidden)}")
        self.widths = [num_features, *hidden, num_classes]
        self.l2 = l2
        self.shapes = [
            s
            for k in range(len(self.widths) - 1)
            for s in ((self.widths[k], self.widths[k + 1]), (self.widths[k + 1],))
        ]

    def logits(self, pieces, features):
        h = features.reshape(features.shape[0], -1)
        for k in range(0, len(pieces) - 2, 2):
            h = torch.relu(h @ pieces[k] + pieces[k + 1])
        return h @ pieces[-2] + pieces[-1]

    def batched_gradient(self, params, features, labels, weights):
        """Backpropagation written out for a stack of clients (batched matmuls; faster than vmap(grad) for small
        MLPs)."""
        pieces, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            pieces.append(params[:, offset : offset + size].reshape(-1, *shape))
            offset += size
        acts = self._activations(pieces, features.reshape(features.shape[0], features.shape[1], -1))
        logits = acts[-1] @ pieces[-2] + pieces[-1].unsqueeze(-2)
        flat = self._backpropagate(pieces, acts, logits, labels, weights)
        return flat + self.l2 * weights.sum(1, keepdim=True) * params if self.l2 else flat

    def _activations(self, pieces, inputs):
        """[a, h_1, ..., h_L]: the inputs and every hidden layer's output, for one model or a stack (leading
        dimension C)."""
        acts = [inputs]
        for k in range(0, len(pieces) - 2, 2):
            acts.append(torch.relu(acts[-1] @ pieces[k] + pieces[k + 1].unsqueeze(-2)))
        return acts

    def _backpropagate(self, pieces, acts, logits, labels, weights):
        """∂/∂pieces Σ_b v_b CE(logits_b, y_b), flat: δ = v ⊙ (softmax − onehot), then through each layer
        (regularizer not included)."""
        delta = torch.softmax(logits, dim=-1)
        delta = (delta - torch.nn.functional.one_hot(labels, delta.shape[-1]).to(delta.dtype)) * weights.unsqueeze(-1)
        grads = []
        for k in range(len(pieces) - 2, -1, -2):
            h = acts[k // 2]
            grads = [h.transpose(-2, -1) @ delta, delta.sum(-2), *grads]
            if k:
                delta = (delta @ pieces[k].transpose(-2, -1)) * (h > 0)
        return torch.cat([g.flatten(start_dim=logits.dim() - 2) for g in grads], dim=-1)

    def row_bytes(self, features):
        """A sample's features and every layer's output, twice (the backward pass's δ beside each)."""
        return (features[0].numel() + 2 * sum(self.widths[1:])) * features.element_size()

    def chunk_scores(self, params, features, labels, weights, gradient):
        """f, ∇f (backpropagation written out, as :meth:`batched_gradient`) and right predictions of a chunk from one
        forward pass."""
        pieces = self.split(params)
        acts = self._activations(pieces, features.reshape(features.shape[0], -1))
        logits = acts[-1] @ pieces[-2] + pieces[-1]
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        penalty = 0.5 * self.l2 * sum((q * q).sum() for q in pieces) if self.l2 else 0.0
        loss = ((ce + penalty) * weights).sum()
        norm = None
        if gradient:
            flat = self._backpropagate(pieces, acts, logits, labels, weights)
            norm = flat + self.l2 * weights.sum() * params if self.l2 else flat
        return ChunkScores(loss, norm, (logits.argmax(dim=-1) == labels).sum(), features.shape[0])

    def init_params(self, generator, dtype):
        """PyTorch's default Linear initialization, U(−1/√fan_in, 1/√fan_in), from ``generator``."""
        chunks = []
        for fan_in, fan_out in zip(self.widths[:-1], self.widths[1:]):
            bound = 1.0 / math.sqrt(fan_in)
            chunks.append(
                (torch.rand(fan_in * fan_out + fan_out, generator=generator, dtype=torch.float64) * 2 - 1) * bound
            )
        return torch.cat(chunks).to(dtype)
