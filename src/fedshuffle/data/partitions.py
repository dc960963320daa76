"""Partitioners: sample indices -> client index sets."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.errors import ConfigError


def contiguous_partition(sizes: Sequence[int]) -> list[np.ndarray]:
    """Client i owns the next ``sizes[i]`` samples, in order (the FedShuffle quadratic (36))."""
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return [np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]


def iid_partition(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle uniformly, then split into ``num_clients`` nearly equal parts."""
    if num_clients > num_samples:
        raise ConfigError("data.clients", f"{num_clients} clients but only {num_samples} samples")
    return [np.sort(part) for part in np.array_split(rng.permutation(num_samples), num_clients)]


def equal_partition(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Shuffle uniformly and give each client ⌊N/M⌋ samples; the remainder is left out (RR-CLI paper §4.2)."""
    per_client = num_samples // num_clients
    if per_client < 1:
        raise ConfigError("data.clients", f"{num_clients} clients but only {num_samples} samples")
    order = rng.permutation(num_samples)[: per_client * num_clients]
    return [np.sort(part) for part in order.reshape(num_clients, per_client)]


def dirichlet_partition(
    labels: np.ndarray, num_clients: int, alpha: float, rng: np.random.Generator, min_size: int = 1
) -> list[np.ndarray]:
    """Label-Dirichlet (LDA) split: for each class, client shares ~ Dir(α·1) (Hsu et al. 2019).

    Follows the FedNova reference code: a client's share of a class is zeroed once it holds
    ≥ N/n samples, and the draw is repeated until every client has ≥ ``min_size`` samples.
    """
    if alpha <= 0:
        raise ConfigError("data.alpha", f"Dirichlet concentration must be > 0, got {alpha}")
    labels = np.asarray(labels)
    n = len(labels)
    for _ in range(1000):
        parts: list[list[int]] = [[] for _ in range(num_clients)]
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            share = rng.dirichlet(np.full(num_clients, alpha))
            share *= np.array([len(p) < n / num_clients for p in parts])
            share /= share.sum()
            cuts = (np.cumsum(share) * len(idx)).astype(int)[:-1]
            for k, chunk in enumerate(np.split(idx, cuts)):
                parts[k].extend(chunk.tolist())
        if min(len(p) for p in parts) >= min_size:
            return [np.sort(np.array(p, dtype=np.int64)) for p in parts]
    raise ConfigError("data.alpha", f"could not give every client {min_size} samples with α={alpha}; raise α or lower the number of clients")
