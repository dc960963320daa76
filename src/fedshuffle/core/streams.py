"""Named, executor-independent random streams.

Every random choice of a run (which clients take part, how each client orders its data, how many
epochs it runs, whether it stops early, the differential-privacy noise) is drawn from its own generator keyed by
``(seed, stream, round, client)``. No generator is shared between clients or rounds, so the numbers
do not depend on the order in which an executor visits clients, on how a cohort is split into
chunks, or on where a resumed run restarts.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Stream(IntEnum):
    """Identifiers of the independent random streams of a run."""

    COHORT = 1
    CLIENT_ORDER = 2
    DATA_ORDER = 3
    SHUFFLE_ONCE = 4
    EPOCHS = 5
    UNFINISHED = 6
    INIT = 7
    PARTITION = 8
    LOCAL_NOISE = 9
    CLIENT_PRIVACY = 10  # local DP: a member's Gaussian noise, keyed (round, client, occurrence)
    SERVER_PRIVACY = 11  # central DP: the aggregate's noise (round, 0) and adaptive clipping's count noise (round, 1)


def generator(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """A NumPy generator for ``stream`` at ``keys`` (e.g. round and client) of run ``seed``."""
    if seed < 0 or any(k < 0 for k in keys):
        raise ValueError(f"seed and stream keys must be non-negative, got {seed}, {keys}")
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), *map(int, keys)]))


def step_seed(key: tuple[int, ...], step: int) -> int:
    """Seed of the random numbers inside one local step (dropout masks) of the client whose plan has
    stream ``key`` = (seed, round, client, occurrence): the same on every executor."""
    seed, *keys = key
    return int(
        np.random.SeedSequence([int(seed), int(Stream.LOCAL_NOISE), *map(int, keys), int(step)]).generate_state(
            1, np.uint64
        )[0]
        >> np.uint64(1)
    )


# -- many generators of one stream at once --------------------------------------------------------
#
# ``generator`` costs tens of microseconds (a SeedSequence, a PCG64 and a Generator per call): at
# batch-1 convex sizes, more than the client's whole local work. ``generators`` gives the same
# generators for many keys: NumPy's SeedSequence hash (numpy/random/bit_generator.pyx) computed for
# all keys at once with uint32 array arithmetic, PCG64's seeding (pcg64.c, pcg_setseq_128_srandom_r)
# on Python integers, and one Generator whose state is set to each in turn.

_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_L, _MIX_R, _POOL = 0xCA01F9DD, 0x4973F715, 4
_PCG_MULT_HIGH, _PCG_MULT_LOW = 2549297995355413924, 4865540595714422341
_PCG_MULT = (_PCG_MULT_HIGH << 64) + _PCG_MULT_LOW
_MASK128 = (1 << 128) - 1


def _hashmix(values: np.ndarray, hash_const: list[np.uint32]) -> np.ndarray:
    values = values ^ hash_const[0]
    hash_const[0] = np.uint32((int(hash_const[0]) * _MULT_A) & 0xFFFFFFFF)
    values = values * hash_const[0]
    return values ^ (values >> np.uint32(16))


def _mix(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    result = np.uint32(_MIX_L) * x - np.uint32(_MIX_R) * y
    return result ^ (result >> np.uint32(16))


def _pcg64_states(entropy: np.ndarray) -> list[tuple[int, int]]:
    """(state, inc) of ``PCG64(SeedSequence(row))`` for each row of 32-bit entropy words."""
    with np.errstate(over="ignore"):
        words = entropy.astype(np.uint32)
        if words.shape[1] < _POOL:
            words = np.concatenate([words, np.zeros((words.shape[0], _POOL - words.shape[1]), np.uint32)], axis=1)
        hash_const = [np.uint32(_INIT_A)]
        mixer = [_hashmix(words[:, i], hash_const) for i in range(_POOL)]
        for src in range(_POOL):
            for dst in range(_POOL):
                if src != dst:
                    mixer[dst] = _mix(mixer[dst], _hashmix(mixer[src], hash_const))
        for src in range(_POOL, words.shape[1]):
            for dst in range(_POOL):
                mixer[dst] = _mix(mixer[dst], _hashmix(words[:, src], hash_const))
        h = np.uint32(_INIT_B)
        out = []
        for i in range(8):  # generate_state(4, uint64): eight 32-bit words, cycling over the pool
            value = mixer[i % _POOL] ^ h
            h = np.uint32((int(h) * _MULT_B) & 0xFFFFFFFF)
            value = value * h
            out.append((value ^ (value >> np.uint32(16))).astype(np.uint64))
    seeds = [(out[2 * k + 1] << np.uint64(32)) | out[2 * k] for k in range(4)]  # little-endian pairs of words
    states = []
    for s0, s1, i0, i1 in zip(*(s.tolist() for s in seeds)):
        initstate, initseq = (s0 << 64) | s1, (i0 << 64) | i1
        inc = ((initseq << 1) | 1) & _MASK128
        state = ((inc + initstate) * _PCG_MULT + inc) & _MASK128  # state = 0; step (state = inc); += initstate; step
        states.append((state, inc))
    return states


def generators(seed: int, stream: Stream, keys: np.ndarray):
    """``generator(seed, stream, *row)`` for each row of ``keys`` ``(n, k)``, in order, as one Generator whose state
    is reset for each row: use each before asking for the next. Keys below 2³² (one entropy word each)."""
    keys = np.asarray(keys, dtype=np.int64).reshape(len(keys), -1)
    if seed < 0 or (keys.size and keys.min() < 0):
        raise ValueError(f"seed and stream keys must be non-negative, got {seed}, {keys.min()}")
    if seed >= 2**32 or (keys.size and keys.max() >= 2**32):  # several entropy words per key: the general path
        for row in keys.tolist():
            yield generator(seed, stream, *row)
        return
    entropy = np.concatenate([np.full((len(keys), 2), [seed, int(stream)], dtype=np.int64), keys], axis=1)
    bit_generator = np.random.PCG64(0)
    rng = np.random.Generator(bit_generator)
    for state, inc in _pcg64_states(entropy):
        bit_generator.state = {
            "bit_generator": "PCG64",
            "state": {"state": state, "inc": inc},
            "has_uint32": 0,
            "uinteger": 0,
        }
        yield rng


# -- many permutations of one stream at once --------------------------------------------------------
#
# Planning random reshuffling draws ``rng.permutation(n)`` from each member's generator, once per epoch. At batch-1
# convex sizes, seeding each generator and calling NumPy per member is most of the planning. ``permutations`` gives
# the same numbers for a whole cohort in one compiled call: the SeedSequence hash and PCG64's seeding as above, then
# PCG64's 128-bit step and XSL-RR output (pcg64.h) on pairs of 64-bit words, its buffered 32-bit draws, and
# ``Generator.shuffle``'s Fisher–Yates with masked rejection (``random_interval``, distributions.c). It is checked
# against NumPy before its first use and not used if they differ (a NumPy release that changes its shuffle): the
# generators' loop then runs.

try:
    import numba
except ImportError:  # the optional dependency: without it, each member's generator
    numba = None


def _njit(function):
    return numba.njit(cache=True)(function) if numba is not None else None


def _times128(high, low, factor_high, factor_low):
    """(high, low) · (factor_high, factor_low) mod 2¹²⁸, on 64-bit words (the low product from 32-bit halves)."""
    half = np.uint64(0xFFFFFFFF)
    a_low, a_high, b_low, b_high = low & half, low >> np.uint64(32), factor_low & half, factor_low >> np.uint64(32)
    p0, p1, p2 = a_low * b_low, a_low * b_high, a_high * b_low
    middle = (p0 >> np.uint64(32)) + (p1 & half) + (p2 & half)
    product_low = (p0 & half) | (middle << np.uint64(32))
    product_high = (
        a_high * b_high
        + (p1 >> np.uint64(32))
        + (p2 >> np.uint64(32))
        + (middle >> np.uint64(32))
        + low * factor_high
        + high * factor_low
    )
    return product_high, product_low


def _plus128(high, low, add_high, add_low):
    """(high, low) + (add_high, add_low) mod 2¹²⁸."""
    total = low + add_low
    return high + add_high + (np.uint64(1) if total < low else np.uint64(0)), total


_times128, _plus128 = _njit(_times128), _njit(_plus128)


def _hashed(value, hash_const, multiplier):
    """SeedSequence's hashmix of one 32-bit word (held in 64 bits), and the hash constant it leaves for the next."""
    low32 = np.uint64(0xFFFFFFFF)
    value ^= hash_const
    hash_const = (hash_const * multiplier) & low32
    value = (value * hash_const) & low32
    return value ^ (value >> np.uint64(16)), hash_const


def _mixed(into, value):
    """SeedSequence's mix of ``value`` into a pool word."""
    mixed = (np.uint64(_MIX_L) * into - np.uint64(_MIX_R) * value) & np.uint64(0xFFFFFFFF)
    return mixed ^ (mixed >> np.uint64(16))


_hashed, _mixed = _njit(_hashed), _njit(_mixed)


def _compiled_states(entropy):
    """``PCG64(SeedSequence(row))``'s (state high, state low, inc high, inc low) for each row of 32-bit words:
    :func:`_pcg64_states` row by row on 32-bit words held in 64-bit integers."""
    multiplier_a, multiplier_b = np.uint64(_MULT_A), np.uint64(_MULT_B)
    out = np.empty((entropy.shape[0], 4), dtype=np.uint64)
    mixer = np.empty(_POOL, dtype=np.uint64)
    words = np.empty(8, dtype=np.uint64)
    for row in range(entropy.shape[0]):
        hash_const = np.uint64(_INIT_A)
        for i in range(_POOL):  # the pool: the first words hashed (zeros past the entropy's end), then mixed together
            mixer[i], hash_const = _hashed(
                np.uint64(entropy[row, i]) if i < entropy.shape[1] else np.uint64(0), hash_const, multiplier_a
            )
        for source in range(_POOL):
            for target in range(_POOL):
                if source != target:
                    hashed, hash_const = _hashed(mixer[source], hash_const, multiplier_a)
                    mixer[target] = _mixed(mixer[target], hashed)
        for i in range(_POOL, entropy.shape[1]):  # a word past the pool: hashed anew for each pool slot
            for target in range(_POOL):
                hashed, hash_const = _hashed(np.uint64(entropy[row, i]), hash_const, multiplier_a)
                mixer[target] = _mixed(mixer[target], hashed)
        hash_const = np.uint64(_INIT_B)
        for i in range(8):  # generate_state(4, uint64)
            words[i], hash_const = _hashed(mixer[i % _POOL], hash_const, multiplier_b)
        seeds = [(words[2 * k + 1] << np.uint64(32)) | words[2 * k] for k in range(4)]
        inc_high = (seeds[2] << np.uint64(1)) | (seeds[3] >> np.uint64(63))
        inc_low = (seeds[3] << np.uint64(1)) | np.uint64(1)
        high, low = _plus128(inc_high, inc_low, seeds[0], seeds[1])  # state = 0; step (state = inc); += initstate; step
        high, low = _times128(high, low, np.uint64(_PCG_MULT_HIGH), np.uint64(_PCG_MULT_LOW))
        out[row, 0], out[row, 1] = _plus128(high, low, inc_high, inc_low)
        out[row, 2], out[row, 3] = inc_high, inc_low
    return out


def _compiled_shuffles(state_words, lengths, repeats, out):
    """For member k: ``repeats[k]`` successive permutations of ``lengths[k]`` from PCG64 state
    ``state_words[k]`` = (state high, state low, inc high, inc low), written one after another into ``out``."""
    multiplier_high, multiplier_low = np.uint64(_PCG_MULT_HIGH), np.uint64(_PCG_MULT_LOW)
    low32 = np.uint64(0xFFFFFFFF)
    at = 0
    for k in range(lengths.shape[0]):
        high, low, inc_high, inc_low = state_words[k, 0], state_words[k, 1], state_words[k, 2], state_words[k, 3]
        buffered, has_buffered = np.uint64(0), False
        n = lengths[k]
        for _ in range(repeats[k]):
            perm = out[at : at + n]
            for i in range(n):
                perm[i] = i
            for i in range(n - 1, 0, -1):
                bound = np.uint64(i)
                mask = bound
                for s in (1, 2, 4, 8, 16, 32):
                    mask |= mask >> np.uint64(s)
                while True:
                    if has_buffered:  # the upper half of the last 64-bit output
                        draw, has_buffered = buffered, False
                    else:  # state ← state·M + inc (mod 2¹²⁸), then XSL-RR: rotr(high ⊕ low, state >> 122)
                        high, low = _times128(high, low, multiplier_high, multiplier_low)
                        high, low = _plus128(high, low, inc_high, inc_low)
                        x, rotation = high ^ low, high >> np.uint64(58)
                        output = (x >> rotation) | (x << ((np.uint64(64) - rotation) & np.uint64(63)))
                        draw, buffered, has_buffered = output & low32, output >> np.uint64(32), True
                    value = draw & mask
                    if value <= bound:
                        break
                j = np.int64(value)
                perm[i], perm[j] = perm[j], perm[i]
            at += n


_compiled_states, _compiled_shuffles = _njit(_compiled_states), _njit(_compiled_shuffles)
_COMPILED_AGREES: bool | None = None


def permutations(seed: int, stream: Stream, keys: np.ndarray, lengths: np.ndarray, repeats: np.ndarray) -> np.ndarray:
    """For each row k of ``keys``: ``repeats[k]`` successive ``permutation(lengths[k])`` of the generator
    ``generator(seed, stream, *keys[k])``, all in one flat int64 array (row after row, each row's in turn)."""
    global _COMPILED_AGREES
    keys = np.asarray(keys, dtype=np.int64).reshape(len(keys), -1)
    lengths, repeats = np.asarray(lengths, dtype=np.int64), np.asarray(repeats, dtype=np.int64)
    if seed < 0 or (keys.size and keys.min() < 0):
        raise ValueError(f"seed and stream keys must be non-negative, got {seed}, {keys.min()}")
    if _COMPILED_AGREES is None:
        _COMPILED_AGREES = numba is not None and _agrees_with_numpy()
    if (
        not _COMPILED_AGREES
        or seed >= 2**32
        or (keys.size and keys.max() >= 2**32)
        or (lengths.size and lengths.max() >= 2**32)
    ):
        drawn = [
            rng.permutation(n)
            for rng, n, r in zip(generators(seed, stream, keys), lengths.tolist(), repeats.tolist())
            for _ in range(r)
        ]
        return np.concatenate(drawn).astype(np.int64, copy=False) if drawn else np.zeros(0, dtype=np.int64)
    return _shuffled(
        np.concatenate([np.full((len(keys), 2), [seed, int(stream)], dtype=np.int64), keys], axis=1), lengths, repeats
    )


def _shuffled(entropy: np.ndarray, lengths: np.ndarray, repeats: np.ndarray) -> np.ndarray:
    out = np.empty(int((lengths * repeats).sum()), dtype=np.int64)
    _compiled_shuffles(_compiled_states(entropy), lengths, repeats, out)
    return out


def _agrees_with_numpy() -> bool:
    """Whether the compiled seeding and shuffles give NumPy's permutations (keys of 2 to 5 words, several in a row)."""
    entropy = np.array([[5, 3, 0, 1, 0], [0, 0, 7, 3, 2], [2**32 - 1, 9, 123, 4567, 1]], dtype=np.int64)
    lengths, repeats = np.array([1, 37, 1000]), np.array([2, 3, 2])
    expected = []
    for row, n, r in zip(entropy.tolist(), lengths.tolist(), repeats.tolist()):
        rng = np.random.default_rng(np.random.SeedSequence(row))
        expected += [rng.permutation(n) for _ in range(r)]
    short = _shuffled(entropy[:1, :2], np.array([50]), np.array([1]))
    return bool(np.array_equal(_shuffled(entropy, lengths, repeats), np.concatenate(expected))) and bool(
        np.array_equal(short, np.random.default_rng(np.random.SeedSequence([5, 3])).permutation(50))
    )
