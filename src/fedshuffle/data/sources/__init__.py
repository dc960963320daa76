"""Real datasets: locating, downloading (with cache and checksum) and reading them."""

from fedshuffle.data.sources import cifar, mnist, shakespeare
from fedshuffle.data.sources.fetch import RemoteFile, cache_dir, locate, locate_derived
from fedshuffle.data.sources.libsvm import LIBSVM_DATASETS, load_libsvm_dataset, read_svmlight

__all__ = [
    "LIBSVM_DATASETS",
    "RemoteFile",
    "cache_dir",
    "cifar",
    "load_libsvm_dataset",
    "locate",
    "locate_derived",
    "mnist",
    "read_svmlight",
    "shakespeare",
]
