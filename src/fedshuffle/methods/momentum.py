"""FedShuffle's global momentum around any method (Horváth et al., TMLR 2022, §5.1, eqs. (12)–(14), Appendix F)."""

from __future__ import annotations

import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.local.steps import Drift
from fedshuffle.methods.base import Method, sample_gradients

ESTIMATORS = ("exact", "approx")


class GlobalMomentum(Method):
    """Wraps a method (as optax's ``MultiSteps`` wraps an optimizer): the server keeps a momentum m^r,
    broadcasts it, and every local step of the inner method's clients folds it in.

    ``estimator="exact"`` (FedShuffleMVR, eqs. (12)–(14)): before training, the cohort returns full
    gradients at x^r and x^{r−1} (a gradient exchange of its own), and

        m^r = a·Σ_S ω_i∇f_i(x^r) + (1−a)·m^{r−1} + (1−a)·Σ_S ω_i(∇f_i(x^r) − ∇f_i(x^{r−1})),

    with ω_i = w_i/E[c_i]; clients step with d = ∇f_{iΠ}(y) + (1−a)(m^r − ∇f_{iΠ}(x^r)) (eq. (13)).
    We start from m^{−1} = 0 and x^{−1} = x^0, which the paper leaves open.

    ``estimator="approx"`` (Appendix F, real data): the last terms of (13)–(14) are dropped and
    ∇f_i(x^r) ≈ Δ_i/(τ_iη_i). Clients step with d = a∇f_{iΠ}(y) + (1−a)m, and after the round
    m ← Σ_S ω_iΔ_i/(τ_iη_i), which equals a·ĝ + (1−a)m for ĝ the estimate above. As in the reference
    code, round 0 (no momentum yet) runs plain local steps. β = 1 − a (the paper uses 0.9).
    """

    def __init__(self, inner: Method, beta: float = 0.9, estimator: str = "exact") -> None:
        super().__init__(inner.aggregator)
        if not 0 < beta < 1:
            raise ConfigError("global_momentum", f"must be in (0, 1), got {beta}")
        if estimator not in ESTIMATORS:
            raise ConfigError("momentum_estimator", f"unknown {estimator!r}; accepted: {', '.join(ESTIMATORS)}")
        self.inner, self.beta, self.estimator = inner, beta, estimator
        self.name = inner.name
        self.state_fields = inner.state_fields
        self.payload_fields = inner.payload_fields
        self.needs_cycles = inner.needs_cycles
        self.sets_own_prox = inner.sets_own_prox
        self.plain_local_steps = False  # every local step folds the momentum in

    @property
    def a(self) -> float:
        return 1.0 - self.beta

    def init(self, params):
        return {
            "inner": self.inner.init(params),
            "momentum": torch.zeros_like(params),
            "previous": params.clone(),
            "started": torch.tensor(False),
        }

    def gradient_requests(self, rnd, params, state):
        return [params, state["previous"]] if self.estimator == "exact" else []

    def absorb_gradients(self, rnd, params, state, gradients):
        m = (1 - self.a) * state["momentum"]
        if len(rnd.cohort):
            weights = torch.as_tensor(rnd.unbiased, dtype=params.dtype, device=params.device)
            now, before = weights @ gradients[0], weights @ gradients[1]
            m = m + self.a * now + (1 - self.a) * (now - before)
        return {**state, "momentum": m, "previous": params.clone(), "started": torch.tensor(True)}

    def configure(self, rnd, params, state):
        broadcast = dict(self.inner.configure(rnd, params, state["inner"]))
        if bool(state["started"]):
            broadcast["momentum"] = state["momentum"]
        return broadcast

    def client_update(self, broadcast, plans, rows, trainer):
        if "momentum" not in broadcast:
            return self.inner.client_update(broadcast, plans, rows, trainer)
        correction = self.estimator == "exact"
        result = self.inner.client_update(
            broadcast, plans, rows, trainer.with_drift(Drift(self.a, broadcast["momentum"], correction))
        )
        if correction:  # each step also takes the minibatch gradient at x
            result.sample_gradients += sample_gradients(plans)
        return result

    def aggregate(self, rnd, params, state, payload):
        direction, inner_state, extras = self.inner.aggregate(rnd, params, state["inner"], payload)
        state = {**state, "inner": inner_state}
        if self.estimator == "approx" and len(rnd.cohort):
            deltas = payload["delta"]
            scale = torch.as_tensor(
                [u / (p.steps * p.lr) for u, p in zip(rnd.unbiased, rnd.plans)],
                dtype=deltas.dtype,
                device=deltas.device,
            )
            state = {**state, "momentum": scale @ deltas, "started": torch.tensor(True)}
        return direction, state, extras

    def aggregation_weights(self, rnd):
        return self.inner.aggregation_weights(rnd)

    def describe(self):
        return f"{self.inner.describe()} with global momentum β = {self.beta} ({self.estimator})"
