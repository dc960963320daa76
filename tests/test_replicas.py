"""Replicas (fedshuffle.replicas): a grid of step sizes and its seeds advanced as one simulation give, replica by
replica, the results folders of the same runs made alone, byte for byte."""

from __future__ import annotations

import io
import json
import threading
from pathlib import Path

import pytest
import torch

from fedshuffle.core.checkpoint import read_checkpoint
from fedshuffle.experiments.results import METRIC_COLUMNS

from fedshuffle.experiments.runner import run_single, sharing_builds
from fedshuffle.experiments.schema import load_experiment
from fedshuffle.local.loop import LocalWork
from fedshuffle.replicas import ReplicaGroup, describe_groups, replica_groups, replica_key, run_together, spread

# logistic regression on 10 clients of unequal sizes (so the members' local step counts differ), 4 per round
CONFIG = """
[problem]
name = "logistic"
l2 = 0.01
[data]
source = "synthetic"
samples = 300
features = {features}
partition = "{partition}"
clients = 10
seed = 3
[method]
name = "{method}"
[local]
lr = {lr}
epochs = 1
batch_size = 4
[sampler]
name = "uniform"
cohort = 4
[run]
rounds = {rounds}
eval_every = 2
executor = "{executor}"
"""

# timing.*, checkpoint.pt: hold measured seconds, which differ between any two runs; .lock: the writing process' id
NOT_COMPARED = ("timing.csv", "timing.json", "checkpoint.pt", ".lock")


def spec_of(
    tmp_path: Path,
    method: str = "fedshuffle",
    lr: float = 0.05,
    rounds: int = 6,
    executor: str = "vectorized",
    features: int = 6,
    partition: str = "dirichlet",
    **run,
):
    path = tmp_path / f"{method}-{lr}-{rounds}-{executor}-{features}-{partition}.toml"
    path.write_text(
        CONFIG.format(method=method, lr=lr, rounds=rounds, executor=executor, features=features, partition=partition)
    )
    spec = load_experiment(path).runs()[0][1]
    return spec.model_copy(update={"run": spec.run.model_copy(update=run)}) if run else spec


def folder_bytes(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder but the measured ones; the checkpoint as its state and its rows' metric columns."""
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name not in NOT_COMPARED}
    _, saved = read_checkpoint(folder / "checkpoint.pt")
    state = saved["simulation"]
    state["counters"].pop("worker_compute_seconds")  # measured
    buffer = io.BytesIO()
    torch.save({"state": state, "rows": [{k: row[k] for k in METRIC_COLUMNS} for row in saved["rows"]]}, buffer)
    return {**files, "checkpoint.pt (state, metric rows)": buffer.getvalue()}


def run_as_replicas(runs, resume: bool = False):
    """Run ``runs`` ((spec, seed, folder) each) as the replicas of one simulation; returns the outcomes and the
    group."""

    def execute(job, adopt):
        spec, seed, folder = job
        return run_single(spec, folder, seed, resume=resume, adopt=adopt)

    with sharing_builds():
        return run_together(runs, execute)


GRID = [(0.02, 0), (0.05, 0), (0.1, 0), (0.05, 1), (0.05, 2)]


@pytest.mark.parametrize("executor", ["sequential", "vectorized", "threaded"])
@pytest.mark.parametrize("method", ["fedshuffle", "fedavg"])
def test_each_replica_writes_the_folder_of_its_run_made_alone(tmp_path, executor, method):
    """fedshuffle sums ω_iΔ_i as the executor produces them; fedavg's aggregation is also the default (summed) one,
    with replacement sampling's weights: both summed paths, on every in-process executor (vectorized: compiled)."""
    if executor == "vectorized":
        pytest.importorskip(
            "numba"
        )  # the compiled round batches the replicas (fedshuffle[fast]); the torch loop is tested below
    runs = [
        (
            spec_of(tmp_path, method, lr, executor=executor, **({"threads": 2} if executor == "threaded" else {})),
            seed,
            tmp_path / "together" / f"{lr}-{seed}",
        )
        for lr, seed in GRID
    ]
    outcomes, group = run_as_replicas(runs)
    assert group.steps == group.batched == 6 and group.widest == len(
        GRID
    )  # one executor call per round, every replica in each
    for (spec, seed, folder), outcome in zip(runs, outcomes):
        alone = tmp_path / "alone" / folder.name
        with sharing_builds():
            run_single(spec, alone, seed)
        assert outcome.status == "complete"
        assert folder_bytes(folder) == folder_bytes(alone), folder.name
    finals = {json.loads((folder / "summary.json").read_text())["final"]["loss"] for _, _, folder in runs}
    assert len(finals) == len(GRID)  # the replicas are different runs


@pytest.mark.parametrize("partition", ["equal", "dirichlet"])
@pytest.mark.parametrize("chunk_size", [3, None])
def test_torch_loop_replicas_match_alone(tmp_path, chunk_size, partition):
    """The vectorized executor's torch loop (not compiled), 60 features. Equal client sizes: every step of a chunk is
    shared by ≥ 2 members, and the replicas' members run as one loop. Unequal sizes: where a member alone would take
    steps by itself (a k = 1 reduction, another floating-point order), its replica's work runs as alone; same bytes."""
    runs = [
        (
            spec_of(tmp_path, "fedshuffle", lr, features=60, partition=partition, chunk_size=chunk_size),
            seed,
            tmp_path / "together" / f"{lr}-{seed}",
        )
        for lr, seed in GRID
    ]
    import fedshuffle.local.fused as fused

    numba, fused.numba = fused.numba, None
    try:
        _, group = run_as_replicas(runs)
        assert group.batched == (
            6 if partition == "equal" and chunk_size is None else 0
        )  # chunks of 3 of a cohort of 4 leave one alone
        for spec, seed, folder in runs:
            with sharing_builds():
                run_single(spec, tmp_path / "alone" / folder.name, seed)
            assert folder_bytes(folder) == folder_bytes(tmp_path / "alone" / folder.name)
    finally:
        fused.numba = numba


def test_a_replica_killed_and_resumed_gives_the_same_bytes(tmp_path):
    """Replicas at different rounds advance together: one resumed from its round-4 checkpoint, one from the start."""
    full = [
        (spec_of(tmp_path, "fedshuffle", lr, rounds=8, checkpoint_every=2), 0, tmp_path / "full" / str(lr))
        for lr in (0.02, 0.1)
    ]
    run_as_replicas(full)
    cut = [
        (spec_of(tmp_path, "fedshuffle", lr, rounds=4, checkpoint_every=2), 0, tmp_path / "cut" / str(lr))
        for lr in (0.02, 0.1)
    ]
    run_as_replicas(cut[:1])
    (cut[0][2] / "summary.json").unlink()  # as if killed after its last checkpoint
    resumed = [
        (spec_of(tmp_path, "fedshuffle", lr, rounds=8, checkpoint_every=2), 0, folder)
        for lr, (_, _, folder) in zip((0.02, 0.1), cut)
    ]

    def execute(job, adopt):
        spec, seed, folder = job
        return run_single(spec, folder, seed, resume=True, extend=True, adopt=adopt)

    with sharing_builds():
        outcomes, group = run_together(resumed, execute)
    assert [o.status for o in outcomes] == ["complete", "complete"]
    assert group.widest == 2 and group.steps == 8  # 4 steps with both, 4 more for the one started from round 0
    for (_, _, a), (_, _, b) in zip(full, resumed):
        assert folder_bytes(a)["metrics.csv"] == folder_bytes(b)["metrics.csv"]
        assert folder_bytes(a)["final_params.npy"] == folder_bytes(b)["final_params.npy"]


def test_grouping_keeps_data_model_and_sampler_apart(tmp_path):
    base = spec_of(tmp_path, "fedshuffle", 0.05)
    other_lr = spec_of(tmp_path, "fedshuffle", 0.2)
    server = base.model_copy(update={"server": base.server.model_copy(update={"lr": 0.5})})
    cohort = base.model_copy(update={"sampler": base.sampler.model_copy(update={"cohort": 5})})
    rounds = base.model_copy(update={"run": base.run.model_copy(update={"rounds": 7})})
    scaffold = spec_of(tmp_path, "scaffold", 0.05)  # its own client half and client state: replicas of its own kind
    assert (
        replica_key(spec_of(tmp_path, "fedshuffle", 0.05, executor="sequential")) is None
    )  # one loop per member anyway
    assert replica_key(base) == replica_key(other_lr) == replica_key(server) is not None
    assert replica_key(base) != replica_key(cohort) and replica_key(base) != replica_key(rounds)
    assert replica_key(scaffold) == replica_key(spec_of(tmp_path, "scaffold", 0.2)) not in (None, replica_key(base))
    assert replica_groups([base, cohort, other_lr, scaffold, server, scaffold]) == [[0, 2, 4], [1], [3, 5]]
    assert (
        describe_groups([[0, 2, 4], [1], [3], [5]])
        == "3 runs as 1 batched simulation of 3 replicas; 3 runs on their own"
    )
    assert describe_groups([list(range(35))]) == "35 runs as 1 batched simulation of 35 replicas"
    assert describe_groups([[0], [1]]) is None
    # fewer groups than workers: the largest are halved, so that every core advances replicas
    assert spread([list(range(35))], 2) == [list(range(18)), list(range(18, 35))]
    assert describe_groups(spread([list(range(35))], 2)) == "35 runs as 2 batched simulations of 18 and 17 replicas"
    assert spread([[0, 1, 2], [3]], 3) == [[0, 1], [2], [3]]
    assert spread([[0], [1]], 4) == [[0], [1]]  # a group of one cannot be halved
    assert spread([[0, 1], [2], [3]], 2) == [[0, 1], [2], [3]]


def test_a_split_drawn_from_the_run_seed_is_other_data(tmp_path):
    base = spec_of(tmp_path, "fedshuffle", 0.05)
    unsplit = base.model_copy(update={"data": base.data.model_copy(update={"seed": None})})
    other_seed = unsplit.model_copy(update={"run": unsplit.run.model_copy(update={"seed": 5})})
    same_seed_base = base.model_copy(update={"run": base.run.model_copy(update={"seed": 5})})
    assert replica_key(base) == replica_key(same_seed_base)
    assert replica_key(unsplit) != replica_key(other_seed)


# FedCDR (Synthetic(1, 1), an MLP, 12 clients of unequal sizes, 3 per round): client state and two executor calls in
# the rounds where new clients start (their first prox, then the round's)
FEDCDR = """
[problem]
name = "mlp"
hidden = [8]
[data]
source = "fedprox_synthetic"
synthetic_alpha = 1.0
synthetic_beta = 1.0
clients = 12
weights = "uniform"
seed = 0
[method]
name = "{method}"
[local]
lr = 0.01
epochs = 2
batch_size = 10
[sampler]
name = "cyclic"
cohort = 3
[run]
rounds = 6
eval_every = 2
dtype = "float32"
executor = "vectorized"
"""

STATEFUL = [
    ({"eta": 10.0, "alpha": 1.0}, 0),
    ({"eta": 10.0, "alpha": 1.5}, 0),
    ({"eta": 10.0, "alpha": 1.0}, 1),
    ({"eta": 100.0, "alpha": 1.0}, 0),
]


@pytest.mark.parametrize("method, cap", [("fedcdr", None), ("scaffold", None), ("fedcdr", 1)])
def test_stateful_replicas_share_executor_calls_and_write_the_folders_of_their_runs_alone(
    tmp_path, monkeypatch, method, cap
):
    """Methods with their own client halves and client state batch too: every replica's client half runs at once and
    their executor calls are gathered. FedCDR's α grid and seeds share one loop (an MLP computes each row on its own,
    so members of unequal step counts need not step in pairs); η = 100 is another prox μ, so its work runs apart. With a
    cap below one call's models (replicas.SHARED_ELEMENTS: large models run faster apart) nothing is shared; same
    bytes."""
    if cap is not None:
        import fedshuffle.replicas as replicas

        monkeypatch.setattr(replicas, "SHARED_ELEMENTS", cap)
    path = tmp_path / f"{method}.toml"
    path.write_text(FEDCDR.format(method=method))
    base = load_experiment(path).runs()[0][1]
    runs = []
    for k, (settings, seed) in enumerate(STATEFUL):
        spec = (
            base.model_copy(update={"method": base.method.model_copy(update=settings)})
            if method == "fedcdr"
            else base.model_copy(update={"local": base.local.model_copy(update={"lr": 0.01 * (1 + k)})})
        )
        runs.append((spec, seed, tmp_path / "together" / str(k)))
    assert len({replica_key(spec) for spec, _, _ in runs}) == 1
    outcomes, group = run_as_replicas(runs)
    assert [o.status for o in outcomes] == ["complete"] * len(runs)
    assert group.steps == 6 and group.batched == (0 if cap else 6) and group.widest == len(runs)
    for spec, seed, folder in runs:
        with sharing_builds():
            run_single(spec, tmp_path / "alone" / folder.name, seed)
        assert folder_bytes(folder) == folder_bytes(tmp_path / "alone" / folder.name), folder.name
    finals = {json.loads((folder / "summary.json").read_text())["final"]["loss"] for _, _, folder in runs}
    assert len(finals) == len(runs)


def test_gathering_stacks_only_works_whose_chains_agree():
    """Works with another prox μ, another center or offset presence, or a chain holding its own tensor (global
    momentum's m) are never stacked with others; equal chains are."""
    from fedshuffle.local.steps import Drift, standard_chain
    from fedshuffle.problems.networks import MLP
    from fedshuffle.replicas import _Call

    problem, start = MLP(4, [3], 2), torch.zeros(2, 3)

    def key(chain, **rows):
        return _Call(None, problem, None, LocalWork([object(), object()], start, chain, **rows), None).key()

    prox = standard_chain(prox_mu=0.1)
    assert key(prox) == key(standard_chain(prox_mu=0.1)) is not None
    assert (
        len(
            {
                key(standard_chain()),
                key(prox),
                key(standard_chain(prox_mu=0.01)),
                key(prox, center=start),
                key(standard_chain(offset=True), offset=start),
            }
        )
        == 5
    )
    assert key(standard_chain(drift=Drift(0.5, torch.zeros(3), False))) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_an_mlps_gradient_rows_do_not_depend_on_the_rows_stacked_with_them(dtype):
    """MLP.independent_rows: a client's minibatch gradient is the same bits alone, beside one other client or beside
    79."""
    from fedshuffle.problems.networks import MLP

    problem = MLP(60, [32], 10)
    assert problem.independent_rows
    generator = torch.Generator().manual_seed(0)
    params = torch.randn(80, problem.dim, generator=generator, dtype=dtype)
    features = torch.randn(80, 10, 60, generator=generator, dtype=dtype)
    labels = torch.randint(0, 10, (80, 10), generator=generator)
    weights = torch.full((80, 10), 0.1, dtype=dtype)
    alone = problem.local_gradient(params[:1], features[:1], labels[:1], weights[:1])[0]
    for k in (2, 3, 25, 80):
        assert torch.equal(problem.local_gradient(params[:k], features[:k], labels[:k], weights[:k])[0], alone)
    last = problem.local_gradient(
        torch.cat([params[5:30], params[:1]]),
        torch.cat([features[5:30], features[:1]]),
        torch.cat([labels[5:30], labels[:1]]),
        torch.cat([weights[5:30], weights[:1]]),
    )[-1]
    assert torch.equal(last, alone)


def test_a_failing_step_fails_every_waiting_replica(monkeypatch):
    """An error in a replica's step reaches its run; none waits for ever."""
    import fedshuffle.replicas as replicas

    class Broken:
        def step(self):
            raise RuntimeError("broken")

    monkeypatch.setattr(replicas, "batches", lambda sims: False)
    group, errors = ReplicaGroup(2), []

    def member(sim):
        try:
            group.step(sim)
        except RuntimeError as exc:
            errors.append(str(exc))
        finally:
            group.leave()

    threads = [threading.Thread(target=member, args=(Broken(),)) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert errors == ["broken", "broken"] and group.steps == 1 and group.batched == 0


@pytest.mark.parametrize("workers", [1, 2])
def test_sweep_runs_a_grid_and_its_seeds_as_one_simulation_with_each_runs_folder(tmp_path, workers):
    """``fedshuffle sweep`` groups the grid × seeds (and says so), SCAFFOLD's runs in a group of their own; every folder
    is
    the one the same point and seed writes alone."""
    from typer.testing import CliRunner

    from fedshuffle.cli import app

    config = tmp_path / "grid.toml"
    config.write_text(
        CONFIG.format(method="fedshuffle", lr=0.05, rounds=4, executor="vectorized", features=6, partition="dirichlet")
        + '\n[[variants]]\nlabel = "FedShuffle"\n[[variants]]\nlabel = "SCAFFOLD"\nmethod = { name = "scaffold" }\n'
    )
    out = tmp_path / "sweep"
    result = CliRunner().invoke(
        app,
        [
            "sweep",
            str(config),
            "--grid",
            "local.lr=0.02,0.1",
            "--seeds",
            "0,1",
            "--out",
            str(out),
            "--workers",
            str(workers),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "8 runs as 2 batched simulations of 4 replicas" in " ".join(result.stderr.split())
    for lr in ("0.02", "0.1"):
        single = tmp_path / "single" / lr  # a sweep of one point and one seed: each variant's run alone
        run = CliRunner().invoke(
            app,
            [
                "sweep",
                str(config),
                "--grid",
                f"local.lr={lr}",
                "--seeds",
                "1",
                "--out",
                str(single),
                "--quiet",
                "--workers",
                "1",
            ],
        )
        assert run.exit_code == 0 and "batched" not in run.stderr, run.output
        for label in ("fedshuffle", "scaffold"):
            assert folder_bytes(out / f"local.lr-{lr}" / label / "seed-1") == folder_bytes(
                single / f"local.lr-{lr}" / label / "seed-1"
            )


def test_the_switch_runs_every_job_on_its_own(tmp_path, monkeypatch):
    base = spec_of(tmp_path, "fedshuffle", 0.05)
    assert replica_groups([base, base]) == [[0, 1]]
    monkeypatch.setenv("FEDSHUFFLE_REPLICAS", "0")
    assert replica_groups([base, base]) == [[0], [1]]


def test_sweep_benchmark_smoke_case():
    """benchmarks/sweep.py --smoke: the batched sweep prints its note and writes every run's folder."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'src'}"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.sweep", "--smoke"],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    cases = json.loads(out.stdout.strip().splitlines()[-1])["cases"]
    assert cases["smoke: 4 runs, batched"]["note"].startswith(
        "4 runs as "
    )  # one simulation per worker: 1 of 4 replicas, or 2 of 2
    assert cases["smoke: 4 runs, separate"]["note"] is None
    assert (
        cases["smoke: 4 runs, batched"]["runs"] == cases["smoke: 4 runs, separate"]["runs"] == 4
        and cases["smoke: one run"]["runs"] == 1
    )


def _specs(executor: str, seeds: list[int], data_seed: int | None = 0, **local) -> list:
    from fedshuffle.experiments.schema import RunSpec

    data = {
        "source": "synthetic",
        "samples": 40,
        "features": 3,
        "classes": 2,
        "clients": 4,
        "partition": "iid",
        "seed": data_seed,
    }
    base = {"problem": {"name": "logistic", "l2": 0.1}, "data": data, "sampler": {"name": "uniform", "cohort": 2}}
    runs = [
        ({"lr": lr, **local}, {"executor": executor, "rounds": 2, "seed": seed}) for lr in (0.1, 0.2) for seed in seeds
    ]
    return [RunSpec.model_validate({**base, "local": step, "run": run}) for step, run in runs]


def test_a_sweep_says_in_one_line_why_its_runs_are_not_batched_and_how_to_let_them_be(monkeypatch):
    from fedshuffle.replicas import AUTO_NUMBERS, replica_groups, unbatched_note

    def note(specs):
        return unbatched_note(specs, replica_groups(specs))

    sequential = note(_specs("sequential", [0, 1]))
    assert sequential.startswith("4 runs cannot be batched as replicas: run.executor = 'sequential'")
    assert "--set run.executor=auto, 4 of them run as replicas" in sequential and AUTO_NUMBERS in sequential
    assert "\n" not in sequential
    assert note(_specs("vectorized", [0, 1])) is None  # one group of 4 replicas
    assert "data.seed is unset" in note(_specs("vectorized", [0, 1], data_seed=None)[:2])  # one step size, two splits
    differing = note([*_specs("vectorized", [0], batch_size=2)[:1], *_specs("vectorized", [0], batch_size=3)[:1]])
    assert "they differ in local.batch_size" in differing
    assert note(_specs("sequential", [0])[:1]) is None  # one run
    monkeypatch.setenv("FEDSHUFFLE_REPLICAS", "0")
    assert "FEDSHUFFLE_REPLICAS=0" in note(_specs("vectorized", [0, 1]))


def test_a_sweeps_note_is_printed_at_its_start(tmp_path, capsys):
    from fedshuffle.experiments.sweep import Job, run_jobs

    specs = _specs("sequential", [0, 1])
    jobs = [Job("", {}, spec, spec.run.seed, tmp_path / f"run-{k}") for k, spec in enumerate(specs)]
    run_jobs(jobs, show_progress=False)
    assert "4 runs cannot be batched as replicas" in capsys.readouterr().err
