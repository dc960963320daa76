"""The messages between the fedshuffle strategy and its ClientApps (Flower's Message API).

Four exchanges, each its own message type (with ``secure-aggregation``, Flower's SecAgg+ workflow adds its own
stages after ``train``: :mod:`~fedshuffle.integrations.flower.secagg`):

* ``query.fedshuffle`` (handshake): the server asks every node for the clients it hosts, the number of
  partitions it was told, each client's dataset size and rows' digest, the fingerprint of the run it would execute
  and the fedshuffle version it runs (a node of another version is refused before training). The server asks again,
  at the start of a round, every node id it has not seen: a node that re-joined takes its clients back.
* ``query.evaluate`` (federated evaluation, when the nodes bring their data): the model, the clients and their
  weights w_i; the node returns its share of Σ_i w_i f_i(x), of ∇f(x), and its correct predictions.
* ``train.gradients`` (FedShuffleMVR's extra exchange): points x^r, x^{r−1}; the node returns ∇f_i there.
* ``train`` (a round): the broadcast (model, control variate, momentum, …), the member's exact plans
  (minibatch rows in its own numbering, η_i, τ_i, ‖a_i‖₁), the round's step-size factor and the last
  round whose update the server accepted from this client; the node returns the payload (Δ_i, Δc_i, …).

Tensors travel as NumPy arrays in ArrayRecords (bit-exact); scalars in ConfigRecords. The server reads
every reply through :func:`checked_tensors` and :func:`checked_int` / :func:`checked_float`: an array
of another dtype, shape or with a non-finite entry, a missing or extra entry, or a count out of its
range raises :class:`InvalidReply` naming the entry, and nothing is cast.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from importlib import metadata

import numpy as np
import torch

#: the Flower releases this integration supports, as (major, minor): at least the first, below the second. The node
#: worker (:mod:`.worker`) runs Flower's ClientApp runtime from its internals, which change between minor releases.
FLOWER_SUPPORTED = ((1, 41), (1, 42))
FLOWER_RANGE = f">={FLOWER_SUPPORTED[0][0]}.{FLOWER_SUPPORTED[0][1]},<{FLOWER_SUPPORTED[1][0]}.{FLOWER_SUPPORTED[1][1]}"


class UnsupportedFlower(ImportError):
    """The installed Flower is outside :data:`FLOWER_SUPPORTED`."""


def check_flower_version(installed: str) -> None:
    """Refuse, in one line (:class:`UnsupportedFlower`), a Flower release outside :data:`FLOWER_SUPPORTED`."""
    match = re.match(r"(\d+)\.(\d+)", installed)
    if match is None or not FLOWER_SUPPORTED[0] <= (int(match[1]), int(match[2])) < FLOWER_SUPPORTED[1]:
        raise UnsupportedFlower(
            f"fedshuffle's Flower integration supports Flower {FLOWER_RANGE} (its node worker "
            f"uses Flower's internals), not the installed {installed}: "
            f"pip install 'flwr[simulation]{FLOWER_RANGE}'"
        )


try:
    check_flower_version(metadata.version("flwr"))
    from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType
except (ImportError, metadata.PackageNotFoundError) as exc:  # pragma: no cover - depends on the environment
    if isinstance(exc, UnsupportedFlower):
        raise
    raise ModuleNotFoundError(
        "fedshuffle's Flower integration needs Flower: pip install 'fedshuffle[flower]' (Python >= 3.11)"
    ) from exc

from fedshuffle.local.plan import ClientPlan

HANDSHAKE = f"{MessageType.QUERY}.fedshuffle"
EVALUATE = f"{MessageType.QUERY}.evaluate"
GRADIENTS = f"{MessageType.TRAIN}.gradients"
TRAIN = MessageType.TRAIN

#: error codes of fedshuffle's own error replies (Flower's own codes are below 100)
STATE_LOST = 4101
WRONG_RUN = 4102

#: Flower's error codes for a message or node that did not answer in time: the member's work is unfinished
UNANSWERED = {3: "message unavailable", 4: "reply unavailable", 5: "node unavailable", 8: "client app crashed"}


class InvalidReply(ValueError):
    """A node's reply that is not what the server asked for; the message names the entry and what was expected."""


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype a tensor of ``dtype`` travels as."""
    return torch.empty(0, dtype=dtype).numpy().dtype


def checked_tensors(
    record: object, names: Sequence[str], shape: tuple[int, ...], dtype: torch.dtype, where: str
) -> dict[str, torch.Tensor]:
    """The arrays ``names`` of ``record`` (an ArrayRecord ``where`` names), each exactly ``dtype`` and ``shape`` and
    finite, as tensors; no other entry may be there. Anything else raises :class:`InvalidReply` (nothing is cast)."""
    if not isinstance(record, ArrayRecord):
        raise InvalidReply(f"{where}: expected arrays, got {type(record).__name__}")
    got, wanted = set(record.keys()), set(names)
    if got != wanted:
        missing, extra = sorted(wanted - got), sorted(got - wanted)
        raise InvalidReply(
            f"{where}: expected the arrays {sorted(wanted)}"
            + (f", missing {missing}" if missing else "")
            + (f", unexpected {extra[:5]}" if extra else "")
        )
    expected_dtype, out = numpy_dtype(dtype), {}
    for name in names:
        entry = record[name]
        if not isinstance(entry, Array) or str(entry.dtype) != expected_dtype.name or tuple(entry.shape) != shape:
            described = (
                f"dtype {entry.dtype}, shape {tuple(entry.shape)}" if isinstance(entry, Array) else type(entry).__name__
            )
            raise InvalidReply(f"{where}.{name}: expected dtype {expected_dtype.name}, shape {shape}, got {described}")
        try:
            array = entry.numpy()
        except (TypeError, ValueError, OSError, EOFError) as exc:
            raise InvalidReply(f"{where}.{name}: not a readable NumPy array ({type(exc).__name__})") from None
        if array.dtype != expected_dtype or array.shape != shape:  # the bytes, not only the header Flower sent
            raise InvalidReply(
                f"{where}.{name}: expected dtype {expected_dtype.name}, shape {shape}, its data has dtype "
                f"{array.dtype}, shape {array.shape}"
            )
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
        if bad:
            raise InvalidReply(f"{where}.{name}: {bad} non-finite entr{'y' if bad == 1 else 'ies'} (NaN or infinity)")
        out[name] = torch.from_numpy(np.array(array))
    return out


def checked_int(record: Mapping, key: str, low: int, high: int, where: str) -> int:
    """Integer ``record[key]`` in ``low..high`` (a bool is not an integer); else :class:`InvalidReply`."""
    value = record.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise InvalidReply(f"{where}.{key}: expected an integer in {low}..{high}, got {value!r}"[:300])
    return value


def checked_float(record: Mapping, key: str, where: str) -> float:
    """Finite number ``record[key]``; else :class:`InvalidReply`."""
    value = record.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise InvalidReply(f"{where}.{key}: expected a finite number, got {value!r}"[:300])
    return float(value)


def tensors_record(tensors: Mapping[str, torch.Tensor]) -> ArrayRecord:
    """Named tensors as an ArrayRecord of NumPy arrays (dtype and bytes kept)."""
    return ArrayRecord({name: Array(np.ascontiguousarray(t.detach().cpu().numpy())) for name, t in tensors.items()})


def record_tensors(
    record: ArrayRecord, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """An ArrayRecord back as named tensors (cast to ``dtype`` when given)."""
    out = {}
    for name, array in record.items():
        t = torch.from_numpy(np.array(array.numpy()))
        out[name] = t.to(device=device, dtype=dtype if dtype is not None and t.is_floating_point() else t.dtype)
    return out


def plans_records(plans: Sequence[ClientPlan]) -> tuple[ConfigRecord, ArrayRecord]:
    """One client's plans (one per occurrence in the cohort): scalars, and the minibatch rows."""
    config = ConfigRecord(
        {
            "members": len(plans),
            "lr": [float(p.lr) for p in plans],
            "planned-steps": [int(p.planned_steps) for p in plans],
            "a-l1": [float(p.a_l1) for p in plans],
        }
    )
    return config, ArrayRecord(
        {f"batches.{k}": Array(np.ascontiguousarray(p.batches, dtype=np.int64)) for k, p in enumerate(plans)}
    )


def records_plans(
    client: int, config: ConfigRecord, batches: ArrayRecord, seed: int, round_index: int
) -> list[ClientPlan]:
    """The plans :func:`plans_records` encoded, for ``client`` in round ``round_index`` of the run of ``seed``: the k-th
    is the
    client's occurrence k in the cohort, so its stream key is (seed, round, client, k), as the server's planner set
    it."""
    members = int(config["members"])
    return [
        ClientPlan(
            client,
            np.array(batches[f"batches.{k}"].numpy(), dtype=np.int64),
            float(config["lr"][k]),
            int(config["planned-steps"][k]),
            float(config["a-l1"][k]),
            (seed, round_index, client, k),
        )
        for k in range(members)
    ]
