"""Every fedshuffle method as a Flower app (``pip install 'fedshuffle[flower]'``, Python ≥ 3.11).

* :class:`~.strategy.FedShuffleStrategy`: the server half of a run (fedshuffle's samplers and seeded
  streams, the simulation's plans, aggregation and server optimizer) as a Flower ``Strategy``.
* :func:`~.app.server_app`, :func:`~.app.client_app`: a fedshuffle experiment as a ServerApp and a
  ClientApp (the client half for the clients a node hosts, client state kept across rounds).
* :func:`~.app.simulate`: both on Flower's simulation engine, with Ray bound to 127.0.0.1.
* :func:`~.bundle.write_app` (``fedshuffle flower-app CONFIG DIR``): a ready Flower App folder for ``flwr run``.
* :func:`~.nodedata.write_node_folders` (``fedshuffle flower-split CONFIG --nodes K --out DIR``): each node's own data
  folder.

Only :mod:`.bundle`, :mod:`.common` and :mod:`.nodedata` work without Flower installed.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "FedShuffleStrategy": "strategy",
    "ServerHalf": "strategy",
    "FederationError": "strategy",
    "ClientStateLost": "strategy",
    "server_app": "app",
    "client_app": "app",
    "simulate": "app",
    "write_app": "bundle",
    "AppSettings": "common",
    "FederatedRun": "common",
    "write_node_folders": "nodedata",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)


__all__ = sorted(_EXPORTS)
