# %% [markdown]
# # Taking a method to Flower
#
# Every fedshuffle method runs as a Flower app (`pip install 'fedshuffle[flower]'`, Python ≥ 3.11): the server
# half is a Flower Strategy, the client half a ClientApp, with fedshuffle's samplers, plans and aggregation, so a
# run gives the numbers of `fedshuffle run`. Here on Flower's simulation engine (one virtual SuperNode per client,
# its Ray bound to 127.0.0.1), then as an app folder for `flwr run` on a SuperLink with real SuperNodes
# (docs/flower.md; TLS and authentication across machines: docs/deploy/tls-and-packaging.md).

# %% tags=["parameters"]
ROUNDS = 20
CLIENTS = 4

# %%
from pathlib import Path

import numpy as np

import fedshuffle as fs
from fedshuffle.integrations.flower import simulate, write_app

config = Path("federated.toml")
config.write_text(f"""
[experiment]
name = "federated"
seeds = [1]

[problem]
name = "logistic"
l2 = 0.01

[data]
source = "synthetic"
samples = {25 * CLIENTS}
features = 5
clients = {CLIENTS}
partition = "dirichlet"

[local]
lr = 0.1
epochs = 1
batch_size = 5

[sampler]
name = "uniform"
cohort = {CLIENTS // 2}

[run]
rounds = {ROUNDS}
eval_every = 5

[[variants]]
label = "FedShuffle"
method = {{ name = "fedshuffle" }}
""")

# %%
simulate(config, num_supernodes=CLIENTS, run_config={"out": "results/flower-sim"}, cpus=2)
flower = fs.load_results("results/flower-sim")
alone = fs.experiment(config).run("results/flower-local", progress=False)
print(flower.final()[["variant", "seed", "round", "loss", "train_accuracy"]])

# %% [markdown]
# The same model, round for round: the final parameters on Flower equal those of `fedshuffle run` to rounding.

# %%
on_flower = np.load(flower.path / "fedshuffle" / "seed-1" / "final_params.npy")
simulated = np.load(alone.path / "fedshuffle" / "seed-1" / "final_params.npy")
np.testing.assert_allclose(on_flower, simulated, rtol=0, atol=1e-12)
print("max |difference| =", np.abs(on_flower - simulated).max())

# %% [markdown]
# For real devices: an app folder (`pyproject.toml`, the experiment, the apps' module) that `flwr run` submits to a
# SuperLink, whose SuperNodes each host some clients (`--node-config 'clients="0-1"'`).

# %%
app = write_app(config, "flower-app")
print(sorted(p.name for p in app.iterdir()))
