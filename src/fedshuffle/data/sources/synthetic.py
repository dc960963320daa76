"""Synthetic(α, β) of FedProx (Li et al. 2020, §5.1), generated one device at a time.

Device k (10 classes, 60 features):

    u_k ~ N(0, α²),  B_k ~ N(0, β²)         (α, β read as standard deviations, as numpy's normal(0, α)
                                               in FedProx's generator does; the paper writes N(0, α))
    W_k ∈ R^{60×10}, b_k ∈ R^{10}: entries ~ N(u_k, 1)
    v_k ∈ R^{60}: entries ~ N(B_k, 1);  x ~ N(v_k, Σ), Σ = diag(j^{−1.2});  y = argmax(W_kᵀx + b_k)
    n_k = ⌊LogNormal(4, 2)⌋ + 50 samples, the first ⌊0.9·n_k⌋ for training, the rest for testing.

The IID variant shares one W, b ~ N(0, 1) across devices and draws every x from N(0, Σ). Every device
has its own random stream (seed, device), so device k's data is the same whatever the number of
devices, and a population of any size costs only its size array until devices are used.
FedProx's own script draws all devices from one global stream, so the individual numbers differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.streams import Stream, generator

DIM, CLASSES = 60, 10


@dataclass(frozen=True)
class FedProxSynthetic:
    alpha: float
    beta: float
    devices: int
    seed: int = 0
    iid: bool = False
    sizes: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta < 0:
            raise ConfigError("data.synthetic_alpha", f"α and β must be >= 0, got α={self.alpha}, β={self.beta}")
        if self.devices < 1:
            raise ConfigError("data.clients", f"need at least one device, got {self.devices}")
        limits.check_fits(3 * limits.array_bytes(self.devices), "data.clients", f"the sizes of {self.devices} devices")
        rng = generator(self.seed, Stream.PARTITION)
        object.__setattr__(self, "sizes", np.floor(rng.lognormal(4.0, 2.0, self.devices)).astype(np.int64) + 50)

    def check_memory(self) -> None:
        """Refuse (naming ``data.clients``) a population whose samples do not fit in memory, before any is drawn."""
        limits.check_dataset(
            float(self.sizes.sum(dtype=np.float64)), DIM, "data.clients", f"{self.devices} Synthetic devices"
        )

    @property
    def train_sizes(self) -> np.ndarray:
        return (0.9 * self.sizes).astype(np.int64)

    def parameters(self, device: int) -> dict[str, np.ndarray | float]:
        """The device's generating parameters (u, B, W, b, v)."""
        if self.iid:
            shared = generator(self.seed, Stream.PARTITION, 0, 1)
            return {
                "u": 0.0,
                "B": 0.0,
                "W": shared.normal(0, 1, (DIM, CLASSES)),
                "b": shared.normal(0, 1, CLASSES),
                "v": np.zeros(DIM),
            }
        rng = generator(self.seed, Stream.PARTITION, device + 1, 0)
        u, big_b = rng.normal(0, self.alpha), rng.normal(0, self.beta)
        return {
            "u": u,
            "B": big_b,
            "W": rng.normal(u, 1, (DIM, CLASSES)),
            "b": rng.normal(u, 1, CLASSES),
            "v": rng.normal(big_b, 1, DIM),
        }

    def device(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        """All of device ``device``'s samples (train first), features ``(n_k, 60)`` and labels."""
        p = self.parameters(device)
        rng = generator(self.seed, Stream.PARTITION, device + 1, 2)
        scale = np.arange(1, DIM + 1) ** -0.6  # √(j^−1.2)
        x = p["v"] + rng.normal(size=(int(self.sizes[device]), DIM)) * scale
        return x, np.argmax(x @ p["W"] + p["b"], axis=1)

    def train(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.device(device)
        cut = int(self.train_sizes[device])
        return x[:cut], y[:cut]

    def test(self, device: int) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.device(device)
        cut = int(self.train_sizes[device])
        return x[cut:], y[cut:]
