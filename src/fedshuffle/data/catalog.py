"""The data registries: sources (where samples come from) and partitions (how they are split among clients).

A source returns :class:`Samples`: pooled samples that a partition then splits, or samples that come
with their own clients (LEAF users, FedProx's synthetic devices). :func:`federate` turns a source and
a partition into a :class:`~fedshuffle.data.federated.FederatedDataset`. Each function declares its
settings as typed keyword parameters (:mod:`fedshuffle.core.registry`); the ``[data]`` section holds the
chosen source's and partition's settings beside the common ones, so a new source or partition is one
function and one ``add`` line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
import torch
from pydantic import AfterValidator, Field, PositiveInt

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.inputs import DataPath
from fedshuffle.core.registry import Example, ModelSize, Registry
from fedshuffle.core.streams import Stream, generator
from fedshuffle.data import partitions
from fedshuffle.data.federated import FederatedDataset, objective_weights
from fedshuffle.data.sources import (
    LIBSVM_DATASETS,
    arrays,
    cifar,
    load_libsvm_dataset,
    mnist,
    read_svmlight,
    shakespeare,
)
from fedshuffle.data.sources.fetch import resolve_data_path
from fedshuffle.data.sources.leaf import load_leaf
from fedshuffle.data.sources.synthetic import FedProxSynthetic


@dataclass
class Samples:
    """What a source provides.

    ``features`` ``(N, ...)`` (images ``(N, C, H, W)`` float32; text ``(N, 80)`` int64 token ids) and
    integer ``labels`` ``(N,)`` (zeros where there are none; ``(N, 80)`` per-position targets for TFF
    Shakespeare); ``num_classes`` (0 for targets without classes; the vocabulary size for text); an
    official ``test`` split if the source has one; ``client_sizes`` when the samples come already
    split into clients (contiguous blocks); ``label_groups[c]``, the coarse class of class c, where
    the data has one (CIFAR-100's 20 superclasses); ``test_client_sizes`` when each client has its own test
    samples, contiguous blocks of ``test`` in client order (FedProx's Synthetic devices).
    """

    features: np.ndarray
    labels: np.ndarray
    num_classes: int
    test: tuple[np.ndarray, np.ndarray] | None = None
    client_sizes: np.ndarray | None = None
    label_groups: np.ndarray | None = None
    test_client_sizes: np.ndarray | None = None


def _positive_sizes(sizes: list[int] | None) -> list[int] | None:
    if sizes is not None and (not sizes or any(s < 1 for s in sizes)):
        raise ValueError("every client needs at least one sample (all sizes >= 1)")
    return sizes


#: the number of clients of a partition; for sources with their own clients, keep the first this many
Clients = Annotated[
    PositiveInt | None,
    Field(description="number of clients (of a partition; of a source with its own clients: keep the first this many)"),
]
#: contiguous client blocks
ClientSizes = Annotated[
    list[int] | None, AfterValidator(_positive_sizes), Field(description="the clients' sizes, as contiguous blocks")
]
#: images scaled by the training set's per-channel statistics
Standardize = Annotated[
    bool,
    Field(description="subtract the training set's per-channel mean, divide by its std (default: pixels in [0, 1])"),
]


def _num_classes(*label_arrays: np.ndarray) -> int:
    return max((int(y.max()) + 1 for y in label_arrays if y.size), default=0)


def targets_source(client_sizes: ClientSizes = None, path: DataPath = None) -> Samples:
    """Targets a_ij of the quadratic f_ij(x) = ½‖x − a_ij‖²: e_1..e_N (FedShuffle eq. (36)) or an ``.npy`` file (N,
    d)."""
    if client_sizes is None:
        raise ConfigError("client_sizes", "source = 'targets' needs client_sizes (contiguous blocks of targets)")
    total = sum(client_sizes)
    if path is None:
        limits.check_dataset(total, total, "client_sizes", "the identity targets e_1..e_N")
    targets = np.eye(total) if path is None else arrays.load_targets(path)
    if targets.shape[0] != total:
        raise ConfigError("client_sizes", f"sizes sum to {total} but {path} has {targets.shape[0]} targets")
    return Samples(targets, np.zeros(total, dtype=np.int64), 0, client_sizes=np.asarray(client_sizes))


def synthetic_source(
    rng: np.random.Generator,
    samples: Annotated[int, Field(ge=1, description="number of samples")] = 1000,
    features: Annotated[int, Field(ge=1, description="features per sample")] = 10,
    classes: Annotated[int, Field(ge=2, description="number of classes"), ModelSize()] = 2,
    separation: Annotated[float, Field(ge=0, description="distance between the class means")] = 1.0,
) -> Samples:
    """Gaussian class clusters (:func:`fedshuffle.data.sources.arrays.synthetic_classification`)."""
    x, y = arrays.synthetic_classification(samples, features, classes, rng, separation)
    return Samples(x, y, classes)


def libsvm_source(
    dataset: Annotated[
        str | None, Field(description=f"a registered dataset ({', '.join(LIBSVM_DATASETS)}); or give path")
    ] = None,
    path: DataPath = None,
    libsvm_test: Annotated[
        bool, Field(description="evaluate on LIBSVM's own test file (<dataset>.t), where it has one")
    ] = False,
    data_dirs: Sequence[str] = (),
    download: bool = True,
    verify: bool = True,
    test_fraction: float = 0.0,
) -> Samples:
    """A registered LIBSVM dataset (located, cached, checksummed) or any binary svmlight file."""
    if (dataset is None) == (path is None):
        raise ConfigError(
            "dataset",
            f"source = 'libsvm' needs exactly one of dataset (one of {', '.join(LIBSVM_DATASETS)}) or path (an "
            "svmlight file)",
        )
    x, y = (
        load_libsvm_dataset(dataset, data_dirs=data_dirs, download=download, verify=verify)
        if dataset
        else read_svmlight(path)
    )
    test = None
    if libsvm_test:
        if dataset is None or test_fraction:
            raise ConfigError(
                "libsvm_test", "needs data.dataset and test_fraction = 0 (the test set is LIBSVM's own file)"
            )
        test = load_libsvm_dataset(dataset, "test", data_dirs=data_dirs, download=download, verify=verify)
    return Samples(x, y, _num_classes(y, *(test[1:] if test else ())), test)


def npz_source(path: DataPath = None) -> Samples:
    """Features ``x`` and integer labels ``y`` from an ``.npz`` file."""
    if path is None:
        raise ConfigError("path", "source = 'npz' needs a path to an .npz file with arrays x and y")
    x, y = arrays.load_npz(path)
    if y.min(initial=0) < 0:
        raise ConfigError("path", f"{path}: labels must be 0..C-1, found {int(y.min())}")
    return Samples(x, y, _num_classes(y))


def _clients(train: list[tuple[np.ndarray, np.ndarray]], test: tuple[np.ndarray, np.ndarray]) -> Samples:
    features = np.concatenate([x for x, _ in train])
    labels = np.concatenate([y for _, y in train])
    return Samples(
        features,
        labels,
        _num_classes(labels, test[1]),
        test if len(test[1]) else None,
        np.array([len(y) for _, y in train]),
    )


def fedprox_synthetic_source(
    seed: int,
    clients: Clients = None,
    synthetic_alpha: Annotated[float, Field(ge=0, description="std of u_k (model heterogeneity)")] = 0.0,
    synthetic_beta: Annotated[float, Field(ge=0, description="std of B_k (data heterogeneity)")] = 0.0,
    iid: Annotated[bool, Field(description="the IID variant (shared W, b; x ~ N(0, Σ))")] = False,
) -> Samples:
    """Synthetic(α, β) devices of Li et al. (MLSys 2020, FedProx), each with its own training and test samples."""
    if clients is None:
        raise ConfigError("clients", "fedprox_synthetic needs the number of devices")
    gen = FedProxSynthetic(synthetic_alpha, synthetic_beta, clients, seed, iid)
    gen.check_memory()
    held = [gen.test(k) for k in range(clients)]
    samples = _clients(
        [gen.train(k) for k in range(clients)],
        (np.concatenate([x for x, _ in held]), np.concatenate([y for _, y in held])),
    )
    samples.num_classes = 10
    samples.test_client_sizes = np.array([len(y) for _, y in held])
    return samples


def leaf_source(path: DataPath = None, clients: Clients = None) -> Samples:
    """LEAF users (Caldas et al., 2018) from a folder with ``train/`` and ``test/`` JSON files."""
    if path is None:
        raise ConfigError("path", "source = 'leaf' needs path: a LEAF folder with train/ and test/")
    _, train, test = load_leaf(path, clients)
    return _leaf_samples(train, test)


def _leaf_samples(train: list[tuple[np.ndarray, np.ndarray]], test: tuple[np.ndarray, np.ndarray]) -> Samples:
    samples = _clients(train, test)
    if np.issubdtype(samples.features.dtype, np.integer):  # text: LEAF Shakespeare's character ids
        samples.num_classes = len(shakespeare.LEAF_VOCAB)
    return samples


def _standardized(train: np.ndarray, test: np.ndarray) -> None:
    """Subtract the training images' per-channel mean and divide by their standard deviation, in place."""
    axes = (0, *range(2, train.ndim))
    mean = train.mean(axis=axes, keepdims=True, dtype=np.float64)
    std = train.std(axis=axes, keepdims=True, dtype=np.float64)
    for x in (train, test):
        x -= mean.astype(x.dtype)
        x /= std.astype(x.dtype)


def mnist_source(
    standardize: Standardize = False,
    data_dirs: Sequence[str] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> Samples:
    """MNIST's official IDX files: 60,000 training images (1, 28, 28) in [0, 1] and the official 10,000 for testing."""
    fetch = {"data_dirs": data_dirs, "download": download, "verify": verify, "mirror": mirror}
    (x, y), test = mnist.load_mnist("train", **fetch), mnist.load_mnist("test", **fetch)
    if standardize:
        _standardized(x, test[0])
    return Samples(x, y, 10, test)


def _cifar_source(name: str) -> Callable[..., Samples]:
    def source(
        standardize: Standardize = False,
        data_dirs: Sequence[str] = (),
        download: bool = True,
        verify: bool = True,
        mirror: str | None = None,
    ) -> Samples:
        (x, y), test, groups = cifar.load_cifar(
            name, data_dirs=data_dirs, download=download, verify=verify, mirror=mirror
        )
        if standardize:
            _standardized(x, test[0])
        return Samples(x, y, cifar.CIFAR_ARCHIVES[name][5], test, label_groups=groups)

    source.__doc__ = (
        f"{name}'s official python archive: 50,000 training images (3, 32, 32) in [0, 1] and the "
        "official 10,000 for testing."
    )
    return source


def tff_cifar100_source(
    clients: Clients = None,
    standardize: Standardize = False,
    data_dirs: Sequence[str] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> Samples:
    """TFF's federated CIFAR-100: 500 clients of 100 training images (the first ``clients``), the 10,000 test images
    pooled."""
    train, test, groups = cifar.load_tff_cifar100(data_dirs=data_dirs, download=download, verify=verify, mirror=mirror)
    samples = _clients(train[:clients], test)
    if standardize:
        _standardized(samples.features, samples.test[0])
    samples.num_classes, samples.label_groups = 100, groups
    return samples


def shakespeare_source(
    clients: Clients = None,
    ignore_padding: Annotated[
        bool,
        Field(
            description="padding targets −1, skipped by the loss and accuracy (TFF); default token 0, scored "
            "(FedShuffle's code)"
        ),
    ] = False,
    data_dirs: Sequence[str] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> Samples:
    """TFF's Shakespeare: 715 roles (the first ``clients`` by name), 80-token sequences with per-position next-character
    targets.

    Padding targets are token 0, scored like any other (as the FedShuffle reference code does), or
    with ``ignore_padding`` −1, which the sequence loss and accuracy skip (as TFF's masked metrics do).
    """
    train, test = shakespeare.load_tff_shakespeare(
        clients, data_dirs=data_dirs, download=download, verify=verify, mirror=mirror
    )
    samples = _clients(train, test)
    samples.num_classes = shakespeare.TFF_VOCAB_SIZE
    if ignore_padding:
        for y in (samples.labels, samples.test[1]):
            y[y == shakespeare.PAD] = -1
    return samples


def shakespeare_leaf_source(
    path: DataPath = None,
    clients: Clients = None,
    data_dirs: Sequence[str] = (),
    download: bool = True,
    verify: bool = True,
    mirror: str | None = None,
) -> Samples:
    """LEAF's Shakespeare JSON: a LEAF output folder (``path``), or the registered 10-user sample; 80-character
    windows and the next character."""
    files = (
        None if path else shakespeare.leaf_files(data_dirs=data_dirs, download=download, verify=verify, mirror=mirror)
    )
    _, train, test = load_leaf(path or files[0][0].parent.parent, clients, files)
    if not np.issubdtype(train[0][0].dtype, np.integer):
        raise ConfigError("path", f"{path} holds numeric LEAF data, not Shakespeare text; use source = 'leaf'")
    return _leaf_samples(train, test)


#: Sources by name. A source's settings are its keyword parameters; the framework passes the partition stream
#: (``rng``), the data seed and the ``[data]`` section's common settings (where files come from, ``test_fraction``).
SOURCES = Registry(
    "data.source", runtime=("rng", "seed", "data_dirs", "download", "verify", "mirror", "test_fraction"), noun="source"
)
SOURCES.add(
    "targets",
    targets_source,
    "quadratic targets: e_1..e_N or an .npy file, in client blocks",
    "Horváth et al., TMLR 2022 (FedShuffle), eq. (36)",
    example=Example(settings={"client_sizes": [1, 2, 3]}),
)
SOURCES.add(
    "synthetic",
    synthetic_source,
    "Gaussian class clusters",
    example=Example(sections={"data": {"partition": "iid", "clients": 3}}),
)
SOURCES.add(
    "libsvm",
    libsvm_source,
    "a LIBSVM dataset (phishing, mushrooms, a3a, w3a, a9a) or an svmlight file",
    "Chang & Lin, LIBSVM",
    example=Example(
        settings={"dataset": "a3a"}, sections={"data": {"partition": "iid", "clients": 3}}, files=("a3a/a3a",)
    ),
)
SOURCES.add(
    "npz",
    npz_source,
    "arrays x and y from an .npz file",
    example=Example(
        sections={"data": {"partition": "iid", "clients": 3}}, arrays={"x": ((12, 3), None), "y": ((12,), 3)}
    ),
)
SOURCES.add(
    "fedprox_synthetic",
    fedprox_synthetic_source,
    "Synthetic(α, β) devices",
    "Li et al., MLSys 2020 (FedProx)",
    example=Example(settings={"clients": 3}),
)
SOURCES.add(
    "leaf",
    leaf_source,
    "LEAF users from JSON files (FEMNIST, Shakespeare, ...)",
    "Caldas et al., arXiv:1812.01097",
    example=Example(settings={"path": "femnist", "clients": 3}, files=("femnist",)),
)
SOURCES.add(
    "mnist",
    mnist_source,
    "MNIST from the official IDX files, official test split",
    "LeCun et al., 1998",
    example=Example(
        sections={"data": {"partition": "iid", "clients": 3}},
        files=tuple(f"mnist/{name}" for name in mnist.MNIST_FILES),
    ),
)
SOURCES.add(
    "cifar10",
    _cifar_source("cifar10"),
    "CIFAR-10 from the official python archive, official test split",
    "Krizhevsky, 2009",
    example=Example(sections={"data": {"partition": "iid", "clients": 3}}, files=("cifar10/cifar-10-python.tar.gz",)),
)
SOURCES.add(
    "cifar100",
    _cifar_source("cifar100"),
    "CIFAR-100 (fine labels; coarse ones for 'pachinko') from the official archive",
    "Krizhevsky, 2009",
    example=Example(sections={"data": {"partition": "iid", "clients": 3}}, files=("cifar100/cifar-100-python.tar.gz",)),
)
SOURCES.add(
    "tff_cifar100",
    tff_cifar100_source,
    "TFF's federated CIFAR-100: 500 clients of 100 images",
    "Reddi et al., ICLR 2021; TFF",
    example=Example(
        settings={"clients": 3}, files=(("cifar100/tff/fed_cifar100_train.h5", "cifar100/tff/fed_cifar100.tar.bz2"),)
    ),
)
SOURCES.add(
    "shakespeare",
    shakespeare_source,
    "TFF's Shakespeare, 715 roles, per-position next characters (vocabulary 90)",
    "Caldas et al., arXiv:1812.01097; TFF",
    example=Example(
        settings={"clients": 3},
        files=(
            tuple(
                f"shakespeare/tff/{name}"
                for name in ("shakespeare_train.h5", "shakespeare_train.h5.gz", "shakespeare.tar.bz2")
            ),
        ),
    ),
)
SOURCES.add(
    "shakespeare_leaf",
    shakespeare_leaf_source,
    "LEAF's Shakespeare JSON, next character of 80 (vocabulary 80)",
    "Caldas et al., arXiv:1812.01097",
    example=Example(
        settings={"clients": 3}, files=tuple(f"shakespeare/leaf/{name}" for name in shakespeare.LEAF_FILES)
    ),
)


def sizes_partition(labels: np.ndarray, client_sizes: ClientSizes = None) -> list[np.ndarray]:
    """Client i owns the next ``client_sizes[i]`` samples, in order."""
    if client_sizes is None or sum(client_sizes) != len(labels):
        raise ConfigError(
            "client_sizes", f"partition = 'sizes' needs client_sizes summing to the {len(labels)} training samples"
        )
    return partitions.contiguous_partition(client_sizes)


def _needs_clients(clients: int | None, partition: str) -> int:
    if clients is None:
        raise ConfigError("clients", f"partition = {partition!r} needs the number of clients")
    return clients


def iid_partition(labels: np.ndarray, rng: np.random.Generator, clients: Clients = None) -> list[np.ndarray]:
    return partitions.iid_partition(len(labels), _needs_clients(clients, "iid"), rng)


def equal_partition(labels: np.ndarray, rng: np.random.Generator, clients: Clients = None) -> list[np.ndarray]:
    return partitions.equal_partition(len(labels), _needs_clients(clients, "equal"), rng)


def dirichlet_partition(
    labels: np.ndarray,
    rng: np.random.Generator,
    clients: Clients = None,
    alpha: Annotated[float, Field(gt=0, description="Dirichlet concentration of each client's label shares")] = 0.5,
) -> list[np.ndarray]:
    return partitions.dirichlet_partition(labels, _needs_clients(clients, "dirichlet"), alpha, rng)


def labels_partition(
    labels: np.ndarray,
    rng: np.random.Generator,
    clients: Clients = None,
    labels_per_client: Annotated[
        int, Field(ge=1, description="the p distinct labels each client holds (Yang et al.: 1, 2, 5, 10)")
    ] = 2,
) -> list[np.ndarray]:
    return partitions.label_partition(labels, _needs_clients(clients, "labels"), labels_per_client, rng)


def shards_partition(
    labels: np.ndarray,
    rng: np.random.Generator,
    clients: Clients = None,
    shards_per_client: Annotated[
        int, Field(ge=1, description="label-sorted shards per client (McMahan et al.: 2)")
    ] = 2,
) -> list[np.ndarray]:
    return partitions.shard_partition(labels, _needs_clients(clients, "shards"), shards_per_client, rng)


def pachinko_partition(
    labels: np.ndarray,
    rng: np.random.Generator,
    label_groups: np.ndarray | None = None,
    clients: Clients = None,
    pachinko_alpha: Annotated[
        float, Field(gt=0, description="concentration of each client's coarse-label distribution (TFF: 0.1)")
    ] = 0.1,
    pachinko_beta: Annotated[
        float, Field(gt=0, description="concentration of each coarse label's fine-label distribution (TFF: 10)")
    ] = 10.0,
) -> list[np.ndarray]:
    if label_groups is None:
        raise ConfigError("partition", "'pachinko' needs a source with coarse labels (cifar100)")
    return partitions.pachinko_partition(
        labels, label_groups, _needs_clients(clients, "pachinko"), pachinko_alpha, pachinko_beta, rng
    )


#: Partitions by name; the framework passes the training labels, the partition stream and the coarse labels.
PARTITIONS = Registry("data.partition", runtime=("labels", "rng", "label_groups"), noun="partition")
PARTITIONS.add(
    "sizes",
    sizes_partition,
    "contiguous blocks of client_sizes (in the source's order after the train/test shuffle)",
    example=Example(settings={"client_sizes": [10, 20, 30]}),
)
PARTITIONS.add(
    "iid", iid_partition, "uniform shuffle split into nearly equal parts", example=Example(settings={"clients": 4})
)
PARTITIONS.add(
    "equal",
    equal_partition,
    "uniform shuffle, ⌊N/M⌋ each, remainder left out",
    "Mishchenko et al., RR-CLI §4.2",
    example=Example(settings={"clients": 4}),
)
PARTITIONS.add(
    "dirichlet",
    dirichlet_partition,
    "label Dirichlet (LDA) shares with concentration alpha",
    "Hsu et al., arXiv:1909.06335",
    example=Example(settings={"clients": 4}),
)
PARTITIONS.add(
    "labels",
    labels_partition,
    "exactly labels_per_client labels per client, equal sizes",
    "Yang, Fang & Liu, ICLR 2021, App. B.1",
    example=Example(settings={"clients": 4}),
)
PARTITIONS.add(
    "shards",
    shards_partition,
    "sorted by label, shards_per_client random shards per client",
    "McMahan et al., AISTATS 2017",
    example=Example(settings={"clients": 4}),
)
PARTITIONS.add(
    "pachinko",
    pachinko_partition,
    "coarse ~ Dir(pachinko_alpha), fine ~ Dir(pachinko_beta), N/clients each",
    "Reddi et al., ICLR 2021, App. C.1 (TFF CIFAR-100)",
    example=Example(
        settings={"clients": 4}, sections={"data": {"source": "cifar100"}}, files=("cifar100/cifar-100-python.tar.gz",)
    ),
)


def load_samples(settings: Mapping[str, Any], seed: int) -> tuple[Samples, np.random.Generator]:
    """The samples a ``[data]`` section's source provides, and the partition stream that will split them.

    The stream is seeded by ``data.seed``, or the run's ``seed`` when it is unset.
    """
    data_seed = seed if settings.get("seed") is None else settings["seed"]
    rng = generator(data_seed, Stream.PARTITION)
    if settings.get("path"):  # the same places for every source: working directory, data folders, cache
        settings = {**settings, "path": str(resolve_data_path(settings["path"], settings.get("data_dirs", ())))}
    entry = SOURCES[settings["source"]]
    own = {k: settings[k] for k in entry.setting_names() if k in settings}
    common = {k: settings[k] for k in SOURCES.runtime if k in settings and k != "seed"}
    return entry.build(own, **common, rng=rng, seed=data_seed), rng


def _split(
    partition: str,
    settings: Mapping[str, Any],
    labels: np.ndarray,
    rng: np.random.Generator,
    label_groups: np.ndarray | None,
) -> list[np.ndarray]:
    entry = PARTITIONS[partition]
    return entry.build(
        {k: settings[k] for k in entry.setting_names() if k in settings},
        labels=labels,
        rng=rng,
        label_groups=label_groups,
    )


def federate(
    samples: Samples,
    settings: Mapping[str, Any],
    rng: np.random.Generator,
    encode_labels: Callable[[np.ndarray], torch.Tensor] = torch.as_tensor,
) -> FederatedDataset:
    """The federated dataset of ``samples`` under a ``[data]`` section's split.

    Samples that come with their clients keep them. Pooled samples are shuffled by ``rng``, the first
    ``test_fraction`` held out (unless the source has an official test split), and the rest split by
    the section's ``partition``; samples that the partition gives to no client are dropped, so that the training
    tensor holds the objective's samples only. ``encode_labels`` maps integer labels to the problem's targets (e.g. ±1).
    """
    source, partition = settings["source"], settings.get("partition", "sizes")
    x, y = samples.features, samples.labels
    if samples.client_sizes is not None:
        if partition != "sizes":
            raise ConfigError("partition", f"source {source!r} comes with its own clients; leave partition unset")
        train, parts, test = np.arange(len(y)), partitions.contiguous_partition(samples.client_sizes), samples.test
    elif samples.test is not None:
        train, test = rng.permutation(len(y)), samples.test
        parts = _split(partition, settings, y[train], rng, samples.label_groups)
    else:
        order, n_test = rng.permutation(len(y)), int(round(settings.get("test_fraction", 0.0) * len(y)))
        train, test = order[n_test:], ((x[order[:n_test]], y[order[:n_test]]) if n_test else None)
        parts = _split(partition, settings, y[train], rng, samples.label_groups)
    held = np.sort(np.concatenate(parts))
    if len(held) < len(train):  # samples that no client holds (a partition's remainder) stay out of the training tensor
        train, parts = train[held], [np.searchsorted(held, ix) for ix in parts]
    sizes = np.array([len(ix) for ix in parts])
    flat = torch.as_tensor(x.reshape(len(x), -1))
    return FederatedDataset(
        flat[train],
        encode_labels(y)[train],
        parts,
        objective_weights(sizes, settings.get("weights", "size")),
        torch.as_tensor(test[0].reshape(len(test[0]), -1)) if test else None,
        encode_labels(test[1]) if test else None,
        name=settings.get("dataset") or source,
        test_client_sizes=samples.test_client_sizes if samples.client_sizes is not None and test else None,
    )
