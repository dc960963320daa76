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
    raise ConfigError(
        "data.alpha",
        f"could not give every client {min_size} samples with α={alpha}; raise α or lower the number of clients",
    )


def _class_labels(labels: np.ndarray, partition: str) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ConfigError(
            "data.partition",
            f"{partition!r} splits by class and needs one label per sample; this source has targets of shape "
            f"{labels.shape[1:]} per sample",
        )
    return labels


def label_partition(
    labels: np.ndarray, num_clients: int, labels_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Every client holds exactly p = ``labels_per_client`` labels and the same number of samples
    (Yang, Fang & Liu, ICLR 2021, App. B.1: MNIST over m = 100 workers, p ∈ {1, 2, 5, 10}).

    The paper says only that the data are distributed "randomly and evenly in a digit-based manner";
    this is the balanced design used here: with the C labels in a random order π, client i holds the
    p cyclically consecutive labels π(s_i), …, π(s_i + p − 1), where the offsets s_i = 0, 1, …, C−1
    are dealt round-robin over a random order of the clients. Label c is then held by h_c clients
    (mp/C each when C divides m); each holder gets q = min_c ⌊n_c/h_c⌋ random samples of it, so every
    client holds p·q samples. The other samples are left out (MNIST, m = 100: q = ⌊5421/(10p)⌋, so
    542, 542, 540 and 540 samples per client for p = 1, 2, 5, 10).
    """
    labels = _class_labels(labels, "labels")
    classes = np.unique(labels)
    num_classes = len(classes)
    if not 1 <= labels_per_client <= num_classes:
        raise ConfigError(
            "data.labels_per_client",
            f"must be between 1 and the {num_classes} labels of the data, got {labels_per_client}",
        )
    order = rng.permutation(classes)
    offsets = np.empty(num_clients, dtype=np.int64)
    offsets[rng.permutation(num_clients)] = np.arange(num_clients) % num_classes
    held = (offsets[:, None] + np.arange(labels_per_client)) % num_classes  # client → positions in `order`
    holders = [np.flatnonzero((held == k).any(axis=1)) for k in range(num_classes)]
    pools = [rng.permutation(np.flatnonzero(labels == order[k])) for k in range(num_classes)]
    per_label = min(len(pool) // max(len(h), 1) for pool, h in zip(pools, holders) if len(h))
    if per_label < 1:
        raise ConfigError(
            "data.clients",
            f"{num_clients} clients with {labels_per_client} labels each leave no sample for some client; use fewer "
            "clients",
        )
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for pool, clients in zip(pools, holders):
        for j, client in enumerate(clients):
            parts[client].append(pool[j * per_label : (j + 1) * per_label])
    return [np.sort(np.concatenate(p)) for p in parts]


def shard_partition(
    labels: np.ndarray, num_clients: int, shards_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """McMahan et al. (AISTATS 2017): sort the samples by label, cut them into m·s shards of ⌊N/(m·s)⌋
    consecutive samples and give each of the m clients s shards at random (MNIST: 200 shards of 300;
    CIFAR-10 as Yang et al. App. B.2: 200 shards of 250, two per client). Ties keep the incoming
    (shuffled) order; the last N mod (m·s) samples of the sorted order are left out."""
    labels = _class_labels(labels, "shards")
    total = num_clients * shards_per_client
    size = len(labels) // total
    if size < 1:
        raise ConfigError(
            "data.shards_per_client",
            f"{num_clients} clients × {shards_per_client} shards is more than the {len(labels)} samples",
        )
    shards = np.argsort(labels, kind="stable")[: total * size].reshape(total, size)
    return [np.sort(shards[deal].ravel()) for deal in rng.permutation(total).reshape(num_clients, shards_per_client)]


def pachinko_partition(
    labels: np.ndarray, label_groups: np.ndarray, num_clients: int, alpha: float, beta: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """The Pachinko allocation (Li & McCallum, ICML 2006) of TFF's federated CIFAR-100, as described by
    Reddi et al. (ICLR 2021, "Adaptive Federated Optimization", App. C.1): clients are filled one after
    another with ⌊N/m⌋ samples each. Client k draws a distribution over the coarse labels ~ Dir(α·1)
    and, for each coarse label, one over its fine labels ~ Dir(β·1); each sample draws a coarse label,
    then a fine label, then an image of that fine label without replacement. An exhausted fine label
    (and a coarse label whose fine labels are all exhausted) is removed and the distributions
    renormalized; should a client's remaining coarse mass be numerically zero it falls back to the
    uniform distribution over the coarse labels left. TFF's split: α = 0.1, β = 10, 500 clients of 100.
    ``label_groups[c]`` is the coarse label of fine label c.
    """
    labels = _class_labels(labels, "pachinko")
    groups = np.asarray(label_groups, dtype=np.int64)
    if labels.max(initial=0) >= len(groups) or (groups[np.unique(labels)] < 0).any():
        raise ConfigError("data.partition", "'pachinko' needs the coarse label of every fine label present")
    per_client = len(labels) // num_clients
    if per_client < 1:
        raise ConfigError("data.clients", f"{num_clients} clients but only {len(labels)} samples")
    num_groups = int(groups.max()) + 1
    members = [np.flatnonzero(groups == g) for g in range(num_groups)]
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in range(len(groups))]
    left = np.array([len(p) for p in pools], dtype=np.int64)
    parts = []
    for _ in range(num_clients):
        coarse = rng.dirichlet(np.full(num_groups, alpha))
        gammas = rng.gamma(beta, size=len(groups))  # normalized within each coarse label: Dir(β·1) per coarse label
        fine = gammas / np.bincount(groups, weights=gammas, minlength=num_groups)[groups]
        taken: list[np.ndarray] = []
        need = per_client
        while need:
            # Draw the rest of the client's samples from the current distributions, keep them up to the first
            # draw that exhausts a label (a stopping time, so this is the sequential process), then renormalize.
            open_groups = np.bincount(groups, weights=left, minlength=num_groups) > 0
            weights = coarse * open_groups
            g = _draw(weights if weights.sum() > 0 else open_groups.astype(np.float64), rng.random(need))
            c = np.empty(need, dtype=np.int64)
            u = rng.random(need)
            for group in np.unique(g):
                at = g == group
                c[at] = members[group][_draw(fine[members[group]] * (left[members[group]] > 0), u[at])]
            rank = _ranks(c)
            exhausting = np.flatnonzero(rank + 1 == left[c])
            keep = int(exhausting[0]) + 1 if exhausting.size else need
            for label, count in zip(*np.unique(c[:keep], return_counts=True)):
                taken.append(pools[label][left[label] - count : left[label]])
                left[label] -= count
            need -= keep
        parts.append(np.sort(np.concatenate(taken)))
    return parts


def _ranks(values: np.ndarray) -> np.ndarray:
    """For each position, how many earlier positions hold the same value."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.flatnonzero(np.r_[True, sorted_values[1:] != sorted_values[:-1]])
    run_start = np.repeat(starts, np.diff(np.r_[starts, len(values)]))
    rank = np.empty(len(values), dtype=np.int64)
    rank[order] = np.arange(len(values)) - run_start
    return rank


def _draw(weights: np.ndarray, u: np.ndarray) -> np.ndarray:
    """Indices drawn with probability ∝ ``weights`` (non-negative, not all zero) by inverting uniforms ``u``; never
    a zero-weight index."""
    cumulative = np.cumsum(weights)
    k = np.searchsorted(cumulative, u * cumulative[-1], side="right")
    return np.where(k < len(weights), k, np.flatnonzero(weights > 0)[-1])
