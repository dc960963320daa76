"""A decoded checkpoint is checked against the run's own state before anything uses it (experiments.loop)."""

import copy
import dataclasses
import shutil

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

import fedshuffle as fs
from fedshuffle.cli import app
from fedshuffle.core.checkpoint import read_checkpoint, save_checkpoint
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments.loop import COLUMNS, check_state, load_checkpoint
from fedshuffle.experiments.results import write_metrics

OWNER = {"config_hash": "h", "label": "", "seed": 0}


def simulation(method: str = "scaffold", **run):
    return fs.experiment(
        {
            "method": {"name": method},
            "data": {"client_sizes": [2, 3, 4]},
            "local": {"lr": 0.05},
            "run": {"rounds": 6, **run},
        }
    ).simulation()


@pytest.fixture
def saved(tmp_path):
    """A SCAFFOLD run's checkpoint after two rounds (rows of rounds 0 and 2 in it and in metrics.csv), and the path."""
    sim = simulation()
    sim.step()
    sim.step()
    blank = dict.fromkeys(COLUMNS)  # a recorded row holds every column (None where not measured)
    rows = [{**blank, "round": 0, "loss": 0.5}, {**blank, "round": 2, "loss": 0.25}]
    write_metrics(tmp_path / "metrics.csv", rows)
    state = {"simulation": sim.state_dict(), "rows": rows}
    return state, tmp_path / "checkpoint.pt"


def resume(path, state):
    save_checkpoint(path, state, {**OWNER, "round": 2})  # the header recomputed: the digest proves nothing
    sim = simulation()
    return sim, load_checkpoint(path, sim, OWNER, 6)


def test_a_checkpoint_of_the_runs_own_state_restores_it(saved):
    state, path = saved
    sim, rows = resume(path, state)
    assert rows == state["rows"] and sim.counters.rounds == 2
    assert torch.equal(sim.params, state["simulation"]["params"])


def _extra_counter(s):
    s["simulation"]["counters"]["extra"] = 1


def _string_rounds(s):
    s["simulation"]["counters"]["rounds"] = "2"


def _float_rounds(s):
    s["simulation"]["counters"]["rounds"] = 2.0


def _no_server(s):
    del s["simulation"]["server"]


def _other_method_state(s):
    s["simulation"]["method"] = {"momentum": torch.zeros(9, dtype=torch.float64)}


def _short_control(s):
    s["simulation"]["method"]["control"] = torch.zeros(4, dtype=torch.float64)


def _int64_params(s):
    s["simulation"]["params"] = s["simulation"]["params"].to(torch.int64)


def _float16_params(s):
    s["simulation"]["params"] = s["simulation"]["params"].to(torch.float16)


def _rows_of_integers(s):
    s["rows"] = [1, 2]


def _no_rows(s):
    s["rows"] = []


def _rows_a_dict(s):
    s["rows"] = {"round": 0}


def _rows_out_of_order(s):
    s["rows"] = s["rows"][::-1]


def _rows_past_the_checkpoint(s):
    s["rows"] = [*s["rows"], {**s["rows"][-1], "round": 4}]


def _row_without_a_column(s):
    del s["rows"][1]["compute_seconds"]


def _extra_top_key(s):
    s["more"] = 1


def _client_rows_of_other_dtype(s):
    arrays = s["simulation"]["client_store"]["arrays"]
    arrays["control"] = arrays["control"].astype(np.float32)


def _extras_a_string(s):
    s["simulation"]["last_extras"] = {"x": "1"}


@pytest.mark.parametrize(
    "tamper, said",
    [
        (_extra_counter, "state.counters has other keys than the run's (extra 'extra')"),
        (_string_rounds, "state.counters.rounds = '2', expected an integer >= 0"),
        (_float_rounds, "state.counters.rounds = 2.0, expected an integer >= 0"),
        (_no_server, "state has other keys than the run's (missing 'server')"),
        (_other_method_state, "state.method has other keys than the run's (extra 'momentum'; missing 'control')"),
        (_short_control, "state.method.control is a Tensor (4,) of torch.float64, the run's is a Tensor (9,) of"),
        (_int64_params, "state.params is a Tensor (9,) of torch.int64, the run's is a Tensor (9,) of torch.float64"),
        (_float16_params, "state.params is a Tensor (9,) of torch.float16"),
        (_rows_of_integers, "rows[0] is not a record of numbers"),
        (_no_rows, "rows hold rounds [], metrics.csv rounds [0, 2]"),
        (_rows_a_dict, "rows is a dict, expected a list of records"),
        (_rows_out_of_order, "rows[1] is of round 0, after round 2"),
        (_rows_past_the_checkpoint, "rows[2] is of round 4, after round 2 and up to the checkpoint's 2"),
        (_row_without_a_column, "rows[1] lacks the column compute_seconds"),
        (_extra_top_key, "checkpoint has other keys than the run's (extra 'more')"),
        (_client_rows_of_other_dtype, "state.client_store.arrays.control is a ndarray (3, 9) of float32"),
        (_extras_a_string, "state.last_extras is not a dict of numbers"),
    ],
    ids=lambda v: getattr(v, "__name__", "")[1:],
)
def test_a_checkpoint_not_of_the_runs_state_is_a_damaged_checkpoint_line(saved, tamper, said):
    state, path = saved
    state = copy.deepcopy(state)
    tamper(state)
    with pytest.raises(ConfigError) as err:
        resume(path, state)
    text = str(err.value)
    assert text.startswith(f"{path}: damaged checkpoint (") and said in text and "\n" not in text, text


def test_rows_the_table_has_not_synced_yet_are_accepted(saved):
    """metrics.csv grows without fsync: after a crash it may lack the checkpoint's last rows, never have others."""
    state, path = saved
    write_metrics(path.with_name("metrics.csv"), state["rows"][:1])
    assert resume(path, state)[1] == state["rows"]


def file_backed(folder):
    """A SCAFFOLD simulation keeping its client state in memory-mapped files in ``folder``."""
    return dataclasses.replace(simulation(), state_memory_limit=0, state_dir=str(folder))


def test_a_file_backed_client_store_is_checked_without_writing_its_journal(tmp_path):
    sim = file_backed(tmp_path / "state")
    assert sim.store is not None and sim.store.mapped
    sim.step()
    state = {"simulation": sim.state_dict(), "rows": []}
    sim.commit_checkpoint()
    save_checkpoint(tmp_path / "checkpoint.pt", state, {**OWNER, "round": 1})
    shutil.copytree(tmp_path / "state", tmp_path / "probe")
    files = {p.name: p.read_bytes() for p in (tmp_path / "probe").iterdir()}
    file_backed(tmp_path / "probe").state_dict()  # what asking the store for its state does: it writes its journal
    assert {p.name: p.read_bytes() for p in (tmp_path / "probe").iterdir()} != files
    fresh = file_backed(tmp_path / "state")
    check_state(read_checkpoint(tmp_path / "checkpoint.pt")[1], fresh, tmp_path / "checkpoint.pt")
    assert {p.name: p.read_bytes() for p in (tmp_path / "state").iterdir()} == files
    assert load_checkpoint(tmp_path / "checkpoint.pt", fresh, OWNER, 6) == []
    assert torch.equal(fresh.params, sim.params)
    state["simulation"]["client_store"]["hashes"]["control"] = np.zeros(7, dtype=np.uint64)
    save_checkpoint(tmp_path / "checkpoint.pt", state, {**OWNER, "round": 1})
    with pytest.raises(ConfigError, match=r"damaged checkpoint \(state.client_store.hashes.control is a ndarray \(7,"):
        load_checkpoint(tmp_path / "checkpoint.pt", file_backed(tmp_path / "state"), OWNER, 6)


def test_resuming_from_a_checkpoint_without_its_rows_leaves_metrics_csv_as_it_was(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text("[data]\nclient_sizes = [2, 3]\n[local]\nlr = 0.1\n[run]\nrounds = 4\neval_every = 2\n")
    out = tmp_path / "out"
    first = CliRunner().invoke(app, ["run", str(config), "--out", str(out), "--quiet"])
    assert first.exit_code == 0, first.output
    checkpoint = out / "seed-0" / "checkpoint.pt"
    recorded, state = read_checkpoint(checkpoint)
    save_checkpoint(checkpoint, {**state, "rows": []}, recorded)
    table = (out / "seed-0" / "metrics.csv").read_bytes()
    again = CliRunner().invoke(app, ["run", str(config), "--resume", str(out), "--extend-to", "6", "--quiet"])
    assert again.exit_code == 3, again.output
    assert "damaged checkpoint (rows hold rounds [], metrics.csv rounds [0, 2, 4])" in again.output
    assert "Traceback" not in again.output and (out / "seed-0" / "metrics.csv").read_bytes() == table
