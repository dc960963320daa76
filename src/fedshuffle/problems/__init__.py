"""Problems: per-sample losses on a flat parameter vector, with batched gradients over a cohort."""

from .base import Problem
from .convex import LogisticRegression, Quadratic, SoftmaxRegression
from .networks import CNN, MLP, Network

__all__ = ["CNN", "MLP", "LogisticRegression", "Network", "Problem", "Quadratic", "SoftmaxRegression"]
