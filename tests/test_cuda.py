"""The GPU path: every problem and the vectorized executor on CUDA (``run.device = "cuda"``), in float32 and float64,
agreeing with the CPU. The agreement tests run only where CUDA is present (``python -m benchmarks.gpu`` runs them on a
GPU machine); what can be checked without a GPU — the compiled loop switched off off the CPU, and said so — runs here.

Tolerances: float64 on a convex preset, the same trajectory to 1e-10 (relative; the two devices sum in other orders);
float32 on the CNN, 1e-3 relative on the parameters and the loss after three rounds (cuDNN's convolutions may round
through TF32, PyTorch's default on CUDA: about 1e-3 relative per product).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedshuffle.executors.choice import COMPILED_OFF, make_executor
from fedshuffle.experiments.runner import build_simulation, run_single
from fedshuffle.experiments.schema import RunSpec, load_experiment
from fedshuffle.problems import LogisticRegression

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)


@pytest.mark.parametrize("name", ["vectorized", "auto"])
def test_the_compiled_loop_is_switched_off_off_the_cpu_and_the_run_is_told(name):
    problem = LogisticRegression(5, 0.1)
    on_gpu, on_cpu = make_executor(name, problem, "cuda"), make_executor(name, problem, "cpu")
    assert on_cpu.compiled and not on_gpu.compiled
    assert on_gpu.chosen.endswith(COMPILED_OFF.format(device="cuda")) and "numba" in on_gpu.chosen
    assert on_cpu.chosen is None or "compiled loop off" not in on_cpu.chosen


def _spec(config: dict, device: str, dtype: str) -> RunSpec:
    config = {**config, "run": {**config.get("run", {}), "device": device, "dtype": dtype, "executor": "vectorized"}}
    return RunSpec.model_validate(config)


def _run(spec: RunSpec, folder) -> tuple[dict, np.ndarray]:
    outcome = run_single(spec, folder, 0)
    assert outcome.status == "complete", outcome.message
    return outcome.final, np.load(folder / "final_params.npy")


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@needs_cuda
def test_a_convex_preset_in_float64_gives_the_cpus_trajectory_to_1e_10(tmp_path):
    """rrcli-a3a-theory's RR-CLI variant, 40 rounds: the same final model and f(x) − f* on both devices."""
    label, spec = next(
        iter(
            load_experiment("rrcli-a3a-theory").runs(
                {"run": {"rounds": 40, "eval_every": 10, "executor": "vectorized"}}
            )
        )
    )
    results = {
        device: _run(spec.model_copy(update={"run": spec.run.model_copy(update={"device": device})}), tmp_path / device)
        for device in ("cpu", "cuda")
    }
    (cpu_final, cpu_x), (gpu_final, gpu_x) = results["cpu"], results["cuda"]
    assert _relative(gpu_x, cpu_x) <= 1e-10, label
    assert gpu_final["loss"] == pytest.approx(cpu_final["loss"], rel=1e-10)


#: 16 × 16 one-channel images (a flat square), enough for every image model
SMALL_IMAGES = {
    "source": "synthetic",
    "samples": 96,
    "features": 16 * 16,
    "classes": 4,
    "partition": "iid",
    "clients": 6,
    "seed": 1,
}


@needs_cuda
def test_the_cnn_in_float32_agrees_with_the_cpu_within_1e_3(tmp_path):
    """pfl-research's CNN without dropout (dropout masks come from each device's own generator), three rounds."""
    config = {
        "problem": {"name": "cnn", "dropout": False},
        "data": SMALL_IMAGES,
        "method": {"name": "fedavg"},
        "local": {"lr": 0.05, "batch_size": 8},
        "sampler": {"name": "uniform", "cohort": 3},
        "run": {"rounds": 3},
    }
    cpu_final, cpu_x = _run(_spec(config, "cpu", "float32"), tmp_path / "cpu")
    gpu_final, gpu_x = _run(_spec(config, "cuda", "float32"), tmp_path / "cuda")
    assert _relative(gpu_x, cpu_x) <= 1e-3
    assert gpu_final["loss"] == pytest.approx(cpu_final["loss"], rel=1e-3)


PROBLEMS_ON_CUDA = [
    (
        "quadratic",
        {"name": "quadratic"},
        {"source": "synthetic", "samples": 60, "features": 4, "classes": 2, "clients": 4, "partition": "iid"},
    ),
    (
        "logistic",
        {"name": "logistic", "l2": 0.1},
        {"source": "synthetic", "samples": 60, "features": 4, "classes": 2, "clients": 4, "partition": "iid"},
    ),
    (
        "softmax",
        {"name": "softmax", "l2": 0.1},
        {"source": "synthetic", "samples": 60, "features": 4, "classes": 3, "clients": 4, "partition": "iid"},
    ),
    (
        "mlp",
        {"name": "mlp", "hidden": [8]},
        {"source": "synthetic", "samples": 60, "features": 4, "classes": 3, "clients": 4, "partition": "iid"},
    ),
    ("cnn", {"name": "cnn"}, SMALL_IMAGES),
    ("lenet5", {"name": "lenet5"}, SMALL_IMAGES),
    ("mnist_cnn", {"name": "mnist_cnn"}, SMALL_IMAGES),
    ("resnet18", {"name": "resnet18", "resnet_width": 8}, SMALL_IMAGES),
]


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name, problem, data", PROBLEMS_ON_CUDA, ids=[p[0] for p in PROBLEMS_ON_CUDA])
@pytest.mark.parametrize("method", ["fedavg", "scaffold", "fedcdr"])
def test_every_problem_and_stateful_method_runs_on_cuda_and_stays_near_the_cpu(
    tmp_path, name, problem, data, dtype, method
):
    """Two rounds on each device; the model stays on the GPU (its parameters and the data's tensors are CUDA tensors),
    the metrics are finite, and the final models agree (1e-8 in float64, 1e-3 in float32: TF32 convolutions)."""
    if method == "fedcdr" and problem["name"] not in ("quadratic", "logistic", "softmax", "mlp"):
        pytest.skip("FedCDR's prox solves are run here on the closed-form problems")
    sampler = (
        {"name": "cyclic", "cohort": 2} if method == "fedcdr" else {"name": "uniform", "cohort": 2}
    )  # FedCDR needs meta-epochs
    config = {
        "problem": {**problem, **({"dropout": False} if name == "cnn" else {})},
        "data": data,
        "method": {"name": method},
        "local": {"lr": 0.05, "batch_size": 5},
        "sampler": sampler,
        "run": {"rounds": 2},
    }
    sim, _ = build_simulation(_spec(config, "cuda", dtype), 0)
    assert sim.params.is_cuda and sim.data.features.is_cuda and sim.params.dtype == getattr(torch, dtype)
    cpu_final, cpu_x = _run(_spec(config, "cpu", dtype), tmp_path / "cpu")
    gpu_final, gpu_x = _run(_spec(config, "cuda", dtype), tmp_path / "cuda")
    assert all(np.isfinite(v) for v in gpu_final.values() if isinstance(v, float))
    assert _relative(gpu_x, cpu_x) <= (1e-8 if dtype == "float64" else 1e-3)
