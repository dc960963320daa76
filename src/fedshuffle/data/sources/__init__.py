"""Real datasets: locating, downloading (with cache and checksum) and reading them."""

from fedshuffle.data.sources.fetch import RemoteFile, cache_dir, locate
from fedshuffle.data.sources.libsvm import LIBSVM_DATASETS, load_libsvm_dataset, read_svmlight

__all__ = ["LIBSVM_DATASETS", "RemoteFile", "cache_dir", "load_libsvm_dataset", "locate", "read_svmlight"]
