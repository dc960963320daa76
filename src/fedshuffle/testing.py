"""The invariants every registered part must satisfy, as public checks (scikit-learn's ``check_estimator``).

A user's plugin runs the same checks in its own test suite as the package runs over every built-in part::

    from fedshuffle.testing import check_method

    def test_my_method():
        import mypkg.methods  # registers "damped_fedavg"
        check_method("damped_fedavg")

* :func:`check_settings` — every declared setting refuses generated bad values (below a bound, above
  one, outside a choice, of the wrong type) and an unknown setting, each error naming
  ``section.setting``; the defaults validate.
* :func:`check_method` — settings; one round from the defaults moves the model and keeps it finite; the
  sequential, vectorized and threaded executors give the same trajectory (fp64, 1e-10); a run cut
  and resumed from its checkpoint ends byte-identical to the uncut run (server and client state
  serialize).
* :func:`check_problem` — settings; the gradient equals central finite differences, the batched
  gradient equals per-client gradients, a run resumes byte-identically.
* :func:`check_source`, :func:`check_partition`, :func:`check_sampler`, :func:`check_server_optimizer`
  — settings, and what the part builds is well formed (samples and labels; a partition of every
  training sample at most once; inclusion probabilities in [0, 1] and cohorts of real clients; a
  finite step, a first one that descends, and a byte-identical resume).
* :func:`check_executor` — settings; the sequential trajectory. :func:`check_sink`, :func:`check_schedule` —
  settings. :func:`check_section` — a section's own settings (``[local]``, ``[aggregation]``, ...).

Each check runs the part on the example it was registered with (:class:`~fedshuffle.core.registry.Example`: its
settings, the data it runs on), or on the inputs given to the check, which replace the example's; with neither, on the
check's defaults. An example that reads data files is skipped (:class:`unittest.SkipTest`, naming the file) when they
are in no data folder (``data.data_dirs``, ``$FEDSHUFFLE_DATA``); nothing is downloaded. Each check raises
:class:`AssertionError` naming the part and the invariant that failed.
"""

from __future__ import annotations

import contextlib
import tempfile
import typing
import unittest
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from annotated_types import Ge, Gt, Le, Lt
from pydantic.fields import FieldInfo

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Entry, Example, Registry

#: the small problem every method check runs on: heterogeneous logistic regression, unequal clients
_DATA = {"source": "synthetic", "samples": 48, "features": 3, "partition": "dirichlet", "clients": 6, "alpha": 0.5}
_BASE: dict[str, Any] = {
    "problem": {"name": "logistic", "l2": 0.01},
    "data": _DATA,
    "local": {"lr": 0.05, "batch_size": 4},
    "run": {"rounds": 4, "eval_every": 2, "checkpoint_seconds": 0},
}


def example(registry: Registry, name: str) -> Example:
    """The example ``registry[name]`` was registered with (none declared: the check's defaults)."""
    return registry[name].example or Example()


def missing_file(example: Example, data_dirs: tuple[str, ...] = ()) -> str | None:
    """The first of ``example``'s files that is in no data folder (``data_dirs``, ``$FEDSHUFFLE_DATA``), or None."""
    from fedshuffle.data.sources.fetch import find_data_path

    for wanted in example.files:
        options = (wanted,) if isinstance(wanted, str) else wanted
        if not any(find_data_path(option, data_dirs) for option in options):
            return options[0]
    return None


@contextlib.contextmanager
def example_data(what: str, example: Example, data: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    """``data`` (a ``[data]`` section) ready for ``example``: its files found (else :class:`unittest.SkipTest` naming
    the one missing), its ``.npz`` written for as long as the context lasts (its path the ``path`` setting)."""
    missing = missing_file(example, tuple(data.get("data_dirs", ())))
    if missing is not None:
        raise unittest.SkipTest(f"{what}: its example reads {missing}, in no data folder (data_dirs, $FEDSHUFFLE_DATA)")
    if not example.arrays:
        yield dict(data)
        return
    rng = np.random.default_rng(0)
    arrays = {
        key: rng.normal(size=shape).astype(np.float32) if bound is None else rng.integers(0, bound, size=shape)
        for key, (shape, bound) in example.arrays.items()
    }
    with tempfile.TemporaryDirectory() as folder:
        np.savez(Path(folder) / "example.npz", **arrays)
        yield {**data, "path": str(Path(folder) / "example.npz")}


def bad_values(entry: Entry | Mapping[str, FieldInfo]) -> dict[str, list[Any]]:
    """Values each declared setting of ``entry`` (or each field of a section's model, its ``model_fields``) must
    refuse: past each bound, outside a choice, of another type."""
    out: dict[str, list[Any]] = {}
    if isinstance(entry, Entry):
        fields = entry.settings.model_fields if entry.settings else {}
    else:
        fields = entry
    for name, info in fields.items():
        values: list[Any] = [{"not": "a value"}]
        for constraint in info.metadata:
            if isinstance(constraint, Ge):
                values.append(constraint.ge - 1)
            elif isinstance(constraint, Gt):
                values.append(constraint.gt)
            elif isinstance(constraint, Le):
                values.append(constraint.le + 1)
            elif isinstance(constraint, Lt):
                values.append(constraint.lt)
        for arg in _flat_args(info.annotation):
            if typing.get_origin(arg) is Literal:
                values.append("no-such-choice")
        out[name] = values
    return out


def _flat_args(annotation: Any) -> list[Any]:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal or not args:
        return [annotation]
    return [a for arg in args for a in _flat_args(arg)]


def check_settings(
    registry: Registry, name: str, raw: Mapping[str, Any], section: str, chooser: str, choice: Any = None
) -> None:
    """Each generated bad value of each setting of ``registry[name]``, set in ``raw[section]``, is refused
    by the configuration naming ``section.setting``; an unknown setting, and another part's, are refused naming the
    part. ``choice``: what
    the chooser is set to where that is not the name itself (``[name]`` for a list, such as ``run.sinks``)."""
    from fedshuffle.experiments.schema import RunSpec, validate

    entry = registry[name]
    base = {**raw, section: {**raw.get(section, {}), chooser: name if choice is None else choice}}
    validate(RunSpec, base)  # the defaults are valid
    for setting, values in bad_values(entry).items():
        for value in values:
            bad = {**base, section: {**base[section], setting: value}}
            try:
                validate(RunSpec, bad)
            except ConfigError as exc:
                assert exc.field.endswith(f"{section}.{setting}"), (
                    f"{registry.noun} {name!r}: {section}.{setting} = {value!r} refused as {exc.field!r}"
                )
            else:
                raise AssertionError(f"{registry.noun} {name!r}: {section}.{setting} = {value!r} was accepted")
    try:
        validate(RunSpec, {**base, section: {**base[section], "no_such_setting": 1}})
    except ConfigError as exc:
        assert f"{section}.no_such_setting" in exc.field and name in exc.message, (
            f"{registry.noun} {name!r}: an unknown setting is refused as {exc}"
        )
    else:
        raise AssertionError(f"{registry.noun} {name!r}: an unknown setting was accepted")
    model = RunSpec.model_fields[section].annotation
    shared = set(model.model_fields) | {  # what the section itself or another of its choices may take
        s for other in getattr(model, "_choosers", {}).values() if other is not registry for s in _declared(other)
    }
    others = sorted(_declared(registry) - set(entry.setting_names()) - shared)
    for setting in others[:3]:  # another part's setting, with a value that part takes
        owner = next(e for e in registry.entries() if setting in e.setting_names())
        default = owner.settings.model_fields[setting].default
        try:
            validate(RunSpec, {**base, section: {**base[section], setting: 1 if default is None else default}})
        except ConfigError as exc:
            assert exc.field == f"{section}.{setting}" and repr(name) in exc.message, (
                f"{registry.noun} {name!r}: {owner.name!r}'s setting {section}.{setting} is refused as {exc}"
            )
        else:
            raise AssertionError(f"{registry.noun} {name!r}: {owner.name!r}'s setting {section}.{setting} was accepted")


def _declared(registry: Registry) -> set[str]:
    return {s for e in registry.entries() for s in e.setting_names()}


def _spec(raw: Mapping[str, Any]) -> Any:
    from fedshuffle.experiments.schema import RunSpec, validate

    return validate(RunSpec, raw)


def _trajectory(spec: Any, executor: str, rounds: int) -> torch.Tensor:
    from fedshuffle.experiments.runner import build_simulation

    threads = spec.run.own_settings().get("threads") or 2  # the threaded executor with threads to share clients
    spec = spec.model_copy(update={"run": spec.run.model_copy(update={"executor": executor, "threads": threads})})
    sim, _ = build_simulation(spec, seed=3)
    out = [sim.params.clone()]  # the start, then the model after each round
    for _ in range(rounds):
        sim.step()
        out.append(sim.params.clone())
    return torch.stack(out)


def check_executors(
    spec: Any, what: str, rounds: int = 3, rtol: float = 1e-10, executors: tuple[str, ...] = ("vectorized", "threaded")
) -> None:
    """The model moves from its start and stays finite; the ``executors`` give the sequential trajectory
    (max |Δ| ≤ rtol·max |x|)."""
    reference = _trajectory(spec, "sequential", rounds)
    assert torch.isfinite(reference).all(), f"{what}: the model is not finite after {rounds} rounds"
    assert not torch.equal(reference[-1], reference[0]), f"{what}: the model did not move in {rounds} rounds"
    for executor in executors:
        other = _trajectory(spec, executor, rounds)
        gap = float((other - reference).abs().max())
        assert gap <= rtol * max(float(reference.abs().max()), 1e-300), (
            f"{what}: the {executor} executor is {gap:.3g} away from the sequential one"
        )


def check_executor(name: str, settings: Mapping[str, Any] | None = None) -> None:
    """The invariants of executor ``name`` with ``settings`` (its ``[run]`` settings): settings; with FedAvg's clients
    on the small logistic problem, the sequential trajectory (fp64, 1e-10)."""
    from fedshuffle.executors import EXECUTORS
    from fedshuffle.experiments.schema import _deep_merge

    raw = _deep_merge(_BASE, {"method": {"name": "fedavg"}, "sampler": {"name": "uniform", "cohort": 3}})
    check_settings(EXECUTORS, name, raw, "run", "executor")
    settings = example(EXECUTORS, name).settings if settings is None else settings
    spec = _spec(_deep_merge(raw, {"run": {"executor": name, **settings}}))
    check_executors(spec, f"executor {name!r}", executors=(name,))


def check_sink(name: str) -> None:
    """The invariants of metric sink ``name`` that need none of its packages: settings (listed in ``run.sinks``)."""
    from fedshuffle.experiments.sinks import SINKS

    check_settings(SINKS, name, _BASE, "run", "sinks", [name])


def check_schedule(name: str, settings: Mapping[str, Any] | None = None) -> None:
    """The invariants of step-size schedule ``name`` with ``settings`` (default: its example's) that need no run:
    settings."""
    from fedshuffle.schedules import SCHEDULES

    settings = example(SCHEDULES, name).settings if settings is None else settings
    check_settings(SCHEDULES, name, {**_BASE, "schedule": dict(settings)}, "schedule", "name")


def check_section(section: str) -> None:
    """Each generated bad value of each of the ``[section]`` section's own settings (those of the part it chooses
    have their part's check) is refused by the configuration naming ``section.setting``."""
    from fedshuffle.experiments.schema import RunSpec, validate

    model = RunSpec.model_fields[section].annotation
    for setting, values in bad_values(model.model_fields).items():
        for value in values:
            bad = {**_BASE, section: {**_BASE.get(section, {}), setting: value}}
            try:
                validate(RunSpec, bad)
            except ConfigError as exc:
                assert exc.field == f"{section}.{setting}", f"{section}.{setting} = {value!r} refused as {exc.field!r}"
            else:
                raise AssertionError(f"{section}.{setting} = {value!r} was accepted")


def check_resume(spec: Any, what: str) -> None:
    """A run stopped halfway and resumed from its checkpoint ends byte-identical to the uncut run."""
    from fedshuffle.experiments.runner import run_single

    rounds = spec.run.rounds
    half = spec.model_copy(update={"run": spec.run.model_copy(update={"rounds": rounds // 2})})
    with tempfile.TemporaryDirectory() as folder:
        full = run_single(spec, Path(folder) / "full", seed=1)
        cut = run_single(half, Path(folder) / "cut", seed=1)
        assert full.status == cut.status == "complete", (
            f"{what}: runs ended {full.status} / {cut.status} ({full.message or cut.message})"
        )
        resumed = run_single(spec, Path(folder) / "cut", seed=1, resume=True, extend=True)
        assert resumed.status == "complete", f"{what}: the resumed run ended {resumed.status} ({resumed.message})"
        a, b = (np.load(Path(folder) / name / "final_params.npy") for name in ("full", "cut"))
        assert a.tobytes() == b.tobytes(), (
            f"{what}: the resumed run ends {float(np.abs(a - b).max()):.3g} away from the uncut one"
        )


def check_method(name: str, settings: Mapping[str, Mapping[str, Any]] | None = None) -> None:
    """The invariants of method ``name`` (module docstring), on a small heterogeneous logistic problem.

    ``settings`` (by section) are added to the check's run: e.g. a method that needs cyclic cohorts
    gets them by itself, and one that needs another problem or sampler can be given them (default: its example's
    sections, and its settings in ``[method]``). The run's configuration holds the method's declared defaults of the
    other sections.
    """
    from fedshuffle.experiments.schema import _deep_merge
    from fedshuffle.methods import METHODS

    entry = METHODS[name]
    assert entry.summary, f"method {name!r}: give a one-line summary"
    raw = _deep_merge(_BASE, {"method": {"name": name}, "sampler": {"name": "uniform", "cohort": 3}})
    if entry.factory(_aggregator()).needs_cycles or entry.defaults.get("server", {}).get("meta_epoch_step"):
        raw["sampler"] = {"name": "cyclic", "cohort": 3}
    if settings is None:
        declared = example(METHODS, name)
        settings = _deep_merge(declared.sections, {"method": dict(declared.settings)})
    raw = _deep_merge(raw, settings)
    check_settings(METHODS, name, raw, "method", "name")
    spec = _spec(raw)
    for section, defaults in entry.defaults.items():
        for key, value in defaults.items():
            if key not in (raw.get(section) or {}):  # what the check's run sets itself
                got = getattr(getattr(spec, section), key)
                assert got == value, f"method {name!r}: {section}.{key} is {got!r}, not its declared default {value!r}"
    check_executors(spec, f"method {name!r}")
    check_resume(spec, f"method {name!r}")


def _aggregator() -> Any:
    from fedshuffle.aggregation import Aggregator

    return Aggregator()


def check_problem(name: str, data: Mapping[str, Any] | None = None, settings: Mapping[str, Any] | None = None) -> None:
    """The invariants of problem ``name`` with ``settings`` on ``data`` (a ``[data]`` section; default: its example's,
    else a small synthetic classification set): settings; gradients against central finite differences (fp64, at a
    random point, 1e-6 relative); the batched gradient against per-client gradients; a byte-identical resume."""
    from fedshuffle.problems import PROBLEMS

    declared = example(PROBLEMS, name)
    settings = declared.settings if settings is None else settings
    classes = PROBLEMS[name].defaults.get("classes", 3)  # a problem that takes one class count declares it
    used = declared if data is None else Example()
    data = declared.sections.get("data", {**_DATA, "classes": classes}) if data is None else data
    with example_data(f"problem {name!r}", used, data) as ready:
        _check_problem(name, ready, settings)


def _check_problem(name: str, data: Mapping[str, Any], settings: Mapping[str, Any]) -> None:
    from fedshuffle.experiments.build import build_problem_and_data
    from fedshuffle.problems import PROBLEMS

    raw = {**_BASE, "problem": {"name": name, **settings}, "data": dict(data)}
    check_settings(PROBLEMS, name, raw, "problem", "name")
    spec = _spec(raw)
    problem, dataset = build_problem_and_data(spec)
    generator = torch.Generator().manual_seed(0)
    x = problem.init_params(generator, torch.float64) + 0.1 * torch.randn(
        problem.dim, generator=generator, dtype=torch.float64
    )
    features = dataset.features[:5].to(torch.float64) if dataset.features.is_floating_point() else dataset.features[:5]
    labels = dataset.labels[:5]
    weights = torch.full((len(labels),), 1.0 / len(labels), dtype=torch.float64)
    gradient = problem.weighted_gradient(x, features, labels, weights)
    direction = torch.randn(problem.dim, generator=generator, dtype=torch.float64)
    direction /= direction.norm()
    h = 1e-6
    numeric = float(
        problem.weighted_loss(x + h * direction, features, labels, weights)
        - problem.weighted_loss(x - h * direction, features, labels, weights)
    ) / (2 * h)
    analytic = float(gradient @ direction)
    assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (
        f"problem {name!r}: directional derivative {analytic:.8g}, finite differences {numeric:.8g}"
    )
    stacked = torch.stack([x, 2 * x])
    batch = torch.stack([features, features])
    batched = problem.batched_gradient(stacked, batch, torch.stack([labels, labels]), torch.stack([weights, weights]))
    for k in range(2):
        one = problem.gradient(stacked[k], features, labels)
        assert torch.allclose(batched[k], one, rtol=1e-10, atol=1e-12), (
            f"problem {name!r}: batched gradient row {k} differs from the per-client gradient"
        )
    check_resume(spec, f"problem {name!r}")


def check_source(
    name: str, settings: Mapping[str, Any] | None = None, partition: Mapping[str, Any] | None = None
) -> None:
    """The invariants of data source ``name`` with ``settings`` and ``partition`` (the rest of the ``[data]``
    section; default: its example's): settings; given nothing but its name, it loads or refuses naming what it needs;
    samples and labels of one length, integer labels in [0, classes) (or −1 padding), an official test split of the
    same feature shape, and client blocks that cover the samples when the source brings its own clients."""
    from fedshuffle.data.catalog import SOURCES

    declared = example(SOURCES, name)
    used = declared if settings is None else Example()
    settings = declared.settings if settings is None else settings
    partition = declared.sections.get("data", {}) if partition is None else partition
    with example_data(f"source {name!r}", used, {"download": False, **settings}) as ready:
        _check_source(name, ready, partition)


def _check_source(name: str, settings: Mapping[str, Any], partition: Mapping[str, Any]) -> None:
    from fedshuffle.data.catalog import SOURCES, load_samples

    try:  # nothing but its name
        load_samples(_spec({**_BASE, "data": {"source": name, "download": False}}).data.model_dump(), seed=0)
    except ConfigError as exc:
        assert exc.message, f"source {name!r}: given nothing but its name, refused without saying why"
    raw = {**_BASE, "problem": {"name": "quadratic"}, "data": {"source": name, **settings, **partition}}
    check_settings(
        SOURCES,
        name,
        {k: v for k, v in raw.items() if k != "problem"} | {"problem": {"name": "quadratic"}},
        "data",
        "source",
    )
    spec = _spec(raw)
    samples, _ = load_samples(spec.data.model_dump(), seed=0)
    assert len(samples.features) == len(samples.labels) > 0, (
        f"source {name!r}: {len(samples.features)} samples but {len(samples.labels)} labels"
    )
    labels = np.asarray(samples.labels)
    assert np.issubdtype(labels.dtype, np.integer), f"source {name!r}: labels must be integers, got {labels.dtype}"
    if samples.num_classes:
        assert labels.min() >= -1 and labels.max() < samples.num_classes, (
            f"source {name!r}: labels outside [0, {samples.num_classes})"
        )
    if samples.test is not None:
        assert samples.test[0].shape[1:] == samples.features.shape[1:], (
            f"source {name!r}: test samples of another shape"
        )
    if samples.client_sizes is not None:
        assert int(np.sum(samples.client_sizes)) == len(labels) and np.all(samples.client_sizes >= 1), (
            f"source {name!r}: client blocks do not cover the samples"
        )


def check_partition(name: str, settings: Mapping[str, Any] | None = None) -> None:
    """The invariants of partition ``name`` with ``settings`` (default: its example's, on its example's data, else
    on a small synthetic set): settings; every client gets samples and no sample is given twice; each of the given
    settings that is needed (declared without a default value) is refused naming it when it is left out."""
    from fedshuffle.data.catalog import PARTITIONS
    from fedshuffle.experiments.build import build_problem_and_data

    declared = example(PARTITIONS, name)
    used = declared if settings is None else Example()
    settings = declared.settings if settings is None else settings
    source = {"source": "synthetic", "samples": 60, "features": 3, "classes": 3}
    data = {**(used.sections.get("data") or source), "download": False, "partition": name, **settings}
    with example_data(f"partition {name!r}", used, data) as ready:
        raw = {**_BASE, "problem": {"name": "softmax"}, "data": ready}
        check_settings(PARTITIONS, name, raw, "data", "partition")
        _, dataset = build_problem_and_data(_spec(raw))
        owned = np.concatenate(dataset.client_indices)
        assert len(np.unique(owned)) == len(owned), f"partition {name!r}: a sample is given to two clients"
        assert all(len(ix) > 0 for ix in dataset.client_indices), f"partition {name!r}: a client without samples"
        fields = PARTITIONS[name].settings.model_fields
        for key in [k for k in settings if k in fields and fields[k].default is None]:
            left_out = {**raw, "data": {k: v for k, v in ready.items() if k != key}}
            try:
                build_problem_and_data(_spec(left_out))
            except ConfigError as exc:
                assert exc.field == f"data.{key}", f"partition {name!r}: without {key}, refused as {exc.field}"
            else:
                raise AssertionError(f"partition {name!r}: built without data.{key}")


def check_sampler(name: str, settings: Mapping[str, Any] | None = None, rounds: int = 50) -> None:
    """The invariants of sampler ``name``: settings; p_i ∈ [0, 1]; cohorts name real clients; the empirical
    inclusion frequencies over ``rounds`` rounds are within 5 standard errors of p_i."""
    from fedshuffle.experiments.build import build_problem_and_data, build_sampler
    from fedshuffle.samplers import SAMPLERS

    settings = example(SAMPLERS, name).settings if settings is None else settings
    raw = {**_BASE, "sampler": {"name": name, **settings}}
    if "cohort" in SAMPLERS[name].setting_names() and "cohort" not in settings:
        raw["sampler"]["cohort"] = 3
    check_settings(SAMPLERS, name, raw, "sampler", "name")
    spec = _spec(raw)
    _, dataset = build_problem_and_data(spec)
    sampler = build_sampler(spec.sampler, dataset)
    p = np.asarray(sampler.inclusion_probabilities())
    assert p.shape == (dataset.num_clients,) and np.all((p >= 0) & (p <= 1)), (
        f"sampler {name!r}: inclusion probabilities outside [0, 1]"
    )
    counts = np.zeros(dataset.num_clients)
    for r in range(rounds):
        cohort = np.asarray(sampler.sample(r, seed=0))
        assert np.all((cohort >= 0) & (cohort < dataset.num_clients)), (
            f"sampler {name!r}: a cohort names a client that does not exist"
        )
        counts[np.unique(cohort)] += 1
    error = np.sqrt(np.maximum(p * (1 - p), 1e-12) / rounds)
    assert np.all(np.abs(counts / rounds - p) <= 5 * error + 1e-9), (
        f"sampler {name!r}: inclusion frequencies {counts / rounds} far from p = {p}"
    )


def check_server_optimizer(name: str, settings: Mapping[str, Any] | None = None) -> None:
    """The invariants of server optimizer ``name``: settings; a finite step from a finite direction; with
    FedAvg's clients, executors agree and a run resumes byte-identically (its state serializes)."""
    from fedshuffle.server import SERVER_OPTIMIZERS

    settings = example(SERVER_OPTIMIZERS, name).settings if settings is None else settings
    raw = {
        **_BASE,
        "method": {"name": "fedavg"},
        "sampler": {"name": "uniform", "cohort": 3},
        "server": {"optimizer": name, **(settings or {})},
    }
    check_settings(SERVER_OPTIMIZERS, name, raw, "server", "optimizer")
    optimizer = SERVER_OPTIMIZERS[name].build(dict(settings or {}))
    params = torch.linspace(-1, 1, 5, dtype=torch.float64)
    state = optimizer.init(params)
    for k in range(3):
        step, state = optimizer.update(torch.full_like(params, 0.1 * (k + 1)), state, params)
        assert step.shape == params.shape and torch.isfinite(step).all(), (
            f"server optimizer {name!r}: a non-finite step"
        )
        assert k > 0 or torch.all(step > 0), f"server optimizer {name!r}: its first step does not descend along Δ"
        params = params - step
    spec = _spec(raw)
    check_executors(spec, f"server optimizer {name!r}")
    check_resume(spec, f"server optimizer {name!r}")
