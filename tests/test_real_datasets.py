"""MNIST, CIFAR-10/100, TFF and LEAF Shakespeare: fixture files in the real formats (made here, served by a
local HTTP server on 127.0.0.1), checksums, offline errors, corrupt files, the partitions' laws, the
offline copies beside the repository, and ``fedshuffle data``."""

import gzip
import io
import json
import pickle
import tarfile

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError, DataError, section
from fedshuffle.data import partitions as P
from fedshuffle.data.catalog import federate, load_samples
from fedshuffle.data.sources import cifar, mnist, shakespeare
from fedshuffle.data.sources.fetch import cache_dir
from fedshuffle.experiments.schema import RunSpec, validate
from conftest import sha

MNIST_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]


def put(root, relative: str, data: bytes):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def data_section(**settings):
    return validate(RunSpec, {"data": settings}).data.model_dump()


def federated(seed=0, **settings):
    """The samples and federated dataset of a ``[data]`` section, errors named as a run names them."""
    data = data_section(**settings)
    with section("data"):
        samples, rng = load_samples(data, seed)
        return samples, federate(samples, data, rng)


# --- fixture files in the real formats -----------------------------------------------------------------------


def idx(array: np.ndarray) -> bytes:
    """An IDX file (unsigned bytes) holding ``array``."""
    header = bytes([0, 0, 0x08, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()


def mnist_fixture(rng, n_train=40, n_test=10):
    files = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = np.arange(n) % 10
        files[f"{prefix}-images-idx3-ubyte.gz"] = gzip.compress(idx(images), mtime=0)
        files[f"{prefix}-labels-idx1-ubyte.gz"] = gzip.compress(idx(labels), mtime=0)
    return files


def cifar_fixture(name: str, rng, per_batch: int) -> tuple[bytes, dict]:
    """A CIFAR python archive (tar.gz of pickled dicts) with ``per_batch`` images per member; returns (bytes,
    contents)."""
    folder = {"cifar10": "cifar-10-batches-py", "cifar100": "cifar-100-python"}[name]
    _, _, train_members, test_member, label_key, classes = cifar.CIFAR_ARCHIVES[name]
    groups = rng.permutation(np.repeat(np.arange(20), 5))  # a coarse label for each of the 100 fine labels
    contents, buffer = {}, io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for member in (*train_members, test_member):
            data = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
            labels = rng.permutation(np.arange(per_batch) % classes)
            batch = {"data": data, label_key: labels.tolist(), "batch_label": "fixture"}
            if name == "cifar100":
                batch = {k.encode(): v for k, v in batch.items()}  # Python 2 pickles: byte-string keys
                batch[b"coarse_labels"] = groups[labels].tolist()
            contents[member] = (data, labels)
            raw = pickle.dumps(batch, protocol=2)
            info = tarfile.TarInfo(f"{folder}/{member}")
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    return buffer.getvalue(), {"members": contents, "groups": groups}


def h5_bytes(build) -> bytes:
    import h5py

    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as h5:
        build(h5.create_group("examples"))
    return buffer.getvalue()


def shakespeare_h5(roles: dict) -> bytes:
    def build(examples):
        for role, snippets in roles.items():
            examples.create_group(role).create_dataset(
                "snippets",
                data=np.array([s.encode() for s in snippets], dtype=object),
                dtype=__import__("h5py").string_dtype(),
            )

    return h5_bytes(build)


def tar_bz2(members: dict) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:bz2") as archive:
        for name, raw in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    return buffer.getvalue()


def leaf_json(users: dict) -> bytes:
    doc = {
        "users": list(users),
        "num_samples": [len(x) for x, _ in users.values()],
        "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
    }
    return gzip.compress(json.dumps(doc).encode(), mtime=0)


# --- MNIST ---------------------------------------------------------------------------------------------------


def test_mnist_downloads_from_a_mirror_checks_and_caches_and_keeps_the_official_split(server, monkeypatch):
    base, root, requests = server
    files = mnist_fixture(np.random.default_rng(0))
    for name, raw in files.items():
        put(root, f"mnist/{name}", raw)
        monkeypatch.setitem(mnist.MNIST_FILES, name, sha(raw))
    samples, data = federated(source="mnist", partition="iid", clients=4, mirror=base)
    assert sorted(requests) == sorted(f"/mnist/{n}" for n in files)
    images = np.frombuffer(gzip.decompress(files["train-images-idx3-ubyte.gz"])[16:], dtype=np.uint8).reshape(
        40, 1, 28, 28
    )
    np.testing.assert_array_equal(samples.features, images / np.float32(255))
    assert samples.features.dtype == np.float32 and samples.num_classes == 10
    assert samples.test[0].shape == (10, 1, 28, 28) and data.test_features.shape == (10, 784) and data.num_samples == 40
    for name in files:
        assert (cache_dir() / "mnist" / name).is_file()
    federated(source="mnist", partition="iid", clients=4, mirror=base, download=False)  # served from the cache
    assert len(requests) == len(files)


def test_a_download_with_the_wrong_checksum_is_refused_and_not_cached(server, monkeypatch):
    base, root, _ = server
    for name, raw in mnist_fixture(np.random.default_rng(0)).items():
        put(root, f"mnist/{name}", raw)
        monkeypatch.setitem(mnist.MNIST_FILES, name, sha(raw))
    monkeypatch.setitem(mnist.MNIST_FILES, "train-images-idx3-ubyte.gz", "0" * 64)
    with pytest.raises(DataError, match="checksum mismatch for mnist/train-images-idx3-ubyte.gz"):
        mnist.load_mnist("train", mirror=base)
    assert not (cache_dir() / "mnist" / "train-images-idx3-ubyte.gz").exists()
    assert not list((cache_dir() / "mnist").glob(".*.part"))


def test_offline_without_a_copy_names_the_file_and_what_to_do(tmp_path):
    with pytest.raises(DataError) as err:
        federated(source="mnist", partition="iid", clients=2, download=False, data_dirs=[str(tmp_path)])
    message = str(err.value)
    assert message.startswith("train-images-idx3-ubyte.gz: mnist/train-images-idx3-ubyte.gz is not in")
    for hint in (str(tmp_path), "downloading is off", "data.data_dirs", "$FEDSHUFFLE_DATA", "data.download = true"):
        assert hint in message


@pytest.mark.parametrize(
    "mutate, where, reason",
    [
        (
            lambda raw: raw[:-100],
            "record 39",
            "truncated: the header declares 40 records of 784 bytes, the file holds 39 complete ones",
        ),
        (lambda raw: b"\x00\x01" + raw[2:], "", "not an IDX file"),
        (lambda raw: raw[:3] + b"\x02" + raw[4:], "", "IDX file has 2 dimensions, expected 3"),
    ],
)
def test_corrupt_idx_files_name_the_file_and_record(tmp_path, mutate, where, reason):
    files = mnist_fixture(np.random.default_rng(1))
    images = put(
        tmp_path, "mnist/train-images-idx3-ubyte", mutate(gzip.decompress(files["train-images-idx3-ubyte.gz"]))
    )
    labels = put(tmp_path, "mnist/train-labels-idx1-ubyte.gz", files["train-labels-idx1-ubyte.gz"])
    with pytest.raises(DataError) as err:
        mnist.read_mnist_pair(images, labels)
    assert str(err.value).startswith(f"{images}{', ' + where if where else ''}: {reason}")


def test_bad_labels_and_broken_gzip_are_named(tmp_path):
    files = mnist_fixture(np.random.default_rng(2))
    images = put(tmp_path, "i.gz", files["train-images-idx3-ubyte.gz"])
    labels = np.arange(40) % 10
    labels[17] = 12
    bad_labels = put(tmp_path, "l.gz", gzip.compress(idx(labels)))
    with pytest.raises(DataError, match=rf"^{bad_labels}, record 17: label 12 is not a digit"):
        mnist.read_mnist_pair(images, bad_labels)
    broken = put(tmp_path, "b.gz", files["train-images-idx3-ubyte.gz"][:200])
    with pytest.raises(DataError, match=rf"^{broken}: cannot read"):
        mnist.read_idx(broken, 3)


# --- CIFAR ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, per_batch", [("cifar10", 20), ("cifar100", 200)])
def test_cifar_archives_download_and_read_planes_labels_and_coarse_labels(server, monkeypatch, name, per_batch):
    base, root, requests = server
    raw, contents = cifar_fixture(name, np.random.default_rng(3), per_batch)
    archive, _, train_members, test_member, *_ = cifar.CIFAR_ARCHIVES[name]
    put(root, f"{name}/{archive}", raw)
    monkeypatch.setitem(cifar.CIFAR_ARCHIVES, name, (archive, sha(raw), *cifar.CIFAR_ARCHIVES[name][2:]))
    samples, data = federated(source=name, partition="iid", clients=5, mirror=base)
    assert requests == [f"/{name}/{archive}"]
    first, first_labels = contents["members"][train_members[0]]
    assert samples.features.shape == (per_batch * len(train_members), 3, 32, 32)
    np.testing.assert_array_equal(samples.features[0, 0].ravel(), first[0, :1024] / np.float32(255))  # red plane first
    np.testing.assert_array_equal(samples.features[0, 2].ravel(), first[0, 2048:] / np.float32(255))
    np.testing.assert_array_equal(samples.labels[:per_batch], first_labels)
    np.testing.assert_array_equal(samples.test[1], contents["members"][test_member][1])
    if name == "cifar100":
        np.testing.assert_array_equal(samples.label_groups, contents["groups"])
    assert data.features.shape == (len(samples.labels), 3072) and data.test_features.shape == (per_batch, 3072)


def test_cifar100_pachinko_split_through_the_config(tmp_path, monkeypatch):
    raw, _ = cifar_fixture("cifar100", np.random.default_rng(4), 500)
    put(tmp_path, "cifar100/cifar-100-python.tar.gz", raw)
    samples, data = federated(
        source="cifar100", partition="pachinko", clients=5, data_dirs=[str(tmp_path)], verify=False
    )
    assert data.num_clients == 5 and set(data.sizes) == {100}
    assert len(np.unique(np.concatenate(data.client_indices))) == 500
    with pytest.raises(ConfigError, match="data.partition: 'pachinko' needs a source with coarse labels"):
        federated(source="synthetic", classes=4, partition="pachinko", clients=5)


def rebuilt(source, target, change):
    """A copy of a tar.gz archive whose members pass through ``change(name, payload)`` (None drops the member)."""
    with tarfile.open(source) as src, tarfile.open(target, mode="w:gz") as dst:
        for info in src:
            payload = change(info.name, src.extractfile(info).read())
            if payload is not None:
                info.size = len(payload)
                dst.addfile(info, io.BytesIO(payload))
    return target


def test_corrupt_cifar_archives_name_the_member_and_record(tmp_path):
    raw, _ = cifar_fixture("cifar10", np.random.default_rng(5), 10)
    good = put(tmp_path, "good.tar.gz", raw)
    missing = rebuilt(
        good, tmp_path / "missing.tar.gz", lambda name, payload: None if name.endswith("data_batch_5") else payload
    )
    with pytest.raises(DataError, match=rf"^{missing}: the archive has no member 'data_batch_5'"):
        cifar.read_cifar_archive(missing, "cifar10")

    def bad_label(name, payload):
        if not name.endswith("data_batch_3"):
            return payload
        batch = pickle.loads(payload, encoding="latin1")
        batch["labels"][7] = 10
        return pickle.dumps(batch, protocol=2)

    bad = rebuilt(good, tmp_path / "bad.tar.gz", bad_label)
    with pytest.raises(DataError, match=rf"^{bad}:cifar-10-batches-py/data_batch_3, record 7: label 10 outside 0–9"):
        cifar.read_cifar_archive(bad, "cifar10")
    truncated = put(tmp_path, "cut.tar.gz", raw[: len(raw) // 2])
    with pytest.raises(DataError, match=rf"^{truncated}: not a readable tar.gz archive"):
        cifar.read_cifar_archive(truncated, "cifar10")


def test_a_pickle_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("this must not run",))

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for member in (*cifar.CIFAR_ARCHIVES["cifar10"][2], cifar.CIFAR_ARCHIVES["cifar10"][3]):
            raw = pickle.dumps({"data": Evil(), "labels": []})
            info = tarfile.TarInfo(f"cifar-10-batches-py/{member}")
            info.size = len(raw)
            archive.addfile(info, io.BytesIO(raw))
    path = put(tmp_path, "evil.tar.gz", buffer.getvalue())
    with pytest.raises(DataError, match="data_batch_1: not a CIFAR pickle \\(refusing to load builtins.print\\)"):
        cifar.read_cifar_archive(path, "cifar10")


def test_tff_cifar100_clients_come_from_tff_archive(server, monkeypatch):
    base, root, requests = server
    rng = np.random.default_rng(6)
    groups = rng.permutation(np.repeat(np.arange(20), 5))

    def clients(count, size):
        def build(examples):
            for k in range(count):
                labels = rng.integers(0, 100, size)
                record = examples.create_group(str(k))
                record.create_dataset("image", data=rng.integers(0, 256, (size, 32, 32, 3), dtype=np.uint8))
                record.create_dataset("label", data=labels)
                record.create_dataset("coarse_label", data=groups[labels])

        return h5_bytes(build)

    raw = tar_bz2({"fed_cifar100_train.h5": clients(12, 4), "fed_cifar100_test.h5": clients(3, 5)})
    put(root, "cifar100/tff/fed_cifar100.tar.bz2", raw)
    monkeypatch.setattr(cifar, "TFF_CIFAR100", ("fed_cifar100.tar.bz2", sha(raw)))
    samples, data = federated(source="tff_cifar100", clients=10, mirror=base)
    assert requests.count("/cifar100/tff/fed_cifar100.tar.bz2") == 1  # one archive, both files unpacked from it
    assert set(requests) == {
        "/cifar100/tff/fed_cifar100_train.h5",
        "/cifar100/tff/fed_cifar100.tar.bz2",
    }  # the mirror has no bare .h5
    assert data.num_clients == 10 and set(data.sizes) == {4} and samples.test[0].shape == (15, 3, 32, 32)
    assert samples.features.shape == (40, 3, 32, 32) and samples.num_classes == 100
    seen = np.unique(np.concatenate([samples.labels, samples.test[1]]))
    np.testing.assert_array_equal(samples.label_groups[seen], groups[seen])


# --- Shakespeare ---------------------------------------------------------------------------------------------


def test_tff_shakespeare_unpacks_from_tff_archive_with_fedshuffle_encoding(server, monkeypatch):
    base, root, requests = server
    train = shakespeare_h5({"B_ROLE": ["To be, or not to be}", "x" * 79], "A_ROLE": ["Hi"]})
    test = shakespeare_h5({"A_ROLE": ["Bye"], "B_ROLE": ["y" * 80]})
    raw = tar_bz2({"shakespeare_train.h5": train, "shakespeare_test.h5": test})
    put(root, "shakespeare/tff/shakespeare.tar.bz2", raw)
    monkeypatch.setattr(shakespeare, "TFF_ARCHIVE", ("shakespeare.tar.bz2", sha(raw)))
    monkeypatch.setitem(shakespeare.TFF_FILES, "shakespeare_train.h5", sha(train))
    monkeypatch.setitem(shakespeare.TFF_FILES, "shakespeare_test.h5", sha(test))
    samples, data = federated(source="shakespeare", mirror=base)
    assert requests.count("/shakespeare/tff/shakespeare.tar.bz2") == 1  # tried after the file itself and its .gz copy
    assert set(requests) == {
        "/shakespeare/tff/shakespeare_train.h5",
        "/shakespeare/tff/shakespeare_train.h5.gz",
        "/shakespeare/tff/shakespeare.tar.bz2",
    }
    assert samples.num_classes == 90 and samples.features.dtype == np.int64 and samples.labels.shape == (3, 80)
    np.testing.assert_array_equal(
        data.sizes, [1, 2]
    )  # A_ROLE first (sorted); 79 characters + BOS fill one row, EOS is its last target
    x, y = samples.features, samples.labels
    assert shakespeare.decode(x[0]) == "⟨Hi⟩" and shakespeare.decode(y[0]) == "Hi⟩"
    assert (
        shakespeare.decode(x[1]) == "⟨To be, or not to be\ufffd⟩" and x[1][20] == shakespeare.OOV
    )  # '}' is out of TFF's vocabulary
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert x[2][0] == shakespeare.BOS and y[2][-1] == shakespeare.EOS and (x[2][1:] == x[2][1]).all()
    assert samples.test[0].shape == (3, 80)  # "Bye" one row, 80 characters two rows
    ignored, _ = federated(source="shakespeare", mirror=base, ignore_padding=True)  # from the cache now
    np.testing.assert_array_equal(ignored.labels, np.where(y == shakespeare.PAD, -1, y))
    assert (ignored.test[1] == -1).sum() == (samples.test[1] == 0).sum() > 0 and (ignored.features == x).all()
    assert (cache_dir() / "shakespeare/tff/shakespeare_train.h5").is_file()


def test_tff_shakespeare_gzip_copy_in_a_data_folder_and_bad_files(tmp_path, monkeypatch):
    train = shakespeare_h5({"ROLE": ["abc"]})
    put(tmp_path, "shakespeare/tff/shakespeare_train.h5.gz", gzip.compress(train))
    put(tmp_path, "shakespeare/tff/shakespeare_test.h5.gz", gzip.compress(train))
    with pytest.raises(DataError, match="shakespeare_train.h5.gz: checksum mismatch"):
        federated(source="shakespeare", data_dirs=[str(tmp_path)], download=False)
    samples, data = federated(source="shakespeare", data_dirs=[str(tmp_path)], download=False, verify=False)
    assert data.num_clients == 1 and shakespeare.decode(samples.features[0]) == "⟨abc⟩"
    no_snippets = put(tmp_path, "bad.h5", h5_bytes(lambda examples: examples.create_group("ROLE_X")))
    with pytest.raises(DataError, match=rf"^{no_snippets}, client 'ROLE_X': no 'snippets' dataset"):
        shakespeare.read_tff_shakespeare(no_snippets)
    not_h5 = put(tmp_path, "not.h5", b"plain text")
    with pytest.raises(DataError, match=rf"^{not_h5}: not a readable HDF5 file"):
        shakespeare.read_tff_shakespeare(not_h5)


def test_leaf_shakespeare_json_from_a_mirror_with_leaf_vocabulary(server, monkeypatch):
    base, root, requests = server
    with pytest.raises(
        DataError,
        match="shakespeare/leaf/train/all_data_niid_023_keep_64_train_9.json.gz .*it has no official "
        "download.*data.mirror",
    ):
        shakespeare.leaf_files(download=True)
    text = "The quick brown fox jumps over the lazy dog! " * 3
    users = {
        "ROLE_A": ([text[k : k + 80] for k in range(5)], [text[k + 80] for k in range(5)]),
        "ROLE_B": ([text[:80]], [text[80]]),
    }
    files = {
        "train/all_data_niid_023_keep_64_train_9.json.gz": leaf_json(users),
        "test/all_data_niid_023_keep_64_test_9.json.gz": leaf_json({"ROLE_A": users["ROLE_A"]}),
    }
    for name, raw in files.items():
        put(root, f"shakespeare/leaf/{name}", raw)
        monkeypatch.setitem(shakespeare.LEAF_FILES, name, sha(raw))
    samples, data = federated(source="shakespeare_leaf", mirror=base)
    assert len(requests) == 2 and samples.num_classes == 80 and samples.labels.shape == (6,)
    np.testing.assert_array_equal(data.sizes, [5, 1])
    assert "".join(shakespeare.LEAF_VOCAB[i] for i in samples.features[2]) == text[2:82]
    assert shakespeare.LEAF_VOCAB[samples.labels[2]] == text[82]


def test_leaf_text_outside_the_vocabulary_names_file_user_and_record(tmp_path):
    window = "a" * 79 + "é"
    bad = put(tmp_path, "leaf/train/t.json.gz", leaf_json({"U1": (["b" * 80, window], ["c", "d"])}))
    put(tmp_path, "leaf/test/t.json.gz", leaf_json({"U1": (["b" * 80], ["c"])}))
    with pytest.raises(
        DataError,
        match=rf"^{bad}, user 'U1': record 1: x has the character 'é', which is not in LEAF's 80-character vocabulary",
    ):
        federated(source="leaf", path=str(tmp_path / "leaf"))
    put(tmp_path, "leaf/train/t.json.gz", leaf_json({"U1": (["b" * 79], ["c"])}))
    with pytest.raises(DataError, match="record 0: x must be a string of 80 characters"):
        federated(source="shakespeare_leaf", path=str(tmp_path / "leaf"))


# --- partitions' laws ----------------------------------------------------------------------------------------


def mnist_like_labels(rng):
    return rng.permutation(np.repeat(np.arange(10), MNIST_COUNTS))


@pytest.mark.parametrize("p, size", [(1, 542), (2, 542), (5, 540), (10, 540)])
def test_yang_et_al_split_gives_every_worker_exactly_p_digits_and_equal_sizes(p, size):
    labels = mnist_like_labels(np.random.default_rng(p))
    parts = P.label_partition(labels, 100, p, np.random.default_rng(10 + p))
    assert len(parts) == 100 and {len(ix) for ix in parts} == {size}  # q = ⌊5421/(10p)⌋ per digit
    assert len(np.unique(np.concatenate(parts))) == 100 * size  # disjoint
    per_client = [np.bincount(labels[ix], minlength=10) for ix in parts]
    assert all(np.count_nonzero(c) == p and set(c[c > 0]) == {size // p} for c in per_client)
    np.testing.assert_array_equal(
        np.count_nonzero(per_client, axis=0), np.full(10, 10 * p)
    )  # each digit held by mp/C workers


def test_label_split_with_clients_not_a_multiple_of_the_classes_and_its_errors():
    labels = mnist_like_labels(np.random.default_rng(0))
    parts = P.label_partition(labels, 7, 3, np.random.default_rng(1))
    assert {len(ix) for ix in parts} == {len(parts[0])} and all(len(np.unique(labels[ix])) == 3 for ix in parts)
    with pytest.raises(ConfigError, match="data.labels_per_client: must be between 1 and the 10 labels"):
        P.label_partition(labels, 100, 11, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="data.partition: 'labels' splits by class"):
        P.label_partition(np.zeros((5, 80), dtype=int), 2, 1, np.random.default_rng(0))


def test_mcmahan_shards_are_200_of_250_two_per_client():
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 5000))  # CIFAR-10's 50,000 training labels
    parts = P.shard_partition(labels, 100, 2, np.random.default_rng(1))
    shards = np.argsort(labels, kind="stable").reshape(200, 250)
    shard_of = np.empty(len(labels), dtype=np.int64)
    shard_of[shards] = np.arange(200)[:, None]
    used = []
    for ix in parts:
        ids, counts = np.unique(shard_of[ix], return_counts=True)
        assert len(ix) == 500 and len(ids) == 2 and set(counts) == {250}  # exactly two whole shards
        assert len(np.unique(labels[ix])) <= 2
        used += ids.tolist()
    assert sorted(used) == list(range(200))


def test_dirichlet_shares_of_a_class_follow_the_beta_marginal():
    """Client k's share of the first class is Beta(α, (K−1)α) under Dir(α·1) (the cap on full clients cannot act on
    the first class)."""
    stats = pytest.importorskip("scipy.stats")
    clients, alpha = 10, 0.5
    labels = np.repeat(np.arange(10), 200)
    rng = np.random.default_rng(2024)
    shares = np.array(
        [np.isin(np.arange(200), P.dirichlet_partition(labels, clients, alpha, rng)[0]).mean() for _ in range(400)]
    )
    variance = (1 / clients) * (1 - 1 / clients) / (clients * alpha + 1)  # Var of Beta(α, (K−1)α)
    assert abs(shares.mean() - 1 / clients) < 4 * np.sqrt(variance / len(shares))
    assert abs(shares.var() / variance - 1) < 0.3
    # client 0 gets ⌊200·S⌋ samples: P(count ≤ k) = P(S < (k+1)/200); Kolmogorov's 1 % bound (conservative for a
    # discrete law)
    counts = np.round(shares * 200).astype(int)
    grid = np.arange(200)
    distance = np.abs(
        (counts[:, None] <= grid).mean(axis=0) - stats.beta(alpha, (clients - 1) * alpha).cdf((grid + 1) / 200)
    ).max()
    assert distance < 1.63 / np.sqrt(len(shares))
    flat = P.dirichlet_partition(labels, clients, 1e4, np.random.default_rng(0))
    assert all(abs(len(ix) - 200) < 15 for ix in flat)  # α → ∞: equal shares


def test_pachinko_split_has_tff_sizes_and_dirichlet_concentrations():
    """500 clients × 100 of 50,000 samples; a client's coarse counts have E[Σ n_g(n_g−1)]/(n(n−1)) = E[Σ p_g²] =
    (α+1)/(Gα+1)."""
    rng = np.random.default_rng(0)
    groups = rng.permutation(np.repeat(np.arange(20), 5))
    labels = rng.permutation(np.repeat(np.arange(100), 500))
    parts = P.pachinko_partition(labels, groups, 500, 0.1, 10.0, np.random.default_rng(1))
    assert len(parts) == 500 and {len(ix) for ix in parts} == {100}
    assert len(np.unique(np.concatenate(parts))) == 50000  # a true partition of the training set
    coarse, fine = [], []
    for ix in parts[:100]:  # early clients: exhaustion does not yet bend their draws
        n = np.bincount(groups[labels[ix]], minlength=20)
        coarse.append((n * (n - 1)).sum() / (100 * 99))
        for g in np.flatnonzero(n > 1):
            m = np.bincount(labels[ix][groups[labels[ix]] == g], minlength=100)
            fine.append((m * (m - 1)).sum() / (n[g] * (n[g] - 1)))
    assert abs(np.mean(coarse) - 1.1 / 3.0) < 4 * np.std(coarse) / 10
    assert abs(np.mean(fine) - 11 / 51) < 4 * np.std(fine) / np.sqrt(len(fine))


# --- the offline copies beside the repository ----------------------------------------------------------------


def test_offline_mnist_has_the_official_counts(shared_data):
    samples, data = federated(
        source="mnist",
        partition="labels",
        clients=100,
        labels_per_client=2,
        data_dirs=[str(shared_data)],
        download=False,
    )
    np.testing.assert_array_equal(np.bincount(samples.labels), MNIST_COUNTS)
    assert samples.features.shape == (60000, 1, 28, 28) and samples.test[0].shape == (10000, 1, 28, 28)
    assert np.bincount(samples.test[1]).tolist() == [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
    assert set(data.sizes) == {542} and all(len(np.unique(data.labels[ix].numpy())) == 2 for ix in data.client_indices)


def test_offline_tff_shakespeare_has_715_roles_and_tff_snippet_counts(shared_data):
    samples, data = federated(source="shakespeare", data_dirs=[str(shared_data)], download=False)
    assert data.num_clients == 715 and samples.num_classes == 90
    assert (
        int((samples.features[:, 0] == shakespeare.BOS).sum()) == 16068
    )  # one BOS per snippet: TFF's 16,068 training snippets
    assert int((samples.test[0][:, 0] == shakespeare.BOS).sum()) == 2356
    assert int(((samples.features > 0) & (samples.features < shakespeare.BOS)).sum()) == 2359315  # every character kept


def test_offline_leaf_shakespeare_users(shared_data):
    """LEAF's test JSON overcounts num_samples by 79 per user (3,881 samples present, 4,671 declared); the samples
    count."""
    samples, data = federated(source="shakespeare_leaf", data_dirs=[str(shared_data)], download=False)
    assert data.num_clients == 10 and data.num_samples == 41990 and len(samples.test[1]) == 3881
    _, generic = federated(source="leaf", path=str(shared_data / "shakespeare" / "leaf"))
    np.testing.assert_array_equal(generic.features.numpy(), data.features.numpy())


# --- fedshuffle data -----------------------------------------------------------------------------------------


def test_data_command_prints_per_client_label_counts_and_writes_a_heatmap(tmp_path):
    files = mnist_fixture(np.random.default_rng(7), n_train=200, n_test=20)
    for name, raw in files.items():
        put(tmp_path / "data", f"mnist/{name}", raw)
    config = tmp_path / "digits.toml"
    config.write_text(
        f'[data]\nsource = "mnist"\npartition = "labels"\nclients = 10\ndata_dirs = ["{tmp_path / "data"}"]\nverify '
        "= false\n"
    )
    runner = CliRunner()
    result = runner.invoke(
        app, ["data", str(config), "--json", "--out", str(tmp_path / "out"), "--set", "data.labels_per_client=2"]
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["num_clients"] == 10 and summary["num_classes"] == 10 and summary["test_size"] == 20
    assert [c["size"] for c in summary["clients"]] == [20] * 10 and summary["sizes"] == {
        "min": 20,
        "median": 20.0,
        "max": 20,
        "mean": 20.0,
    }
    assert all(
        len(c["label_counts"]) == 10
        and sum(c["label_counts"]) == c["size"]
        and np.count_nonzero(c["label_counts"]) == 2
        for c in summary["clients"]
    )
    assert (tmp_path / "out" / "label_heatmap.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "out" / "data_summary.json").read_text())["clients"] == summary["clients"]
    table = runner.invoke(app, ["data", str(config), "--out", str(tmp_path / "out")], terminal_width=200)
    assert table.exit_code == 0 and "20 / 20 / 20" in table.output and "label heatmap" in table.output
    bad = runner.invoke(app, ["data", str(config), "--set", "data.labels_per_client=11"])
    assert bad.exit_code == 2 and "data.labels_per_client: must be between 1 and the 10 labels" in bad.output


def test_token_features_get_sample_weights_in_the_run_dtype():
    """Text samples are int64 token ids; f = Σ_j s_j f_j needs floating s_j = w_i/|D_i|, not ids' integers."""
    import torch

    from fedshuffle.data import FederatedDataset

    data = FederatedDataset(
        torch.zeros((5, 80), dtype=torch.int64),
        torch.zeros((5, 80), dtype=torch.int64),
        [np.arange(2), np.arange(2, 5)],
        np.array([0.4, 0.6]),
    )
    np.testing.assert_allclose(data.sample_weights().numpy(), [0.2] * 5)
    single = data.to(torch.float32)
    assert single.sample_weights().dtype == torch.float32 and single.features.dtype == torch.int64
