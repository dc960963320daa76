"""Any ``torch.nn.Module`` as a :class:`~fedshuffle.problems.base.Problem` on one flat parameter vector.

:class:`ModuleProblem` wraps a module and a per-sample loss ℓ (default: cross-entropy) as

    f_j(x) = ℓ(module_x(a_j), y_j) + (λ/2)‖x‖²,

where x ∈ R^d is the concatenation of the module's trainable parameters (in ``named_parameters``
order, tied parameters once). Every method, executor and metric then works with the module.

How a gradient is taken. The module's parameters are made *views* of the row of the (C, d) stack
being evaluated (``param.data = row[a:b].view(shape)``: no copy), the module runs forward,
``torch.autograd.grad`` returns the gradient pieces and they are written into the output row. For
one client (the sequential executor) this is the hand-written PyTorch loop — module forward,
backward, in-place update of the same memory — without ``functional_call`` or ``torch.func``.
Several clients run one after another in the same way, or, where it is faster (``vectorize``; by
default on CUDA for modules without dropout or recurrent layers), as one ``vmap`` of
``torch.func.grad`` over the stack. Padding rows of a short minibatch (weight 0) are not run
through the module in the per-client path.

Train and eval modes. Local steps (:meth:`local_gradient`) run the module in train mode; dropout
masks are drawn from a generator seeded by the client's round stream and the step
(:func:`fedshuffle.core.streams.step_seed`), so every executor draws the same masks. Everything
else — the objective, its full gradients (also the full local gradients of SCAFFOLD and
FedShuffleMVR), accuracies — runs in eval mode, without dropout, in slices of ``eval_batch`` samples.

Buffers are constants: they are moved to the run's device and dtype and left as they are, not
trained and not averaged. Frozen parameters (``requires_grad=False``) are treated as buffers.
BatchNorm is refused: its running statistics are buffers that every forward pass changes, which
a model sent as one flat vector of parameters cannot carry, and its batch statistics couple the
samples of a minibatch. Replace it with GroupNorm — :func:`batchnorm_to_groupnorm` does, as Hsieh
et al. (ICML 2020) recommend for federated training and as FedShuffle's ResNet-18 does.
"""

from __future__ import annotations

import copy
import math
import threading
from collections.abc import Callable, Sequence

import torch
from torch.func import functional_call, grad, vmap

from ..core.errors import ConfigError
from .base import Problem, Scores, evaluation_chunks

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
RECURRENT = (torch.nn.RNNBase, torch.nn.RNNCellBase)


def cross_entropy(outputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of class scores, shape ``(B,)``.

    ``outputs`` ``(B, K)`` with labels ``(B,)``; or sequence outputs ``(B, L, K)`` with labels
    ``(B, L)`` — the mean over the positions whose label is ≥ 0 (a negative label marks padding) —
    or with one label per sample ``(B,)``, scored at the last position.
    """
    outputs, labels = _align(outputs, labels)
    if labels.dim() == 1:
        return torch.nn.functional.cross_entropy(outputs, labels, reduction="none")
    per = torch.nn.functional.cross_entropy(outputs.transpose(1, -1), labels.clamp(min=0), reduction="none")
    keep = (labels >= 0).to(per.dtype)
    return (per * keep).flatten(1).sum(1) / keep.flatten(1).sum(1).clamp(min=1)


def correct_predictions(outputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of correct arg-max predictions, number of scored labels) of a batch."""
    outputs, labels = _align(outputs, labels)
    keep = labels >= 0
    return ((outputs.argmax(-1) == labels) & keep).sum(), keep.sum()


def _align(outputs: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    labels = labels.long()
    if outputs.dim() == 3 and labels.dim() == 1:
        outputs = outputs[:, -1]
    return outputs, labels


def batchnorm_to_groupnorm(module: torch.nn.Module, groups: int = 2) -> torch.nn.Module:
    """``module`` with every BatchNorm layer replaced by GroupNorm over ``groups`` groups (affine, in place).

    GroupNorm normalizes each sample on its own, so a model of parameters only is complete (Hsieh et
    al., ICML 2020, §5; FedShuffle's ResNet-18 on CIFAR-100 uses it). A layer whose channel count is
    not divisible by ``groups`` gets the largest divisor of it below ``groups``.
    """
    for name, child in module.named_children():
        if isinstance(child, torch.nn.modules.batchnorm._BatchNorm):
            channels = child.num_features
            g = max(k for k in range(1, groups + 1) if channels % k == 0)
            setattr(module, name, torch.nn.GroupNorm(g, channels, eps=child.eps, affine=True))
        else:
            batchnorm_to_groupnorm(child, groups)
    return module


class _Bound:
    """The module on one device and dtype, with its trainable parameters in flat order."""

    def __init__(self, module: torch.nn.Module, names: Sequence[str], device: torch.device, dtype: torch.dtype) -> None:
        self.module = copy.deepcopy(module).to(device=device, dtype=dtype)
        lookup = dict(self.module.named_parameters())
        self.params = [lookup[n] for n in names]
        self.training: bool | None = None
        self._empty = torch.empty(0, device=device, dtype=dtype)

    def mode(self, training: bool) -> None:
        if self.training is not training:
            self.module.train(training)
            self.training = training

    def bind(self, row: torch.Tensor, shapes: Sequence[tuple[int, ...]]) -> None:
        """Make the parameters views of ``row`` (d,): the module now computes with x = row."""
        offset = 0
        for p, shape in zip(self.params, shapes):
            size = math.prod(shape)
            p.data = row[offset : offset + size].view(shape)
            offset += size

    def release(self) -> None:
        """Drop the views, so that the module does not keep the caller's tensor alive."""
        for p in self.params:
            p.data = self._empty

    def gradient(self, total: torch.Tensor) -> list[torch.Tensor]:
        """∂total/∂(parameters), zeros for parameters the output does not use."""
        return list(torch.autograd.grad(total, self.params, allow_unused=True, materialize_grads=True))


class ModuleProblem(Problem):
    """A ``torch.nn.Module`` and a per-sample loss as a problem on flat parameters.

    Parameters
    ----------
    module:
        Maps a batch of inputs ``(B, *sample_shape)`` to outputs (class scores ``(B, K)`` or
        ``(B, L, K)`` for the default loss). Integer inputs (token ids) are passed as they are.
    loss:
        ``loss(outputs, labels)`` → one loss per sample ``(B,)``; default :func:`cross_entropy`.
    sample_shape:
        Shape of one input; samples arrive flattened ``(B, prod(sample_shape))`` and are reshaped.
    l2:
        λ of the regularizer (λ/2)‖x‖² in every f_j.
    accuracy:
        Report arg-max accuracy (default: when the loss is the default cross-entropy).
    init:
        ``"reset"``: x⁰ from the modules' ``reset_parameters`` (PyTorch's default initialization)
        under the run's seed, then ``initializer(module)`` if given; ``"keep"``: the module's
        current parameters are x⁰ (a pre-trained model).
    vectorize:
        Several clients as one ``vmap`` (never for modules with dropout); default: on CUDA for
        modules without recurrent layers, where one batched computation beats a loop over
        clients. On CPU a loop over clients is as fast for convolutional networks and recurrent
        layers (``benchmarks/networks.py``).
    eval_batch:
        Samples per forward pass when evaluating the objective, its gradient and accuracy.
    """

    name = "module"

    def __init__(
        self,
        module: torch.nn.Module,
        loss: Loss | None = None,
        *,
        sample_shape: Sequence[int] | None = None,
        l2: float = 0.0,
        accuracy: bool | None = None,
        init: str = "reset",
        initializer: Callable[[torch.nn.Module], None] | None = None,
        vectorize: bool | None = None,
        eval_batch: int = 1024,
        name: str | None = None,
    ) -> None:
        if not isinstance(module, torch.nn.Module):
            raise ConfigError("module", f"must be a torch.nn.Module, got {type(module).__name__}")
        if l2 < 0:
            raise ConfigError("l2", f"must be >= 0, got {l2}")
        if init not in ("reset", "keep"):
            raise ConfigError(
                "init",
                "accepted: 'reset' (PyTorch's initialization under the run's seed) or 'keep' (the module's "
                f"parameters); got {init!r}",
            )
        if eval_batch < 1:
            raise ConfigError("eval_batch", f"must be >= 1, got {eval_batch}")
        _check_module(module)
        self.module, self.loss = module, loss or cross_entropy
        self.sample_shape = None if sample_shape is None else tuple(int(s) for s in sample_shape)
        self.l2, self.init, self.initializer, self.eval_batch = l2, init, initializer, eval_batch
        self.classification = loss is None if accuracy is None else accuracy
        if name is not None:
            self.name = name
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]  # tied parameters once
        if not self.names:
            raise ConfigError("module", "has no trainable parameters")
        params = dict(module.named_parameters())
        self.shapes = [tuple(params[n].shape) for n in self.names]
        self.stochastic = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) for m in module.modules())
        self.recurrent = any(isinstance(m, RECURRENT) for m in module.modules())
        self.vectorize = vectorize
        self._bound: dict[tuple[torch.device, torch.dtype, int], _Bound] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_bound": {}}

    @property
    def dim(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    # -- the module on the parameters' device and dtype --------------------------------------------

    def _instance(self, params: torch.Tensor) -> _Bound:
        """The module bound for ``params``' device and dtype, one per thread (the threaded executor runs clients in
        parallel)."""
        key = (params.device, params.dtype, threading.get_ident())
        if key not in self._bound:
            self._bound[key] = _Bound(self.module, self.names, params.device, params.dtype)
        return self._bound[key]

    def inputs(self, features: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A batch of flat samples as the module's inputs: reshaped to the sample shape, floats in the parameters'
        dtype."""
        x = features if self.sample_shape is None else features.reshape(features.shape[0], *self.sample_shape)
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x

    def split(self, params: torch.Tensor) -> list[torch.Tensor]:
        """Views of the flat vector as the trainable parameters' tensors."""
        pieces, offset = [], 0
        for shape in self.shapes:
            size = math.prod(shape)
            pieces.append(params[..., offset : offset + size].view(*params.shape[:-1], *shape))
            offset += size
        return pieces

    def init_params(self, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
        """x⁰: the modules' ``reset_parameters`` (then ``initializer``) under a seed drawn from ``generator``, or
        the module's own values."""
        module = self.module
        if self.init == "reset":
            module = copy.deepcopy(module)
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for m in module.modules():
                    if hasattr(m, "reset_parameters"):
                        m.reset_parameters()
                if self.initializer is not None:
                    self.initializer(module)
        params = dict(module.named_parameters())
        return torch.cat([params[n].detach().reshape(-1).to(device="cpu", dtype=dtype) for n in self.names])

    # -- per-sample losses and local gradients ----------------------------------------------------

    def _objective(self, outputs: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        losses = self.loss(outputs, labels)
        if losses.shape != weights.shape:
            raise ConfigError(
                "loss",
                f"must return one loss per sample, shape {tuple(weights.shape)}; got {tuple(losses.shape)} (use "
                "reduction='none')",
            )
        return (losses * weights).sum()

    def losses(self, params, features, labels):
        """Per-sample f_j(x) in eval mode, differentiable in ``params``."""
        bound = self._instance(params)
        bound.mode(False)
        pieces = dict(zip(self.names, self.split(params)))
        ce = self.loss(functional_call(bound.module, pieces, (self.inputs(features, params.dtype),)), labels)
        return ce + 0.5 * self.l2 * params.dot(params) if self.l2 else ce

    def batched_gradient(self, params, features, labels, weights):
        """Row c: Σ_b v_cb ∇f(y_c; a_cb) in eval mode (full local gradients)."""
        return self._gradients(params, features, labels, weights, training=False, seeds=None)

    def local_gradient(self, params, features, labels, weights, seeds=None):
        """The minibatch gradients of a local step, in train mode; ``seeds[c]`` seeds client c's dropout masks."""
        if self.stochastic and seeds is None:
            raise ValueError("a module with dropout needs the step seeds of its clients")
        return self._gradients(params, features, labels, weights, training=True, seeds=seeds)

    def _vectorized(self, params: torch.Tensor) -> bool:
        """vmap over clients: never with dropout (its masks would depend on the chunk); by default on CUDA without
        recurrent layers."""
        if self.stochastic:
            return False
        if self.vectorize is None:
            return params.device.type == "cuda" and not self.recurrent
        return self.vectorize

    def _gradients(
        self, params, features, labels, weights, training: bool, seeds: Sequence[int] | None
    ) -> torch.Tensor:
        bound = self._instance(params)
        bound.mode(training)
        if params.shape[0] > 1 and self._vectorized(params):
            out = self._vmap_gradients(bound, params, features, labels, weights)
        else:
            out = torch.empty_like(params)
            for c, grads in self._per_client(bound, params, features, labels, weights, seeds):
                torch.cat([g.reshape(-1) for g in grads], out=out[c])
        if self.l2:
            out.add_(params * (self.l2 * weights.sum(1, keepdim=True)))
        return out

    def descend(self, params, features, labels, weights, lrs, seeds=None):
        """y_c ← y_c − η_c·g_c in train mode, per client on the module's parameters (views of y_c): the gradient
        pieces from backward update their own slices of y_c (``_foreach_add_``), never assembled into one vector."""
        if self.stochastic and seeds is None:
            raise ValueError("a module with dropout needs the step seeds of its clients")
        bound = self._instance(params)
        bound.mode(True)
        if params.shape[0] > 1 and self._vectorized(params):
            return super().descend(params, features, labels, weights, lrs, seeds)
        for c, grads in self._per_client(bound, params, features, labels, weights, seeds):
            pieces = self.split(params[c])
            if self.l2:
                grads = torch._foreach_add(grads, pieces, alpha=self.l2 * float(weights[c].sum()))
            torch._foreach_add_(pieces, grads, alpha=-float(lrs[c]))

    def _per_client(self, bound: _Bound, params, features, labels, weights, seeds: Sequence[int] | None):
        """(c, ∂/∂pieces Σ_b v_cb ℓ(module_{y_c}(a_cb), b_cb)) for each row c, the module's parameters bound to y_c;
        padding rows (weight 0, after the real rows) are not run through the module."""
        counts = (weights > 0).sum(1).tolist()
        devices = [params.device] if params.device.type == "cuda" else []
        try:
            with torch.enable_grad(), torch.random.fork_rng(devices=devices, enabled=seeds is not None):
                for c, n in enumerate(counts):
                    if seeds is not None:
                        _seed(params.device, seeds[c])
                    bound.bind(params[c], self.shapes)
                    total = self._objective(
                        bound.module(self.inputs(features[c, :n], params.dtype)), labels[c, :n], weights[c, :n]
                    )
                    yield c, bound.gradient(total)
        finally:
            bound.release()

    def _vmap_gradients(self, bound: _Bound, params, features, labels, weights) -> torch.Tensor:
        def client(p, f, y, v):
            def total(pieces):
                return self._objective(
                    functional_call(bound.module, dict(zip(self.names, pieces)), (self.inputs(f, p.dtype),)), y, v
                )

            return torch.cat([g.reshape(-1) for g in grad(total)(self.split(p))])

        return vmap(client)(params, features, labels, weights)

    # -- the objective and metrics, in eval mode and in slices ------------------------------------

    def chunk_rows(self, features: torch.Tensor) -> int:
        return self.eval_batch

    def _evaluate(
        self,
        params: torch.Tensor,
        features: torch.Tensor,
        labels: torch.Tensor,
        each: Callable[[_Bound, torch.Tensor, slice | torch.Tensor], None],
        rows: torch.Tensor | None = None,
    ) -> None:
        """``each(bound, outputs, index)`` for the eval-mode outputs of every chunk of ``eval_batch`` samples (of
        ``rows`` only, when given), at x = ``params``."""
        bound = self._instance(params)
        bound.mode(False)
        bound.bind(params.detach(), self.shapes)
        try:
            for index in evaluation_chunks(features.shape[0], rows, self.eval_batch):
                each(bound, bound.module(self.inputs(features[index], params.dtype)), index)
        finally:
            bound.release()

    def weighted_loss(self, params, features, labels, weights):
        if params.requires_grad and torch.is_grad_enabled():
            return super().weighted_loss(params, features, labels, weights)
        total = params.new_zeros(())

        def add(bound, outputs, rows):
            total.add_(self._objective(outputs, labels[rows], weights[rows]))

        with torch.no_grad():
            self._evaluate(params, features, labels, add)
        return total + 0.5 * self.l2 * weights.sum() * params.dot(params) if self.l2 else total

    def weighted_gradient(self, params, features, labels, weights):
        out = torch.zeros_like(params)

        def add(bound, outputs, rows):
            out.add_(
                torch.cat(
                    [g.reshape(-1) for g in bound.gradient(self._objective(outputs, labels[rows], weights[rows]))]
                )
            )

        with torch.enable_grad():
            self._evaluate(params, features, labels, add)
        return out + self.l2 * weights.sum() * params.detach() if self.l2 else out

    def gradient(self, params, features, labels):
        n = features.shape[0]
        return self.weighted_gradient(params, features, labels, params.new_full((n,), 1.0 / n))

    def accuracy(self, params, features, labels):
        if not self.classification:
            return None
        counts = [0, 0]

        def add(bound, outputs, rows):
            right, scored = correct_predictions(outputs, labels[rows])
            counts[0] += int(right)
            counts[1] += int(scored)

        with torch.no_grad():
            self._evaluate(params, features, labels, add)
        return counts[0] / max(counts[1], 1)

    def scores(self, params, features, labels, weights, gradient=True, rows=None):
        """f, ‖∇f‖² and accuracy from one eval-mode forward pass per chunk (and, for the gradient, one backward of it);
        the right predictions are counted on the device and read once."""
        total = params.new_zeros(())
        right, scored = params.new_zeros((), dtype=torch.int64), params.new_zeros((), dtype=torch.int64)
        out = torch.zeros_like(params) if gradient else None

        def add(bound, outputs, index):
            objective = self._objective(outputs, labels[index], weights[index])
            if out is not None:
                out.add_(torch.cat([g.reshape(-1) for g in bound.gradient(objective)]))
            total.add_(objective.detach())
            if self.classification:
                hits, count = correct_predictions(outputs.detach(), labels[index])
                right.add_(hits)
                scored.add_(count)

        with torch.enable_grad() if gradient else torch.no_grad():
            self._evaluate(params, features, labels, add, rows)
        mass = weights.sum() if rows is None else weights[rows].sum()
        loss = float(total + 0.5 * self.l2 * mass * params.dot(params) if self.l2 else total)
        norm = None if out is None else float((out + self.l2 * mass * params.detach() if self.l2 else out).pow(2).sum())
        return Scores(loss, norm, int(right) / max(int(scored), 1) if self.classification else None)


def _seed(device: torch.device, seed: int) -> None:
    """Seed the generator that dropout on ``device`` draws from (only that one: ``torch.manual_seed`` also
    initializes every other backend's generators, at a cost of milliseconds per call)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)


def _check_module(module: torch.nn.Module) -> None:
    """Refuse what a flat parameter vector cannot represent (see the module docstring)."""
    for name, m in module.named_modules():
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
            raise ConfigError(
                "module",
                f"{type(m).__name__} at {name or 'the top'!r} normalizes with batch statistics and keeps running "
                "statistics that a "
                "model of flat parameters cannot carry; replace it with GroupNorm "
                "(fedshuffle.problems.modules.batchnorm_to_groupnorm(module))",
            )
        if isinstance(m, torch.nn.modules.instancenorm._InstanceNorm) and m.track_running_stats:
            raise ConfigError(
                "module",
                f"{type(m).__name__} at {name!r} tracks running statistics; construct it with "
                "track_running_stats=False",
            )
    if any(isinstance(p, torch.nn.parameter.UninitializedParameter) for p in module.parameters()):
        raise ConfigError(
            "module", "has lazy (uninitialized) parameters; run one forward pass on an example input first"
        )
