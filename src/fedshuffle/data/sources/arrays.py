"""Arrays from files and generators: quadratic targets (.npy), features and labels (.npz), Gaussian clusters.

Files are checked before their data is read (the ``.npy`` headers: no object arrays, no more data than
the file holds or memory allows) and after (:mod:`fedshuffle.data.sources.checks`).
"""

from __future__ import annotations

import lzma
import zipfile
import zlib
from pathlib import Path

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.data.sources import checks

#: what a damaged .npy/.npz raises while it is read (a corrupt deflate or LZMA member included)
READ_ERRORS = (
    ValueError,
    OSError,
    EOFError,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    NotImplementedError,
    RuntimeError,
    lzma.LZMAError,
    zlib.error,
)


def load_targets(path: str | Path) -> np.ndarray:
    """Per-sample targets e_ij for the quadratic problem, from an ``.npy`` file of real numbers, shape (N, d)."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise ConfigError("data.path", f"file not found: {path}" if not path.exists() else f"{path} is not a file")
    try:
        checks.check_npy_file(path, where)
        targets = np.load(path, allow_pickle=False)
    except ConfigError:
        raise
    except READ_ERRORS as exc:
        raise ConfigError("data.path", f"cannot read {path} as a .npy array ({exc or type(exc).__name__})") from None
    if not isinstance(targets, np.ndarray) or targets.ndim != 2:
        raise ConfigError(
            "data.path",
            f"{path} must hold an array of shape (samples, dim), got shape {getattr(targets, 'shape', None)}",
        )
    if targets.shape[0] == 0:
        raise ConfigError("data.path", f"{path} holds no samples")
    return checks.features(targets, where, "targets")


def synthetic_classification(
    num_samples: int, num_features: int, num_classes: int, rng: np.random.Generator, separation: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Gaussian class clusters: x ~ N(μ_c, I) with μ_c ~ N(0, separation²·I); labels uniform over classes."""
    limits.check_dataset(
        num_samples,
        num_features,
        "data.features" if num_features > num_samples else "data.samples",
        "the synthetic dataset",
    )
    limits.check_fits(limits.array_bytes(num_classes, num_features), "data.classes", f"the {num_classes} class centers")
    centers = rng.normal(0.0, abs(separation), size=(num_classes, num_features))  # abs: −0.0 is 0
    labels = rng.integers(0, num_classes, size=num_samples)
    features = centers[labels] + rng.normal(size=(num_samples, num_features))
    return features, labels


def load_npz(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Features ``x`` (N, ...) of real numbers and class labels ``y`` (N,) ∈ {0, 1, …} from an ``.npz`` file."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("data.path", f"file not found: {path}" if not path.exists() else f"{path} is not a file")
    try:
        checks.check_npz_members(path, str(path), ("x", "y"))
        with np.load(path, allow_pickle=False) as archive:
            if "x" not in archive or "y" not in archive:
                raise ConfigError("data.path", f"{path} must contain arrays 'x' and 'y', found {sorted(archive.files)}")
            x, y = archive["x"], archive["y"]
    except ConfigError:
        raise
    except READ_ERRORS as exc:
        raise ConfigError("data.path", f"cannot read {path} as .npz ({exc or type(exc).__name__})") from None
    labels = checks.class_labels(y, str(path), "y")
    if labels.size == 0:
        raise ConfigError("data.path", f"{path}: the file holds no samples")
    return checks.features(x, str(path), "x", samples=len(labels)), labels
