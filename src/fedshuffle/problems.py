"""Problems: a per-sample loss f_ij(x) on a flat parameter vector x ∈ R^d.

Every problem works on one flat vector so that clients, aggregators and server optimizers see the
same object whatever the model, and so that a cohort can later be stacked as a (C, d) tensor.
Convex problems also give their minimizer x* in high precision (for f − f* and ‖x − x*‖²).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np
import torch
from torch.func import grad, vmap

from .errors import ConfigError


class Problem(ABC):
    """A per-sample loss on flat parameters.

    Subclasses define :meth:`losses`; :meth:`gradient` defaults to autograd of the batch mean and is
    overridden in closed form where that is faster (quadratic, logistic regression).
    """

    name: str = "problem"
    convex: bool = False

    @property
    @abstractmethod
    def dim(self) -> int:
        """Number of parameters d."""

    @abstractmethod
    def losses(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-sample losses f_ij(x), shape ``(B,)``, regularizer included."""

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

    def weighted_loss(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Σ_j s_j f_j(x) — the objective f(x) when ``weights`` are the dataset's sample weights."""
        return (self.losses(params, features, labels) * weights).sum()

    def weighted_gradient(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """∇ Σ_j s_j f_j(x)."""
        return grad(lambda p: self.weighted_loss(p, features, labels, weights))(params)

    def accuracy(self, params: torch.Tensor, features: torch.Tensor, labels: torch.Tensor) -> float | None:
        """Fraction of correct predictions, or ``None`` for non-classification problems."""
        return None

    def prox(self, centers: torch.Tensor, data, clients: np.ndarray, eta: float) -> torch.Tensor | None:
        """prox_{ηf_i}(center_i) for each listed client in closed form, or ``None`` where there is none."""
        return None

    def minimizer(self, features: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor | None:
        """argmin_x Σ_j s_j f_j(x) when it can be computed reliably, else ``None``."""
        return None


class Quadratic(Problem):
    """f_ij(x) = ½‖x − e_ij‖² with per-sample targets e_ij given as the features.

    The FedShuffle paper's (36) is this problem with targets e_1..e_6 (canonical basis of R⁶) split
    1/2/3 over three clients; then f = Σ_i (|D_i|/|D|) f_i = (1/12) Σ_j ‖x − e_j‖² and x* = 1/6.
    """

    name = "quadratic"
    convex = True

    def __init__(self, dim: int) -> None:
        self._dim = dim

    @property
    def dim(self) -> int:
        return self._dim

    def losses(self, params, features, labels):
        return 0.5 * ((params - features) ** 2).sum(dim=-1)

    def gradient(self, params, features, labels):
        return params - features.mean(dim=0)

    def weighted_gradient(self, params, features, labels, weights):
        return params * weights.sum() - weights @ features

    def batched_gradient(self, params, features, labels, weights):
        return params * weights.sum(1, keepdim=True) - (features * weights.unsqueeze(-1)).sum(1)

    def prox(self, centers, data, clients, eta):
        """f_i(z) = ½‖z − ē_i‖² + const (ē_i the client's mean target): prox_{ηf_i}(y) = (y + ηē_i)/(1 + η)."""
        if not hasattr(data, "features"):
            return None
        means = torch.stack([data.features[torch.from_numpy(data.client_indices[i]).to(centers.device)].mean(0) for i in clients])
        return (centers + eta * means) / (1 + eta)

    def minimizer(self, features, labels, weights):
        return (weights @ features) / weights.sum()


class LogisticRegression(Problem):
    """f_j(x) = log(1 + exp(−b_j a_jᵀx)) + (λ/2)‖x‖², labels b_j ∈ {−1, +1} (L2-regularized, μ = λ)."""

    name = "logistic"
    convex = True

    def __init__(self, num_features: int, l2: float) -> None:
        if l2 < 0:
            raise ConfigError("problem.l2", f"must be >= 0, got {l2}")
        self._dim = num_features
        self.l2 = l2

    @property
    def dim(self) -> int:
        return self._dim

    def losses(self, params, features, labels):
        margins = labels * (features @ params)
        return torch.nn.functional.softplus(-margins) + 0.5 * self.l2 * params.dot(params)

    def gradient(self, params, features, labels):
        coef = -labels * torch.sigmoid(-labels * (features @ params))
        return features.T @ coef / features.shape[0] + self.l2 * params

    def weighted_gradient(self, params, features, labels, weights):
        coef = -labels * torch.sigmoid(-labels * (features @ params)) * weights
        return features.T @ coef + self.l2 * weights.sum() * params

    def batched_gradient(self, params, features, labels, weights):
        # Broadcast products rather than batched matmuls (C tiny (1×B)(B×p) products are slower as bmm),
        # and in-place steps: at B = 1 a local step is a few microseconds of arithmetic and the rest dispatch.
        signed = (features * params.unsqueeze(1)).sum(-1).mul_(labels)
        coef = torch.sigmoid(signed.neg_()).mul_(labels).mul_(weights)
        grad = (coef.unsqueeze(-1) * features).sum(1).neg_()
        return grad.addcmul_(weights.sum(1, keepdim=True), params, value=self.l2) if self.l2 else grad

    def accuracy(self, params, features, labels):
        return float(((features @ params) * labels > 0).double().mean())

    def minimizer(self, features, labels, weights):
        """Damped Newton in float64, then full Newton steps while ‖∇f‖ still falls (≈1e-16 at the end).

        Requires λ > 0 for a unique x*. The gradient norm reached is that of float64 round-off:
        ≤ 1e-14 on the LIBSVM problems of the RR-CLI paper (which asks for ‖∇f(x*)‖ ≤ 1e-14).
        """
        if self.l2 <= 0:
            return None
        a, b, s = features.double(), labels.double(), weights.double()
        eye = torch.eye(self.dim, dtype=torch.float64)
        objective = lambda z: self.weighted_loss(z, a, b, s)  # noqa: E731

        def newton_step(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            g = self.weighted_gradient(z, a, b, s)
            sig = torch.sigmoid(b * (a @ z))
            hess = (a.T * (s * sig * (1 - sig))) @ a + self.l2 * s.sum() * eye
            return g, torch.linalg.solve(hess, g)

        x = torch.zeros(self.dim, dtype=torch.float64)
        for _ in range(100):
            g, step = newton_step(x)
            if g.norm() <= 1e-8:
                break
            t, f0 = 1.0, objective(x)
            while objective(x - t * step) > f0 - 0.25 * t * g.dot(step) and t > 1e-10:
                t *= 0.5
            x = x - t * step
        best, best_norm = x, float(self.weighted_gradient(x, a, b, s).norm())
        for _ in range(10):
            x = x - newton_step(x)[1]
            norm = float(self.weighted_gradient(x, a, b, s).norm())
            if norm >= best_norm:
                break
            best, best_norm = x, norm
        return best


class SoftmaxRegression(Problem):
    """Multinomial logistic regression: f_j = CE(Wᵀa_j + c, y_j) + (λ/2)‖W‖², parameters (W, c) flattened."""

    name = "softmax"
    convex = True

    def __init__(self, num_features: int, num_classes: int, l2: float) -> None:
        if num_classes < 2:
            raise ConfigError("problem.classes", f"softmax regression needs >= 2 classes, got {num_classes}")
        self.num_features, self.num_classes, self.l2 = num_features, num_classes, l2

    @property
    def dim(self) -> int:
        return (self.num_features + 1) * self.num_classes

    def _logits(self, params, features):
        k = self.num_features * self.num_classes
        weight = params[:k].reshape(self.num_features, self.num_classes)
        return features @ weight + params[k:], weight

    def losses(self, params, features, labels):
        logits, weight = self._logits(params, features)
        ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
        return ce + 0.5 * self.l2 * (weight**2).sum()

    def accuracy(self, params, features, labels):
        logits, _ = self._logits(params, features)
        return float((logits.argmax(dim=-1) == labels).double().mean())

    def minimizer(self, features, labels, weights):
        """Full-batch L-BFGS in float64, polished by Newton steps when d ≤ 2000 (strongly convex for λ > 0)."""
        if self.l2 <= 0:
            return None
        a, s = features.double(), weights.double()
        x = torch.zeros(self.dim, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([x], lr=1, max_iter=500, tolerance_grad=1e-12, tolerance_change=1e-15, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            loss = self.weighted_loss(x, a, labels, s)
            loss.backward()
            return loss

        for _ in range(20):
            opt.step(closure)
        x = x.detach()
        if self.dim <= 2000:
            objective = lambda z: self.weighted_loss(z, a, labels, s)  # noqa: E731
            for _ in range(5):
                g = grad(objective)(x)
                if g.norm() <= 1e-13:
                    break
                x = x - torch.linalg.lstsq(torch.func.hessian(objective)(x), g).solution
        return x


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

    def piece_losses(self, pieces: Sequence[torch.Tensor], features: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
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

    def __init__(self, num_features: int, hidden: Sequence[int], num_classes: int, l2: float = 0.0) -> None:
        if not hidden or any(h < 1 for h in hidden):
            raise ConfigError("problem.hidden", f"hidden layer sizes must be positive integers, got {list(hidden)}")
        self.widths = [num_features, *hidden, num_classes]
        self.l2 = l2
        self.shapes = [s for k in range(len(self.widths) - 1) for s in ((self.widths[k], self.widths[k + 1]), (self.widths[k + 1],))]

    def logits(self, pieces, features):
        h = features.reshape(features.shape[0], -1)
        for k in range(0, len(pieces) - 2, 2):
            h = torch.relu(h @ pieces[k] + pieces[k + 1])
        return h @ pieces[-2] + pieces[-1]

    def batched_gradient(self, params, features, labels, weights):
        """Backpropagation written out for a stack of clients (batched matmuls; faster than vmap(grad) for small MLPs)."""
        pieces, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            pieces.append(params[:, offset : offset + size].reshape(-1, *shape))
            offset += size
        acts = [features.reshape(features.shape[0], features.shape[1], -1)]
        for k in range(0, len(pieces) - 2, 2):
            acts.append(torch.relu(acts[-1] @ pieces[k] + pieces[k + 1].unsqueeze(1)))
        logits = acts[-1] @ pieces[-2] + pieces[-1].unsqueeze(1)
        delta = torch.softmax(logits, dim=-1)
        delta = (delta - torch.nn.functional.one_hot(labels, delta.shape[-1]).to(delta.dtype)) * weights.unsqueeze(-1)
        grads = []
        for k in range(len(pieces) - 2, -1, -2):
            h = acts[k // 2]
            grads = [h.transpose(1, 2) @ delta, delta.sum(1), *grads]
            if k:
                delta = (delta @ pieces[k].transpose(1, 2)) * (h > 0)
        flat = torch.cat([g.reshape(g.shape[0], -1) for g in grads], dim=1)
        return flat + self.l2 * weights.sum(1, keepdim=True) * params if self.l2 else flat

    def init_params(self, generator, dtype):
        """PyTorch's default Linear initialization, U(−1/√fan_in, 1/√fan_in), from ``generator``."""
        chunks = []
        for fan_in, fan_out in zip(self.widths[:-1], self.widths[1:]):
            bound = 1.0 / math.sqrt(fan_in)
            chunks.append((torch.rand(fan_in * fan_out + fan_out, generator=generator, dtype=torch.float64) * 2 - 1) * bound)
        return torch.cat(chunks).to(dtype)


class CNN(Network):
    """The small two-convolution CNN of pfl-research's cross-device CIFAR-10 benchmark, for C×H×W images.

    conv 3×3 (32) → ReLU → conv 3×3 (64) → ReLU → max-pool 2 → dense 128 → ReLU → dense (classes),
    cross-entropy; Glorot-uniform weights and PyTorch's default biases, as there. Its two dropout
    layers are left out so that a local step is a deterministic function of its minibatch. The
    network runs through :func:`torch.func.functional_call`, so that the vectorized executor can
    ``vmap`` it over a cohort.
    """

    name = "cnn"

    def __init__(self, image_shape: Sequence[int] = (3, 32, 32), num_classes: int = 10, l2: float = 0.0) -> None:
        channels, height, width = image_shape
        pooled = ((height - 4) // 2) * ((width - 4) // 2)
        self.image_shape, self.num_classes, self.l2 = tuple(image_shape), num_classes, l2
        self.module = torch.nn.Sequential(
            torch.nn.Conv2d(channels, 32, 3), torch.nn.ReLU(), torch.nn.Conv2d(32, 64, 3), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
            torch.nn.Flatten(), torch.nn.Linear(pooled * 64, 128), torch.nn.ReLU(), torch.nn.Linear(128, num_classes),
        ).to("meta")
        self.names = [name for name, _ in self.module.named_parameters()]
        self.shapes = [tuple(p.shape) for _, p in self.module.named_parameters()]

    def logits(self, pieces, features):
        return torch.func.functional_call(self.module, dict(zip(self.names, pieces)), (features.reshape(-1, *self.image_shape),))

    def init_params(self, generator, dtype):
        chunks = []
        for name, shape in zip(self.names, self.shapes):
            if name.endswith("weight"):
                fan_in, fan_out = math.prod(shape[1:]), shape[0] * math.prod(shape[2:])
                bound = math.sqrt(6.0 / (fan_in + fan_out))
            else:
                bound = 1.0 / math.sqrt(math.prod(self.shapes[self.names.index(name.removesuffix("bias") + "weight")][1:]))
            chunks.append((torch.rand(math.prod(shape), generator=generator, dtype=torch.float64) * 2 - 1) * bound)
        return torch.cat(chunks).to(dtype)
