"""``fedshuffle reproduce --smoke``: every paper-scale preset built and run for two rounds on a CPU.

A ``gpu`` preset takes hours on the hardware it is sized for, and that hardware is rarely at hand. The
smoke run proves, in seconds per preset, that each of its variants builds and trains: the preset's own
model (same layers, same parameter count), its own method, local solver, sampler, schedule and
server, on data of the source's real shapes (image channels and sizes, token sequences, class
counts, own clients). Only the scale is cut: :data:`CLIENTS` clients holding
:data:`SAMPLES_PER_CLIENT` samples each, a cohort of at most :data:`COHORT`, :data:`ROUNDS` rounds
(two, so that a momentum that starts at round 1 is exercised), one seed.

Where the source's files are on this machine (``$FEDSHUFFLE_DATA``, the data folders, the cache;
nothing is downloaded) a cut of the real samples is used; otherwise samples drawn at random with the
real shapes, and the report says so. Before anything is allocated the memory of the smoke run is
checked (:func:`fedshuffle.core.limits.check_fits`), and the memory the paper-scale data will need is
reported beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError, DataError, ResultsError
from fedshuffle.core.registry import call_with
from fedshuffle.data.catalog import SOURCES, Samples
from fedshuffle.experiments.runner import run_single
from fedshuffle.experiments.schema import Experiment, RunSpec, load_experiment, preset_names
from fedshuffle.problems import PROBLEMS

#: clients of a smoke run, samples each, the largest cohort, rounds, test samples
CLIENTS = 4
SAMPLES_PER_CLIENT = 2
COHORT = 2
ROUNDS = 2
TEST_SAMPLES = 4
#: the most local steps a member takes in a smoke round (its epochs are cut to one)
LOCAL_STEPS = 2


@dataclasses.dataclass(frozen=True)
class SourceShape:
    """What a data source's samples look like at paper scale: one sample's shape, classes, sizes."""

    sample: tuple[int, ...]
    classes: int
    train: int
    test: int
    tokens: bool = False  # integer token ids with one target per position (TFF Shakespeare)
    own_clients: bool = False  # the source comes split into its own clients
    coarse_groups: int = 0  # coarse labels (CIFAR-100's 20 superclasses)

    def bytes(self) -> float:
        """Host memory of the paper-scale samples (float32 features, or int64 tokens and targets)."""
        per_sample = 2 * 8 * int(np.prod(self.sample)) if self.tokens else 4 * int(np.prod(self.sample)) + 8
        return float(per_sample) * (self.train + self.test)


#: the sources paper-scale presets read, at their real sizes (training + test samples)
SHAPES: dict[str, SourceShape] = {
    "mnist": SourceShape((1, 28, 28), 10, 60_000, 10_000),
    "cifar10": SourceShape((3, 32, 32), 10, 50_000, 10_000),
    "cifar100": SourceShape((3, 32, 32), 100, 50_000, 10_000, coarse_groups=20),
    "tff_cifar100": SourceShape((3, 32, 32), 100, 50_000, 10_000, own_clients=True, coarse_groups=20),
    "shakespeare": SourceShape((80,), 90, 16_068, 2_356, tokens=True, own_clients=True),
}


@dataclasses.dataclass
class SmokeResult:
    """One preset's smoke run: what it ran on and how it went."""

    preset: str
    variants: int
    data: str
    parameters: int
    paper_scale_data: str
    seconds: float
    status: str  # "ok" or "failed"
    error: str = ""


def _random_samples(shape: SourceShape, partition: str, rng: np.random.Generator) -> Samples:
    """Samples of ``shape`` drawn at random for :data:`CLIENTS` clients, classes in turn so that every one is
    present."""

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        if shape.tokens:
            x = rng.integers(1, shape.classes, size=(n, *shape.sample), dtype=np.int64)
            return x, np.roll(x, -1, axis=1)
        return rng.random((n, *shape.sample), dtype=np.float32), np.arange(n, dtype=np.int64) % shape.classes

    x, y = draw(CLIENTS * SAMPLES_PER_CLIENT if shape.own_clients else _pooled_count(shape.classes, partition))
    sizes = np.full(CLIENTS, SAMPLES_PER_CLIENT) if shape.own_clients else None
    return Samples(x, y, shape.classes, draw(TEST_SAMPLES), sizes)


def _pooled_count(classes: int, partition: str) -> int:
    """Pooled samples of a smoke run: :data:`SAMPLES_PER_CLIENT` per client, or for a split by labels every class
    :data:`CLIENTS` times (it gives each class to at most that many clients)."""
    return CLIENTS * (classes if partition == "labels" else SAMPLES_PER_CLIENT)


def _cut(samples: Samples, partition: str) -> Samples:
    """The first :data:`SAMPLES_PER_CLIENT` samples of the first :data:`CLIENTS` clients (a source with its own
    clients), or :func:`_pooled_count` pooled samples taking the classes in turn."""
    x, y, sizes = samples.features, samples.labels, samples.client_sizes
    if sizes is not None:
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])[:CLIENTS]
        sizes = np.minimum(sizes[:CLIENTS], SAMPLES_PER_CLIENT)
        keep = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, sizes)])
    else:
        order = np.argsort(y, kind="stable")
        _, first, counts = np.unique(y[order], return_index=True, return_counts=True)
        rank_in_class = np.arange(len(y)) - np.repeat(first, counts)
        keep = np.sort(order[np.argsort(rank_in_class, kind="stable")[: _pooled_count(samples.num_classes, partition)]])
    test = None if samples.test is None else (samples.test[0][:TEST_SAMPLES], samples.test[1][:TEST_SAMPLES])
    return Samples(x[keep], y[keep], samples.num_classes, test, sizes, samples.label_groups)


def smoke_samples(source: str, settings: dict[str, Any]) -> tuple[Samples, str]:
    """The smoke run's samples of ``source`` and where they come from: a cut of the real files if they are
    on this machine (nothing is downloaded), else random samples of the source's real shapes."""
    shape = SHAPES[source]
    partition = settings.get("partition", "sizes")
    _check_memory(shape, partition)
    try:
        samples = _cut(
            call_with(SOURCES[source].factory, **{**settings, "download": False, "clients": CLIENTS}), partition
        )
        origin = f"real {source} files (a cut)"
    except (DataError, ConfigError, OSError):
        samples = _random_samples(shape, partition, np.random.default_rng(0))
        origin = f"random samples of {source}'s shapes ({source} files not found on this machine)"
    if shape.coarse_groups and samples.label_groups is None:
        samples.label_groups = np.arange(shape.classes) % shape.coarse_groups
    return samples, origin


def _constant(samples: Samples) -> Callable[[], Samples]:
    """A source factory that returns ``samples`` whatever the settings (they were checked by the real source's
    model)."""
    return lambda **_: samples


@contextlib.contextmanager
def _sources_replaced(factories: dict[str, Callable[..., Samples]]) -> Iterator[None]:
    """Within the block, ``SOURCES[name]`` builds ``factories[name]``'s samples; restored afterwards."""
    entries = SOURCES._entries  # the registry has no public way to swap an entry for a while
    saved = {name: entries[name] for name in factories}
    try:
        for name, factory in factories.items():
            entries[name] = dataclasses.replace(saved[name], factory=factory)
        yield
    finally:
        entries.update(saved)


def smoke_spec(spec: RunSpec, rounds: int = ROUNDS) -> RunSpec:
    """``spec`` at smoke scale: :data:`CLIENTS` clients, a cohort of at most :data:`COHORT`, ``rounds`` rounds
    evaluated at the start and the end, one local epoch (or at most :data:`LOCAL_STEPS` steps), no metric sinks;
    model, method and every step-size setting unchanged."""
    data = spec.data.model_copy(update={"clients": CLIENTS})
    steps = spec.local.steps
    local = spec.local.model_copy(
        update={"epochs": 1, "steps": min(steps, LOCAL_STEPS) if isinstance(steps, int) else steps}
    )
    cohort = spec.sampler.own_settings().get("cohort")
    sampler = (
        spec.sampler.model_copy(update={"cohort": min(cohort, COHORT)})
        if cohort is not None and cohort >= 1
        else spec.sampler
    )
    run = spec.run.model_copy(
        update={"rounds": rounds, "eval_every": rounds, "checkpoint_every": 0, "sinks": [], "device": "cpu"}
    )
    return spec.model_copy(update={"data": data, "local": local, "sampler": sampler, "run": run})


def _check_memory(shape: SourceShape, partition: str) -> None:
    """Refuse before allocating when the smoke run's samples cannot fit (the model is checked when it is built)."""
    smoke = SourceShape(
        shape.sample, shape.classes, _pooled_count(shape.classes, partition), TEST_SAMPLES, shape.tokens
    )
    limits.check_fits(limits.DATASET_COPIES * smoke.bytes(), "data.source", "the smoke run's samples")


def smoke_preset(
    name: str, experiment: Experiment, folder: Path, cache: dict[tuple[str, str], tuple[Samples, str]] | None = None
) -> SmokeResult:
    """Build and run every variant of ``experiment`` at smoke scale into ``folder``; a failure is returned, not raised.
    ``cache`` keeps the smoke samples of each (source, partition) across presets."""
    cache = {} if cache is None else cache
    started = time.perf_counter()
    data, parameters, paper_bytes = "", 0, ""
    try:
        runs = experiment.runs()
        sources = {spec.data.source for _, spec in runs}
        unknown = sorted(sources - set(SHAPES))
        if unknown:
            raise ConfigError(
                "data.source", f"no smoke shapes for {unknown[0]!r}; sources with shapes: {', '.join(SHAPES)}"
            )
        paper_bytes = ", ".join(f"{s}: {limits.human(SHAPES[s].bytes())}" for s in sorted(sources))
        origins = []
        for k, (label, spec) in enumerate(runs):
            key = (spec.data.source, spec.data.partition)  # a split by labels needs more samples than the others
            if key not in cache:
                cache[key] = smoke_samples(spec.data.source, spec.data.model_dump())
            samples, origin = cache[key]
            origins += [origin] if origin not in origins else []
            if (
                k == 0
                # the first variant's model gives the preset's size (a variant that changes it is still built by its
                # run)
            ):
                parameters = PROBLEMS[spec.problem.name].build(spec.problem.own_settings(), samples=samples).dim
            with _sources_replaced({spec.data.source: _constant(samples)}):
                outcome = run_single(
                    smoke_spec(spec),
                    folder / f"variant-{k}",
                    seed=experiment.seeds(spec)[0],
                    label=label,
                    experiment=name,
                )
            if outcome.status not in ("complete", "diverged"):
                raise ResultsError(f"variant {label!r}: the run ended {outcome.status} ({outcome.message})")
        data = "; ".join(origins)
    except Exception as exc:  # noqa: BLE001 — whatever stops a preset from building or training is the finding
        return SmokeResult(
            name,
            len(experiment.variants) or 1,
            data,
            parameters,
            paper_bytes,
            time.perf_counter() - started,
            "failed",
            f"{type(exc).__name__}: {exc}".splitlines()[0],
        )
    return SmokeResult(
        name, len(experiment.variants) or 1, data, parameters, paper_bytes, time.perf_counter() - started, "ok"
    )


def smoke(
    presets: Sequence[str] = (), budget: str = "gpu", note: Callable[[str], None] | None = None
) -> list[SmokeResult]:
    """Smoke-run ``presets`` (default: every preset sized for a GPU); every config is loaded first."""
    if budget != "gpu":
        raise ConfigError(
            "--budget",
            f"--smoke checks the presets sized for a GPU (a cpu preset is simply run); accepted: gpu, got {budget!r}",
        )
    names = list(presets) or [n for n in preset_names() if load_experiment(n).experiment.budget == "gpu"]
    loaded = [load_experiment(n) for n in names]
    results: list[SmokeResult] = []
    cache: dict[tuple[str, str], tuple[Samples, str]] = {}
    with tempfile.TemporaryDirectory(prefix="fedshuffle-smoke-") as scratch:
        for experiment in loaded:
            name = experiment.experiment.name
            result = smoke_preset(name, experiment, Path(scratch) / name, cache)
            if note:
                note(
                    f"{name}: {result.status} in {result.seconds:.1f} s on {result.data or '?'}"
                    + (f" — {result.error}" if result.error else "")
                )
            results.append(result)
    return results


def summary(results: Sequence[SmokeResult]) -> str:
    """A Markdown table of smoke results, one row per preset."""
    lines = [
        "| preset | variants | parameters | data used | paper-scale data | seconds | status |",
        "| --- | ---: | ---: | --- | --- | ---: | --- |",
    ]
    for r in results:
        status = r.status if not r.error else f"{r.status}: {r.error}"
        lines.append(
            f"| {r.preset} | {r.variants} | {r.parameters:,} | {r.data} | {r.paper_scale_data} | {r.seconds:.1f} | "
            f"{status} |"
        )
    return "\n".join(lines)
