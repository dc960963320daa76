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
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from fedshuffle.core.errors import ConfigError
from fedshuffle.core.io import write_atomic

JOURNAL, APPLIED = "journal.npz", "applied"


class ClientStateStore:
    """Named per-client vectors (``fields``: name → length) for ``num_clients`` clients."""

    def __init__(self, num_clients: int, fields: Mapping[str, int], dtype: torch.dtype = torch.float64, memory_limit: int = 1 << 30, directory: str | Path | None = None) -> None:
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
        self.directory = Path(directory) if directory is not None else Path(tempfile.mkdtemp(prefix="fedshuffle-state-"))
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.arrays = {name: self._open(name, dim) for name, dim in self.fields.items()}
        except OSError as exc:
            raise ConfigError("run.state_dir", f"cannot create client state files in {self.directory} ({exc.strerror or exc})") from None
        self.dirty: dict[str, dict[int, np.ndarray]] = {name: {} for name in self.fields}

    def _open(self, name: str, dim: int) -> np.memmap:
        path = self.directory / f"{name}.bin"
        size = self.num_clients * dim * self.np_dtype.itemsize
        with open(path, "ab") as fh:  # a sparse file of the full size: untouched rows take no disk or memory
            if fh.tell() < size:
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
            return {"tag": self.tag, "created": self.created.copy(), "arrays": {k: v.copy() for k, v in self.arrays.items()}}
        buf = io.BytesIO()
        rows = {}
        for name, dirty in self.dirty.items():
            rows[f"{name}.clients"] = np.fromiter(dirty, dtype=np.int64, count=len(dirty))
            rows[f"{name}.rows"] = np.stack(list(dirty.values())) if dirty else np.zeros((0, self.fields[name]), dtype=self.np_dtype)
        np.savez(buf, __tag__=np.array(self.tag), **rows)
        write_atomic(self.directory / JOURNAL, buf.getvalue())
        return {"tag": self.tag, "created": self.created.copy(), "directory": str(self.directory)}

    def commit(self) -> None:
        """After ``checkpoint.pt`` is written: apply the journal to the mapped files."""
        if not self.mapped:
            return
        self._apply_journal(self.tag)
        self.dirty = {name: {} for name in self.fields}

    def _write_rows(self, name: str, dim: int, clients: np.ndarray, rows: np.ndarray) -> None:
        """Rows into the state file with positioned writes, then fsync (cheaper than faulting in mapped pages)."""
        width = dim * self.np_dtype.itemsize
        fd = os.open(self.directory / f"{name}.bin", os.O_WRONLY)
        try:
            for client, row in zip(clients.tolist(), np.ascontiguousarray(rows, dtype=self.np_dtype)):
                os.pwrite(fd, row.tobytes(), client * width)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _apply_journal(self, tag: int) -> None:
        journal = self.directory / JOURNAL
        if not journal.exists():
            return
        with np.load(journal) as saved:
            if int(saved["__tag__"]) != tag:
                journal.unlink()  # written after the checkpoint we resume from: discard
                return
            for name, dim in self.fields.items():
                self._write_rows(name, dim, saved[f"{name}.clients"], saved[f"{name}.rows"])
        write_atomic(self.directory / APPLIED, str(tag))
        journal.unlink()

    def load_state_dict(self, state: Mapping) -> None:
        self.tag, self.created = int(state["tag"]), np.array(state["created"], dtype=bool)
        if not self.mapped:
            for name, array in state["arrays"].items():
                self.arrays[name][...] = array
            return
        if Path(state["directory"]).resolve() != self.directory.resolve():
            raise ConfigError("run.state_dir", f"the checkpoint's client state is in {state['directory']}, not {self.directory}")
        applied = (self.directory / APPLIED).read_text() if (self.directory / APPLIED).exists() else "0"
        self.dirty = {name: {} for name in self.fields}
        if int(applied) != self.tag:
            self._apply_journal(self.tag)
        elif (self.directory / JOURNAL).exists():
            os.unlink(self.directory / JOURNAL)
