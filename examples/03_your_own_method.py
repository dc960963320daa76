# %% [markdown]
# # Your own method, checked as the built-in ones are
#
# A method is a server half and a client half (`fedshuffle.Method`); a new one overrides the halves it changes
# and declares its own settings as typed keyword parameters of its constructor, which the config then takes under
# `[method]` (and `--set method.damping=0.2` on the command line). This one damps FedAvg's server direction:
# x ← x − δ·Σᵢ ωᵢΔᵢ. In a module of your own it is one file, named by `[experiment] plugins` and run with
# `--plugins MODULE` (a plugin is code: a config alone imports none; docs/extending.md).

# %% tags=["parameters"]
ROUNDS = 20
SEEDS = [0, 1]

# %%
from typing import Annotated

from pydantic import Field

import fedshuffle as fs
from fedshuffle.testing import check_method


class DampedFedAvg(fs.Method):
    """FedAvg whose server direction is damped: x ← x − δ·Σ ω_iΔ_i, with δ ∈ (0, 1]."""

    def __init__(self, aggregator, damping: Annotated[float, Field(gt=0, le=1, description="δ, the factor")] = 0.5):
        super().__init__(aggregator)
        self.damping = damping

    def aggregate(self, rnd, params, state, payload):
        direction, state, extras = super().aggregate(rnd, params, state, payload)
        return self.damping * direction, state, extras


fs.METHODS.add(
    "damped_fedavg",
    DampedFedAvg,
    "FedAvg with a damped server direction",
    local={"order": "reshuffle"},
    aggregation={"normalization": "sum_one"},
)

# %% [markdown]
# `check_method` checks it as the package's tests check every built-in method: each declared setting's bad
# values are refused naming it, the sequential, vectorized and threaded executors agree (fp64, 1e-10), and a
# run cut and resumed from its checkpoint ends byte-identical to the uncut one. It raises naming what fails.

# %%
check_method("damped_fedavg")

try:
    fs.experiment({"method": {"name": "damped_fedavg", "damping": 2.0}})
except fs.ConfigError as error:
    print(error)  # method.damping: Input should be less than or equal to 1 (got 2.0)

# %%
exp = fs.experiment(
    {
        "experiment": {"name": "damped"},
        "data": {"client_sizes": [1, 2, 3]},
        "local": {"lr": 0.05},
        "run": {"rounds": ROUNDS, "eval_every": 5},
        "variants": [
            {"label": "FedAvgRR", "method": {"name": "fedavg_rr"}},
            {"label": "damped 0.5", "method": {"name": "damped_fedavg"}},
            {"label": "damped 0.2", "method": {"name": "damped_fedavg", "damping": 0.2}},
        ],
    }
)
print(exp.spec("damped 0.2").method)  # name='damped_fedavg' damping=0.2
results = exp.run(seeds=SEEDS, progress=False)
summary = results.summary("f_gap")
summary

# %% [markdown]
# Damping the server step slows the first rounds down: after 20 rounds the more damped run is further from f*
# (all three settle at the same point later: damping changes the steps, not the fixed point).

# %%
final = summary[("f_gap", "mean")]
assert final[("FedAvgRR", "")] < final[("damped 0.5", "")] < final[("damped 0.2", "")]
