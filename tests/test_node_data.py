"""A node's own client files go through the checks the ``npz`` data source applies (flower.nodedata)."""

import io
import os
import threading
import zipfile

import numpy as np
import pytest

pytest.importorskip("flwr")

from fedshuffle.core.errors import ConfigError, DataError
from fedshuffle.experiments.schema import Experiment, validate
from fedshuffle.integrations.flower.common import parse_clients
from fedshuffle.integrations.flower.nodedata import OwnClients, folder_clients


def spec(problem: str = "logistic"):
    raw = {
        "problem": {"name": problem},
        "local": {"lr": 0.1},
        "data": {"source": "synthetic", "samples": 24, "features": 3, "client_sizes": [12, 12]},
    }
    return validate(Experiment, raw).runs()[0][1]


def write(folder, client: int, **arrays) -> str:
    path = folder / f"client-{client}.npz"
    np.savez(path, **arrays)
    return str(path)


def good(n: int = 4, features: int = 3, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(n, features)), "y": np.arange(n) % 2, "classes": np.array(2)}


def refused(folder, match: str, problem: str = "logistic") -> DataError:
    with pytest.raises(DataError) as err:
        OwnClients.read(folder, None, spec(problem))
    assert match in str(err.value) and "\n" not in str(err.value), str(err.value)
    return err.value


def test_files_that_pass_build_the_clients(tmp_path):
    write(tmp_path, 0, **good())
    write(tmp_path, 1, **good(5, seed=1))
    own = OwnClients.read(tmp_path, None, spec())
    assert own.clients == (0, 1) and own.sizes == {0: 4, 1: 5} and own.sample.classes == 2
    assert sorted(set(own.labels.tolist())) == [-1.0, 1.0]  # logistic's coding of 0/1


@pytest.mark.parametrize(
    "labels, said",
    [
        (np.array([0, 1, 7, 0]), "y[2] = 7: labels must be class indices 0..1 (the file's classes = 2)"),
        (np.array([0, -1, 1, 0]), "y[1] = -1: labels must be class indices"),
        (np.array([0.0, 0.5, 1.0, 0.0]), "y[1] = 0.5: labels must be integers"),
        (np.array(["a", "b", "a", "b"]), "y: labels must be integers"),
    ],
)
def test_labels_outside_the_problems_classes_fail_naming_the_file(tmp_path, labels, said):
    write(tmp_path, 0, **good())
    path = write(tmp_path, 1, **{**good(), "y": labels})
    error = refused(tmp_path, said)
    assert error.field == path


def test_labels_beyond_a_binary_problem_without_classes_name_the_file_that_holds_them(tmp_path):
    write(tmp_path, 0, x=np.ones((3, 3)), y=np.array([0, 1, 0]))
    path = write(tmp_path, 1, x=np.ones((3, 3)), y=np.array([0, 7, 1]))
    said = "its largest label, 7, makes 8 classes: problem.name: logistic regression needs binary labels"
    error = refused(tmp_path, said)
    assert error.field == path


@pytest.mark.parametrize(
    "classes, said",
    [
        (np.array(2.7), "classes = 2.7: the number of classes is an integer"),
        (np.array(-3), "classes = -3: the number of classes is an integer"),
        (np.array([2, 2]), "classes: expected one integer (a 0-d array)"),
        (np.array(True), "classes: expected one integer"),
    ],
)
def test_classes_must_be_one_whole_number(tmp_path, classes, said):
    path = write(tmp_path, 0, **{**good(), "classes": classes})
    assert refused(tmp_path, said).field == path


def test_an_integral_float_for_classes_is_accepted(tmp_path):
    write(tmp_path, 0, **{**good(), "classes": np.array(2.0)})
    assert OwnClients.read(tmp_path, None, spec()).sample.classes == 2


@pytest.mark.parametrize(
    "x, said",
    [
        (np.array([[0.0, np.nan, 1.0]] * 4), "x[0]: features must be finite"),
        (np.zeros((4, 0)), "x: every sample needs at least one feature"),
        (np.array([[1 + 1j] * 3] * 4), "x: features must be real numbers, got complex"),
    ],
)
def test_features_are_checked_as_the_npz_source_checks_them(tmp_path, x, said):
    path = write(tmp_path, 0, **{**good(), "x": x})
    assert refused(tmp_path, said).field == path


def test_a_header_claiming_billions_of_rows_is_one_clear_line(tmp_path):
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f8", "fortran_order": False, "shape": (4_000_000_000, 3)})
    path = tmp_path / "client-0.npz"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x.npy", header.getvalue() + b"\0" * 64)
        archive.writestr("y.npy", b"")
    error = refused(tmp_path, "the header claims (4000000000, 3)")
    assert error.field == f"{path}, x" and "MemoryError" not in str(error)


def test_a_file_that_is_not_an_archive_is_one_line(tmp_path):
    (tmp_path / "client-0.npz").write_bytes(b"not a zip at all")
    refused(tmp_path, "not a readable .npz file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_among_the_files_is_refused_without_opening_it(tmp_path):
    write(tmp_path, 0, **good())
    os.mkfifo(tmp_path / "client-1.npz")
    result: list = []
    run = spec()

    def read() -> None:
        result.append(pytest.raises(DataError, OwnClients.read, tmp_path, None, run))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(60)
    if reader.is_alive():  # opening the FIFO would wait for a writer: free the reader, then fail
        with open(tmp_path / "client-1.npz", "wb"):
            pass
        pytest.fail("the node opened the FIFO")
    assert "client-1.npz: is a FIFO, not a regular file" in str(result[0].value)


def test_a_device_is_refused_without_reading_it(tmp_path):
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    os.symlink("/dev/zero", tmp_path / "client-0.npz")
    refused(tmp_path, "not a regular file")


def test_client_numbers_are_ascii_digits(tmp_path):
    write(tmp_path, 0, **good())
    np.savez(tmp_path / "client-\u0663.npz", **good())  # ARABIC-INDIC DIGIT THREE
    np.savez(tmp_path / "client-+4.npz", **good())
    assert folder_clients(tmp_path) == (0,)
    for bad in ("\u0663", "0-\u0663", "+1", "1_0", "0-99999999999"):
        with pytest.raises(ConfigError, match="node-config.clients: expected client ids"):
            parse_clients(bad)
