"""What a worker process needs before its first run, loaded once by the fork server that workers are forked from
(:func:`~fedshuffle.experiments.sweep.worker_context`) instead of once per worker (≈ 3 s of start-up each on a
2-core machine): PyTorch, NumPy and the parts of a run (:mod:`fedshuffle.experiments.runner`), scikit-learn's
svmlight reader (LIBSVM sources) and the compiled random streams (numba's first load of its on-disk cache).

Importing this module does that work. It starts no Python thread and runs no PyTorch operator (whose thread pool
a fork would not carry), so forking afterwards is safe; nothing else imports it.
"""

from __future__ import annotations

import numpy as np
import sklearn.datasets  # noqa: F401  (the LIBSVM reader)

from fedshuffle.core import streams
from fedshuffle.experiments import runner  # noqa: F401  (PyTorch and every registered part)

streams.permutations(0, streams.Stream.DATA_ORDER, np.zeros((1, 2), dtype=np.int64), np.array([2]), np.array([1]))
