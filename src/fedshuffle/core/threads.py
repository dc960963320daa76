"""PyTorch's operator threads for a block of code."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def operator_threads(count: int) -> Iterator[None]:
    """Run the block with ``count`` intra-op threads (``torch.set_num_threads``), restoring the setting after it.

    One thread suits work made of small operations, and code that runs its own threads: a small dense
    eigendecomposition took 4 ms on one thread and 5 ms to 8 s on two while another process kept the
    cores busy (each parallel call waits for the scheduler to run all its threads).
    """
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
