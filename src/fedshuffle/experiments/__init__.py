"""Experiments: configuration files, runs, results folders, sweeps, reports and the papers' claims.

Every method is imported first, so that the metrics the methods declare next to their code (FedCDR's
prox residual) are in :data:`fedshuffle.metrics.METRICS` before any module here reads its columns.
"""

import fedshuffle.methods  # noqa: F401  (declares the methods' diagnostics)
