"""Replicas: runs that differ only in step sizes or seed, advanced together as one simulation.

A grid of step sizes (local η_l and its multiplier, server η_g, RR-CLI's global step θ) and a set of
seeds on the same data, model and sampler law are R runs whose rounds have the same shape. Each replica
keeps its own :class:`~fedshuffle.simulation.Simulation` (model, server and method state, counters),
and one step of the replicas is::

    per replica r:  open its round (cohort S_r, plans with η_{l,r}), its broadcast x_r
    all replicas:   ONE executor call on the members of every S_r, concatenated (per-member starts x_r,
                    per-member plans with their own step sizes): R replicas × C clients per local step
    per replica r:  its updates Δ_i (i ∈ S_r) back, Σ ω_iΔ_i, its server step x_r ← x_r − η_{g,r}·d_r

Every replica gives the numbers of the same run made alone. A member's update does not depend on
the other rows of its chunk (the compiled backend runs each member on its own; the torch loop's
batched operations compute each row on its own), and where the single run adds ω_iΔ_i as the executor
produces them (``method.sums_updates``), each replica's sum is formed from its own rows in the single
run's order — the executor's chunks of that replica's cohort alone (``add_up``) — so the sums are the
same floating-point numbers (``tests/test_replicas.py`` compares the results folders byte for byte).

Replicas run in lockstep through :class:`ReplicaGroup`: each replica's run (:func:`~fedshuffle.experiments.runner.run_single`,
which evaluates, writes and checkpoints it exactly as alone) runs in a thread of one process, and its
``step`` waits until every replica still running asks for one, then one batched step advances them all.
Replicas need not be at the same round (a resumed replica continues from its own checkpoint).
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fedshuffle.data import FederatedDataset
from fedshuffle.executors.choice import run_threads
from fedshuffle.executors.local import LocalExecutor, ThreadedExecutor
from fedshuffle.local import fused
from fedshuffle.local.loop import LocalWork
from fedshuffle.local.steps import standard_chain
from fedshuffle.methods.algorithm import build_algorithm
from fedshuffle.methods.base import ClientResult, sample_gradients
from fedshuffle.simulation import RoundRecord, Simulation

#: the settings in which replicas of one group may differ: (section, field)
STEP_SIZE_FIELDS = (("local", "lr"), ("local", "lr_multiplier"), ("server", "lr"), ("server", "global_lr"), ("run", "seed"), ("data", "seed"))


def _local_settings(sim: Simulation) -> tuple[Any, ...]:
    local = sim.algorithm.local
    return local.weight_decay, local.clip_norm, local.prox_mu, local.momentum


def _executor_settings(sim: Simulation) -> tuple[Any, ...] | None:
    executor = sim.executor
    if not isinstance(executor, (LocalExecutor, ThreadedExecutor)):
        return None
    return type(executor), *(getattr(executor, name, None) for name in ("chunk_size", "memory_budget", "compiled", "threads"))


def _same_data(a: Any, b: Any) -> bool:
    """The same samples and split (the build shared by runs of equal data settings; the dataset object itself is the run's cast of it)."""
    return a is b or (
        isinstance(a, FederatedDataset) and isinstance(b, FederatedDataset) and a.features is b.features and a.labels is b.labels and a.weights is b.weights
        and len(a.client_indices) == len(b.client_indices) and all(x is y for x, y in zip(a.client_indices, b.client_indices))
    )


def batches(sims: Sequence[Simulation]) -> bool:
    """Whether the replicas' local work can run as one executor call: the methods keep the default halves
    (client: Δ_i from the broadcast model, no client state; server: Σ ω_iΔ_i), the replicas share one problem and dataset, and their
    executors (in-process: sequential, vectorized, threaded) and local step chains are alike."""
    first = sims[0]
    return _executor_settings(first) is not None and all(
        sim.method.sums_updates and sim.store is None and sim.problem is first.problem and _same_data(sim.data, first.data)
        and _executor_settings(sim) == _executor_settings(first) and _local_settings(sim) == _local_settings(first)
        for sim in sims
    )


def _same_rows_in_any_chunk(sim: Simulation, work: LocalWork) -> bool:
    """Whether each member's update is the same number in a chunk of any other members (so the work can be
    batched): one member per loop (sequential, threaded) or the compiled backend (member after member) always; the
    torch loop where, in each chunk, no step is taken by one member alone (its top two step counts are equal).

    The torch loop computes a step of k working members as (k, B, d) tensors, whose reductions are one
    floating-point order for k ≥ 2 and may be another for k = 1 (measured: sequential and vectorized differ
    by ~1 ulp on a3a); so a step that is one member's alone in one run and shared in the other may differ."""
    executor = sim.executor
    if isinstance(executor, ThreadedExecutor) or executor.chunk_size == 1:
        return True
    if executor.compiled and fused.usable(sim.problem, sim.data.features, work):
        return True
    for members in executor.chunks(sim.data, work):
        steps = sorted((work.plans[i].steps for i in members), reverse=True)
        if len(steps) < 2 or steps[0] != steps[1]:
            return False
    return True


def step_replicas(sims: Sequence[Simulation], together: bool | None = None) -> tuple[list[RoundRecord], bool]:
    """One round of every replica, and whether their local work ran as one executor call.

    It does where the replicas can be batched (``together``, default :func:`batches`) and every member's update
    comes out the same as alone (:func:`_same_rows_in_any_chunk`, for each replica's work alone and for all
    together); else each replica's local work runs as alone, in its own executor call."""
    if len(sims) == 1 or not (batches(sims) if together is None else together):
        return [sim.step() for sim in sims], False
    started = time.perf_counter()
    opened = []
    for sim in sims:
        rnd, points = sim.open_round()
        trainer = sim.trainer(rnd)
        broadcast = sim.broadcast(rnd, points, [trainer.gradients(p, rnd.cohort) for p in points])
        opened.append((rnd, points, broadcast))
    first = sims[0]
    local = first.algorithm.local
    chain = standard_chain(local.weight_decay, local.clip_norm, local.prox_mu, local.momentum, None, False)
    works = [LocalWork(list(rnd.plans), broadcast["model"], chain) for rnd, _, broadcast in opened]
    weights = [torch.as_tensor(sim.method.aggregation_weights(rnd), dtype=sim.dtype, device=sim.device) for sim, (rnd, _, _) in zip(sims, opened)]
    members = [len(work) for work in works]
    sums: list[torch.Tensor | None] = [None] * len(sims)
    combined = None
    if sum(members):
        combined = LocalWork([plan for work in works for plan in work.plans], torch.cat([work.rows("start") for work in works if len(work)]), chain)
        if not all(_same_rows_in_any_chunk(sim, work) for sim, work in [*zip(sims, works), (first, combined)] if len(work)):
            combined = None
    if combined is not None:
        deltas = first.executor.run(first.problem, first.data, combined).split(members)
        sums = [sim.executor.add_up(sim.data, work, w, own) if len(work) else None for sim, work, w, own in zip(sims, works, weights, deltas)]
    else:
        sums = [sim.executor.run(sim.problem, sim.data, work, w) if len(work) else None for sim, work, w in zip(sims, works, weights)]
    seconds = time.perf_counter() - started
    records = []
    for sim, (rnd, points, broadcast), work, total in zip(sims, opened, works, sums):
        result = None if total is None else ClientResult({"delta_sum": total}, sample_gradients=sample_gradients(rnd.plans))
        records.append(sim.close_round(rnd, points, broadcast, result, seconds * len(work) / max(sum(members), 1)))
    return records, combined is not None


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
        #: the group's steps, those that ran the replicas' local work as one executor call, the most replicas in one
        self.steps, self.batched, self.widest = 0, 0, 0

    def join(self, sim: Simulation, evaluator: Callable[[torch.Tensor], Any]) -> tuple[Replica, Callable[[torch.Tensor], Any]]:
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
            outcomes, together = step_replicas(sims, together)
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


def run_together(jobs: Sequence[Any], execute: Callable[[Any, Callable[..., Any]], Any]) -> tuple[list[Any], ReplicaGroup]:
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

#: executors whose replicas a sweep batches: in this process, and more than one member per loop or thread pool (with
#: ``sequential`` every member is its own loop either way, so a group would only give up the parallel workers)
BATCHED_EXECUTORS = ("vectorized", "threaded", "auto")


def replica_key(spec: Any) -> str | None:
    """What runs of one group share: the resolved spec without its step sizes (:data:`STEP_SIZE_FIELDS`) and, where
    the data split has its own seed (``data.seed``), without the run's seed. None for a run that cannot be a replica
    (a method with its own halves or client state, an executor not in :data:`BATCHED_EXECUTORS`)."""
    if spec.run.executor not in BATCHED_EXECUTORS:
        return None
    settings = spec.algorithm_settings()
    for section, name in STEP_SIZE_FIELDS:
        if section in settings and name in settings[section] and settings[section][name] is not None:
            settings[section][name] = 1.0  # any number: only the method's halves are looked at
    method = build_algorithm(spec.method.name, settings, spec.run.rounds).method
    if not method.sums_updates or method.state_fields:
        return None
    dumped = spec.model_dump()
    for section, name in STEP_SIZE_FIELDS:
        if section == "data" or (section == "run" and dumped["data"]["seed"] is None):
            continue  # another split seed is other data
        dumped[section].pop(name, None)
    return json.dumps(dumped, sort_keys=True, default=str)


#: set to "0" in the environment, every run is a group of its own (to compare with the runs made separately)
SWITCH = "FEDSHUFFLE_REPLICAS"


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
