"""Start-up work done once: a command builds each distinct problem and dataset once for its preflight, variants
and seeds, and the results are those of runs that build their own."""

import numpy as np

import fedshuffle.experiments.runner as runner_mod
from fedshuffle.experiments.schema import load_experiment
from fedshuffle.experiments.session import run_experiment
from conftest import toy_config

VARIANTS = """
[[variants]]
label = "A"
[[variants]]
label = "B"
local = {{ lr = 0.002 }}
[[variants]]
label = "C"
data = {{ client_sizes = {sizes} }}
"""


def test_variants_and_seeds_with_equal_data_share_one_build_and_the_numbers(tmp_path, monkeypatch):
    builds = []
    real = runner_mod.build_problem_and_data

    def counted(spec, *load):
        builds.append(spec.data.client_sizes)
        return real(spec, *load)

    monkeypatch.setattr(runner_mod, "build_problem_and_data", counted)
    cfg = toy_config(tmp_path, method="fedavg", rounds=4, eval_every=1, seeds=(0, 1))
    cfg.write_text(
        cfg.read_text().replace("client_sizes = [1, 2, 3]", "client_sizes = [1, 2, 3]\nseed = 0")
        + VARIANTS.format(sizes="[2, 2, 2]")
    )
    experiment = load_experiment(cfg)
    _, outcomes = run_experiment(experiment, tmp_path / "out", show_progress=False)
    assert sorted(builds) == [[1, 2, 3], [2, 2, 2]]  # A and B (both seeds) share a build; C has other data
    assert runner_mod._BUILT is None  # nothing kept after the command
    assert len(outcomes) == 6
    for k, outcome in enumerate(outcomes):
        job = outcome.job
        alone = runner_mod.run_single(job.spec, tmp_path / "alone" / str(k), job.seed, label=job.label)
        for name in ("metrics.csv", "final_params.npy"):
            assert (job.run_dir / name).read_bytes() == (alone.run_dir / name).read_bytes(), (job.run_dir, name)
    assert len(builds) == 2 + 6  # the runs made alone built their own


def test_variants_that_differ_in_the_split_only_read_their_source_once(tmp_path, monkeypatch):
    """Two partitions of one source (and the preflight, and two seeds of a fixed split): the samples are read once,
    each variant split from them as when it reads them itself."""
    from fedshuffle.experiments.build import build_problem_and_data

    reads = []
    real = runner_mod.load_samples

    def counted(settings, seed):
        reads.append(settings["partition"])
        return real(settings, seed)

    monkeypatch.setattr(runner_mod, "load_samples", counted)
    cfg = tmp_path / "split.toml"
    cfg.write_text("""
[experiment]
seeds = [0, 1]
[problem]
name = "softmax"
[data]
source = "synthetic"
samples = 60
features = 3
classes = 3
clients = 4
seed = 5
[local]
lr = 0.1
[run]
rounds = 2
[[variants]]
label = "iid"
data = { partition = "iid" }
[[variants]]
label = "labels"
data = { partition = "labels", labels_per_client = 1 }
""")
    experiment = load_experiment(cfg)
    _, outcomes = run_experiment(experiment, tmp_path / "out", show_progress=False)
    assert reads == ["iid"] and len(outcomes) == 4
    for label, spec in experiment.runs({}):
        _, alone = build_problem_and_data(spec)
        with runner_mod.sharing_builds():
            runner_mod._problem_and_data(spec)  # another variant's samples first
            iid = spec.model_copy(update={"data": spec.data.model_copy(update={"partition": "iid"})})
            _, shared = runner_mod._problem_and_data(iid)
            _, again = runner_mod._problem_and_data(spec)
        assert [ix.tolist() for ix in again.client_indices] == [ix.tolist() for ix in alone.client_indices], label
        assert again.features.equal(alone.features) and shared.features.shape[0] == shared.num_samples == 60


def test_seeds_that_split_a_shared_sources_samples_each_draw_their_own_split(tmp_path):
    """A source that reads files (no draws of its own) is read once for every seed; with data.seed unset each seed
    still splits the samples by its own stream, as a run that reads them itself."""
    from fedshuffle.experiments.build import build_problem_and_data
    from fedshuffle.experiments.runner import seeded
    from fedshuffle.experiments.schema import RunSpec

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "pool.npz", x=rng.normal(size=(40, 3)), y=np.arange(40) % 2)
    data = {"source": "npz", "path": str(tmp_path / "pool.npz"), "partition": "iid", "clients": 4}
    spec = RunSpec.model_validate({"problem": {"name": "logistic"}, "local": {"lr": 0.1}, "data": data})
    with runner_mod.sharing_builds():
        shared = [runner_mod._problem_and_data(seeded(spec, seed))[1] for seed in (0, 1, 2)]
    alone = [build_problem_and_data(seeded(spec, seed))[1] for seed in (0, 1, 2)]
    for a, b in zip(shared, alone):
        assert [ix.tolist() for ix in a.client_indices] == [ix.tolist() for ix in b.client_indices]
        assert a.features.equal(b.features)
    assert shared[0].client_indices[0].tolist() != shared[1].client_indices[0].tolist()  # the splits differ by seed
