"""Bad input from outside: hostile download servers, damaged and hostile data files, special files,
and values too large, too deep or overflowing. Each ends in one line naming what to change (a
:class:`ConfigError`/:class:`DataError`, or exit status 2), within a bounded time, and nothing is
allocated, written or run on its behalf.

The download tests start servers on 127.0.0.1 (tests/fuzzing.py's :class:`HostileServer`, stopped in
``finally``) and shrink the download bounds (1 s time-outs, a 1.5 s deadline, two tries).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import re
import shutil
import socket
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import fuzzing
from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError, DataError
from fedshuffle.data.catalog import fedprox_synthetic_source
from fedshuffle.data.sources import arrays, cifar, fetch, mnist, shakespeare
from fuzzing import SMALL_CONFIG, HostileServer, tar_bytes

CIFAR10_MEMBERS = [
    f"cifar-10-batches-py/{m}" for m in (*cifar.CIFAR_ARCHIVES["cifar10"][2], cifar.CIFAR_ARCHIVES["cifar10"][3])
]
BODY = b"the genuine file\n" * 20


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and "Traceback" not in text, text
    return text


def cli(*argv: str):
    """``fedshuffle ARGV`` in this process: never an exception other than the exit, never a traceback."""
    result = CliRunner().invoke(app, list(argv))
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result


def refused(result, field: str) -> str:
    """The CLI's one-line error (exit 2) naming ``field``."""
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert lines[-1].startswith(f"error: {field}"), result.output
    return lines[-1]


# --- downloads ------------------------------------------------------------------------------------------------


@pytest.fixture
def small_limits(monkeypatch):
    monkeypatch.setattr(fetch, "LIMITS", fuzzing.download_limits())
    return fetch.LIMITS


def toy(url: str, body: bytes = BODY) -> fetch.RemoteFile:
    return fetch.RemoteFile("toy", "toy.bin", url, fuzzing.hashlib.sha256(body).hexdigest(), len(body))


HOSTILE = {
    "garbage_status": "BadStatusLine",
    "empty_reply": "RemoteDisconnected",
    "incomplete": "ncomplete",
    "long_header_line": "LineTooLong",
    "too_many_headers": "more than 100 headers",
    "huge_length": "announces",
    "endless_body": "sent more than",
    "trickle_headers": "deadline",
    "trickle_body": "deadline",
    "silent": "deadline|timed out",
    "server_error": "HTTP 503",
    "not_found": "HTTP 404",
    "reset": "reset",
    "redirect_loop": "HTTP 302",
    "wrong_file": "checksum mismatch",
}


@pytest.mark.parametrize("reply, reason", sorted(HOSTILE.items()))
def test_a_hostile_mirror_ends_in_one_line_naming_the_url_and_where_to_put_the_file(small_limits, reply, reason):
    with HostileServer([reply], BODY) as server:
        url = f"{server.url}/toy.bin"
        began = time.monotonic()
        with pytest.raises(DataError) as err:
            fetch.locate(toy(url))
        seconds = time.monotonic() - began
    message = one_line(err.value)
    assert re.search(reason, message) and seconds < 1.5 + 2 * small_limits.read_timeout + 1, (message, seconds)
    target = fetch.cache_dir() / "toy" / "toy.bin"
    if reply != "wrong_file":
        assert message.startswith(url) and f"put it at {target}" in message and "FEDSHUFFLE_DATA" in message
    assert not target.exists() and not list(target.parent.glob(".*.part"))  # nothing kept, no partial file


def test_retries_are_bounded_and_only_for_what_may_pass(small_limits):
    with HostileServer(["server_error"], BODY) as server:
        with pytest.raises(DataError, match=r"after 2 tries \(HTTP 503"):
            fetch.locate(toy(f"{server.url}/toy.bin"))
    assert server.served == ["server_error"] * small_limits.attempts
    with HostileServer(["not_found"], BODY) as server:
        with pytest.raises(DataError, match=r"toy.bin \(HTTP 404"):
            fetch.locate(toy(f"{server.url}/toy.bin"))
    assert server.served == ["not_found"]  # a missing file is not asked for again
    with HostileServer(["reset", "good"], BODY) as server:
        path = fetch.locate(toy(f"{server.url}/toy.bin"))
    assert server.served == ["reset", "good"] and path.read_bytes() == BODY


def test_a_file_larger_than_its_known_size_is_cut_off_at_the_cap(small_limits, monkeypatch):
    monkeypatch.setattr(fetch, "LIMITS", fetch.DownloadLimits(**{**small_limits.__dict__, "margin": 0.5, "slack": 100}))
    assert fetch.LIMITS.cap(toy("")) == int(len(BODY) * 1.5) + 100
    with HostileServer(["endless_body"], BODY) as server:
        with pytest.raises(DataError, match=f"sent more than the {int(len(BODY) * 1.5) + 100} B"):
            fetch.locate(toy(f"{server.url}/toy.bin"))
    assert (
        fetch.LIMITS.cap(fetch.RemoteFile("d", "f", "", "")) == small_limits.max_bytes
    )  # unknown size: the default cap
    assert mnist.remote_files("train")[0].size == 9912422 and cifar.remote_archive("cifar10").size == 170498071


@pytest.mark.parametrize(
    "mirror", ["not a url", "http://[::1", "ftp://host/x", "http://", "http://127.0.0.1:99999", "http://a b/"]
)
def test_a_mirror_that_is_not_an_http_url_is_refused_naming_the_setting(mirror):
    with pytest.raises(ConfigError, match=r"^data\.mirror: ") as err:
        fetch.locate(toy("https://example.invalid/toy.bin"), mirror=mirror)
    one_line(err.value)


def test_the_download_deadline_covers_every_try(small_limits):
    """A server sending a byte every 0.2 s never trips the 1 s read time-out; the 1.5 s deadline stops it."""
    with HostileServer(["trickle_body", "trickle_body"], BODY) as server:
        began = time.monotonic()
        with pytest.raises(DataError, match="deadline"):
            fetch.locate(toy(f"{server.url}/toy.bin"))
        assert time.monotonic() - began < 3.0
    assert len(server.served) == 1  # the deadline ends the download, it is not tried again


# --- loaders ----------------------------------------------------------------------------------------------------


def cifar_archive(tmp_path: Path, first: bytes, mode: str = "w:gz") -> Path:
    good = pickle.dumps({"data": np.zeros((4, 3072), np.uint8), "labels": [0, 1, 2, 3]}, protocol=2)
    path = tmp_path / "cifar.tar"
    path.write_bytes(tar_bytes({m: first if k == 0 else good for k, m in enumerate(CIFAR10_MEMBERS)}, mode))
    return path


@pytest.mark.parametrize("labels", [["1", "2", "3", "4"], [2**70] * 4, None, {"a": 1}, [1.5] * 4, [[0, 1]] * 4])
def test_cifar_labels_that_are_not_class_indices_are_refused(tmp_path, labels):
    path = cifar_archive(tmp_path, pickle.dumps({"data": np.zeros((4, 3072), np.uint8), "labels": labels}, protocol=2))
    with pytest.raises(DataError, match=r"data_batch_1(, record \d+)?: .*label") as err:
        cifar.read_cifar_archive(path, "cifar10")
    one_line(err.value)


@pytest.mark.parametrize("shape", [(2**40,), (2**20, 2**20), (2**62, 4)])
def test_a_pickled_terabyte_array_is_refused_before_it_is_allocated(tmp_path, shape):
    path = cifar_archive(tmp_path, pickle.dumps({"data": fuzzing._HugeArray(shape), "labels": [0]}, protocol=2))
    began = time.monotonic()
    with pytest.raises(DataError, match="refusing to allocate it|overflow|not a CIFAR pickle"):
        cifar.read_cifar_archive(path, "cifar10")
    assert time.monotonic() - began < 5


def test_damaged_compressed_archives_and_members_are_one_line(tmp_path):
    xz = bytearray(
        cifar_archive(
            tmp_path, pickle.dumps({"data": np.zeros((4, 3072), np.uint8), "labels": [0] * 4}), "w:xz"
        ).read_bytes()
    )
    xz[len(xz) // 2] ^= 0xFF
    (tmp_path / "bad.tar.xz").write_bytes(bytes(xz))
    with pytest.raises(DataError, match="not a readable tar.gz archive"):
        cifar.read_cifar_archive(tmp_path / "bad.tar.xz", "cifar10")
    (tmp_path / "big.tar").write_bytes(tar_bytes({CIFAR10_MEMBERS[0]: b"x" * 10}, "w", {CIFAR10_MEMBERS[0]: 8**11 - 1}))
    with pytest.raises(DataError, match="declares 8.0 GiB, more than any CIFAR member"):
        cifar.read_cifar_archive(tmp_path / "big.tar", "cifar10")


def test_a_corrupt_lzma_member_of_an_npz_is_one_line(tmp_path):
    buffer = io.BytesIO()
    np.savez(buffer, x=np.ones((64, 2)), y=np.arange(64) % 2)
    source = zipfile.ZipFile(io.BytesIO(buffer.getvalue()))
    path = tmp_path / "d.npz"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_LZMA) as out:
        for name in source.namelist():
            out.writestr(name, source.read(name))
    assert arrays.load_npz(path)[0].shape == (64, 2)  # an intact LZMA member loads
    info = zipfile.ZipFile(path).getinfo("x.npy")
    raw = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    raw[start + 20 : start + 40] = bytes(20)  # inside the compressed stream
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"^data\.path: cannot read .*d\.npz as \.npz") as err:
        arrays.load_npz(path)
    one_line(err.value)


def test_a_gzip_bomb_in_an_idx_file_stops_at_the_declared_size(tmp_path):
    path = tmp_path / "labels.gz"
    path.write_bytes(
        gzip.compress(b"\0\0\x08\x01" + (10).to_bytes(4, "big") + bytes(64 << 20), 1)
    )  # 64 MiB of zeros behind 10 labels
    began = time.monotonic()
    with pytest.raises(DataError, match="more bytes after the 10 records the header declares"):
        mnist.read_idx(path, 1)
    assert time.monotonic() - began < 2  # one byte beyond the declared size is read, not 64 MiB
    path.write_bytes(b"\0\0\x08\x03" + b"".join(n.to_bytes(4, "big") for n in (2**32 - 1, 28, 28)))
    with pytest.raises(DataError, match="the header declares"):
        mnist.read_idx(path, 3)
    bomb = tmp_path / "bomb.gz"
    bomb.write_bytes(gzip.compress(bytes(4 << 20), 1))
    with pytest.raises(DataError, match="unpacks to more than 1.0 MiB"):
        fetch.gunzip(bomb, tmp_path / "out", 1 << 20)


def test_a_gzip_bomb_in_a_leaf_json_file_stops_at_what_memory_allows(tmp_path, monkeypatch):
    from fedshuffle.data.sources.leaf import load_leaf

    monkeypatch.setenv("FEDSHUFFLE_MAX_MEMORY", "80M")  # 8 MiB of JSON text (8 bytes of objects per byte)
    text = '{"users": ["u"], "num_samples": [1], "user_data": {"u": {"x": [[1.0]], "y": [1]}}}'
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
    (tmp_path / "test" / "a.json").write_text(text)
    (tmp_path / "train" / "a.json.gz").write_bytes(gzip.compress((text + " " * (64 << 20)).encode(), 1))
    with pytest.raises(DataError, match=r"a\.json\.gz: decompresses to more than 8\.0 MiB of JSON"):
        load_leaf(tmp_path, None)
    (tmp_path / "train" / "a.json.gz").write_bytes(gzip.compress(text.replace("1.0", "1" * 4301).encode()))
    with pytest.raises(DataError, match="not valid JSON"):
        load_leaf(tmp_path, None)


def tff_cifar(path: Path, image, label, coarse=None) -> Path:
    return fuzzing._h5(path, lambda h5: fuzzing._tff_cifar_client(h5, image, label, coarse))


@pytest.mark.parametrize(
    "label, images, reason",
    [
        (np.array([b"1", b"2"]), 2, "label must be 2 integers"),
        (
            np.zeros((2, 2), np.int64),
            2,
            r"label must be 2 integers \(one per image, shape \(2,\)\), got int64 \(2, 2\)",
        ),
        (np.array([1.5, 2.0]), 2, "label must be 2 integers"),
        (np.zeros(0, np.int64), 0, "the client has no images"),
    ],
)
def test_tff_cifar100_files_are_checked_strictly(tmp_path, label, images, reason):
    path = tff_cifar(tmp_path / "t.h5", np.zeros((images, 32, 32, 3), np.uint8), label)
    with pytest.raises(DataError, match=rf"^{path}, client '0': {reason}") as err:
        cifar.read_tff_cifar100(path)
    one_line(err.value)
    assert not fetch.RemoteFile(
        "cifar100/tff", "fed_cifar100_train.h5", "", ""
    ).sha256  # TFF publishes none: the structure is what is checked


def test_tff_hdf5_files_of_another_structure_are_one_line(tmp_path):
    wrong = fuzzing._h5(
        tmp_path / "a.h5", lambda h5: h5.require_group("examples").create_dataset("0", data=np.zeros(3))
    )
    with pytest.raises(DataError, match="client '0': expected a group"):
        cifar.read_tff_cifar100(wrong)
    for build, reason in [
        (lambda h5: h5.create_dataset("examples", data=np.zeros(3)), "no /examples group"),
        (
            lambda h5: h5.create_group("examples").create_dataset("ROLE", data=np.zeros(3)),
            "client 'ROLE': expected a group",
        ),
        (
            lambda h5: h5.create_group("examples").create_group("ROLE").create_dataset("snippets", data=np.arange(3)),
            "snippets must be a non-empty list of strings",
        ),
        (
            lambda h5: h5.create_group("examples").create_group("ROLE").create_group("snippets"),
            "'snippets' is a Group, not a dataset",
        ),
    ]:
        path = fuzzing._h5(tmp_path / "s.h5", build)
        with pytest.raises(DataError, match=reason) as err:
            shakespeare.read_tff_shakespeare(path)
        one_line(err.value)


# --- memory and time bombs -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "clients, what", [(10**9, "the sizes of 1000000000 devices"), (10**6, "1000000 Synthetic devices")]
)
def test_fedprox_synthetic_populations_that_cannot_fit_are_refused_before_generation(monkeypatch, clients, what):
    monkeypatch.setenv("FEDSHUFFLE_MAX_MEMORY", "4G")
    began = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^data\.clients: {what}.* needs about"):
        fedprox_synthetic_source(seed=0, clients=clients)
    assert time.monotonic() - began < 10
    assert len(fedprox_synthetic_source(seed=0, clients=3).client_sizes) == 3


def test_inspect_sizes_are_checked_against_memory_and_time(monkeypatch):
    monkeypatch.setenv("FEDSHUFFLE_MAX_MEMORY", "4G")
    assert "needs about" in refused(cli("inspect", "--sizes", "1000000000,1"), "--sizes")
    slow = refused(
        cli(
            "inspect",
            "--sizes",
            "1000,1000,1000",
            "--sampler",
            "uniform",
            "--cohort",
            "1",
            "--monte-carlo",
            "--samples",
            "10000000",
        ),
        "--samples",
    )
    assert "would take at least" in slow and "FEDSHUFFLE_MAX_SECONDS" in slow
    monkeypatch.setenv("FEDSHUFFLE_MAX_SECONDS", "1e-9")
    refused(cli("inspect"), "--sizes")


def test_inspect_says_a_diverging_step_size_diverges():
    line = refused(cli("inspect", "--lr", "1e308"), "local.lr")
    assert "diverge" in line
    assert "consistent" not in cli("inspect", "--lr", "1e308").output


# --- special files and config files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "socket", "big"])
def test_a_config_that_is_not_a_regular_file_or_too_large_is_refused_before_reading(tmp_path, kind):
    path = tmp_path / "cfg.toml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(path))
        sock.close()
    elif kind == "big":
        path.write_text(SMALL_CONFIG + "#" * (1 << 20))
    else:
        path = Path("/dev/zero")
    with fuzzing.wall_limit(20):
        line = refused(cli("run", str(path), "--out", str(tmp_path / "out")), "config")
    assert {"fifo": "a FIFO", "dev_zero": "a character device", "socket": "a socket", "big": "larger than 1.0 MiB"}[
        kind
    ] in line
    assert not (tmp_path / "out").exists()


# --- values ------------------------------------------------------------------------------------------------------


@pytest.fixture
def small(tmp_path):
    (tmp_path / "c.toml").write_text(SMALL_CONFIG)
    return tmp_path


@pytest.mark.parametrize(
    "value, reason",
    [("9" * 4301, "Exceeds the limit"), ("[" * 1000, "nests too deeply"), ("x" * 100_001, "at most 100000")],
)
def test_huge_and_deeply_nested_set_and_grid_values_are_one_line(small, value, reason):
    assert reason in refused(
        cli("run", str(small / "c.toml"), "--set", f"local.lr={value}", "--out", str(small / "out")), "--set"
    )
    assert reason in refused(
        cli("sweep", str(small / "c.toml"), "--grid", f"local.lr=0.1,{value}", "--out", str(small / "out")), "--grid"
    )
    (small / "deep.toml").write_text(
        SMALL_CONFIG.replace("lr = 0.1", f"lr = {value}" if value[0] != "x" else "lr = 0.1")
    )
    if value[0] != "x":
        refused(cli("run", str(small / "deep.toml"), "--out", str(small / "out")), "config")
    assert not (small / "out").exists()


def test_every_problem_of_a_config_is_on_one_line_and_a_union_lists_its_alternatives(small):
    result = cli(
        "run", str(small / "c.toml"), "--set", "local.lr=fast", "--set", "server.lr=-1", "--out", str(small / "out")
    )
    line = refused(result, "--set local.lr")  # the override's fault, not the first variant's
    assert len([x for x in result.output.splitlines() if x.strip()]) == 1, result.output
    assert "Input should be 'theory' or a valid number" in line and line.count("(got 'fast')") == 1
    assert "server.lr: Input should be greater than 0 (got -1)" in line


def test_a_huge_worker_count_is_refused_before_any_folder_is_written(small):
    assert "from 1 to" in refused(
        cli("run", str(small / "c.toml"), "--workers", "9999999999999999999999", "--out", str(small / "out")),
        "--workers",
    )
    assert not (small / "out").exists()


def test_a_prox_mu_that_makes_the_proximal_step_diverge_is_refused(small):
    assert "η·μ" in refused(
        cli("run", str(small / "c.toml"), "--set", "local.prox_mu=1e308", "--out", str(small / "out")), "local.prox_mu"
    )


def test_weights_whose_sum_overflows_are_refused(small):
    line = refused(
        cli(
            "run",
            str(small / "c.toml"),
            "--set",
            "aggregation.weighting=[1e308, 1e308]",
            "--set",
            'aggregation.normalization="sum_one"',
            "--out",
            str(small / "out"),
        ),
        "--set aggregation.weighting",
    )
    assert "largest float" in line


def test_a_data_path_longer_than_the_file_system_allows_is_one_line(small):
    long_path = f'data.path="{"a" * 300}"'
    refused(cli("run", str(small / "c.toml"), "--set", long_path, "--out", str(small / "out")), "--set data.path")
    (small / "long.toml").write_text(SMALL_CONFIG.replace("[data]\n", f'[data]\npath = "{"a" * 300}"\n'))
    refused(cli("run", str(small / "long.toml"), "--out", str(small / "out")), "variants[0] (A).data.path")
    assert "File name too long" in refused(cli("run", "a" * 300), "config")


def test_a_plot_metric_that_no_run_records_is_refused_before_running(small):
    line = refused(
        cli("run", str(small / "c.toml"), "--set", 'plot.metric="test_accuracy"', "--out", str(small / "out")),
        "plot.metric",
    )
    assert "no run records test_accuracy" in line and not (small / "out").exists()


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished run of SMALL_CONFIG (two variants, two rounds)."""
    root = tmp_path_factory.mktemp("finished")
    (root / "c.toml").write_text(SMALL_CONFIG)
    assert cli("run", str(root / "c.toml"), "--out", str(root / "out"), "--quiet").exit_code == 0
    return root


@pytest.mark.parametrize("rounds", ['"ten"', "1e400", "-3", "2.5"])
def test_a_run_config_with_a_bad_round_count_is_refused_on_resume(finished, tmp_path, rounds):
    shutil.copytree(finished, tmp_path / "copy")
    stored = next((tmp_path / "copy" / "out").rglob("config.json"))
    text = stored.read_text()
    assert text.count('"rounds": 2') >= 1
    stored.write_text(text.replace('"rounds": 2', f'"rounds": {rounds}', 1))
    line = refused(
        cli("run", str(tmp_path / "copy" / "c.toml"), "--resume", str(tmp_path / "copy" / "out"), "--quiet"),
        str(stored),
    )
    assert "not a whole number of rounds" in line


def test_an_unreachable_mlflow_server_fails_at_once_in_one_line(small):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now
    began = time.monotonic()
    line = refused(
        cli(
            "run",
            str(small / "c.toml"),
            "--set",
            'run.sinks=["mlflow"]',
            "--set",
            f'run.mlflow_uri="http://127.0.0.1:{port}"',
            "--out",
            str(small / "out"),
        ),
        "run.mlflow_uri",
    )
    assert (
        "cannot reach the MLflow tracking server" in line
        and time.monotonic() - began < 30
        and not (small / "out").exists()
    )


# --- the fuzzer's new classes (scripts/fuzz.py runs thousands)
# --------------------------------------------------------------


@pytest.mark.parametrize("kind, seeds", [("downloads", 12), ("bombs", 16), ("special", 4), ("values", 6)])
def test_fuzzed_inputs_from_outside_end_cleanly(tmp_path, monkeypatch, kind, seeds):
    for key, value in fuzzing.environment(tmp_path).items():
        monkeypatch.setenv(key, value)
    outcomes = []
    for seed in range(seeds):
        work = tmp_path / f"{kind}-{seed}"
        work.mkdir()
        result = fuzzing.run_case(kind, seed, work, None)
        assert result.outcome not in fuzzing.BAD, (
            f"{result.outcome}: {result.detail} [{result.case}] — replay: python scripts/fuzz.py --replay {kind}:{seed}"
        )
        outcomes.append(result.outcome)
    assert "clean_error" in outcomes
