# %% [markdown]
# # Your first comparison: FedAvg against FedShuffle
#
# The FedShuffle paper's quadratic (Horváth et al., TMLR 2022, eq. 36): three clients hold the targets
# e₁ | e₂, e₃ | e₄, e₅, e₆, and f(x) = Σᵢ wᵢ fᵢ(x) with wᵢ ∝ |Dᵢ|. Every client runs one local epoch, so the
# client with most data takes most steps. FedAvg then minimizes another objective, one that favours the large
# client; FedShuffle scales each client's step by 1/τᵢ and reshuffles its data, and minimizes f itself.
#
# The same from the command line: `fedshuffle run quickstart --variant FedAvg --variant FedShuffle`.

# %% tags=["parameters"]
ROUNDS = 1000  # rounds of each run
SEEDS = [0, 1, 2]  # one run per variant and seed

# %%
import matplotlib.pyplot as plt
import numpy as np

import fedshuffle as fs

exp = fs.experiment(
    {
        "experiment": {"name": "first-comparison", "title": "FedAvg against FedShuffle on the quadratic (36)"},
        "problem": {"name": "quadratic"},
        "data": {"client_sizes": [1, 2, 3]},  # |D_i|: the targets e_1..e_6 split 1/2/3
        "local": {"lr": 1 / 240, "epochs": 1, "batch_size": 1},  # η/max|D_i| with η = 1/80
        "sampler": {"name": "full"},
        "run": {"rounds": ROUNDS, "eval_every": 10},
        "variants": [
            {"label": "FedAvg", "method": {"name": "fedavg"}},
            {"label": "FedShuffle", "method": {"name": "fedshuffle"}},
        ],
    }
)
print(exp)

# %% [markdown]
# Before running anything: which objective does each variant minimize? ŵᵢ are the weights of the objective a
# method converges to (eq. 31); FedShuffle's equal the objective's wᵢ, FedAvg's do not.

# %%
for label in exp.variants:
    report = exp.objective(label)
    print(f"{label:10s} w = {np.round(report.weights, 3)}  ŵ = {np.round(report.effective_weights, 3)}")
assert exp.objective("FedShuffle").max_deviation < 1e-9 < exp.objective("FedAvg").max_deviation

# %%
results = exp.run(seeds=SEEDS, progress=False)  # into results/first-comparison/ (or -2, -3, ... when taken)
print(results.path)
summary = results.summary(["f_gap", "dist_sq"])
summary

# %% [markdown]
# f − f* after the last round: FedShuffle ends lower, since FedAvg stalls at the minimizer of its own objective.

# %%
final = summary[("f_gap", "mean")]
assert final[("FedShuffle", "")] < final[("FedAvg", "")]
ax = results.plot("f_gap", x="epochs")
ax.set_title(exp.config.experiment.title)
plt.savefig(results.path / "f_gap-by-epochs.png", dpi=110)
