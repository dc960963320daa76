# %% [markdown]
# # A step-size sweep over seeds, run as replicas of one simulation
#
# A sweep runs every grid point × variant × seed, each into its own folder, and picks each variant's best point
# by a metric's final mean over the seeds (the FedShuffle paper's Appendix F tunes this way). Runs that differ
# only in step sizes or seed — same data, model and sampler — run as the replicas of one simulation, every
# replica's round at once (`run.executor = "vectorized"` or `"auto"`), and each writes the files it would write
# alone. The command line: `fedshuffle sweep quickstart --grid local.lr=0.008,0.004,0.002 --seeds 0..2 --pick f_gap`.

# %% tags=["parameters"]
ROUNDS = 500
STEPS = [0.008, 0.004, 0.002]
SEEDS = [0, 1, 2]

# %%
import numpy as np

import fedshuffle as fs

exp = fs.experiment("quickstart", overrides={"run.rounds": ROUNDS, "run.executor": "vectorized"})
swept = exp.sweep(
    {"local.lr": STEPS},
    "results/lr-sweep",
    seeds=SEEDS,
    variants=["FedAvg", "FedShuffle"],
    pick="f_gap",
    progress=False,
)
for label, best in swept.best.items():
    print(f"{label}: best {best['point']} (mean f − f* {best['mean']:.3g} over {len(SEEDS)} seeds)")
swept.summary("f_gap")

# %% [markdown]
# A replica's numbers are those of the run made alone: here the first step size of FedShuffle on the first seed,
# run by itself, gives the same curve to the last bit.

# %%
first = exp.with_overrides({"local.lr": STEPS[0]})
alone = first.run("results/lr-alone", seeds=SEEDS[:1], variants=["FedShuffle"], progress=False)
curves = swept.curves
replica = curves[
    (curves["variant"] == "FedShuffle") & (curves["point"] == f"local.lr={STEPS[0]}") & (curves["seed"] == SEEDS[0])
]
np.testing.assert_array_equal(replica["f_gap"].to_numpy(), alone.curves["f_gap"].to_numpy())
print(f"{len(replica)} evaluations, equal")
