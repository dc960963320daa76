"""What a client does in a round: how much local work, in which data order, with which step size.

:class:`LocalPlanner` *plans* each participating client's round — its epochs E_i, its sequence of
minibatches (random reshuffling, shuffle-once or with replacement), its step size η_i = η_l/c_i
and any unfinished work — from the run's seeded streams only (:mod:`fedshuffle.core.streams`), so that
every executor (and a device running the client half) does exactly the same arithmetic. How one step
turns a gradient into a move is the step chain of :mod:`fedshuffle.local.steps`; the loop that runs
the plans is :func:`fedshuffle.local.loop.run_local`.

Notation follows FedShuffle Algorithm 4 (FedShuffleGen): client i runs τ_i steps
y ← y − (η_l/c_i)·d with d built from ∇f_{iΠ}(y), and returns Δ_i = x − y_{τ_i}. (The paper writes
Δ_i = y − x and x ← x − η_gΔ; the two signs cannot both hold. We send the pseudo-gradient x − y so
that the server step x ← x − η_g Σ ω_iΔ_i reduces to FedAvg for η_g = 1.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Literal, NamedTuple

import numpy as np
from pydantic import AfterValidator, Field, PositiveFloat, PositiveInt

from fedshuffle.core import limits
from fedshuffle.core.errors import ConfigError
from fedshuffle.core.registry import Entry, StepSize, settings_model
from fedshuffle.local.steps import StepChain, standard_chain
from fedshuffle.core.streams import Stream, generator, generators, permutations

ORDERS = ("reshuffle", "shuffle_once", "with_replacement")
STEP_NORMALIZATIONS = ("none", "local_work", "max_local_work")
STEP_MODES = ("min", "mean")


def _epoch_range(epochs: int | Sequence[int]) -> int | Sequence[int]:
    if not isinstance(epochs, int) and epochs[1] < epochs[0]:
        raise ValueError(f"a range [a, b] needs a <= b, got {list(epochs)}")
    return epochs


def _flattened(batches: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Members' ``(steps, width)`` minibatch rows as one flat array, member after member, with each member's start
    and width."""
    shapes = np.array([b.shape for b in batches], dtype=np.int64).reshape(len(batches), 2)
    sizes = shapes[:, 0] * shapes[:, 1]
    rows = (
        np.concatenate([b.ravel() for b in batches]).astype(np.int64, copy=False)
        if len(batches)
        else np.zeros(0, dtype=np.int64)
    )
    return rows, np.cumsum(sizes) - sizes, shapes[:, 1].copy()


def _key_rows(keys: Sequence[tuple[int, ...]]) -> np.ndarray:
    """Stream keys (seed, round, client, occurrence) as a ``(C, 4)`` array of Python integers (a seed may exceed 64
    bits)."""
    rows = np.empty((len(keys), 4), dtype=object)
    for c, key in enumerate(keys):
        rows[c] = key
    return rows


def _occurrences(cohort: np.ndarray) -> list[int]:
    """How many times each member's client appeared earlier in ``cohort`` (0 for a first appearance)."""
    seen: dict[int, int] = {}
    occurrences = []
    for i in cohort.tolist():
        occurrences.append(seen.get(i, -1) + 1)
        seen[i] = occurrences[-1]
    return occurrences


def local_settings() -> Entry:
    """The local settings as a part's settings model (:mod:`fedshuffle.core.registry`), derived once from
    :class:`LocalPlanner`'s annotated fields: the configuration's ``[local]`` section and the planner
    check them with the same declarations."""
    global _SETTINGS
    if _SETTINGS is None:
        _SETTINGS = Entry(
            "local",
            LocalPlanner,
            "plans the clients' local work",
            settings=settings_model("local", LocalPlanner, runtime=()),
            noun="local planner",
        )
    return _SETTINGS


_SETTINGS: Entry | None = None


@dataclass(frozen=True)
class ClientPlan:
    """One client's planned round.

    ``batches[k]`` are the sample rows of step k (−1 pads a short last batch); ``lr`` is η_i;
    ``a_l1`` is FedNova's ‖a_i‖₁ of the steps actually run; ``key`` = (seed, round, client,
    occurrence) locates the plan in the run's streams, for randomness inside the steps (dropout).
    """

    client: int
    batches: np.ndarray
    lr: float
    planned_steps: int
    a_l1: float
    key: tuple[int, ...] = (0, 0, 0, 0)

    @property
    def steps(self) -> int:
        """Steps actually run (fewer than ``planned_steps`` when the client does not finish)."""
        return int(self.batches.shape[0])

    @property
    def sample_gradients(self) -> int:
        """Per-sample gradient evaluations of the local steps."""
        return int(np.count_nonzero(self.batches >= 0))


@dataclass(frozen=True, eq=False)
class CohortPlan(Sequence[ClientPlan]):
    """Every member's plan of one round as columns, the form :meth:`LocalPlanner.plan` returns.

    Member c (client ``clients[c]``) runs ``steps[c]`` steps on the minibatch rows ``rows[row_starts[c] : row_starts[c]
    +
    steps[c]·widths[c]]`` read as ``(steps[c], widths[c])``; ``keys[c]`` is its (seed, round, client, occurrence),
    Python
    integers (a seed may exceed 64 bits). It is a sequence of
    :class:`ClientPlan` (made on indexing), and :meth:`take` selects members without copying their rows: executors and
    the aggregation read the columns, so a cohort of many small clients costs no Python object per member there.
    """

    clients: np.ndarray
    rows: np.ndarray
    row_starts: np.ndarray
    steps: np.ndarray
    widths: np.ndarray
    lrs: np.ndarray
    planned_steps: np.ndarray
    a_l1: np.ndarray
    keys: np.ndarray

    @classmethod
    def of(cls, plans: Sequence[ClientPlan]) -> CohortPlan:
        """The columns of ``plans`` (themselves when they are a CohortPlan already)."""
        if isinstance(plans, CohortPlan):
            return plans
        rows, row_starts, widths = _flattened([p.batches for p in plans])
        return cls(
            np.array([p.client for p in plans], dtype=np.int64),
            rows,
            row_starts,
            np.array([p.steps for p in plans], dtype=np.int64),
            widths,
            np.array([p.lr for p in plans], dtype=np.float64),
            np.array([p.planned_steps for p in plans], dtype=np.int64),
            np.array([p.a_l1 for p in plans], dtype=np.float64),
            _key_rows([p.key for p in plans]),
        )

    def batches(self, c: int) -> np.ndarray:
        """Member c's minibatch rows ``(steps[c], widths[c])``: a read-only view of the round's rows, which other
        members' plans share."""
        start, steps, width = int(self.row_starts[c]), int(self.steps[c]), int(self.widths[c])
        view = self.rows[start : start + steps * width].reshape(steps, width)
        view.flags.writeable = False
        return view

    def __reduce__(self):
        """Pickled (to a worker process) with its own members' rows only, not the whole round's that :meth:`take`
        shares."""
        rows, row_starts, _ = _flattened([self.batches(c) for c in range(len(self))])
        return CohortPlan, (
            self.clients,
            rows,
            row_starts,
            self.steps,
            self.widths,
            self.lrs,
            self.planned_steps,
            self.a_l1,
            self.keys,
        )

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, index: int | slice) -> ClientPlan | CohortPlan:
        """Member ``index``'s plan, or the CohortPlan of a slice of members."""
        if isinstance(index, slice):
            return self.take(np.arange(len(self))[index])
        c = range(len(self))[index]
        return ClientPlan(
            int(self.clients[c]),
            self.batches(c),
            float(self.lrs[c]),
            int(self.planned_steps[c]),
            float(self.a_l1[c]),
            tuple(self.keys[c].tolist()),
        )

    @staticmethod
    def joined(parts: Sequence[Sequence[ClientPlan]]) -> CohortPlan:
        """The plans of ``parts``, one after another, as one CohortPlan."""
        columns = [CohortPlan.of(part) for part in parts]
        shifts = np.cumsum([0] + [len(c.rows) for c in columns[:-1]])
        return CohortPlan(
            np.concatenate([c.clients for c in columns]),
            np.concatenate([c.rows for c in columns]),
            np.concatenate([c.row_starts + shift for c, shift in zip(columns, shifts.tolist())]),
            *(
                np.concatenate([getattr(c, name) for c in columns])
                for name in ("steps", "widths", "lrs", "planned_steps", "a_l1", "keys")
            ),
        )

    def take(self, members: Sequence[int] | np.ndarray) -> CohortPlan:
        """The plans of ``members`` (positions, in that order), on the same ``rows``."""
        m = np.asarray(members, dtype=np.int64)
        return CohortPlan(
            self.clients[m],
            self.rows,
            self.row_starts[m],
            self.steps[m],
            self.widths[m],
            self.lrs[m],
            self.planned_steps[m],
            self.a_l1[m],
            self.keys[m],
        )

    @property
    def sample_gradients(self) -> int:
        """Per-sample gradient evaluations of the members' steps (−1 pads a short batch)."""
        used = self.steps * self.widths
        real = np.concatenate([[0], np.cumsum(self.rows >= 0)])  # real[k]: real rows before position k
        return int(np.sum(real[self.row_starts + used] - real[self.row_starts]))


class Draws(NamedTuple):
    """A round's plans as the run's streams decide them (:meth:`LocalPlanner._draw`), before the step sizes."""

    rows: np.ndarray
    row_starts: np.ndarray
    widths: np.ndarray
    planned_steps: np.ndarray
    steps: np.ndarray
    keys: np.ndarray


class SharedDraws:
    """Rounds' draws that runs of the same data and seed share when they differ only in step sizes: replicas
    (:mod:`fedshuffle.replicas`) of a grid of G step sizes draw every round's minibatch rows once per seed instead of
    G times. Kept for the newest :data:`ROUNDS_KEPT` rounds (replicas step in lockstep); arrays made read-only, as
    every run now reads the same ones. Safe across threads."""

    ROUNDS_KEPT = 2

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._draws: dict[tuple[object, ...], Draws] = {}
        self._newest = 0

    def get(self, key: tuple[object, ...], draw: Callable[[], Draws]) -> Draws:
        """The draws under ``key`` (whose third entry is the round), made by ``draw`` the first time."""
        with self._lock:
            found = self._draws.get(key)
        if found is not None:
            return found
        made = Draws(*map(_read_only, draw()))
        with self._lock:
            self._newest = max(self._newest, key[2])
            self._draws[key] = made
            for old in [k for k in self._draws if k[2] <= self._newest - self.ROUNDS_KEPT]:
                del self._draws[old]
        return made


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class LocalPlanner:
    """Plans client rounds (FedShuffle Algorithm 4, lines 4–11).

    Parameters
    ----------
    lr:
        Local step size η_l.
    epochs:
        E local epochs, or an inclusive range ``(a, b)`` drawn uniformly per client per round (the
        paper's CIFAR-100 setup uses 2–5).
    steps:
        Instead of epochs: a fixed number K of steps, ``"min"`` (FedAvgMin: K = min over the cohort
        of the epoch-based step counts) or ``"mean"`` (FedAvgMean: K = their rounded mean).
    order:
        ``"reshuffle"`` (random reshuffling, RR) a fresh permutation every epoch, ``"shuffle_once"`` (SO) one
        permutation per client for the whole run, ``"with_replacement"`` an independent minibatch every step —
        the words the cyclic sampler uses for its cohorts too.
    batch_size:
        B; an epoch is ⌈|D_i|/B⌉ steps, the last batch possibly smaller.
    epoch_batches:
        Instead of B: an epoch is exactly K steps whose minibatches split the epoch's permutation into
        K nearly equal parts of ⌊|D_i|/K⌋ or ⌈|D_i|/K⌉ samples (``numpy.array_split``), so that K steps are
        one full pass (RR-CLI §4.5: 100 local steps on 1 % of the local data). Needs K ≤ |D_i|.
    step_normalization:
        c_i in η_i = η_l/c_i: ``"none"`` (c_i = 1), ``"local_work"`` (c_i = τ_i, Algorithm 1's
        η_l/|D_i| written per step), ``"max_local_work"`` (c_i = τ_i/τ_max, so the client with the
        most local steps uses η_l — Appendix F's comparison), or explicit per-client values.
        τ counts steps, τ_i = E_i⌈|D_i|/B⌉ (= E_i|D_i| at B = 1, the paper's setting).
    weight_decay, clip_norm, momentum, prox_mu:
        The step pipeline (:mod:`fedshuffle.local.steps`): λ of weight decay, the clipping norm, local
        heavy-ball ρ, FedProx's μ.
    drop_last_steps:
        Every client leaves its last k planned steps undone (FedShuffle Appendix F.1), keeping ≥ 1.
    straggler_probability:
        With this probability a client completes only U{1..τ_i} of its steps (random drop-off, §4.3).
    """

    lr: Annotated[float, Field(gt=0, description="local step size η_l"), StepSize("lr")]
    epochs: Annotated[
        PositiveInt | Annotated[Sequence[PositiveInt], Field(min_length=2, max_length=2)],
        AfterValidator(_epoch_range),
        Field(description="E local epochs, or [a, b] drawn uniformly per client and round"),
    ] = 1
    steps: Annotated[
        PositiveInt | Literal[STEP_MODES] | None,
        Field(description="K local steps instead of epochs; 'min'/'mean' over the cohort"),
    ] = None
    order: Annotated[
        Literal[ORDERS], Field(description="minibatch order: reshuffle (RR), shuffle_once (SO) or with_replacement")
    ] = "reshuffle"
    batch_size: Annotated[int, Field(ge=1, description="B; an epoch is ⌈|D_i|/B⌉ steps")] = 1
    step_normalization: Annotated[
        Literal[STEP_NORMALIZATIONS] | Sequence[PositiveFloat],
        Field(description="c_i in η_i = η_l/c_i, or one value per client"),
    ] = "none"
    weight_decay: Annotated[float, Field(ge=0, description="λ of the weight decay step")] = 0.0
    clip_norm: Annotated[
        PositiveFloat | None, Field(description="the clipping norm of every local step (none: no clipping)")
    ] = None
    momentum: Annotated[float, Field(ge=0, lt=1, description="local heavy-ball ρ")] = 0.0
    prox_mu: Annotated[float, Field(ge=0, description="FedProx's μ")] = 0.0
    drop_last_steps: Annotated[int, Field(ge=0, description="every client leaves its last k steps undone")] = 0
    straggler_probability: Annotated[
        float, Field(ge=0, le=1, description="a client completes only U{1..τ_i} steps with this probability")
    ] = 0.0
    epoch_batches: Annotated[
        PositiveInt | None, Field(description="instead of batch_size: exactly K nearly equal minibatches per epoch")
    ] = None
    _epoch_range: tuple[int, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        checked = local_settings().check(
            {f: getattr(self, f) for f in local_settings().setting_names()}
        )  # the declarations above, once
        for name, value in checked.items():
            object.__setattr__(self, name, value)
        if self.momentum and self.prox_mu:
            raise ConfigError(
                "momentum", "local momentum together with a proximal term is not supported (no FedNova normalizer)"
            )
        rng = (self.epochs, self.epochs) if isinstance(self.epochs, int) else tuple(self.epochs)
        object.__setattr__(self, "_epoch_range", (int(rng[0]), int(rng[1])))

    # -- local work ------------------------------------------------------------------------------

    def epoch_steps(self, size: int | np.ndarray) -> int | np.ndarray:
        """Steps in one epoch: ⌈|D_i|/B⌉, or K with ``epoch_batches`` (a Python int for an int size: planning calls
        it per client)."""
        if isinstance(size, int):
            return -(-size // self.batch_size) if self.epoch_batches is None else self.epoch_batches
        if self.epoch_batches is not None:
            return np.full_like(np.asarray(size), self.epoch_batches)
        return -(-np.asarray(size) // self.batch_size)

    def batch_width(self, size: int) -> int:
        """Samples in the largest minibatch of a client with ``size`` samples."""
        if self.epoch_batches is not None:
            if self.epoch_batches > size:
                raise ConfigError(
                    "epoch_batches",
                    f"{self.epoch_batches} minibatches per epoch need at least as many samples; a client has {size}",
                )
            return -(-size // self.epoch_batches)
        return min(self.batch_size, size)

    def draw_epochs(self, client: int, round_index: int, seed: int) -> int:
        """E_i for this round: the fixed value, or uniform on the configured range."""
        low, high = self._epoch_range
        if low == high:
            return low
        return int(generator(seed, Stream.EPOCHS, round_index, client).integers(low, high + 1))

    def max_planned_steps(self, sizes: np.ndarray) -> int:
        """τ_max over all clients and rounds (fixed K, or max epochs × max ⌈|D_j|/B⌉). The population's scan is kept
        for the ``sizes`` array it was made from, so that planning a round costs O(cohort), not O(n)."""
        if isinstance(self.steps, int):
            return self.steps
        cached = self.__dict__.get("_tau_max")
        if cached is not None and cached[0] is sizes:
            return cached[1]
        tau_max = int(self._epoch_range[1] * np.max(self.epoch_steps(sizes)))
        object.__setattr__(self, "_tau_max", (sizes, tau_max))
        return tau_max

    def __getstate__(self) -> dict:
        """Pickled (to workers) without the kept population scan: it holds the population's sizes."""
        return {k: v for k, v in self.__dict__.items() if k != "_tau_max"}

    def normalizations(self, planned: np.ndarray, clients: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        """c_i for the given clients and their planned step counts τ_i."""
        sn = self.step_normalization
        if not isinstance(sn, str):
            if len(sn) != len(sizes):
                raise ConfigError("step_normalization", f"expected {len(sizes)} values (one per client), got {len(sn)}")
            return np.asarray(sn, dtype=np.float64)[clients]
        if sn == "none":
            return np.ones(len(clients))
        if sn == "local_work":
            return planned.astype(np.float64)
        tau_max = planned.max() if isinstance(self.steps, str) else self.max_planned_steps(sizes)
        return planned / tau_max

    def expected_progress(self, sizes: np.ndarray) -> np.ndarray:
        """E[‖a_i‖₁/c_i] of every client over its epoch draw (planned work, no unfinished steps).

        ‖a_i‖₁/c_i = η_i‖a_i‖₁/η_l is client i's progress in units of the base step; FedNova's
        τ_eff = Σ_i w_i·E[‖a_i‖₁/c_i] (Wang et al. 2020: Σ_i p_i‖a_i‖₁ when c_i = 1).
        """
        if self.steps in STEP_MODES:
            raise ConfigError("tau_eff", "steps = 'min'/'mean' depend on the cohort; use tau_eff = 'cohort'")
        clients = np.arange(len(sizes))
        chain = self.chain()
        low, high = self._epoch_range
        total = np.zeros(len(sizes))
        for epochs in range(low, high + 1):
            planned = (
                np.full(len(sizes), self.steps) if isinstance(self.steps, int) else epochs * self.epoch_steps(sizes)
            )
            c = self.normalizations(planned, clients, sizes)
            total += np.array([chain.a_l1(int(t), self.lr / ci) for t, ci in zip(planned, c)]) / c
        return total / (high - low + 1)

    # -- planning --------------------------------------------------------------------------------

    def plan(
        self,
        client_indices: Sequence[np.ndarray],
        cohort: np.ndarray,
        round_index: int,
        seed: int,
        lr_scale: float = 1.0,
        sizes: np.ndarray | None = None,
        shared: SharedDraws | None = None,
    ) -> CohortPlan:
        """Plans for every member of ``cohort`` (a repeated client gets independent runs); η_i = lr_scale·η_l/c_i.

        ``sizes`` (|D_i| of all clients) saves counting ``client_indices`` when the population is large. ``shared``:
        draws made for the same data by runs that differ from this one at most in step sizes (replicas), taken
        from there where they were made already.
        """
        sizes = np.array([len(ix) for ix in client_indices]) if sizes is None else sizes
        cohort = np.asarray(cohort, dtype=np.int64)
        if len(cohort) == 0:
            return CohortPlan.of([])
        if shared is None:
            drawn = self._draw(client_indices, cohort, round_index, seed, sizes)
        else:
            drawn = shared.get(
                (self._drawing(), seed, round_index, cohort.tobytes()),
                lambda: self._draw(client_indices, cohort, round_index, seed, sizes),
            )
        lrs = (self.lr * lr_scale / self.normalizations(drawn.planned_steps, cohort, sizes)).astype(
            np.float64, copy=False
        )
        chain = self.chain()
        a_l1 = (
            np.array([chain.a_l1(n, lr) for n, lr in zip(drawn.steps.tolist(), lrs.tolist())])
            if chain.transforms
            else drawn.steps.astype(np.float64)
        )
        return CohortPlan(
            cohort, drawn.rows, drawn.row_starts, drawn.steps, drawn.widths, lrs, drawn.planned_steps, a_l1, drawn.keys
        )

    def _drawing(self) -> tuple[object, ...]:
        """The settings that decide a round's draws (:meth:`_draw`): all but the step sizes."""
        return (
            self.order,
            self.batch_size,
            self.epoch_batches,
            self._epoch_range,
            self.steps,
            self.drop_last_steps,
            self.straggler_probability,
        )

    def _draw(
        self, client_indices: Sequence[np.ndarray], cohort: np.ndarray, round_index: int, seed: int, sizes: np.ndarray
    ) -> Draws:
        """What the run's streams decide of a round's plans: each member's epochs, planned and completed steps, and
        minibatch rows."""
        low, high = self._epoch_range
        epochs = (
            np.full(len(cohort), low)
            if low == high
            else np.array([self.draw_epochs(int(i), round_index, seed) for i in cohort])
        )
        epoch_based = epochs * self.epoch_steps(sizes[cohort])
        if self.steps is None:
            planned = epoch_based
        elif self.steps == "min":
            planned = np.full(len(cohort), epoch_based.min())
        elif self.steps == "mean":
            planned = np.full(len(cohort), max(1, int(np.floor(epoch_based.mean() + 0.5))))
        else:
            planned = np.full(len(cohort), self.steps)
        planned = planned.astype(np.int64, copy=False)
        width = self.batch_width(int(np.max(sizes[cohort])))
        limits.check_fits(
            4 * limits.array_bytes(float(np.sum(planned)), width),
            "local.steps" if isinstance(self.steps, int) else "local.epochs",
            "one round's minibatch plans",
        )
        occurrences = _occurrences(cohort)
        stream_keys = np.stack(
            [np.full(len(cohort), round_index), cohort, occurrences], axis=1
        )  # (round, client, occurrence)
        rows, row_starts, widths = self._cohort_batches(client_indices, cohort, planned, stream_keys, sizes, seed)
        done = self._completed_steps(planned, stream_keys.tolist(), seed)
        keys = _key_rows([(seed, round_index, i, k) for i, k in zip(cohort.tolist(), occurrences)])
        return Draws(rows, row_starts, widths, planned, done, keys)

    def _cohort_batches(
        self,
        client_indices: Sequence[np.ndarray],
        cohort: np.ndarray,
        planned: np.ndarray,
        keys: np.ndarray,
        sizes: np.ndarray,
        seed: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every member's τ_i minibatches as ``(rows, row_starts, widths)`` of a :class:`CohortPlan`.

        With replacement, each member draws from its DATA_ORDER stream (keyed ``keys``). Otherwise the permutations
        of every epoch a member starts are drawn at once — a fresh one per epoch from its DATA_ORDER stream under
        random reshuffling, the client's one permutation (its SHUFFLE_ONCE stream) every epoch under shuffle-once — and
        cut into minibatches: B rows each, the last one of an epoch padded with −1 to B; or, with ``epoch_batches``, K
        nearly equal parts."""
        if self.order == "with_replacement":
            return _flattened(
                [
                    self._with_replacement(client_indices[i], tau, rng)
                    for i, tau, rng in zip(cohort.tolist(), planned.tolist(), generators(seed, Stream.DATA_ORDER, keys))
                ]
            )
        counts = sizes[cohort].astype(np.int64)
        epochs_run = -(-planned // self.epoch_steps(counts))
        run = counts * epochs_run  # the samples of the epochs each member starts
        limits.check_fits(
            10 * limits.array_bytes(float(run.sum())),
            "local.epochs" if self.steps is None else "local.steps",
            "one round's epoch permutations",
        )
        within = np.arange(int(run.sum())) - np.repeat(
            np.cumsum(run) - run, run
        )  # a sample's place in its member's epochs
        size = np.repeat(counts, run)
        epoch, place = within // size, within % size
        member_starts = np.repeat(np.cumsum(counts) - counts, run)
        if self.order == "reshuffle":
            orders = permutations(seed, Stream.DATA_ORDER, keys, counts, epochs_run)
        else:
            orders = permutations(seed, Stream.SHUFFLE_ONCE, cohort[:, None], counts, np.ones_like(counts))[
                member_starts + place
            ]
        samples = np.concatenate([client_indices[i] for i in cohort.tolist()])[member_starts + orders].astype(
            np.int64, copy=False
        )
        if self.epoch_batches is not None:
            ends = np.cumsum(run).tolist()
            return _flattened(
                [
                    self._parts(samples[end - n * r : end].reshape(r, n), tau)
                    for tau, end, n, r in zip(planned.tolist(), ends, counts.tolist(), epochs_run.tolist())
                ]
            )
        widths = np.minimum(self.batch_size, counts)
        padded = -(-counts // widths) * widths  # an epoch's ⌈n/B⌉ minibatches of B rows
        starts = np.cumsum(padded * epochs_run) - padded * epochs_run
        rows = np.full(int((padded * epochs_run).sum()), -1, dtype=np.int64)
        rows[np.repeat(starts, run) + epoch * np.repeat(padded, run) + place] = samples
        return rows, starts, widths

    def _with_replacement(self, rows: np.ndarray, steps: int, rng: np.random.Generator) -> np.ndarray:
        """One member's ``(steps, width)`` minibatch rows, each step's drawn without replacement within the step."""
        n, b = (
            len(rows),
            self.batch_width(len(rows)),
        )  # a batch beyond the client's data is all of it: no padding columns
        picks = (
            np.stack([rng.choice(n, size=b, replace=False) for _ in range(steps)])
            if b < n
            else np.tile(np.arange(n), (steps, 1))
        )
        return rows[picks]

    def _parts(self, epochs: np.ndarray, steps: int) -> np.ndarray:
        """One member's first ``steps`` minibatches when each epoch (a row of ``epochs``, its samples in order) is
        ``epoch_batches`` = K parts of ⌈n/K⌉ or ⌊n/K⌋ samples (``numpy.array_split``), each padded with −1 to ⌈n/K⌉."""
        n = epochs.shape[1]
        out = np.full((len(epochs), self.epoch_batches, self.batch_width(n)), -1, dtype=np.int64)
        for e, epoch in enumerate(epochs):
            for k, part in enumerate(np.array_split(epoch, self.epoch_batches)):
                out[e, k, : len(part)] = part
        return out.reshape(-1, out.shape[2])[:steps]

    def _completed_steps(self, planned: np.ndarray, keys: Sequence[Sequence[int]], seed: int) -> np.ndarray:
        """Steps each member completes: its planned steps less ``drop_last_steps`` (at least one), or with
        ``straggler_probability`` only U{1..τ_i} of them (its UNFINISHED stream, keyed (round, client, occurrence),
        drawn only then)."""
        done = np.maximum(1, planned - self.drop_last_steps)
        if self.straggler_probability > 0:
            for c, (round_index, client, occurrence) in enumerate(keys):
                rng = generator(seed, Stream.UNFINISHED, round_index, client, occurrence)
                if rng.random() < self.straggler_probability:
                    done[c] = min(done[c], int(rng.integers(1, planned[c] + 1)))
        return done

    def chain(self) -> StepChain:
        """The local step pipeline of these settings: clip → weight decay → prox → local momentum."""
        return standard_chain(self.weight_decay, self.clip_norm, self.prox_mu, self.momentum)
