"""Each benchmark's smoke case (``--smoke``: seconds, prints its JSON, writes nothing) runs end to end and
measures what it claims: every case timed, no case failed. Speed itself is judged from the full runs'
JSON under benchmarks/results/, never here."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def smoke(module: str, *args: str) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-m", module, "--smoke", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "module, cases",
    [
        ("benchmarks.scale", {"100", "10000"}),
        ("benchmarks.client_state", {"scaffold-200", "scaffold-20000", "fedcdr-200", "fedcdr-20000"}),
        ("benchmarks.ray_workers", {"vectorized", "ray-1"}),
    ],
)
def test_population_and_executor_benchmarks_time_every_case(module, cases):
    if module == "benchmarks.ray_workers":
        pytest.importorskip("ray")  # the Ray executor's benchmark needs Ray (fedshuffle[ray])
    result = smoke(module)
    assert set(result["cases"]) == cases
    for name, case in result["cases"].items():
        assert "error" not in case, f"{name}: {case.get('error')}"
        assert case["median_s"] > 0 and case["rounds"] == result["setup"]["rounds"]
    if (
        module == "benchmarks.client_state"
    ):  # the larger population's state was kept for the clients that took part, not all
        for method in ("scaffold", "fedcdr"):
            large = result["cases"][f"{method}-20000"]
            assert 0 < large["clients_with_state"] < 20000
            assert large["memory_mapped"] and not result["cases"][f"{method}-200"]["memory_mapped"]
        assert all(case["checkpoints"] >= 1 for case in result["cases"].values())  # the state was checkpointed


def test_profile_shares_finds_the_writes_and_the_evaluation():
    result = smoke("benchmarks.profile_shares")["smoke"]["this"]
    assert "error" not in result, result
    assert 0 < result["writes_s"] and 0 < result["evaluation_s"]
    assert 0 < result["writes_share"] + result["evaluation_share"] + result["preflight_share"] < 1


def test_threads_benchmark_times_every_tree_and_the_one_thread_case():
    result = smoke("benchmarks.threads")
    assert set(result["cases"]) == {"this default threads", "one thread"} and result["setup"]["busy_processes"] == 1
    for name, case in result["cases"].items():
        assert "error" not in case, f"{name}: {case.get('error')}"
        assert case["wall_s"] > 0 and case["cpu_s"] > 0
    assert result["cases"]["this default threads"]["runs"][0]["chosen"].startswith(
        "operator threads per run: 1 (logistic"
    )


def test_flower_rounds_benchmark_times_fedshuffle_run():
    """The smoke case times ``fedshuffle run``'s rounds from its timing.csv; the SuperLink cases run in the full
    benchmark."""
    result = smoke("benchmarks.flower_rounds")
    assert set(result["cases"]) == {"fedshuffle-run"}
    case = result["cases"]["fedshuffle-run"]
    assert "error" not in case, case.get("error")
    assert case["rounds"] == 2 and 0 < case["min_s"] <= case["median_s"] <= case["max_s"] < case["wall_s"]


def test_mlp_loop_benchmark_times_both_loops_for_every_shape():
    """Each MLP shape's round is timed on the torch loop and the compiled one, plain SGD and with a prox term; the
    backend's own rule sends FedCDR's small network to the compiled loop and the 2NN to the torch loop."""
    pytest.importorskip("numba")
    result = smoke("benchmarks.mlp_loop")
    assert set(result["cases"]) == {"fedcdr-synthetic", "fedcdr-femnist", "2nn"}
    for name, case in result["cases"].items():
        for chain in ("sgd", "prox"):
            assert case[chain]["torch_s"] > 0 and case[chain]["compiled_s"] > 0, name
            assert 0 < case[chain]["max_relative_difference"] < 1e-4, name  # the same updates, to float32 rounding
    assert result["cases"]["fedcdr-synthetic"]["chosen"] == "compiled" and result["cases"]["2nn"]["chosen"] == "torch"


def test_evaluation_benchmark_times_the_evaluation_beside_the_bare_forward_pass():
    """The chunked evaluation, the same in one chunk, and the forward pass of the same rows are all timed; the smoke
    model's rows fit in one chunk of the cache budget."""
    result = smoke("benchmarks.evaluation")
    assert set(result["cases"]) == {"evaluation", "one_chunk", "forward_1024"}
    assert all(case["median_s"] > 0 for case in result["cases"].values())
    setup = result["setup"]
    assert setup["held_rows"] == setup["train_rows"] and setup["chunk_rows"] >= setup["train_rows"]
    assert result["ratios"]["evaluation_over_forward"] > 0


def test_the_gpu_benchmark_runs_every_step_on_this_machine():
    """``benchmarks/gpu.py --smoke``: the agreement tests run (here, without CUDA, the GPU ones skip with their reason),
    the CNN harness' fedshuffle case is timed (pfl-research where installed), each smoke preset is timed and
    projected."""
    from benchmarks.gpu import SMOKE_PRESETS

    result = smoke("benchmarks.gpu")
    tests = result["agreement"]
    assert tests["failed"] == 0 and tests["passed"] >= 2, tests
    if result["device"] == "cpu":
        assert tests["skipped"] > 0 and any("CUDA" in reason for reason in tests["skip_reasons"])
    assert result["cnn"]["fedshuffle-auto"]["median_s"] > 0
    assert set(result["presets"]) == set(SMOKE_PRESETS)
    for name, preset in result["presets"].items():
        assert "error" not in preset, f"{name}: {preset.get('error')}"
        assert preset["round_s"] > 0 and preset["evaluation_s"] > 0 and preset["projected_minutes"] > 0
        assert preset["scale"] == "smoke"
