"""What a configuration's federated training data looks like, before any training: ``fedshuffle data``.

:func:`summarize` loads the ``[data]`` section's source, splits it exactly as a run would (same
seed, same partition stream) and reports the clients' sizes and per-class counts;
:func:`plot_label_heatmap` draws the clients × classes shares.
"""

from __future__ import annotations

import io
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedshuffle.core.errors import section
from fedshuffle.core.io import write_atomic
from fedshuffle.data.catalog import federate, load_samples


def summarize(settings: Mapping[str, Any], seed: int) -> dict[str, Any]:
    """Clients (each one's ``size`` and ``label_counts``, one count per class), size statistics, classes
    and test size of the federated training data of a ``[data]`` section's ``settings`` (every default
    filled in) for a run of ``seed``, after partitioning.

    For per-position targets (TFF Shakespeare) a client's counts are over every target position of
    its sequences (80 × size of them, fewer when ignored padding targets, −1, are left out).
    """
    with section("data"):
        samples, rng = load_samples(settings, seed)
        data = federate(samples, settings, rng)
    labels = data.labels.numpy()
    classes = max(samples.num_classes, int(labels.max()) + 1 if labels.size else 0)
    counts = [np.bincount((y := labels[ix].ravel())[y >= 0], minlength=classes).tolist() for ix in data.client_indices]
    sizes = data.sizes
    return {
        "dataset": data.name,
        "source": settings["source"],
        "partition": "natural" if samples.client_sizes is not None else settings.get("partition", "sizes"),
        "num_clients": int(data.num_clients),
        "num_samples": int(sizes.sum()),
        "left_out": int(len(labels) - sizes.sum()),
        "sizes": {
            "min": int(sizes.min()),
            "median": float(np.median(sizes)),
            "max": int(sizes.max()),
            "mean": float(sizes.mean()),
        },
        "num_classes": int(classes),
        "feature_shape": list(samples.features.shape[1:]),
        "target_shape": list(samples.labels.shape[1:]),
        "test_size": 0 if data.test_labels is None else int(len(data.test_labels)),
        "clients": [{"size": int(n), "label_counts": c} for n, c in zip(sizes, counts)],
    }


def plot_label_heatmap(summary: dict[str, Any], path: str | Path) -> Path:
    """Clients (rows) × classes (columns): each client's share of its samples in each class, as a PNG/PDF/SVG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = np.array([c["label_counts"] for c in summary["clients"]], dtype=np.float64)
    shares = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
    height = min(10.0, 2.5 + 0.02 * len(shares))
    fig, ax = plt.subplots(figsize=(min(12.0, 6.4 + 0.05 * shares.shape[1]), height), constrained_layout=True)
    image = ax.imshow(shares, aspect="auto", interpolation="nearest", cmap="viridis", vmin=0)
    ax.set_xlabel("class")
    ax.set_ylabel("client")
    sizes = summary["sizes"]
    ax.set_title(
        f"{summary['dataset']} — {summary['partition']}: {summary['num_clients']} clients\n"
        f"sizes {sizes['min']}/{sizes['median']:g}/{sizes['max']} (min/median/max)",
        fontsize=10,
    )
    fig.colorbar(image, ax=ax, label="share of the client's samples")
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix[1:] or "png", dpi=110)
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
    return path
