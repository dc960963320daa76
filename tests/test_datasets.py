"""LIBSVM loading: offline copies, download from a local HTTP server, cache, checksums, bad files."""

import numpy as np
import pytest

from fedshuffle.data.sources import LIBSVM_DATASETS, RemoteFile, load_libsvm_dataset, locate, read_svmlight
from fedshuffle.data.sources.fetch import cache_dir
from fedshuffle.core.errors import DataError
from conftest import sha

FIXTURE = "+1 1:0.5 3:1\n-1 2:-1.5\n+1 1:2 2:0.25 3:-1 # comment\n-1\n"


def test_fixture_file_is_downloaded_verified_and_then_served_from_the_cache(server, tmp_path):
    base, root, requests = server
    (root / "toy").write_text(FIXTURE)
    remote = RemoteFile("toy", "toy", base + "toy", sha(FIXTURE.encode()))
    path = locate(remote)
    assert path == cache_dir() / "toy" / "toy" and path.read_text() == FIXTURE
    assert len(requests) == 1
    assert locate(remote) == path and len(requests) == 1  # cached: no second request
    x, y = read_svmlight(path, 3)
    np.testing.assert_array_equal(x, [[0.5, 0, 1], [0, -1.5, 0], [2, 0.25, -1], [0, 0, 0]])
    np.testing.assert_array_equal(y, [1, 0, 1, 0])
    assert not list(path.parent.glob(".*.part"))  # no temporary file left behind


def test_wrong_checksum_on_download_is_an_error_and_nothing_is_cached(server):
    base, root, _ = server
    (root / "toy").write_text(FIXTURE[:-10])  # truncated on the server
    remote = RemoteFile("toy", "toy", base + "toy", sha(FIXTURE.encode()))
    with pytest.raises(DataError, match="checksum mismatch for toy/toy"):
        locate(remote)
    assert not (cache_dir() / "toy").exists() or not any((cache_dir() / "toy").iterdir())


def test_offline_without_a_copy_says_where_to_put_the_file(tmp_path):
    remote = RemoteFile("toy", "toy", "http://127.0.0.1:9/toy", sha(FIXTURE.encode()))  # port 9: nothing listens
    with pytest.raises(DataError, match="could not download toy/toy") as err:
        locate(remote, timeout=5)
    assert str(cache_dir() / "toy" / "toy") in str(err.value)
    with pytest.raises(DataError, match="downloading is off"):
        locate(remote, download=False)


def test_registered_dataset_downloads_from_a_mirror_and_matches_the_offline_copy(server, shared_data, monkeypatch):
    base, root, requests = server
    (root / "a3a").write_bytes((shared_data / "a3a" / "a3a").read_bytes())
    x, y = load_libsvm_dataset("a3a", base_url=base)
    assert x.shape == (3185, 123) and requests == ["/a3a"]
    monkeypatch.setenv("FEDSHUFFLE_DATA", str(shared_data))
    x_offline, y_offline = load_libsvm_dataset("a3a", download=False)
    np.testing.assert_array_equal(x, x_offline)
    np.testing.assert_array_equal(y, y_offline)


@pytest.mark.parametrize(
    "name, rows, positives",
    [("phishing", 11055, 6157), ("mushrooms", 8124, 4208), ("w3a", 4912, 143), ("a3a", 3185, 773)],
)
def test_offline_copies_load_with_their_shapes_and_labels(shared_data, name, rows, positives):
    x, y = load_libsvm_dataset(name, data_dirs=[shared_data], download=False)
    assert x.shape == (rows, LIBSVM_DATASETS[name][0]) and int(y.sum()) == positives and set(np.unique(y)) == {0, 1}


def test_a_modified_local_copy_fails_its_checksum_unless_verification_is_off(tmp_path, shared_data):
    folder = tmp_path / "data" / "phishing"
    folder.mkdir(parents=True)
    lines = (shared_data / "phishing" / "phishing").read_bytes().splitlines(keepends=True)
    (folder / "phishing").write_bytes(b"".join(lines[:-100]))  # cut at a line boundary: still parseable
    with pytest.raises(DataError, match="checksum mismatch"):
        load_libsvm_dataset("phishing", data_dirs=[tmp_path / "data"], download=False)
    x, _ = load_libsvm_dataset("phishing", data_dirs=[tmp_path / "data"], download=False, verify=False)
    assert x.shape == (11055 - 100, 68)


@pytest.mark.parametrize(
    "content, line, reason",
    [
        ("+1 1:0.5\n-1 2:1.0 3:\n", 2, "'3:' is not index:value"),  # truncated mid-pair
        ("+1 1:0.5\n+1 2:abc\n", 2, "value 'abc' is not a number"),
        ("+1 1:0.5\n-1 2:1\nyes 1:1\n", 3, "label 'yes' is not a number"),
        ("+1 3:0.5 2:1\n", 1, "feature indices must increase"),
        ("+1 1:1\n-1 9:1\n", 2, "feature index 9 exceeds the 3 features"),
    ],
)
def test_corrupted_file_names_the_file_and_the_line(tmp_path, content, line, reason):
    path = tmp_path / "bad.svm"
    path.write_text(content)
    with pytest.raises(DataError) as err:
        read_svmlight(path, 3)
    assert f"{path}, line {line}" in str(err.value) and reason in str(err.value)


def test_nan_features_and_single_class_files_are_rejected(tmp_path):
    nan = tmp_path / "nan.svm"
    nan.write_text("+1 1:0.5\n-1 2:nan\n")
    with pytest.raises(DataError, match="line 2.*finite"):
        read_svmlight(nan, 3)
    single = tmp_path / "one.svm"
    single.write_text("+1 1:0.5\n+1 2:1\n")
    with pytest.raises(DataError, match="exactly two label values"):
        read_svmlight(single, 3)
    with pytest.raises(DataError, match="unknown LIBSVM dataset 'phishng'"):
        load_libsvm_dataset("phishng")


def test_official_test_split_is_used_for_test_metrics(shared_data, monkeypatch):
    from fedshuffle.experiments.schema import RunSpec, validate
    from fedshuffle.experiments.build import build_problem_and_data

    monkeypatch.setenv("FEDSHUFFLE_DATA", str(shared_data))
    spec = validate(
        RunSpec,
        {
            "problem": {"name": "logistic", "l2": 1e-3},
            "data": {"source": "libsvm", "dataset": "a3a", "partition": "equal", "clients": 5, "libsvm_test": True},
        },
    )
    _, data = build_problem_and_data(spec)
    assert data.num_samples == 3185 // 5 * 5 and data.test_features.shape == (29376, 123)
    assert float(data.test_labels.sum()) == 7068 - 22308  # a3a.t: 7068 positive, 22308 negative, as ±1


def test_an_svmlight_file_is_parsed_once_then_read_back_without_scikit_learn(tmp_path, monkeypatch):
    """The second read of the same bytes comes from the cache folder (the parser is not called: scikit-learn need not
    be imported); a file whose bytes changed is parsed again; a damaged cache entry is parsed again and replaced."""
    import sys

    from fedshuffle.data.sources import libsvm

    path = tmp_path / "toy.svm"
    path.write_text(FIXTURE)
    first = read_svmlight(path, 3)
    with pytest.MonkeyPatch.context() as without:
        without.setitem(sys.modules, "sklearn.datasets", None)  # importing it now fails
        again = read_svmlight(path, 3)
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype
    calls = []
    parse = libsvm.parse_svmlight
    monkeypatch.setattr(libsvm, "parse_svmlight", lambda *args: calls.append(args) or parse(*args))
    path.write_text(FIXTURE.replace("0.5", "0.75"))
    assert read_svmlight(path, 3)[0][0, 0] == 0.75 and len(calls) == 1
    for entry in (cache_dir() / "svmlight").glob("*.npz"):
        entry.write_bytes(b"damaged")
    assert read_svmlight(path, 3)[0][0, 0] == 0.75 and len(calls) == 2
    assert read_svmlight(path, 3)[0][0, 0] == 0.75 and len(calls) == 2
