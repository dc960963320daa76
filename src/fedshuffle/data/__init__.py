"""Federated data: datasets (in memory or generated on demand), partitions, and sources."""

from .federated import ClientRows, FederatedDataset, LazyFederatedDataset, objective_weights
from .partitions import (
    contiguous_partition,
    dirichlet_partition,
    equal_partition,
    iid_partition,
    label_partition,
    pachinko_partition,
    shard_partition,
)

__all__ = [
    "ClientRows",
    "FederatedDataset",
    "LazyFederatedDataset",
    "contiguous_partition",
    "dirichlet_partition",
    "equal_partition",
    "iid_partition",
    "label_partition",
    "objective_weights",
    "pachinko_partition",
    "shard_partition",
]
