"""Per-client state for methods whose clients remember things between rounds (SCAFFOLD, FedCDR).

A client's rows are created when it first takes part, so memory follows the clients that have
participated, never the population. Small populations keep their state in arrays; beyond
``memory_limit`` bytes (n × Σ field sizes × itemsize) it goes to memory-mapped files, which the
operating system allocates only where rows are written (sparse files).

Checkpoints are consistent with the run's ``checkpoint.pt``, and are saved in three steps:

* **In memory:** the arrays go into the checkpoint itself.
* **Memory-mapped:** rows changed since the last checkpoint are held in memory, and a checkpoint
  1. writes them to a journal file,
  2. lets the runner write ``checkpoint.pt``,
  3. then applies the journal to the mapped files (:meth:`commit`).

  A run killed anywhere in between resumes from ``checkpoint.pt`` and replays or discards the
  journal, so the files always match the checkpoint.

  The checkpoint also holds a checksum of every written row (h(row) = Σ_j m_j·u_j mod 2⁶⁴ over the
  row's bit patterns u_j with fixed odd multipliers m_j, so any one changed word changes it); on
  resume the rows are checked against them, and a state file that was truncated, deleted or
  changed is an error naming it instead of a run continuing from other numbers. The checkpoint
  stores no paths: the store's folder is where the run folder is now.

The journal is read with ``allow_pickle=False`` and the state files are opened without following
links and only when they are regular files, so a hostile folder can neither run code nor make the
store write outside it.
"""

from __future__ import annotations

import errno
import functools
import io
import os
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from fedshuffle.core.errors import ConfigError, ResultsError
from fedshuffle.core.io import open_regular, read_regular, read_text, write_atomic

JOURNAL, APPLIED = "journal.npz", "applied"
_CHUNK = 4096  # rows hashed at a time


@functools.lru_cache(maxsize=8)
def _multipliers(width: int) -> np.ndarray:
    return np.random.default_rng(0x5EED).integers(1, 2**62, width, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def row_hashes(rows: np.ndarray) -> np.ndarray:
    """h(row) = Σ_j m_j·u_j mod 2⁶⁴ for each row of a 2-D float array (u_j: the bit pattern of entry j)."""
    rows = np.ascontiguousarray(rows)
    words = rows.view(np.uint64 if rows.dtype.itemsize == 8 else np.uint32)
    multipliers = _multipliers(words.shape[1])
    out = np.empty(len(rows), dtype=np.uint64)
    for start in range(0, len(rows), _CHUNK):
        block = words[start : start + _CHUNK].astype(np.uint64)
        out[start : start + _CHUNK] = (block * multipliers).sum(axis=1, dtype=np.uint64)
    return out


class ClientStateStore:
    """Named per-client vectors (``fields``: name → length) for ``num_clients`` clients."""

    def __init__(
        self,
        num_clients: int,
        fields: Mapping[str, int],
        dtype: torch.dtype = torch.float64,
        memory_limit: int = 1 << 30,
        directory: str | Path | None = None,
    ) -> None:
        if not fields:
            raise ValueError("a client state needs at least one field")
        self.num_clients, self.fields, self.dtype = num_clients, dict(fields), dtype
        self.np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
        total = num_clients * sum(self.fields.values()) * self.np_dtype.itemsize
        self.mapped = total > memory_limit
        self.created = np.zeros(num_clients, dtype=bool)
        self.tag = 0
        if not self.mapped:
            self.arrays = {name: np.zeros((num_clients, dim), dtype=self.np_dtype) for name, dim in self.fields.items()}
            return
        self.directory = (
            Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="fedshuffle-state-"))
        )
        try:
            if self.directory.is_symlink():
                raise OSError(
                    errno.ELOOP, "a symbolic link, which a results folder never holds; remove it", str(self.directory)
                )
            self.directory.mkdir(parents=True, exist_ok=True)
            self.arrays = {name: self._open(name, dim) for name, dim in self.fields.items()}
        except OSError as exc:
            where = exc.filename or self.directory
            raise ResultsError(
                f"cannot create client state files in {self.directory} ({where}: {exc.strerror or exc})"
            ) from None
        self.dirty: dict[str, dict[int, np.ndarray]] = {name: {} for name in self.fields}
        self.hashes = {name: np.zeros(num_clients, dtype=np.uint64) for name in self.fields}

    def _open(self, name: str, dim: int) -> np.memmap:
        path = self.directory / f"{name}.bin"
        size = self.num_clients * dim * self.np_dtype.itemsize
        with os.fdopen(
            open_regular(path, os.O_RDWR | os.O_CREAT), "r+b"
        ) as fh:  # a sparse file of the full size: untouched rows take no disk or memory
            if os.fstat(fh.fileno()).st_size < size:
                fh.truncate(size)
        return np.memmap(path, dtype=self.np_dtype, mode="r+", shape=(self.num_clients, dim))

    @property
    def resident_bytes(self) -> int:
        """Bytes of state held in memory (arrays, or rows waiting for the next checkpoint)."""
        if not self.mapped:
            return sum(a.nbytes for a in self.arrays.values())
        return sum(row.nbytes for rows in self.dirty.values() for row in rows.values())

    # -- rows -------------------------------------------------------------------------------------------

    def get(self, name: str, clients: np.ndarray, device: str | torch.device = "cpu") -> torch.Tensor:
        """Rows of ``clients`` (zeros for clients never written), as a ``(C, dim)`` tensor."""
        clients = np.asarray(clients)
        rows = np.zeros((len(clients), self.fields[name]), dtype=self.np_dtype)
        seen = self.created[clients]
        if seen.any():  # never-written rows are zeros: no read (no page fault) for them
            rows[seen] = self.arrays[name][clients[seen]]
        if self.mapped and self.dirty[name]:
            dirty = self.dirty[name]
            for k, i in enumerate(clients.tolist()):
                if i in dirty:
                    rows[k] = dirty[i]
        return torch.from_numpy(rows).to(device)

    def set(self, name: str, clients: np.ndarray, values: torch.Tensor) -> None:
        """Write rows; a client repeated in ``clients`` keeps its last row."""
        values = values.detach().to("cpu", self.dtype).numpy()
        if not self.mapped:
            self.arrays[name][np.asarray(clients)] = values
        else:
            for i, row in zip(np.asarray(clients).tolist(), values):
                self.dirty[name][i] = row.copy()
        self.created[np.asarray(clients)] = True

    # -- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        self.tag += 1
        if not self.mapped:
            return {
                "tag": self.tag,
                "created": self.created.copy(),
                "arrays": {k: v.copy() for k, v in self.arrays.items()},
            }
        buf = io.BytesIO()
        rows = {}
        for name, dirty in self.dirty.items():
            rows[f"{name}.clients"] = np.fromiter(dirty, dtype=np.int64, count=len(dirty))
            rows[f"{name}.rows"] = (
                np.stack(list(dirty.values())) if dirty else np.zeros((0, self.fields[name]), dtype=self.np_dtype)
            )
            self.hashes[name][rows[f"{name}.clients"]] = row_hashes(
                rows[f"{name}.rows"]
            )  # the rows as they will be once committed
        np.savez(buf, __tag__=np.array(self.tag), **rows)
        write_atomic(self.directory / JOURNAL, buf.getvalue())
        written = np.flatnonzero(self.created)
        return {
            "tag": self.tag,
            "created": self.created.copy(),
            "hashes": {name: h[written] for name, h in self.hashes.items()},
        }

    def commit(self) -> None:
        """After ``checkpoint.pt`` is written: apply the journal to the mapped files."""
        if not self.mapped:
            return
        self._apply_journal(self.tag)
        self.dirty = {name: {} for name in self.fields}

    def _write_rows(self, name: str, dim: int, clients: np.ndarray, rows: np.ndarray) -> None:
        """Rows into the state file with positioned writes, then fsync (cheaper than faulting in mapped pages)."""
        width = dim * self.np_dtype.itemsize
        fd = open_regular(self.directory / f"{name}.bin", os.O_WRONLY)
        try:
            for client, row in zip(clients.tolist(), np.ascontiguousarray(rows, dtype=self.np_dtype)):
                os.pwrite(fd, row.tobytes(), client * width)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _apply_journal(self, tag: int) -> None:
        """Write the journal's rows into the state files, if the journal belongs to checkpoint ``tag``."""
        journal = self.directory / JOURNAL
        try:
            with np.load(io.BytesIO(read_regular(journal)), allow_pickle=False) as saved:
                if int(saved["__tag__"]) != tag:
                    raise ConfigError(
                        str(journal),
                        f"belongs to another checkpoint than checkpoint.pt ({tag}); the run cannot be continued: "
                        "start it again in another folder",
                    )
                entries = {name: (saved[f"{name}.clients"], saved[f"{name}.rows"]) for name in self.fields}
        except FileNotFoundError:
            raise ConfigError(
                str(journal),
                f"missing: the client state files are older than checkpoint.pt ({tag}); the run cannot be continued: "
                "start it again in another folder",
            ) from None
        except (ValueError, KeyError, EOFError, OSError, zipfile.BadZipFile) as exc:
            raise ConfigError(
                str(journal),
                f"damaged client-state journal ({exc.__class__.__name__}); the run cannot be continued: start it "
                "again in another folder",
            ) from None
        for name, (clients, rows) in entries.items():
            self._write_rows(name, self.fields[name], clients, rows)
        write_atomic(self.directory / APPLIED, str(tag))
        journal.unlink()

    def load_state_dict(self, state: Mapping) -> None:
        self.tag, self.created = int(state["tag"]), np.array(state["created"], dtype=bool)
        if len(self.created) != self.num_clients:
            raise ConfigError(
                "checkpoint.pt",
                f"the checkpoint's client state is for {len(self.created)} clients, the run has {self.num_clients}",
            )
        if not self.mapped:
            if "arrays" not in state:
                raise ConfigError(
                    "run.state_memory_mb",
                    "the checkpoint keeps client state in files, this run keeps it in memory: give the "
                    "state_memory_mb it was run with",
                )
            for name, array in state["arrays"].items():
                self.arrays[name][...] = array
            return
        if "hashes" not in state:
            raise ConfigError(
                "run.state_memory_mb",
                "the checkpoint keeps client state in memory, this run keeps it in files: give the state_memory_mb "
                "it was run with",
            )
        applied_path, journal = self.directory / APPLIED, self.directory / JOURNAL
        try:
            applied = int(read_text(applied_path)) if applied_path.exists() else 0
        except (ValueError, OSError, UnicodeDecodeError):
            raise ConfigError(
                str(applied_path),
                "damaged (expected the number of the last applied checkpoint); the run cannot be continued: start it "
                "again in another folder",
            ) from None
        self.dirty = {name: {} for name in self.fields}
        if applied != self.tag:
            self._apply_journal(self.tag)
        elif journal.exists():
            os.unlink(journal)
        written = np.flatnonzero(self.created)
        for name in self.fields:
            self.hashes[name] = np.zeros(self.num_clients, dtype=np.uint64)
            self.hashes[name][written] = state["hashes"][name]
            self._verify(name, written)

    def _verify(self, name: str, clients: np.ndarray) -> None:
        """Every written row of ``name`` against its checksum in the checkpoint."""
        path = self.directory / f"{name}.bin"
        bad = 0
        for start in range(0, len(clients), _CHUNK):
            block = clients[start : start + _CHUNK]
            bad += int(np.count_nonzero(row_hashes(np.asarray(self.arrays[name][block])) != self.hashes[name][block]))
        if bad:
            raise ConfigError(
                str(path),
                f"{bad} of {len(clients)} client rows do not match their checksums in checkpoint.pt (the file was "
                "truncated, deleted or changed); "
                "the run cannot be continued: restore the file or start the run again in another folder",
            )
