"""The exact solution x* and f* of a convex problem on its data, cached by content or by the run's settings.

f − f* and ‖x − x*‖² (:mod:`fedshuffle.metrics`) need x*; :meth:`Problem.minimizer` computes it (closed
form or a fine solver), and every variant and seed of an experiment asks for the same one, so it is kept
in memory and on disk.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from fedshuffle.core.io import write_atomic
from fedshuffle.data import FederatedDataset
from fedshuffle.data.sources.fetch import cache_dir
from fedshuffle.problems.base import Problem


_SOLUTIONS: dict[str, tuple[torch.Tensor, float]] = {}


def _digest(problem: Problem, data: FederatedDataset) -> str:
    h = hashlib.sha256(
        repr(
            (type(problem).__name__, problem.dim, getattr(problem, "l2", None), getattr(problem, "num_classes", None))
        ).encode()
    )
    for t in (data.features.double(), data.labels, data.sample_weights().double()):
        h.update(np.ascontiguousarray(t.cpu().numpy()).tobytes())
    return h.hexdigest()[:32]


def solution_key(spec: Mapping[str, Any], file_hashes: Mapping[str, str]) -> str:
    """The x* cache key of a run: its ``[problem]`` and ``[data]`` settings (those that make the data, not where
    it is looked for), the seed of the split (``data.seed``, else ``run.seed``), ``run.dtype`` (the data are built in
    it) and the hashes of the data files the settings
    name (``data.path``). Named datasets (LIBSVM, MNIST, ...) are checked against their published SHA-256 when
    fetched, so their settings name their contents. Computing it reads no data: a run whose x* is cached never
    copies its dataset to float64 to hash it.
    """
    data = {k: v for k, v in spec.get("data", {}).items() if k not in ("data_dirs", "download", "verify", "mirror")}
    run = spec.get("run", {})
    split_seed = (
        run.get("seed") if data.get("seed") is None else data["seed"]
    )  # the split's seed: data.seed, else the run's
    settings = {
        "problem": spec.get("problem", {}),
        "data": data,
        "split_seed": split_seed,
        "dtype": run.get("dtype"),
        "files": dict(file_hashes),
    }
    return "config-" + hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:32]


def solution(problem: Problem, data: FederatedDataset, key: str | None = None) -> tuple[torch.Tensor, float] | None:
    """(x*, f*) in float64 for a convex problem with a computable minimizer, else ``None``.

    Cached in memory and on disk (``<cache>/solutions/<key>.npz``, x* and f*) so that the variants and seeds
    of an experiment solve it once; ``key`` (:func:`solution_key` of a run's settings) names the problem and
    dataset, by default the SHA-256 of the problem and of the dataset's contents in float64.
    """
    if not problem.convex:
        return None
    key = key or _digest(problem, data)
    if key in _SOLUTIONS:
        return _SOLUTIONS[key]
    path = cache_dir() / "solutions" / f"{key}.npz"
    result = None
    if path.is_file():
        try:
            with np.load(path, allow_pickle=False) as stored:
                x_star, f_star = torch.as_tensor(stored["x_star"]), float(stored["f_star"])
            if x_star.shape == (problem.dim,) and x_star.dtype == torch.float64 and math.isfinite(f_star):
                result = (x_star, f_star)
        except (ValueError, OSError, KeyError):
            result = None
    if result is None:
        data = data.to(torch.float64, "cpu")
        labels = data.labels.double() if data.labels.is_floating_point() else data.labels
        a, s = data.features.double(), data.sample_weights().double()
        x_star = problem.minimizer(a, labels, s)
        if x_star is None:
            return None
        x_star = x_star.double()
        result = (x_star, float(problem.weighted_loss(x_star, a, labels, s)))
        buf = io.BytesIO()
        np.savez(buf, x_star=x_star.numpy(), f_star=np.float64(result[1]))
        try:
            write_atomic(path, buf.getvalue())
        except OSError:
            pass  # an unwritable cache only costs the next run a re-solve
    _SOLUTIONS[key] = result
    return result
