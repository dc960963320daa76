"""A run's configuration with the defaults its parts fill in when built, as ``fedshuffle show`` prints it.

The schema leaves some settings ``None`` where the default depends on other settings: the server
optimizer (``sgd``, or ``heavy_ball`` when ``server.momentum > 0``) and its step size and
constants, and each method's own settings (FedCDR's α, η, ...). :func:`resolved_settings` builds the
algorithm and reads those values back from the built parts, so what is printed is what runs.
Settings of other methods are dropped; ``'theory'`` step sizes stay ``'theory'`` (they need the
problem and data: ``fedshuffle inspect --config``), and so does RR-CLI's θ (default ηR, with R the
rounds of a meta-epoch, known once the clients are).
"""

from __future__ import annotations

from typing import Any

from fedshuffle.experiments.schema import RunSpec
from fedshuffle.methods import METHODS, METHOD_SETTINGS
from fedshuffle.methods.algorithm import build_algorithm
from fedshuffle.methods.momentum import GlobalMomentum

#: server optimizer attribute → the ``[server]`` setting it comes from
_SERVER_FIELDS = {"lr": "lr", "beta": "momentum", "beta1": "beta1", "beta2": "beta2", "eps": "eps"}


def resolved_settings(spec: RunSpec) -> dict[str, Any]:
    """``spec`` by section, with the method's and the server optimizer's defaults filled in (see the module)."""

    out = spec.model_dump()
    settings = spec.algorithm_settings()
    theory = {("local", "lr"): spec.local.lr == "theory", ("server", "lr"): spec.server.lr == "theory", ("server", "global_lr"): spec.server.global_lr == "theory"}
    for (part, key), is_theory in theory.items():
        if is_theory:  # a stand-in number to build the parts with; printed as 'theory'
            settings[part] = {**settings[part], key: 1.0}
    algorithm = build_algorithm(spec.method.name, settings, spec.run.rounds)
    method = algorithm.method.inner if isinstance(algorithm.method, GlobalMomentum) else algorithm.method
    factory = METHODS[spec.method.name].factory
    for key, (owner, argument) in METHOD_SETTINGS.items():
        if owner is factory:
            out["method"][key] = getattr(method, argument)
        else:
            out["method"].pop(key, None)
    server = out["server"]
    server["optimizer"] = spec.server.optimizer or ("heavy_ball" if spec.server.momentum else "sgd")
    for attribute, key in _SERVER_FIELDS.items():
        if hasattr(algorithm.server, attribute):
            server[key] = getattr(algorithm.server, attribute)
        elif server.get(key) is None:
            server.pop(key, None)  # not a setting of this optimizer
    for (part, key), is_theory in theory.items():
        if is_theory:
            out[part][key] = "theory"
    return out
