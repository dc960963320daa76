"""Replicas: runs that differ only in step sizes or seed, advanced together as one simulation.

A grid of step sizes (every setting declared with the role :class:`~fedshuffle.core.registry.StepSize` or
:class:`~fedshuffle.core.registry.StepScale`: local η_l and its multiplier, server η_g, RR-CLI's global step θ, FedCDR's
η and α, FedDyn's α, a plugin's own) and a set of seeds on the same data, model and sampler law are R runs whose
rounds have the same shape. Each replica keeps its own :class:`~fedshuffle.simulation.Simulation` (model, server,
method and client state, counters), and one step of the replicas is::

    per replica r, at once:  its own round (cohort S_r, plans with η_{l,r}, broadcast, its client half, its state rows);
                             replicas of one seed share the round's minibatch rows, drawn once
                             (:class:`~fedshuffle.local.plan.SharedDraws`)
    every executor call:     waits until each replica still stepping waits in one (:class:`Gathering`); then the
                             waiting works run as ONE executor call where their step chains agree (per-member starts,
                             centers, offsets and plans with their own step sizes): R replicas × C clients per local
                             step
    per replica r:           its updates back, its aggregation and server step x_r ← x_r − η_{g,r}·d_r

so methods with their own halves and client state (SCAFFOLD, FedDyn, FedCDR's prox solves, two executor calls in a
round where new clients start) batch as the FedAvg family does.

Every replica gives the numbers of the same run made alone. A member's update does not depend on the other rows of
its chunk (the compiled backend runs each member on its own; the torch loop's batched operations compute each row on
its own where the problem says so, :attr:`~fedshuffle.problems.Problem.independent_rows`, and otherwise wherever no
step is one member's alone, the executor's ``same_rows_in_any_chunk``), and where the single run adds ω_iΔ_i as
the executor produces them (a ``weights`` call), each replica's sum is formed from its own rows in the single run's
order — the executor's chunks of that replica's work alone (``add_up``) — so the sums are the same floating-point
numbers (``tests/test_replicas.py`` compares the results folders byte for byte).

Replicas run in lockstep through :class:`ReplicaGroup`: each replica's run
(:func:`~fedshuffle.experiments.runner.run_single`,
which evaluates, writes and checkpoints it exactly as alone) runs in a thread of one process, and its
``step`` waits until every replica still running asks for one, then one gathered step advances them all.
Replicas need not be at the same round (a resumed replica continues from its own checkpoint).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from fedshuffle.core.registry import StepScale, StepSize
from fedshuffle.data import FederatedDataset
from fedshuffle.executors.choice import batches_replicas, run_threads
from fedshuffle.executors.local import LocalExecutor, ThreadedExecutor
from fedshuffle.local.loop import LocalWork
from fedshuffle.local.plan import CohortPlan, SharedDraws
from fedshuffle.local.steps import StepChain
from fedshuffle.problems import Problem
from fedshuffle.simulation import RoundRecord, Simulation

#: the seed in which replicas of one group may differ besides their step sizes, where the split has its own
#: (``data.seed``): (section, field)
RUN_SEED = ("run", "seed")


def _executor_settings(sim: Simulation) -> tuple[Any, ...] | None:
    executor = sim.executor
    return executor.batching() if isinstance(executor, (LocalExecutor, ThreadedExecutor)) else None


def _same_data(a: Any, b: Any) -> bool:
    """The same samples and split (the build shared by runs of equal data settings; the dataset object itself is the
    run's cast of it)."""
    return a is b or (
        isinstance(a, FederatedDataset)
        and isinstance(b, FederatedDataset)
        and a.features is b.features
        and a.labels is b.labels
        and a.weights is b.weights
        and len(a.client_indices) == len(b.client_indices)
        and all(x is y for x, y in zip(a.client_indices, b.client_indices))
    )


def batches(sims: Sequence[Simulation]) -> bool:
    """Whether the replicas' local work can be gathered into shared executor calls: they share one problem and
    dataset, and their executors are in this process (sequential, vectorized, threaded) with the same settings.
    Which calls of a step then run as one is decided call by call (:class:`Gathering`)."""
    first = sims[0]
    return _executor_settings(first) is not None and all(
        sim.problem is first.problem
        and _same_data(sim.data, first.data)
        and _executor_settings(sim) == _executor_settings(first)
        for sim in sims
    )


def _chain_key(chain: StepChain) -> tuple[Any, ...] | None:
    """The chain's transforms and their settings, to tell which works step alike; None where a transform holds a tensor
    (global momentum's m: each replica's own), so that its work never runs with another replica's."""
    parts = []
    for transform in chain.transforms:
        values = tuple(getattr(transform, f.name) for f in dataclasses.fields(transform))
        if any(isinstance(v, torch.Tensor) for v in values):
            return None
        parts.append((type(transform), values))
    return tuple(parts)


@dataclasses.dataclass
class _Call:
    """One replica's executor call, waiting in :class:`Gathering`."""

    executor: Any
    problem: Problem
    data: Any
    work: LocalWork
    weights: torch.Tensor | None
    result: Any = None
    done: bool = False
    seconds: float = 0.0  # its share of the computing time: its members' part of a shared call

    def key(self) -> tuple[Any, ...] | None:
        chain = _chain_key(self.work.chain)
        if chain is None or not len(self.work):
            return None
        return id(self.problem), chain, self.work.center is None, self.work.offset is None


#: the most stacked model elements (members × d) one shared call holds: past it a local step's working set leaves the
#: caches and one wide call is slower than its parts (benchmarks/sweep.py, 2NN MNIST: 18 replicas of 10 members ×
#: 199k parameters shared 1.2× slower than the runs made separately), while small models gain from sharing the
#: dispatch of each step (FedCDR's 60-32-10 MLP: 3 seeds of 25 members in 28.7 against 46.3 s)
SHARED_ELEMENTS = 1 << 21


def _within_caches(calls: list[_Call]) -> list[list[_Call]]:
    """``calls`` cut, in order, into runs of at most :data:`SHARED_ELEMENTS` stacked model elements (a call larger than
    that alone)."""
    parts: list[list[_Call]] = []
    size = 0
    for call in calls:
        elements = len(call.work) * call.work.start.shape[-1]
        if not parts or size + elements > SHARED_ELEMENTS:
            parts.append([])
            size = 0
        parts[-1].append(call)
        size += elements
    return parts


class Gathering:
    """The executor calls of replicas stepping at once, one thread each.

    A call of :meth:`run` waits until every replica still stepping waits in one or has finished its step
    (:meth:`finished`); then the waiting calls run: those whose step chains agree (same transforms and settings,
    the same presence of centers and offsets) as ONE call of the first one's executor on all their members (up to
    :data:`SHARED_ELEMENTS` stacked model elements a call), each
    replica's ``weights`` sum added up afterwards in its own run's order; a call that cannot share (a chain with its
    own tensors, a member who would step alone, the executor's ``same_rows_in_any_chunk``) runs as alone. Calls run
    one at a time, in the order they arrived within each gathering, so a replica's numbers never depend on the
    others."""

    def __init__(self, stepping: int) -> None:
        self._ready = threading.Condition()
        self._stepping = stepping
        self._pending: list[_Call] = []
        #: executor calls that ran the work of two replicas or more together
        self.shared = 0

    def executor(self, executor: Any) -> _GatheredExecutor:
        return _GatheredExecutor(executor, self)

    def run(self, call: _Call) -> torch.Tensor:
        with self._ready:
            self._pending.append(call)
            self._flush()
            while not call.done:
                self._ready.wait()
        if isinstance(call.result, BaseException):
            raise call.result
        return call.result

    def finished(self) -> None:
        """A replica's step has ended: the others no longer wait for its calls."""
        with self._ready:
            self._stepping -= 1
            self._flush()

    def _flush(self) -> None:
        """Run the waiting calls once every replica still stepping waits in one (called holding the lock)."""
        if not self._pending or len(self._pending) < self._stepping:
            return
        calls, self._pending = self._pending, []
        groups: dict[Any, list[_Call]] = {}
        for call in calls:
            key = call.key()
            groups.setdefault(("alone", id(call)) if key is None else key, []).append(call)
        for group in (part for alike in groups.values() for part in _within_caches(alike)):
            try:
                self._run_group(group)
            except BaseException as exc:  # every call of the group fails with it
                for call in group:
                    call.result = exc
            for call in group:
                call.done = True
        self._ready.notify_all()

    def _run_group(self, group: list[_Call]) -> None:
        first = group[0]
        combined = None
        if len(group) > 1 and all(_same_data(c.data, first.data) for c in group):
            works = [c.work for c in group]
            combined = LocalWork(
                CohortPlan.joined([work.plans for work in works]),
                torch.cat([work.rows("start") for work in works]),
                first.work.chain,
                None if first.work.center is None else torch.cat([work.rows("center") for work in works]),
                None if first.work.offset is None else torch.cat([work.rows("offset") for work in works]),
            )
            if not all(
                c.executor.same_rows_in_any_chunk(c.problem, c.data, work)
                for c, work in [*((c, c.work) for c in group), (first, combined)]
            ):
                combined = None
        if combined is None:
            for call in group:
                started = time.perf_counter()
                call.result = call.executor.run(call.problem, call.data, call.work, call.weights)
                call.seconds = time.perf_counter() - started
            return
        started = time.perf_counter()
        deltas = first.executor.run(first.problem, first.data, combined).split([len(c.work) for c in group])
        for call, own in zip(group, deltas):
            call.result = own if call.weights is None else call.executor.add_up(call.data, call.work, call.weights, own)
        seconds = time.perf_counter() - started
        for call in group:
            call.seconds = seconds * len(call.work) / len(combined)
        self.shared += 1


class _GatheredExecutor:
    """A replica's executor during a gathered step: local work through :class:`Gathering`, the rest (full local
    gradients) its own executor's, in the replica's thread."""

    def __init__(self, executor: Any, gathering: Gathering) -> None:
        self._executor, self._gathering = executor, gathering
        self.waited = 0.0  # seconds spent waiting for the other replicas or computing their work

    def run(self, problem: Problem, data: Any, work: LocalWork, weights: torch.Tensor | None = None) -> torch.Tensor:
        started = time.perf_counter()
        call = _Call(self._executor, problem, data, work, weights)
        result = self._gathering.run(call)
        self.waited += time.perf_counter() - started - call.seconds
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


def step_replicas(
    sims: Sequence[Simulation], together: bool | None = None, pool: ThreadPoolExecutor | None = None
) -> tuple[list[RoundRecord | BaseException], bool]:
    """One round of every replica (its record, or the exception its step raised), and whether any of their local work
    ran as a shared executor call.

    Where the replicas can be gathered (``together``, default :func:`batches`), their steps run at once in the threads
    of ``pool`` (kept by the group from round to round: a module problem binds a copy of its module per thread), with
    every executor call through one :class:`Gathering`; else one after another, each as alone."""
    if len(sims) == 1 or not (batches(sims) if together is None else together):
        return [_outcome(sim.step) for sim in sims], False
    gathering = Gathering(len(sims))

    def step(sim: Simulation) -> RoundRecord | BaseException:
        executor = sim.executor
        sim.executor = gathered = gathering.executor(executor)
        try:
            outcome = _outcome(sim.step)
        finally:
            sim.executor = executor
            gathering.finished()
        if isinstance(outcome, RoundRecord) and len(outcome.cohort):  # the round's compute time without the waits
            sim.counters.worker_compute_seconds -= gathered.waited / len(outcome.cohort)
        return outcome

    if pool is None:
        with ThreadPoolExecutor(len(sims), thread_name_prefix="fedshuffle-replica-step") as own:
            outcomes = list(own.map(step, sims))
    else:
        outcomes = list(pool.map(step, sims))
    return outcomes, gathering.shared > 0


def _outcome(step: Callable[[], RoundRecord]) -> RoundRecord | BaseException:
    try:
        return step()
    except BaseException as exc:  # reaches the replica's own run
        return exc


class ReplicaGroup:
    """Replicas run in threads, each as a single run, advanced in lockstep by :func:`step_replicas`.

    ``members`` is the number of replica threads; each calls :meth:`leave` when its run ends (or never
    starts), so the others stop waiting for it.
    """

    def __init__(self, members: int) -> None:
        self._ready = threading.Condition()
        self._members = members
        self._waiting: dict[int, Simulation] = {}
        self._done: dict[int, RoundRecord | BaseException] = {}
        self._threads_set = False
        self._batches: dict[frozenset[int], bool] = {}
        self._evaluating = threading.BoundedSemaphore(os.cpu_count() or 1)
        self._pool = (
            ThreadPoolExecutor(members, thread_name_prefix="fedshuffle-replica-step") if members > 1 else None
        )  # the gathered steps' threads
        self._draws = SharedDraws()
        #: the group's steps, those in which two replicas or more shared an executor call, the most replicas in one step
        self.steps, self.batched, self.widest = 0, 0, 0

    def join(
        self, sim: Simulation, evaluator: Callable[[torch.Tensor], Any]
    ) -> tuple[Replica, Callable[[torch.Tensor], Any]]:
        """The replica of ``sim`` (a simulation whose :meth:`~Replica.step` waits for the group's batched step) and
        ``evaluator`` taking its turn: at most one evaluation per core at a time, however many replicas evaluate after
        a step (each holds its activations over the whole dataset while it runs).

        The first replica sets the process' operator threads to the count its run chooses
        (:func:`~fedshuffle.executors.choice.run_threads`, the same for every replica of a group) before any run enters
        its ``operator_threads`` block, so that every block saves and restores that count: one replica ending never
        changes the count under another (a reduction's bits can depend on it)."""
        with self._ready:
            if not self._threads_set:
                torch.set_num_threads(run_threads(sim.problem, sim.device)[0])
                self._threads_set = True
        return Replica(sim, self), functools.partial(self._evaluate, evaluator)

    def _evaluate(self, evaluator: Callable[[torch.Tensor], Any], params: torch.Tensor) -> Any:
        with self._evaluating:
            return evaluator(params)

    def leave(self) -> None:
        with self._ready:
            self._members -= 1
            self._advance()
            if self._members == 0 and self._pool is not None:
                self._pool.shutdown()

    def step(self, sim: Simulation) -> RoundRecord:
        key = id(sim)
        with self._ready:
            self._waiting[key] = sim
            self._advance()
            while key not in self._done:
                self._ready.wait()
            outcome = self._done.pop(key)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _advance(self) -> None:
        """Once every replica still running waits, step them all (called holding the lock)."""
        if not self._waiting or len(self._waiting) < self._members:
            return
        keys, sims = list(self._waiting), list(self._waiting.values())
        self._waiting.clear()
        together = False
        try:
            together = self._batches.get(frozenset(keys))
            if together is None:  # the same replicas batch alike at every step: asked once per set of replicas
                together = self._batches[frozenset(keys)] = len(sims) > 1 and batches(sims)
                for sim in sims if together else ():  # one data: the replicas of a seed draw each round's rows once
                    sim.shared_draws = self._draws
            outcomes, together = step_replicas(sims, together, self._pool)
        except BaseException as exc:  # every waiting replica's run fails with it
            outcomes, together = [exc] * len(sims), False
        self.steps, self.batched, self.widest = self.steps + 1, self.batched + together, max(self.widest, len(sims))
        self._done.update(zip(keys, outcomes))
        self._ready.notify_all()


class Replica:
    """A replica's simulation as its run sees it: everything is the simulation's, except that a step is the group's."""

    def __init__(self, sim: Simulation, group: ReplicaGroup) -> None:
        self._sim, self._group = sim, group

    def step(self) -> RoundRecord:
        return self._group.step(self._sim)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sim, name)


def run_together(
    jobs: Sequence[Any], execute: Callable[[Any, Callable[..., Any]], Any]
) -> tuple[list[Any], ReplicaGroup]:
    """Run ``jobs`` as the replicas of one simulation: ``execute(job, adopt)`` runs one job as a single run
    (:func:`~fedshuffle.experiments.runner.run_single` with ``adopt``), whose simulation and evaluator are
    ``adopt(sim, evaluator)``. Returns each job's result, in the order of ``jobs``, and the group."""
    group = ReplicaGroup(len(jobs))
    results: list[Any] = [None] * len(jobs)
    failures: list[BaseException] = []

    def replica(k: int) -> None:
        try:
            results[k] = execute(jobs[k], group.join)
        except BaseException as exc:  # raised again in the calling thread
            failures.append(exc)
        finally:
            group.leave()

    threads = [threading.Thread(target=replica, args=(k,), name=f"fedshuffle-replica-{k}") for k in range(len(jobs))]
    before, started = torch.get_num_threads(), 0
    try:
        for thread in threads:
            thread.start()
            started += 1
    finally:
        for _ in range(len(threads) - started):  # never started: the others do not wait for them
            group.leave()
        for thread in threads[:started]:
            thread.join()
        torch.set_num_threads(before)
    if failures:
        raise failures[0]
    return results, group


# -- which runs are replicas of one another -------------------------------------------------------------


def replica_key(spec: Any) -> str | None:
    """What runs of one group share: the resolved spec without its step sizes and their multipliers (the settings
    whose declared role is :class:`~fedshuffle.core.registry.StepSize` or
    :class:`~fedshuffle.core.registry.StepScale`, ``spec.roles()``) and, where the data split has its own seed
    (``data.seed``), without the run's seed. None for a run that cannot be a replica (an executor not declared
    ``batches_replicas`` in :data:`fedshuffle.executors.EXECUTORS`); methods with their own halves and client state
    are replicas too, their executor calls gathered (:class:`Gathering`)."""
    if not batches_replicas(spec.run.executor):
        return None
    dumped = spec.model_dump()
    steps = (StepSize, StepScale)
    varying = [tuple(setting.split(".", 1)) for setting, role in spec.roles().items() if isinstance(role, steps)]
    if dumped["data"]["seed"] is not None:  # else another run seed splits other data
        varying.append(RUN_SEED)
    for section, name in varying:
        dumped[section].pop(name, None)
    return json.dumps(dumped, sort_keys=True, default=str)


#: set to "0" in the environment, every run is a group of its own (to compare with the runs made separately)
SWITCH = "FEDSHUFFLE_REPLICAS"

#: what switching a run from the sequential executor to ``auto`` changes in its numbers (measured on rrcli-a3a-theory)
AUTO_NUMBERS = (
    "the same trajectories up to floating-point rounding (the cohort's sums in another order: "
    "final models within 1e-11 relative in float64)"
)


def unbatched_note(specs: Sequence[Any], groups: Sequence[Sequence[int]]) -> str | None:
    """One line for the start of a sweep whose runs ``specs`` (grouped as ``groups``, :func:`replica_groups`) include
    runs that cannot be batched as replicas: why (the executor, or settings that differ beyond step sizes and seeds)
    and how to let them be. None when every run is in a batched group, or there is one run."""
    alone = [group[0] for group in groups if len(group) == 1]
    if len(specs) < 2 or not alone:
        return None
    if os.environ.get(SWITCH) == "0":
        return f"{len(alone)} runs on their own: {SWITCH}=0 is set (unset it to run replicas as one simulation)"
    executors = sorted({specs[k].run.executor for k in alone if not batches_replicas(specs[k].run.executor)})
    if executors:
        on_auto = [_on_auto(specs[k]) for k in alone]
        batched = sum(len(g) for g in replica_groups(on_auto) if len(g) > 1)
        if batched:
            named = " or ".join(f"'{name}'" for name in executors)
            return (
                f"{len(alone)} runs cannot be batched as replicas: run.executor = {named} runs each on its own; "
                f"with --set run.executor=auto, {batched} of them run as replicas of one simulation, "
                f"with {AUTO_NUMBERS}"
            )
    keys = [json.loads(replica_key(specs[k]) or "{}") for k in alone]
    differing = sorted(
        {
            f"{section}.{name}"
            for key in keys[1:]
            for section, values in key.items()
            if isinstance(values, dict)
            for name in values
            if values.get(name) != keys[0].get(section, {}).get(name)
        }
    )
    if not differing:
        return None
    if differing == ["run.seed"]:
        return (
            f"{len(alone)} runs on their own: data.seed is unset, so each seed splits its own data; runs that "
            "differ only in step sizes and seeds of one split are replicas (set data.seed for one split for all)"
        )
    named = ", ".join(differing[:4]) + (" …" if len(differing) > 4 else "")
    return (
        f"{len(alone)} runs on their own: they differ in {named}, and only runs that differ in step sizes and "
        "seeds are replicas of one simulation"
    )


def _on_auto(spec: Any) -> Any:
    return spec.model_copy(update={"run": spec.run.model_copy(update={"executor": "auto"})})


def replica_groups(specs: Sequence[Any]) -> list[list[int]]:
    """The runs ``specs`` (positions) grouped into replicas of one simulation, in order of first appearance; a run
    that cannot be a replica is a group of its own (every run, with ``FEDSHUFFLE_REPLICAS=0``)."""
    groups: dict[str, list[int]] = {}
    alone: list[list[int]] = []
    separate = os.environ.get(SWITCH) == "0"
    for k, spec in enumerate(specs):
        key = None if separate else replica_key(spec)
        if key is None:
            alone.append([k])
        else:
            groups.setdefault(key, []).append(k)
    return sorted([*groups.values(), *alone], key=lambda group: group[0])


def spread(groups: Sequence[Sequence[int]], workers: int) -> list[list[int]]:
    """``groups`` with the largest halved (in order, first half first) until there are ``workers`` of them or none has
    two runs: a simulation of replicas runs on one core (its step is one Python thread), so with fewer groups than
    workers the cores would idle."""
    out = [list(g) for g in groups]
    while len(out) < workers:
        largest = max(range(len(out)), key=lambda k: len(out[k]))
        group = out[largest]
        if len(group) < 2:
            break
        half = (len(group) + 1) // 2
        out[largest : largest + 1] = [group[:half], group[half:]]
    return out


def describe_groups(groups: Sequence[Sequence[int]]) -> str | None:
    """The note a sweep prints: "35 runs as 1 batched simulation of 35 replicas" (None when nothing is batched)."""
    batched = [len(g) for g in groups if len(g) > 1]
    if not batched:
        return None
    runs, alone = sum(batched), len(groups) - len(batched)
    sizes = " and ".join(str(n) for n in batched) if len(set(batched)) > 1 else str(batched[0])
    text = f"{runs} runs as {len(batched)} batched simulation{'s' if len(batched) > 1 else ''} of {sizes} replicas"
    return text + (f"; {alone} run{'s' if alone > 1 else ''} on {'their' if alone > 1 else 'its'} own" if alone else "")
