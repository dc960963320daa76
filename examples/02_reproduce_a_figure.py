# %% [markdown]
# # Reproducing a paper's figure, and judging its claims
#
# Every preset reproduces a figure or table of one of five papers and carries that figure's claims as data: an
# ordering of variants, a value within a tolerance, a target reached first, each with the paper's words. Here
# Figure 1 (middle right) of the FedShuffle paper (Horváth et al., TMLR 2022): with two of three clients per
# round, sum-one aggregation is biased and FedShuffle with it settles at a worse point than with unbiased weights.
#
# The command line does all of it in one line, over the preset's seeds, and writes `report.md` and
# `report.html`: `fedshuffle reproduce fedshuffle-fig1-sum-one`.

# %% tags=["parameters"]
PRESET = "fedshuffle-fig1-sum-one"
ROUNDS = None  # None: the preset's own (10,000 rounds, a few minutes on a 2-core CPU); fewer for a quick look

# %%
import matplotlib.pyplot as plt

import fedshuffle as fs
from fedshuffle.experiments.reproduce import judge

exp = fs.experiment(PRESET, overrides={"run.rounds": ROUNDS} if ROUNDS else None)
meta = exp.config.experiment
print(f"{meta.figure} of {meta.paper}\n{meta.title}\nseeds {exp.seeds}")
print("where it departs from the paper:", meta.deviations)
for claim in exp.config.claims:
    print("claim:", claim["quote"])

# %%
results = exp.run(f"results/{PRESET}", progress=False)  # every variant on the preset's seeds
ax = results.plot("f_gap")
ax.set_title(meta.title)
plt.savefig(results.path / "f_gap.png", dpi=110)

# %% [markdown]
# Each claim is judged over the seeds: *holds* when the means are more than k standard errors apart in the
# claimed order, *partly* when in that order but closer, *does not hold* otherwise (`docs/presets.md`).

# %%
verdicts = judge(PRESET, exp.config, results.path)
for row in verdicts:
    print(f"{row.verdict:>14s}: {row.claim}\n{'':>16s}measured {row.measured}; {row.why}")
assert len(verdicts) == len(exp.config.claims) and all(row.verdict for row in verdicts)
