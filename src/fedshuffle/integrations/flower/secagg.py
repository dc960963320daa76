"""Secure aggregation: the server learns only the round's weighted sum, through Flower's SecAgg+.

SecAgg+ (Bell, Bonawitz, Gascón, Lepoint & Raykova, "Secure Single-Server Aggregation with (Poly)Logarithmic
Overhead", CCS 2020) lets a server add the nodes' integer vectors without seeing any of them: each node masks
its vector with pairwise masks (agreed with its neighbours) and a private mask, and shares the secrets of both
(Shamir) so that the masks of a node that drops out can still be removed. Flower implements it as
:class:`flwr.server.workflow.SecAggPlusWorkflow` (server) and :func:`flwr.client.mod.secaggplus_mod` (node);
this module uses both as they are and writes no cryptography of its own.

It serves every method whose server half needs only d = Σ_S ν_iΔ_i with ν_i fixed by the plans
(:attr:`fedshuffle.methods.base.Method.server_needs_only_sum`; ν_i =
:meth:`~fedshuffle.methods.base.Method.sum_weights`, the aggregation
weights ω_i for the default halves, FedCDR's w_i). A round, with ``secure-aggregation = true``::

    train (one message per sampled client)   plans, broadcast and the member's ν_i; the node trains, keeps
                                             ν_iΔ_i (summed over the client's members) and replies with counts only
    SecAgg+ (one exchange per node)           each node hosting an answered client inputs s_k = Σ_{i on k} ν_iΔ_i
                                             (where they sit on one node, one other node inputs 0: two take part);
                                             the server gets Σ_k s_k and which nodes' inputs it holds

Quantization. A node clips its input to [−c, c] and rounds it stochastically onto Q levels (``clipping-range``
c, ``quantization-range`` Q): each entry moves by less than one level 2c/Q, so with K nodes in the sum

    |Σ_k s_k(SecAgg+) − Σ_k s_k| < K·2c/Q  per entry        (c = 8, Q = 2²²: 3.8e-6 per node)

A node whose input has an entry outside [−c, c] refuses (its input would be clipped): the run stops naming the setting.
The sum of K inputs must stay below the modulus 2³²: K·Q < 2³² (K < 1024 nodes at the default Q).

Dropouts are SecAgg+'s: a node whose masked input does not arrive is left out of the sum and its masks are removed
with its neighbours' shares (one that drops later stays in), as long as each node keeps ``reconstruction-threshold``
neighbours; otherwise
SecAgg+ halts and the round aggregates nothing (every member dropped, the model unchanged). When members drop,
the server rescales the sum to the weights the method gives the members that remain, ν_i(S') = ρ·ν_i(S):
every :class:`~fedshuffle.aggregation.Aggregator` has one factor ρ for all members (sum-one normalization,
FedNova's cohort τ_eff), which the server checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitIns, FitRes, Parameters, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.compat.legacy_context import LegacyContext
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey

from fedshuffle.core.errors import ConfigError
from fedshuffle.integrations.flower.common import AppSettings, FederationError
from fedshuffle.integrations.flower.half import keep_members
from fedshuffle.integrations.flower.messages import UNANSWERED
from fedshuffle.methods.base import ClientResult, Method

if TYPE_CHECKING:
    from fedshuffle.integrations.flower.replies import Reply
    from fedshuffle.integrations.flower.strategy import _OpenRound

#: SecAgg+'s masks are drawn modulo 2³² (Flower's default ``modulus_range``)
MODULUS = 1 << 32
#: Flower's quantizer rounds into int32: Q must stay below 2³¹
MAX_QUANTIZATION = (1 << 31) - 1
#: the ``run-config`` switch
SETTING = "run-config.secure-aggregation"
#: the coarsest quantization level 2c/Q accepted, as a fraction of the model's scale: coarser, most updates round to 0
RESOLUTION = 1e-3


@dataclass(frozen=True)
class SecureAggregation:
    """SecAgg+'s settings (``run-config``: ``secure-aggregation = true`` and ``secagg-*``).

    ``num_shares``: shares of each node's secrets (an integer > 2, or a fraction of the round's nodes in (0, 1]);
    ``reconstruction_threshold``: shares that rebuild a secret (an integer ≥ 2 below ``num_shares``, or a fraction
    of ``num_shares``); defaults 3 and 2 as Flower's secure-aggregation example. ``clipping_range`` c and
    ``quantization_range`` Q: Flower's defaults 8 and 2²² (see the module docstring for the tolerance they give).
    """

    num_shares: int | float = 3
    reconstruction_threshold: int | float = 2
    clipping_range: float = 8.0
    quantization_range: int = 1 << 22

    def __post_init__(self) -> None:
        for key, value in (
            ("secagg-num-shares", self.num_shares),
            ("secagg-reconstruction-threshold", self.reconstruction_threshold),
        ):
            if isinstance(value, float) and not 0 < value <= 1:
                raise ConfigError(
                    f"run-config.{key}", f"a fraction must be in (0, 1], got {value}; or give a whole number of shares"
                )
        if isinstance(self.num_shares, int) and self.num_shares <= 2:
            raise ConfigError("run-config.secagg-num-shares", f"a number of shares must be > 2, got {self.num_shares}")
        threshold = self.reconstruction_threshold
        if isinstance(threshold, int) and (
            threshold < 2 or (isinstance(self.num_shares, int) and threshold >= self.num_shares)
        ):
            raise ConfigError(
                "run-config.secagg-reconstruction-threshold",
                f"must be >= 2 and below secagg-num-shares ({self.num_shares}), got {threshold}",
            )
        if not (self.clipping_range > 0 and math.isfinite(self.clipping_range)):
            raise ConfigError(
                "run-config.secagg-clipping-range", f"must be a positive number, got {self.clipping_range}"
            )
        if not 2 <= self.quantization_range <= MAX_QUANTIZATION:
            raise ConfigError(
                "run-config.secagg-quantization-range",
                f"must be an integer in 2..2^31 − 1 (Flower quantizes into int32), got {self.quantization_range}",
            )
        try:  # and Flower's own checks
            self.workflow(None)
        except (TypeError, ValueError) as exc:
            raise ConfigError(SETTING, f"Flower's SecAgg+ refuses these settings: {exc}") from None

    @classmethod
    def from_settings(cls, settings: AppSettings) -> SecureAggregation | None:
        """The settings of an :class:`~fedshuffle.integrations.flower.common.AppSettings` (None: secure aggregation is
        off).
        Shares given as a whole number > 1 count shares; in (0, 1] they are a fraction (Flower's float form)."""
        if not settings.secure_aggregation:
            return None

        def shares(key: str, value: float) -> int | float:
            if value > 1 and not float(value).is_integer():
                raise ConfigError(f"run-config.{key}", f"a number of shares must be whole, got {value}")
            return int(value) if value > 1 else float(value)

        return cls(
            shares("secagg-num-shares", settings.secagg_num_shares),
            shares("secagg-reconstruction-threshold", settings.secagg_reconstruction_threshold),
            float(settings.secagg_clipping_range),
            int(settings.secagg_quantization_range),
        )

    @property
    def level(self) -> float:
        """One quantization level 2c/Q: a node's input moves by less than this per entry."""
        return 2 * self.clipping_range / self.quantization_range

    def tolerance(self, nodes: int) -> float:
        """Bound on |secure sum − exact sum| per entry with ``nodes`` inputs in the sum: nodes·2c/Q."""
        return nodes * self.level

    def check_resolution(self, params: torch.Tensor) -> None:
        """Refuse a clipping range c and quantization range Q whose level 2c/Q is coarser than :data:`RESOLUTION` of the
        model's scale (max|x⁰|, or 1 for a model that starts at 0): an update that small rounds to 0 with probability
        near 1, so the model would hardly move."""
        largest = float(params.detach().abs().max()) if params.numel() else 0.0
        scale = largest if 0 < largest < math.inf else 1.0
        finest = RESOLUTION * scale
        if self.level <= finest:
            return
        needed = math.ceil(2 * self.clipping_range / finest)
        c, q = self.clipping_range, self.quantization_range
        why = (
            f"one quantization level 2c/Q = 2·{c:g}/{q} = {self.level:.3g} is coarser than {RESOLUTION:g} of the "
            f"model's scale ({scale:.3g}, max|x⁰|): updates would round to 0 and the model would hardly move; "
        )
        if needed <= MAX_QUANTIZATION:
            raise ConfigError(
                "run-config.secagg-quantization-range", f"{why}give Q >= {needed} (up to {MAX_QUANTIZATION})"
            )
        raise ConfigError(
            "run-config.secagg-clipping-range",
            f"{why}give c <= {finest * MAX_QUANTIZATION / 2:.3g} (with Q up to {MAX_QUANTIZATION})",
        )

    def check_federation(self, nodes: int) -> None:
        """A federation of ``nodes`` nodes can sum securely: at least two nodes, and nodes·Q below the modulus 2³²."""
        if nodes < 2:
            raise ConfigError(SETTING, f"SecAgg+ needs at least 2 nodes; the federation has {nodes}")
        if nodes * self.quantization_range >= MODULUS:
            raise ConfigError(
                "run-config.secagg-quantization-range",
                f"{nodes} nodes × Q = {self.quantization_range} would overflow the modulus 2^32: "
                f"give Q below {MODULUS // nodes}",
            )

    def workflow(self, timeout: float | None) -> SecAggPlusWorkflow:
        """Flower's SecAgg+ workflow with these settings, waiting ``timeout`` s per stage; a node's weight is 1
        (``max_weight`` 1:
        the workflow returns the inputs' mean)."""
        return SecAggPlusWorkflow(
            self.num_shares,
            self.reconstruction_threshold,
            max_weight=1.0,
            clipping_range=self.clipping_range,
            quantization_range=self.quantization_range,
            modulus_range=MODULUS,
            timeout=timeout,
        )


def refuse_individual_updates(method: Method, label: str) -> None:
    """Secure aggregation serves only a method whose server half needs only Σ_S ν_iΔ_i: else one line naming both."""
    if not method.server_needs_only_sum or tuple(method.payload_fields) != ("delta",):
        raise ConfigError(
            SETTING,
            f"{label!r} runs {method.describe()}, whose server half needs each member's own upload "
            f"({', '.join(method.payload_fields)}"
            f"{', gradients' if type(method).gradient_requests is not Method.gradient_requests else ''}), not only "
            "one weighted sum Σ ν_iΔ_i: "
            "set secure-aggregation = false for it",
        )
    privacy = getattr(method, "privacy", None)
    if privacy is not None and privacy.adaptive:
        raise ConfigError(
            SETTING,
            f"{label!r} uses adaptive clipping, whose members report in the clear whether their update was clipped "
            "(Andrew et al. sum those bits securely too; not built): use privacy.clipping = 'fixed' or "
            "secure-aggregation = false",
        )


# -- the node's half --------------------------------------------------------------------------------------


def _key(run: int, client: int) -> str:
    return f"fedshuffle.secagg.{run}.{client}"


def keep_weighted_update(state: RecordDict, run: int, client: int, round_index: int, weighted: torch.Tensor) -> None:
    """Keep a client's Σ_{its members} ν_iΔ_i on its node (``context.state``) until the round's SecAgg+ exchange asks
    for it
    (:func:`node_input`); one the exchange never asks for (the client's node left out) is replaced at the client's next
    round."""
    state[_key(run, client)] = ArrayRecord(
        {
            "sum": Array(np.ascontiguousarray(weighted.detach().cpu().numpy(), dtype=np.float64)),
            "round": Array(np.array(round_index, dtype=np.int64)),
        }
    )


def node_input(
    state: RecordDict, run: int, round_index: int, clients: Sequence[int], dim: int, clipping_range: float
) -> np.ndarray:
    """The node's SecAgg+ input s_k = Σ of ``clients``' kept weighted updates of ``round_index`` (zeros for none); each
    is used once.
    An entry outside [−c, c] raises :class:`ValueError` (SecAgg+ would clip it: a silently wrong sum)."""
    total = np.zeros(dim, dtype=np.float64)
    for client in clients:
        record = state.pop(_key(run, client), None)
        if record is None or int(record["round"].numpy()) != round_index:
            raise ValueError(
                f"secure aggregation: no weighted update of client {client} for round {round_index} on this node"
            )
        total += record["sum"].numpy()
    worst = float(np.abs(total).max(initial=0.0))
    if worst > clipping_range:
        raise ValueError(
            f"secure aggregation: this node's weighted update has an entry of magnitude {worst:.4g} outside "
            f"±{clipping_range:g} "
            "(SecAgg+ would clip it): raise run-config secagg-clipping-range"
        )
    return total


def node_mod(
    dimension: Callable[[Context, int], int],
) -> Callable[[Message, Context, Callable[[Message, Context], Message]], Message]:
    """The ClientApp mod of a round's training: SecAgg+'s messages go to Flower's :func:`secaggplus_mod`, whose
    masked-input stage gets the node's input (:func:`node_input`; ``dimension(context, run)`` is the model's size);
    every other message goes on to the ClientApp."""

    def masked_input(message: Message, context: Context) -> Message:
        config = compat.recorddict_to_fitins(message.content, keep_input=True).config
        run, clients = int(config["run"]), [int(c) for c in str(config["clients"]).split(",") if c]
        total = node_input(
            context.state, run, int(config["round"]), clients, dimension(context, run), float(config["clipping-range"])
        )
        result = FitRes(Status(Code.OK, ""), ndarrays_to_parameters([total]), num_examples=1, metrics={})
        return Message(compat.fitres_to_recorddict(result, keep_input=True), reply_to=message)

    def mod(message: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
        if RECORD_KEY_CONFIGS not in message.content.config_records:
            return call_next(message, context)
        return secaggplus_mod(message, context, masked_input)

    return mod


# -- the server's half ------------------------------------------------------------------------------------


def content_bytes(content: RecordDict) -> int:
    """Bytes a message's records carry: arrays' data, byte strings and text, 8 per number (not Flower's framing)."""
    total = 0
    for record in content.values():
        for value in record.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, Array):
                    total += len(item.data)
                elif isinstance(item, (bytes, str)):
                    total += len(item)
                else:
                    total += 8
    return total


@dataclass
class SecureSum:
    """What the server learns from one SecAgg+ exchange: Σ_k s_k over ``nodes`` (None: SecAgg+ halted), the nodes' error
    replies (node, error), and the bytes the exchange's messages carried each way."""

    total: np.ndarray | None
    nodes: frozenset[int]
    errors: list[tuple[int, Error]] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0


def sum_metrics(summed: SecureSum | None) -> dict[str, float]:
    """The round's SecAgg+ figures: nodes whose input is in the sum, bytes its exchange carried up and down (0: no
    exchange)."""
    if summed is None:
        return {"secagg_nodes": 0, "secagg_bytes_up": 0, "secagg_bytes_down": 0}
    return {
        "secagg_nodes": len(summed.nodes),
        "secagg_bytes_up": summed.bytes_up,
        "secagg_bytes_down": summed.bytes_down,
    }


class _Observed:
    """The grid as the SecAgg+ workflow sees it, counting bytes and keeping the error replies."""

    def __init__(self, grid: object) -> None:
        self.grid, self.errors, self.up, self.down = grid, [], 0, 0

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        self.down += sum(content_bytes(m.content) for m in messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        self.errors += [(r.metadata.src_node_id, r.error) for r in replies if r.has_error()]
        self.up += sum(content_bytes(r.content) for r in replies if not r.has_error())
        return replies


class _Inputs:
    """What Flower's workflow asks of a strategy: the nodes' instructions (``configure_fit``), and the sum's
    delivery (``aggregate_fit``)."""

    def __init__(self, instructions: dict[int, FitIns], grid: object) -> None:
        self.instructions, self.grid = instructions, grid
        self.results: list[tuple[GridClientProxy, FitRes]] | None = None

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: object
    ) -> list[tuple[GridClientProxy, FitIns]]:
        return [(GridClientProxy(node, self.grid, 0), fitins) for node, fitins in self.instructions.items()]

    def aggregate_fit(self, server_round: int, results: list, failures: list) -> tuple[None, dict]:
        self.results = results
        return None, {}


def secure_sum(
    grid: object,
    settings: SecureAggregation,
    inputs: Mapping[int, Sequence[int]],
    run: int,
    round_index: int,
    timeout: float,
) -> SecureSum:
    """Σ_k s_k of the nodes' inputs through Flower's SecAgg+ workflow: ``inputs`` maps each taking part node to the
    clients
    whose kept weighted updates it adds (none: it adds zeros). The workflow returns the mean of the inputs it holds
    (every weight 1); times their number, that is the sum."""
    observed = _Observed(grid)
    instructions = {
        node: FitIns(
            Parameters([], ""),
            {
                "run": run,
                "round": round_index,
                "clients": ",".join(map(str, clients)),
                "clipping-range": settings.clipping_range,
            },
        )
        for node, clients in inputs.items()
    }
    strategy = _Inputs(instructions, observed)
    state = RecordDict(
        {
            MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: round_index + 1}),
            MAIN_PARAMS_RECORD: ArrayRecord(),
        }
    )
    context = LegacyContext(Context(run_id=0, node_id=0, node_config={}, state=state, run_config={}), strategy=strategy)
    settings.workflow(timeout)(observed, context)
    if not strategy.results:
        return SecureSum(None, frozenset(), observed.errors, observed.up, observed.down)
    nodes = frozenset(proxy.node_id for proxy, _ in strategy.results)
    (mean,) = parameters_to_ndarrays(strategy.results[0][1].parameters)
    return SecureSum(mean * len(nodes), nodes, observed.errors, observed.up, observed.down)


def rescaling(sent: np.ndarray, kept: np.ndarray) -> float | None:
    """ρ with ``kept`` = ρ·``sent`` (the ν_i the method gives the members that remain, against those they were sent), or
    None
    where no single factor fits (then the secure sum cannot be turned into the method's aggregate)."""
    rho = float(kept.sum() / sent.sum()) if sent.sum() else 1.0
    return rho if np.allclose(kept, rho * sent, rtol=1e-12, atol=0.0) else None


# -- the strategy's secure rounds ---------------------------------------------------------------------------


class SecureRounds:
    """The strategy's aggregation through SecAgg+ (``secure``): on its server half (``half``), ``nodes``, ``run``
    and ``round_timeout``."""

    def _secure_result(
        self, server_round: int, state: _OpenRound, keep: np.ndarray, decoded: dict[int, Reply]
    ) -> tuple[np.ndarray, ClientResult | None, dict[str, float]]:
        """The round's aggregate through SecAgg+ (:func:`secure_sum`) over the nodes of the members that answered
        (``keep``), with a node without members where only one node has any: the members whose node's input is in the
        sum stay, and their aggregate is d = ρ·Σ_k s_k (ρ: their weights ν_i over the ν_i they were sent,
        :func:`rescaling`)."""
        rnd, half = state.rnd, self.half
        inputs: dict[int, list[int]] = {}
        for client in sorted({int(i) for i in rnd.cohort[keep]}):
            inputs.setdefault(self.nodes[client], []).append(client)
        for node in sorted(self._run_nodes() - set(inputs))[: max(0, 2 - len(inputs))]:
            inputs[node] = []
        summed = secure_sum(state.grid, self.secure, inputs, self.run.index, rnd.index, self.round_timeout)
        for node, error in summed.errors:
            if int(error.code) not in UNANSWERED:
                raise FederationError(
                    f"node {node} failed the secure aggregation of round {server_round}: {error.reason}"
                )
        extras = sum_metrics(summed)
        if summed.total is None:
            self._log(
                f"round {server_round}: SecAgg+ halted (too few nodes answered for reconstruction-threshold): every "
                "member dropped, the model is not changed"
            )
            return np.zeros_like(keep), None, extras
        limit = len(summed.nodes) * self.secure.clipping_range + self.secure.tolerance(len(summed.nodes))
        if not np.all(np.abs(summed.total) <= limit):  # inputs in [−c, c] cannot sum beyond: a malformed masked input
            raise FederationError(
                f"round {server_round}: the SecAgg+ sum of {len(summed.nodes)} node(s) has entries beyond "
                f"±{limit:g}: a node sent a malformed masked input"
            )
        keep = keep & np.array([self.nodes[int(i)] in summed.nodes for i in rnd.cohort], dtype=bool)
        kept = keep_members(rnd, keep)
        rho = rescaling(state.weights[keep], half.method.sum_weights(kept))
        if rho is None:
            raise FederationError(
                f"round {server_round}: the method's weights of the members that remain are not one multiple of "
                "those they were sent; the secure sum cannot be rescaled"
            )
        result = self._result(kept, {c: decoded[c] for c in np.unique(kept.cohort).tolist()})
        result.payload = {"delta_sum": torch.from_numpy(rho * summed.total).to(half.device, half.dtype)}
        return keep, result, extras

    def _run_nodes(self) -> set[int]:
        """The nodes hosting clients of this run (a node of the app may host only clients of a larger run)."""
        return {node for client, node in self.nodes.items() if client < self.half.data.num_clients}
