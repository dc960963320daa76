"""Federated datasets: clients as index sets over shared tensors.

The objective of every run is

    f(x) = Σ_i w_i f_i(x),    f_i(x) = (1/|D_i|) Σ_{j ∈ D_i} f_ij(x),

with objective weights w_i (default |D_i|/|D|, FedShuffle paper eq. (1)). All samples live in one
``features``/``labels`` pair; client i owns the rows ``client_indices[i]``. For populations too large
to hold, :class:`LazyFederatedDataset` generates a client's rows when it takes part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ..core.errors import ConfigError


class PopulationCounts:
    """The counts of a federation read from its client sizes |D_i|: shared by in-memory and generated
    datasets and by the server's and a node's views of a federation that holds no samples."""

    sizes: np.ndarray

    @property
    def num_clients(self) -> int:
        return len(self.sizes)

    @property
    def num_samples(self) -> int:
        return int(self.sizes.sum())


_CASTING = threading.Lock()


@dataclass
class FederatedDataset(PopulationCounts):
    """Clients as index sets into shared tensors.

    Parameters
    ----------
    features, labels:
        All training samples, shape ``(N, ...)`` and ``(N,)``.
    client_indices:
        One int64 array per client, the rows of ``features`` it owns (disjoint, non-empty).
    weights:
        Objective weights w_i, non-negative and summing to one.
    test_features, test_labels:
        Optional held-out samples for test metrics.
    test_client_sizes:
        Where each client has its own held-out samples (FedProx's Synthetic devices): how many, client after
        client, as contiguous blocks of ``test_features`` (zero for a client without any). None: the test set
        is pooled.
    float_dtype:
        The dtype of the sample weights when the features are not floating (token ids); otherwise the features'.
    """

    features: torch.Tensor
    labels: torch.Tensor
    client_indices: list[np.ndarray]
    weights: np.ndarray
    test_features: torch.Tensor | None = None
    test_labels: torch.Tensor | None = None
    name: str = "dataset"
    float_dtype: torch.dtype = torch.float64
    test_client_sizes: np.ndarray | None = None
    sizes: np.ndarray = field(init=False)
    #: :meth:`to`'s results, so that runs sharing this dataset share its cast too (replicas stack only shared data)
    _casts: dict[tuple[torch.dtype, str], FederatedDataset] = field(
        init=False, default_factory=dict, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        self.client_indices = [np.asarray(ix, dtype=np.int64) for ix in self.client_indices]
        self.sizes = np.array([len(ix) for ix in self.client_indices], dtype=np.int64)
        self.weights = np.asarray(self.weights, dtype=np.float64)
        n_samples = self.features.shape[0]
        if self.features.dim() == 0 or self.labels.dim() == 0:
            raise ConfigError(
                "data",
                "features and labels need one row per sample (labels: a class, or per-position targets), got shapes "
                f"{tuple(self.features.shape)} and {tuple(self.labels.shape)}",
            )
        if self.labels.shape[0] != n_samples:
            raise ConfigError("data", f"{n_samples} feature rows but {self.labels.shape[0]} labels")
        if n_samples and self.features[0].numel() == 0:
            raise ConfigError(
                "data", f"every sample needs at least one feature, got feature shape {tuple(self.features.shape[1:])}"
            )
        if self.features.is_complex() or self.labels.is_complex():
            raise ConfigError("data", "features and labels must be real numbers, got complex ones")
        if not self.client_indices:
            raise ConfigError("data.clients", "a dataset needs at least one client")
        empty = np.flatnonzero(self.sizes == 0)
        if empty.size:
            raise ConfigError(
                "data.client_sizes", f"client {int(empty[0])} has no samples; every client needs at least one"
            )
        if self.weights.shape != (self.num_clients,):
            raise ConfigError("data.weights", f"expected {self.num_clients} weights, got {self.weights.shape[0]}")
        if np.any(~(self.weights >= 0)) or not np.isclose(self.weights.sum(), 1.0, rtol=0, atol=1e-12):
            raise ConfigError("data.weights", "objective weights must be non-negative and sum to 1")
        flat = np.concatenate(self.client_indices)
        if flat.min() < 0 or flat.max() >= n_samples:
            raise ConfigError("data", "client index out of range of the sample tensor")
        owners = np.bincount(flat, minlength=n_samples)
        if owners.max(initial=0) > 1:
            row = int(np.argmax(owners))
            raise ConfigError(
                "data",
                f"sample {row} is owned {int(owners[row])} times (by clients "
                f"{[i for i, ix in enumerate(self.client_indices) if row in ix][:5]}); clients must own "
                "disjoint rows",
            )
        if self.test_features is not None and (
            self.test_labels is None
            or self.test_features.shape[0] != self.test_labels.shape[0]
            or self.test_features.shape[1:] != self.features.shape[1:]
        ):
            raise ConfigError("data", "test features must have the training samples' shape and one label each")
        if self.test_client_sizes is not None:
            self.test_client_sizes = np.asarray(self.test_client_sizes, dtype=np.int64)
            held = 0 if self.test_features is None else self.test_features.shape[0]
            if (
                self.test_client_sizes.shape != (self.num_clients,)
                or self.test_client_sizes.min() < 0
                or self.test_client_sizes.sum() != held
            ):
                raise ConfigError(
                    "data",
                    f"test_client_sizes must give each of the {self.num_clients} clients its count of the {held} "
                    "test samples",
                )

    def client_test_rows(self) -> ClientRows | None:
        """Each client's rows of ``test_features`` (None where the test set is pooled)."""
        if self.test_client_sizes is None:
            return None
        return ClientRows(self.test_client_sizes)

    def held_rows(self) -> np.ndarray | None:
        """The rows of ``features`` that some client holds, ascending: the samples of the objective, which the
        training metrics score (None: every row is held)."""
        held = np.sort(np.concatenate(self.client_indices))  # disjoint sets
        return None if len(held) == self.features.shape[0] else held

    def sample_weights(self) -> torch.Tensor:
        """Per-sample weights s_j = w_i/|D_i| for j ∈ D_i, so that f(x) = Σ_j s_j f_j(x)."""
        s = np.zeros(self.features.shape[0], dtype=np.float64)
        for i, ix in enumerate(self.client_indices):
            s[ix] = self.weights[i] / len(ix)
        dtype = self.features.dtype if self.features.is_floating_point() else self.float_dtype
        return torch.as_tensor(s, dtype=dtype, device=self.features.device)

    def to(self, dtype: torch.dtype, device: str | torch.device | None = None) -> FederatedDataset:
        """The same dataset with floating tensors cast to ``dtype`` and every tensor moved to ``device`` (made once per
        dtype and device, then the same object)."""

        def cast(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)

        key = (dtype, str(device))
        with _CASTING:  # runs build their simulations in threads (replicas)
            if key not in self._casts:
                self._casts[key] = FederatedDataset(
                    cast(self.features),
                    cast(self.labels),
                    self.client_indices,
                    self.weights,
                    cast(self.test_features),
                    cast(self.test_labels),
                    self.name,
                    dtype,
                    self.test_client_sizes,
                )
            return self._casts[key]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_casts": {}}  # a pickled copy (a worker's) casts again where it needs to


class ClientRows(Sequence):
    """``client_indices`` of clients with contiguous rows, without storing them: client i owns
    rows offsets[i] ≤ j < offsets[i+1]."""

    def __init__(self, sizes: np.ndarray) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i):
        return np.arange(self.offsets[i], self.offsets[i + 1], dtype=np.int64)


@dataclass
class LazyFederatedDataset(PopulationCounts):
    """Clients whose samples are generated when they take part: memory grows with the cohort, not with n.

    ``make_client(i)`` returns client i's ``(features, labels)`` as arrays and must be deterministic.
    Rows are numbered globally (client i's j-th sample is row offsets[i] + j) as in
    :class:`FederatedDataset`, so samplers, plans and executors treat both alike; executors fetch the
    rows a round needs with :meth:`gather`. Whole-population quantities (f(x), x*) are not available.
    """

    sizes: np.ndarray
    weights: np.ndarray
    make_client: Callable[[int], tuple[np.ndarray, np.ndarray]]
    feature_shape: tuple[int, ...]
    dtype: torch.dtype = torch.float64
    device: str | torch.device = "cpu"
    name: str = "lazy"
    client_indices: ClientRows = field(init=False)

    def __post_init__(self) -> None:
        self.sizes = np.asarray(self.sizes, dtype=np.int64)
        self.weights = np.asarray(self.weights, dtype=np.float64)
        if self.sizes.ndim != 1 or self.sizes.size == 0 or self.sizes.min(initial=1) < 1:
            raise ConfigError("data.client_sizes", "every client needs at least one sample")
        if int(np.prod(self.feature_shape)) < 1:
            raise ConfigError(
                "data", f"every sample needs at least one feature, got feature shape {tuple(self.feature_shape)}"
            )
        if (
            self.weights.shape != self.sizes.shape
            or np.any(~(self.weights >= 0))
            or not np.isclose(self.weights.sum(), 1.0, rtol=0, atol=1e-9)
        ):
            raise ConfigError("data.weights", f"expected {len(self.sizes)} non-negative weights summing to 1")
        self.client_indices = ClientRows(self.sizes)

    def gather(self, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Features and labels of the sorted, distinct global ``rows``, generating only their clients."""
        offsets = self.client_indices.offsets
        owners = np.searchsorted(offsets, rows, side="right") - 1
        parts_x, parts_y = [], []
        for client in np.unique(owners):
            x, y = self.make_client(int(client))
            local = rows[owners == client] - offsets[client]
            parts_x.append(np.asarray(x)[local])
            parts_y.append(np.asarray(y)[local])
        features = torch.as_tensor(np.concatenate(parts_x)).to(self.device, self.dtype)
        labels = torch.as_tensor(np.concatenate(parts_y)).to(self.device)
        return features, labels.to(self.dtype) if labels.is_floating_point() else labels

    def to(self, dtype: torch.dtype, device: str | torch.device | None = None) -> LazyFederatedDataset:
        return replace(self, dtype=dtype, device=device or self.device)


def localized(
    data: LazyFederatedDataset, row_sets: Sequence[np.ndarray]
) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """Of lazy data, generate only the rows ``row_sets`` use (−1 is padding) and renumber the sets into them."""
    rows = np.unique(np.concatenate([r[r >= 0] for r in row_sets]))
    features, labels = data.gather(rows)
    return features, labels, [np.where(r >= 0, np.searchsorted(rows, r), -1) for r in row_sets]


def client_rows(
    data: FederatedDataset | LazyFederatedDataset, clients: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, list[np.ndarray]]:
    """Sample tensors and, per client, its rows in them (all of its data), for full local gradients."""
    own = [data.client_indices[i] for i in clients]
    if not isinstance(data, LazyFederatedDataset):
        return data.features, data.labels, own
    return localized(data, own)


def objective_weights(sizes: np.ndarray, kind: str | Sequence[float]) -> np.ndarray:
    """Objective weights w_i: ``"size"`` (|D_i|/|D|), ``"uniform"`` (1/n) or explicit values (normalized)."""
    sizes = np.asarray(sizes, dtype=np.float64)
    if isinstance(kind, str):
        if kind == "size":
            return sizes / sizes.sum()
        if kind == "uniform":
            return np.full(len(sizes), 1.0 / len(sizes))
        raise ConfigError("data.weights", f"unknown weights {kind!r}; accepted: 'size', 'uniform' or a list of numbers")
    w = np.asarray(kind, dtype=np.float64)
    if w.shape != sizes.shape:
        raise ConfigError("data.weights", f"expected {len(sizes)} weights (one per client), got {w.size}")
    if np.any(~np.isfinite(w)) or np.any(w < 0) or w.sum() <= 0:
        raise ConfigError("data.weights", "weights must be finite, non-negative and not all zero")
    return w / w.sum()
