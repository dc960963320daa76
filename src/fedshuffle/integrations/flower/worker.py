"""One long-lived ClientApp process per SuperNode: ``python -m fedshuffle.integrations.flower.worker``.

A SuperNode started with ``--isolation subprocess`` (Flower's default) starts ``flower-superexec``, which starts a new
``flwr-clientapp`` process for every message: each imports PyTorch and Flower, loads the app and builds the run
(problem, data, client half) again, then exits. With ``--isolation process`` the SuperNode starts nothing and waits
for a process to ask its Runtime API for tasks; this module is that process, and it runs every task itself::

    flower-supernode --isolation process --port 9094 --superlink … --node-config 'data-path="…"'
    python -m fedshuffle.integrations.flower.worker --runtime-api-address 127.0.0.1:9094 --insecure --supernode-pid PID

For each task it does what ``flwr-clientapp`` does (Flower 1.41's ``flwr.supernode.runtime.run_clientapp``): pull the
message, the node's context and the app bundle (FAB), call the ClientApp, push the reply and the context back, sending
the task's heartbeats meanwhile, and an error reply where the ClientApp raises; but it does not exit. The ClientApp is
loaded once per app bundle, and :func:`fedshuffle.integrations.flower.app.client_app` keeps the node runtimes it builds
(:class:`~fedshuffle.integrations.flower.client.NodeRuntime`, keyed by Flower run, run fingerprint, hosted clients and
data folder), so the build is paid once per run, not once per message. Client state stays where it always is: in the
context the SuperNode keeps, or in the node's ``state-dir``.

Tasks are run one at a time, as the SuperNode hands them out (it processes one message at a time). The worker runs
until stopped; with ``--supernode-pid`` it exits when that process (the SuperNode) ends, as ``flwr-clientapp`` does
with its parent.
"""

from __future__ import annotations

import argparse
import sys
import time
from logging import ERROR, INFO

from fedshuffle.integrations.flower import messages  # noqa: F401  isort: skip  (first: refuses an unsupported Flower)
from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.config import get_project_config, get_project_dir
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # pylint: disable=E0611
from flwr.supercore import log
from flwr.supercore.app_utils import start_parent_process_monitor
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

#: seconds between two asks for a task while the node has none (flower-superexec's default is 1 s)
POLL_SECONDS = 0.05


class ClientApps:
    """The ClientApp of each app bundle (FAB hash) this process has run, loaded once.

    Flower loads a ClientApp by importing its module (``fedshuffle_app``); two bundles with the same module name
    would share the first one's module, so the module is imported afresh for a bundle not seen before."""

    def __init__(self) -> None:
        self.apps: dict[str, ClientApp] = {}
        self._load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)

    def get(self, fab_id: str, fab_version: str, fab_hash: str, fab_content: bytes) -> ClientApp:
        if fab_hash not in self.apps:
            install_from_fab(fab_content, skip_prompt=True)
            reference = get_project_config(get_project_dir(fab_id, fab_version, fab_hash))["tool"]["flwr"]["app"][
                "components"
            ]["clientapp"]
            sys.modules.pop(reference.partition(":")[0], None)
            self.apps[fab_hash] = self._load(fab_id, fab_version, fab_hash)
        return self.apps[fab_hash]


def _task_client(address: str, token: str, insecure: bool, certificates: bytes | None) -> RuntimeHttpClient:
    return RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=certificates,
        interceptors=[
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
            RuntimeTokenHttpInterceptor(token),
        ],
        retry_invoker=make_simple_http_retry_invoker(),
    )


def run_task(client: RuntimeHttpClient, apps: ClientApps) -> bool:
    """One task: pull its message and context, answer it with the app's ClientApp, push the reply and context.

    An exception of the ClientApp becomes an error reply (as ``flwr-clientapp`` sends it) and the process goes on.
    Returns whether the task completed."""

    def heartbeat() -> bool:  # flwr-clientapp's interrupts its own process when the task is over; this one must not
        try:
            client.SendTaskHeartbeat(SendTaskHeartbeatRequest())
        except Exception:  # pylint: disable=broad-exception-caught
            return False
        return True

    sender = HeartbeatSender(heartbeat)
    sender.start()
    message = context = reply = None
    status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
    try:
        message, context, run, fab = pull_task_input(client)
        app = apps.get(run.fab_id, run.fab_version, fab.hash_str, fab.content)
        reply = app(message=message, context=context)
        status, details = SubStatus.COMPLETED, ""
    except Exception as exc:  # pylint: disable=broad-exception-caught
        log(ERROR, "ClientApp raised an exception", exc_info=exc)
        code = (
            ErrorCode.LOAD_CLIENT_APP_EXCEPTION
            if isinstance(exc, LoadClientAppError)
            else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
        )
        details = f"{type(exc)}:<'{exc}'>"
        if message is not None:
            reply = Message(Error(code=code, reason=details), reply_to=message)
    finally:
        try:
            if reply is not None and context is not None:
                push_message(client, reply, context)
        finally:
            push_task_output(client=client, context=context, sub_status=status, details=details)
            sender.stop()
    return status == SubStatus.COMPLETED


def serve(address: str, insecure: bool, certificates: bytes | None, max_tasks: int | None = None) -> int:
    """Ask the SuperNode's Runtime API at ``address`` for ClientApp tasks and run them, until stopped (or ``max_tasks``
    were run); returns the number of tasks run."""
    acquirer = RuntimeHttpClient.from_server_address(
        server_address=address,
        insecure=insecure,
        root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    apps, done = ClientApps(), 0
    log(INFO, "fedshuffle worker: running the ClientApp tasks of the SuperNode at %s in this process", address)
    while max_tasks is None or done < max_tasks:
        acquired = acquirer.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        if not (acquired.HasField("task") and acquired.token):
            time.sleep(POLL_SECONDS)
            continue
        client, started = _task_client(address, acquired.token, insecure, certificates), time.monotonic()
        try:
            completed = run_task(client, apps)
        finally:
            client.close()
        done += 1
        log(
            INFO,
            "fedshuffle worker: task %d %s in %.3f s",
            done,
            "answered" if completed else "failed",
            time.monotonic() - started,
        )
    return done


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fedshuffle.integrations.flower.worker", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--runtime-api-address", required=True, help="the SuperNode's Runtime API (its --port), e.g. 127.0.0.1:9094"
    )
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument(
        "--insecure", action="store_true", help="connect without TLS (the SuperNode was started with the same)"
    )
    security.add_argument("--root-certificates", help="CA certificate (PEM) of the Runtime API's TLS certificate")
    parser.add_argument("--supernode-pid", type=int, help="exit when this process (the SuperNode) ends")
    args = parser.parse_args(argv)
    certificates = validate_and_resolve_root_certificates(args.root_certificates, args.insecure)
    if args.supernode_pid is not None:
        start_parent_process_monitor(args.supernode_pid)
    try:
        serve(args.runtime_api_address, args.insecure, certificates)
    except KeyboardInterrupt:  # Ctrl-C, or the SuperNode ended (--supernode-pid)
        log(INFO, "fedshuffle worker: stopped")


if __name__ == "__main__":
    main()
