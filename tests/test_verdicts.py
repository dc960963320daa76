"""How verdicts are reached: targets no arm reaches, roles and totals, readings over the last part of a
run and at fractions of it, the seeds a verdict rests on, the papers' tuning protocols, reports that
accumulate, and ``fedshuffle reproduce`` of a file with its own claims."""

import json
import math

import numpy as np
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments import reproduce
from fedshuffle.experiments.claims import parse_claims
from fedshuffle.experiments.reproduction_report import fractions_text, markdown
from fedshuffle.experiments.verdicts import ClaimResult, counts, other_roles
from fedshuffle.experiments.results import write_metrics
from fedshuffle.experiments.schema import load_experiment


def write_curves(tmp_path, label, curves, rounds):
    """One metrics.csv per seed with the given f_gap (and test_accuracy = 1 − f_gap) at ``rounds``."""
    files = []
    for seed, values in enumerate(curves):
        rows = [
            {"round": r, "f_gap": v, "test_accuracy": 1 - v, "mib_up": float(r), "mib_down": 0.0, "epochs": r / 10}
            for r, v in zip(rounds, values)
        ]
        path = tmp_path / label / f"seed-{seed}" / "metrics.csv"
        path.parent.mkdir(parents=True)
        write_metrics(path, rows)
        files.append(path)
    return files


def claim(**raw):
    return parse_claims([{"quote": "the paper's words", **raw}], ["A", "B"])[0]


def test_a_target_no_arm_reaches_is_not_measured_for_who_reaches_it_first(tmp_path):
    rounds = [0, 10, 20]
    runs = {
        "A": write_curves(tmp_path, "A", [[1, 0.9, 0.8]] * 3, rounds),
        "B": write_curves(tmp_path, "B", [[1, 0.95, 0.9]] * 3, rounds),
    }
    both = claim(kind="reaches_first", first="A", second="B", target="f_gap=0.1").judge(runs)
    assert both.verdict == "not measured" and "neither A nor B reached" in both.why
    # reached by the second arm only: the first arm's failure is a verdict
    assert (
        claim(kind="reaches_first", first="B", second="A", target="f_gap=0.85").judge(runs).verdict == "does not hold"
    )


def test_reaching_a_target_in_at_most_k_rounds_fails_when_the_runs_pass_k_without_it(tmp_path):
    """The paper's "95 % in 3 rounds": runs that go to round 20 without reaching it took more than 3 rounds."""
    rounds = [0, 10, 20]
    runs = {"A": write_curves(tmp_path, "A", [[1, 0.9, 0.8]] * 3, rounds)}
    past = claim(kind="reaches", variant="A", target="f_gap=0.1", value=3, bound="at_most").judge(runs)
    assert past.verdict == "does not hold" and "ran past 3 round without reaching f_gap=0.1 in 3 of 3 seeds" in past.why
    # runs that stopped before k say nothing about whether k was enough
    short = claim(kind="reaches", variant="A", target="f_gap=0.1", value=30, bound="at_most").judge(runs)
    assert short.verdict == "not measured" and "no run went past 30 round" in short.why
    # "at least" or "within" a cost: a run that never reached the target gives no cost to compare
    assert (
        claim(kind="reaches", variant="A", target="f_gap=0.1", value=3, tolerance=1).judge(runs).verdict
        == "not measured"
    )
    # two seeds reach it within k, the third runs past k without it: in order where reached, not every seed
    mixed = {"A": write_curves(tmp_path / "m", "A", [[1, 0.05, 0.01], [1, 0.05, 0.01], [1, 0.9, 0.8]], rounds)}
    partly = claim(kind="reaches", variant="A", target="f_gap=0.1", value=12, bound="at_most").judge(mixed)
    assert partly.verdict == "partly" and "only 2 of 3 seeds reached it (1 ran past 12 round without it)" in partly.why


def test_at_least_twice_the_cost_holds_at_exactly_twice(tmp_path):
    """SCAFFOLD sends the control variate with the model: exactly twice FedAvg's bytes a round, so at equal rounds
    "twice" holds."""
    rounds = [0, 1, 2, 3]
    curve = [[1, 0.5, 0.2, 0.1]] * 3
    fedavg = write_curves(tmp_path, "A", curve, rounds)
    scaffold = write_curves(tmp_path / "x", "B", curve, rounds)
    for path in scaffold:  # twice the MiB at every evaluation
        text = path.read_text().splitlines()
        header = text[0].split(",")
        col = header.index("mib_up")
        rows = [
            ",".join(str(2 * float(v)) if i == col else v for i, v in enumerate(line.split(","))) for line in text[1:]
        ]
        path.write_text("\n".join([text[0], *rows]) + "\n")
    runs = {"A": fedavg, "B": scaffold}
    twice = claim(kind="reaches_first", first="A", second="B", target="f_gap=0.3", by="mib", ratio=2).judge(runs)
    assert twice.verdict == "holds", twice
    assert (
        claim(kind="reaches_first", first="A", second="B", target="f_gap=0.3", by="mib", ratio=2.01).judge(runs).verdict
        == "does not hold"
    )
    assert (
        claim(kind="reaches_first", first="A", second="B", target="f_gap=0.3", by="round").judge(runs).verdict
        == "does not hold"
    )  # a tie is not "fewer"


def test_rounds_to_a_target_against_the_papers_number(tmp_path):
    rounds = [0, 1, 2, 3, 4, 5]
    # f_gap reaches 0.5 at round 2 in two seeds and round 3 in the third: mean 2.33, se 0.33
    runs = {
        "A": write_curves(
            tmp_path,
            "A",
            [[1, 0.8, 0.5, 0.4, 0.3, 0.2], [1, 0.8, 0.5, 0.4, 0.3, 0.2], [1, 0.8, 0.6, 0.5, 0.3, 0.2]],
            rounds,
        )
    }
    reaches = claim(kind="reaches", variant="A", target="f_gap=0.5", value=2.9, bound="at_most").judge(runs)
    assert reaches.verdict == "partly" and "2.333 ± 0.33 (n=3)" in reaches.measured  # 2.33 + 2·0.33 > 2.9
    assert (
        claim(kind="reaches", variant="A", target="f_gap=0.5", value=4, bound="at_most").judge(runs).verdict == "holds"
    )
    assert (
        claim(kind="reaches", variant="A", target="f_gap=0.5", value=1, tolerance=0.5).judge(runs).verdict
        == "does not hold"
    )


def test_the_last_fraction_and_the_area_under_the_curve(tmp_path):
    rounds = [0, 10, 20, 30, 40]
    values = [0.9, 0.7, 0.5, 0.3, 0.1]
    runs = {"A": write_curves(tmp_path, "A", [values], rounds), "B": write_curves(tmp_path, "B", [[0.5] * 5], rounds)}
    # last:0.25 of 40 rounds: the evaluations at rounds >= 30: mean(0.3, 0.1) = 0.2; last:0.5: mean(0.5, 0.3, 0.1) = 0.3
    assert (
        "A: 0.2 (n=1)"
        in claim(kind="ordering", metric="f_gap", order=["A", "B"], at="last:0.25", scale="linear").judge(runs).measured
    )
    assert (
        "A: 0.3 (n=1)"
        in claim(kind="ordering", metric="f_gap", order=["A", "B"], at="last:0.5", scale="linear").judge(runs).measured
    )
    # a straight line's area divided by its span is its mean, 0.5; on the log scale the geometric mean of the trapezoids
    assert (
        "A: 0.5 (n=1)"
        in claim(kind="ordering", metric="f_gap", order=["A", "B"], at="auc", scale="linear").judge(runs).measured
    )
    logs = np.log10(values)
    geometric = 10 ** (np.sum(np.diff(rounds) * (logs[1:] + logs[:-1]) / 2) / 40)
    assert (
        f"A: {geometric:.4g} (geometric mean, n=1)"
        in claim(kind="ordering", metric="f_gap", order=["A", "B"], at="auc").judge(runs).measured
    )
    with pytest.raises(ConfigError, match="last:F takes a fraction"):
        claim(kind="ordering", metric="f_gap", order=["A", "B"], at="last:0")


def test_an_ordering_is_also_judged_at_fractions_of_the_run_so_a_flip_shows(tmp_path):
    rounds = [0, 25, 50, 75, 100]
    # A starts better and ends worse than B: the ordering holds at 25 % and 50 % and fails at 100 %
    a = [[1.0, 0.30, 0.20, 0.20, 0.20 + d] for d in (0, 0.01, 0.02)]
    b = [[1.0, 0.60, 0.40, 0.15, 0.10 + d] for d in (0, 0.01, 0.02)]
    runs = {"A": write_curves(tmp_path, "A", a, rounds), "B": write_curves(tmp_path, "B", b, rounds)}
    verdict = claim(kind="ordering", metric="f_gap", order=["A", "B"], scale="linear").judge(runs)
    assert verdict.verdict == "does not hold"
    assert verdict.fractions == ((0.25, "holds"), (0.5, "holds"), (1.0, "does not hold"))
    # the same on the mean of the last half of each cut: at 50 % the rows of rounds 25..50; at 100 % 50..100
    window = claim(kind="ordering", metric="f_gap", order=["A", "B"], at="last:0.5", scale="linear").judge(runs)
    assert (
        window.fractions[1] == (0.5, "holds") and window.fractions[2][1] == "holds"
    )  # A: mean(0.2, 0.2, 0.2x) < B: mean(0.4, 0.15, 0.1x)
    row = ClaimResult(
        "p",
        "P",
        "F",
        "c",
        "q",
        "m",
        verdict.verdict,
        verdict.why,
        fractions={f"{f:.0%}": v for f, v in verdict.fractions},
    )
    assert fractions_text(row) == "holds / holds / does not hold"
    # a cut that leaves only the starting evaluation (where every variant is alike) reads nothing
    early = {k: write_curves(tmp_path / "early", k, [[1.0, 0.5, 0.1]], [0, 10, 20]) for k in ("A", "B")}
    assert claim(kind="ordering", metric="f_gap", order=["A", "B"]).judge(early).fractions[0] == (0.25, "not measured")


def test_a_verdict_on_fewer_seeds_than_the_protocol_says_so(tmp_path):
    rounds = [0, 10]
    runs = {
        "A": write_curves(tmp_path, "A", [[1, 0.1], [1, 0.11]], rounds),
        "B": write_curves(tmp_path, "B", [[1, 0.5], [1, 0.51]], rounds),
    }
    two = claim(kind="ordering", metric="f_gap", order=["A", "B"]).judge(runs)
    assert two.seeds == 2 and two.why.startswith("judged on 2 seeds, fewer than the 3 the protocol asks for;")
    assert not claim(kind="ordering", metric="f_gap", order=["A", "B"], seeds=2).judge(runs).why.startswith("judged on")


def row(paper, verdict, role="primary"):
    return ClaimResult("p", paper, "F", "c", "q", "m", verdict, "why", role)


def test_only_primary_claims_enter_the_totals():
    primary = [row("P", "holds"), row("P", "does not hold")]
    others = [
        row("P", "holds", "proxy"),
        row("P", "holds", "extrapolation"),
        row("P", "does not hold", "post_hoc"),
        row("Q", "holds", "duplicate"),
    ]
    assert counts(primary + others) == {"P": {"holds": 1, "does not hold": 1}, "Q": {}} == {**counts(primary), "Q": {}}
    assert other_roles(primary + others) == {
        "P": {"proxy": {"holds": 1}, "extrapolation": {"holds": 1}, "post_hoc": {"does not hold": 1}},
        "Q": {"duplicate": {"holds": 1}},
    }
    store = {"p": {"name": "p", "paper": "P", "figure": "F", "claims": [r.__dict__ for r in primary + others]}}
    md = markdown(store)
    assert (
        "| P | 1 | 0 | 1 | 0 | 0 |" in md
        and "| P | proxy | 1 | 0 | 0 | 0 | 0 |" in md
        and "| Q | duplicate | 1 |" in md
    )


QUADRATIC = """
[experiment]
paper = "Quad et al."
figure = "Fig. 9"
seeds = [0, 1, 2]
deviations = ["the step grid is ours"]
[problem]
name = "quadratic"
[data]
client_sizes = [1, 2, 3]
[sampler]
name = "full"
[run]
rounds = 8
eval_every = 4
[[variants]]
label = "Tuned"
method = {{ name = "fedavg" }}
local = {{ lr = 0.01 }}
tune = {{ grid = {{ "local.lr" = [0.001, 0.05, 0.01] }}, metric = "f_gap", at = "final", seeds = [100, 101] }}
[[variants]]
label = "Fixed"
method = {{ name = "fedavg" }}
local = {{ lr = 0.002 }}
[[claims]]
kind = "ordering"
quote = "tuned beats fixed"
metric = "f_gap"
order = ["Tuned", "Fixed"]
{extra}
"""


@pytest.fixture
def no_plots(monkeypatch):
    from fedshuffle.experiments import report

    monkeypatch.setattr(report, "plot_runs", lambda groups, out_stem, **_: [])


def test_tuning_selects_on_the_tuning_seeds_and_judges_on_fresh_seeds(tmp_path, no_plots):
    cfg = tmp_path / "quad.toml"
    cfg.write_text(QUADRATIC.format(extra=""))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    tuning = out / "quad.tuning" / "tuned"
    # every grid point on the tuning seeds, and nothing of them in the judged folder
    assert sorted(p.parent.parent.name + "/" + p.name for p in tuning.glob("*/tuned/seed-*")) == sorted(
        f"local.lr-{lr}/seed-{s}" for lr in ("0.001", "0.05", "0.01") for s in (100, 101)
    )
    assert sorted(p.name for p in (out / "quad" / "tuned").glob("seed-*")) == ["seed-0", "seed-1", "seed-2"]
    # the selected point is the best geometric mean of f_gap at the end of the tuning runs
    finals = {
        lr: np.mean(
            [
                np.log10(
                    json.loads((tuning / f"local.lr-{lr}" / "tuned" / f"seed-{s}" / "summary.json").read_text())[
                        "final"
                    ]["f_gap"]
                )
                for s in (100, 101)
            ]
        )
        for lr in ("0.001", "0.05", "0.01")
    }
    best = min(finals, key=finals.get)
    stored = json.loads((out / "verdicts.json").read_text())["presets"]["quad"]
    [t] = stored["tuning"]
    assert t["selected"] == {"local": {"lr": float(best)}} and t["scores"] == pytest.approx(
        [10 ** finals[k] for k in ("0.001", "0.05", "0.01")]
    )
    judged = json.loads((out / "quad" / "tuned" / "seed-0" / "config.json").read_text())["spec"]["local"]["lr"]
    assert judged == float(best)
    # the verdict at every grid point, and the selection, in the report
    assert [b["point"] for b in stored["robustness"]] == ["local.lr = 0.001", "local.lr = 0.05", "local.lr = 0.01"]
    md = (out / "report.md").read_text()
    assert (
        f"Tuned: selected local.lr = {float(best)} by the geometric mean of f_gap final over tuning seeds 100, 101"
        in md
    )
    assert "- the step grid is ours" in md and "| tuned beats fixed | local.lr = 0.001 |" in md.replace(
        "final f_gap: Tuned < Fixed", "tuned beats fixed"
    )
    # again: nothing runs again and the selection is the same
    again = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(out), "--json", "--no-run"])
    assert again.exit_code == 0 and json.loads(again.stdout)["claims"] == json.loads(result.stdout)["claims"]


def test_the_selection_rule_follows_the_metric_and_skips_points_with_a_missing_seed(tmp_path):
    from fedshuffle.experiments.schema import TuneConfig

    tune = TuneConfig(grid={"local.lr": [0.1, 0.2, 0.3]}, metric="test_accuracy", at="last:0.5", seeds=[7, 8])
    rounds = [0, 10, 20]
    key = lambda lr: json.dumps({"local": {"lr": lr}}, sort_keys=True)  # noqa: E731
    runs = {
        key(0.1): write_curves(
            tmp_path / "a", "p", [[1, 0.5, 0.3], [1, 0.5, 0.3]], rounds
        ),  # accuracy: mean of 0.5, 0.7 = 0.6
        key(0.2): write_curves(tmp_path / "b", "p", [[1, 0.4, 0.2], [1, 0.4, 0.2]], rounds),  # 0.7: the best
        key(0.3): write_curves(tmp_path / "c", "p", [[1, 0.1, 0.0]], rounds),
    }  # better still, but one of two seeds
    chosen = reproduce.select("V", tune, runs)
    assert (
        chosen.scores[:2] == pytest.approx([0.6, 0.7])
        and chosen.scores[2] is None
        and chosen.selected == {"local": {"lr": 0.2}}
    )
    assert reproduce.select("V", tune, {}).selected is None


def test_a_tuning_where_no_point_completes_leaves_the_claims_not_measured(tmp_path, no_plots):
    cfg = tmp_path / "quad.toml"
    cfg.write_text(QUADRATIC.format(extra="").replace('"local.lr" = [0.001, 0.05, 0.01]', '"local.lr" = [1e30]'))
    result = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(tmp_path / "o"), "--json"])
    [row] = json.loads(result.stdout)["claims"]
    assert row["verdict"] == "not measured" and "tuning chose no point for Tuned" in row["why"]
    assert not (tmp_path / "o" / "quad").exists()  # nothing judged on an untuned point


def test_tuning_seeds_must_not_be_judged_seeds(tmp_path):
    cfg = tmp_path / "quad.toml"
    cfg.write_text(QUADRATIC.format(extra="").replace("seeds = [100, 101]", "seeds = [2, 101]"))
    with pytest.raises(ConfigError) as info:
        load_experiment(cfg)
    assert info.value.field == "variants[0].tune.seeds" and "seed 2 is also a judged seed" in info.value.message
    cfg.write_text(QUADRATIC.format(extra="").replace('"local.lr" =', '"local.rate" ='))
    with pytest.raises(ConfigError, match="'local.rate' is not a setting"):
        load_experiment(cfg)
    cfg.write_text(QUADRATIC.format(extra="").replace("[0.001, 0.05, 0.01]", "[0.001, -1]"))
    with pytest.raises(ConfigError) as info:
        load_experiment(cfg)  # before anything runs
    assert (
        info.value.field == "variants[0].tune.grid"
        and "{'local': {'lr': -1}} gives no valid run" in info.value.message
        and "local.lr" in info.value.message
    )


TINY = """
[experiment]
paper = "{paper}"
figure = "Fig. 1"
seeds = [0, 1, 2]
[problem]
name = "quadratic"
[data]
client_sizes = [1, 2]
[local]
lr = 0.02
[run]
rounds = 4
eval_every = 2
[[variants]]
label = "FedShuffle"
method = {{ name = "fedshuffle" }}
[[variants]]
label = "FedAvg"
method = {{ name = "fedavg" }}
[[claims]]
kind = "value"
quote = "{quote}"
metric = "f_gap"
variant = "FedShuffle"
value = 1e9
bound = "at_most"
role = "{role}"
"""


def test_reports_accumulate_and_say_when_and_from_which_runs(tmp_path, no_plots):
    out = tmp_path / "out"
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    a.write_text(TINY.format(paper="Paper A", quote="A converges", role="primary"))
    b.write_text(TINY.format(paper="Paper B", quote="B converges", role="proxy"))
    assert CliRunner().invoke(app, ["reproduce", str(a), "--out", str(out)]).exit_code == 0
    first = json.loads((out / "verdicts.json").read_text())["presets"]["a"]
    result = CliRunner().invoke(app, ["reproduce", str(b), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert [c["quote"] for c in json.loads(result.stdout)["claims"]] == ["B converges"]  # this call's claims only
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "“A converges”" in md and "“B converges”" in md and "A converges" in page and "B converges" in page
    assert "| Paper A | 1 | 0 | 0 | 0 | 0 |" in md and "| Paper B | proxy | 1 |" in md
    store = json.loads((out / "verdicts.json").read_text())["presets"]
    assert store["a"] == first and list(store) == ["a", "b"]
    assert sorted(store["a"]["provenance"]["runs"]) == sorted(
        f"a/{v}/seed-{s}" for v in ("fedshuffle", "fedavg") for s in range(3)
    )
    assert all(len(h) == 64 for h in store["a"]["provenance"]["runs"].values())
    assert f"computed {first['computed']} from 6 runs in a/ (seeds 0, 1, 2" in md
    # a preset skipped for its budget keeps the verdicts it had
    skipped = CliRunner().invoke(app, ["reproduce", str(a), "--out", str(out), "--no-run", "--json"])
    assert skipped.exit_code == 0
    (out / "a" / "summary.json").unlink()
    CliRunner().invoke(app, ["reproduce", str(a), "--out", str(out), "--no-run"])
    assert json.loads((out / "verdicts.json").read_text())["presets"]["a"]["claims"][0]["verdict"] == "holds"
    (out / "verdicts.json").write_text("[1]")
    broken = CliRunner().invoke(app, ["reproduce", str(b), "--out", str(out), "--no-run"])
    assert broken.exit_code == 2 and "verdicts.json" in broken.output and "not a verdicts file" in broken.output


def test_reproduce_judges_the_claims_of_a_config_file(tmp_path, no_plots):
    """A researcher's own experiment: a TOML file with its [[claims]], judged like a preset, named after the file."""
    cfg = tmp_path / "mine.toml"
    cfg.write_text(
        TINY.format(paper="My study", quote="mine converges", role="primary").replace(
            'paper = "My study"', 'paper = "My study"\nname = "my-study"'
        )
    )
    result = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [(c["preset"], c["verdict"], c["role"], c["seeds"]) for c in doc["claims"]] == [
        ("my-study", "holds", "primary", 3)
    ]
    assert doc["counts"] == {"My study": {"holds": 1}} and doc["other_roles"] == {}
    assert (tmp_path / "o" / "my-study" / "manifest.json").is_file()
    assert math.isfinite(
        json.loads((tmp_path / "o" / "my-study" / "fedshuffle" / "seed-2" / "summary.json").read_text())["final"][
            "f_gap"
        ]
    )


def test_a_claim_reads_each_variant_at_the_point_the_paper_reports_it(tmp_path):
    """FedCDR's curves are the clients' own models (local_loss), its baseline's the server model (loss)."""
    rounds = [0, 10, 20]

    def runs_of(label, loss, local):
        files = []
        for seed in range(3):
            path = tmp_path / label / f"seed-{seed}" / "metrics.csv"
            path.parent.mkdir(parents=True)
            write_metrics(
                path,
                [
                    {"round": r, "loss": a + 0.01 * seed, "local_loss": b + 0.01 * seed}
                    for r, a, b in zip(rounds, loss, local)
                ],
            )
            files.append(path)
        return files

    runs = {"A": runs_of("A", [2.3, 2.2, 2.1], [2.3, 0.5, 0.2]), "B": runs_of("B", [2.3, 1.5, 1.1], [2.3, 1.5, 1.1])}
    assert claim(kind="ordering", metric="loss", order=["A", "B"]).judge(runs).verdict == "does not hold"
    read = claim(kind="ordering", metric="loss", order=["A", "B"], reading={"A": "local_loss"})
    assert read.judge(runs).verdict == "holds" and "(A: local_loss)" in read.describe()
    for bad, message in (({"C": "local_loss"}, "does not compare"), ({"A": "local_accuracy"}, "not read like")):
        with pytest.raises(ConfigError, match=message):
            claim(kind="ordering", metric="loss", order=["A", "B"], reading=bad)


def test_an_experiment_whose_data_cannot_be_had_reads_not_reproducible(tmp_path, no_plots):
    """The substitute's measurement is shown, but no claim of it holds or fails for the paper."""
    cfg = tmp_path / "substitute.toml"
    cfg.write_text(
        TINY.format(paper="My study", quote="mine converges", role="primary").replace(
            'paper = "My study"',
            'paper = "My study"\nname = "substitute"\nnot_reproducible = "the paper\'s dataset cannot be built here"',
        )
    )
    result = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(tmp_path / "o"), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    (row,) = doc["claims"]
    assert row["verdict"] == "not reproducible" and row["why"].startswith(
        "the paper's dataset cannot be built here; on the substitute it holds"
    )
    assert (
        doc["counts"] == {"My study": {"not reproducible": 1}}
        and "not reproducible" in (tmp_path / "o" / "report.md").read_text()
    )


def test_a_tuning_horizon_cuts_the_tuning_runs_and_a_parts_own_setting_can_be_tuned(tmp_path, no_plots):
    """``tune.rounds``: the grid runs stop there while the judged runs go the variant's whole horizon; the report says
    so.
    A grid may name the chosen part's own settings (FedDyn's method.alpha), and a setting no part takes is refused."""
    cfg = tmp_path / "quad.toml"
    cfg.write_text(QUADRATIC.format(extra="").replace("seeds = [100, 101] }", "seeds = [100], rounds = 4 }"))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    tuned = json.loads(
        (out / "quad.tuning" / "tuned" / "local.lr-0.01" / "tuned" / "seed-100" / "summary.json").read_text()
    )
    judged = json.loads((out / "quad" / "tuned" / "seed-0" / "summary.json").read_text())
    assert tuned["rounds"] == 4 and judged["rounds"] == 8
    assert "of 4-round runs over tuning seeds 100" in (out / "report.md").read_text()
    dyn = cfg.read_text().replace(
        'method = { name = "fedavg" }\nlocal = { lr = 0.01 }',
        'method = { name = "feddyn", alpha = 0.1 }\nlocal = { lr = 0.01 }',
        1,
    )
    assert dyn != cfg.read_text()
    cfg.write_text(dyn.replace('"local.lr" = [0.001, 0.05, 0.01]', '"method.alpha" = [0.01, 0.1]'))
    assert load_experiment(cfg).variants[0].tune.points() == [{"method": {"alpha": 0.01}}, {"method": {"alpha": 0.1}}]
    cfg.write_text(dyn.replace('"local.lr" = [0.001, 0.05, 0.01]', '"method.alfa" = [0.01]'))
    with pytest.raises(ConfigError, match="'method.alfa' is not a setting"):
        load_experiment(cfg)


def test_a_claim_read_two_ways_takes_its_own_readings_verdict_with_the_other_beside_it(tmp_path):
    """FedCDR's presets: the global model (the paper's objective) decides; the clients' own models are reported beside
    it in the same line, and a failure at the global model stays a failure whatever the other reading shows."""
    rounds = [0, 10, 20]
    runs = {
        "A": write_curves(tmp_path, "A", [[1, 0.5, 0.1], [1, 0.5, 0.11], [1, 0.5, 0.12]], rounds),
        "B": write_curves(tmp_path, "B", [[1, 0.6, 0.3], [1, 0.6, 0.31], [1, 0.6, 0.32]], rounds),
        "A own": write_curves(tmp_path, "A own", [[1, 0.6, 0.4], [1, 0.6, 0.41], [1, 0.6, 0.42]], rounds),
        "B own": write_curves(tmp_path, "B own", [[1, 0.5, 0.2], [1, 0.5, 0.21], [1, 0.5, 0.22]], rounds),
    }
    raw = dict(
        kind="ordering",
        metric="f_gap",
        order=["A", "B"],
        reads="the global model",
        alternative={"name": "the clients' own models", "order": ["A own", "B own"]},
    )
    two = parse_claims([{"quote": "q", **raw}], list(runs))[0].judge(runs)
    assert two.verdict == "holds" and two.readings == (
        ("the global model", "holds"),
        ("the clients' own models", "does not hold"),
    )
    assert two.why.startswith("holds at the global model") and "does not hold at the clients' own models" in two.why
    flipped = dict(raw, order=["B", "A"], alternative={"name": "the clients' own models", "order": ["B own", "A own"]})
    fails = parse_claims([{"quote": "q", **flipped}], list(runs))[0].judge(runs)
    assert fails.verdict == "does not hold"  # the paper's objective fails: a failure, though the other reading holds
    assert fails.readings == (("the global model", "does not hold"), ("the clients' own models", "holds"))
    agree = parse_claims(
        [{"quote": "q", **raw, "alternative": {"name": "again", "order": ["A", "B own"]}}], list(runs)
    )[0]
    assert agree.judge(runs).verdict == "holds"  # both readings hold: the claim holds
    row = ClaimResult("p", "P", "F", "c", "q", "m", fails.verdict, fails.why, readings=dict(fails.readings))
    assert counts([row]) == {"P": {"does not hold": 1}}  # counted at the paper's objective, never as a hold
    with pytest.raises(ConfigError, match="alternative cannot change 'quote'"):
        parse_claims([{"quote": "q", **raw, "alternative": {"name": "x", "quote": "other"}}], list(runs))
    with pytest.raises(ConfigError) as info:
        parse_claims([{"quote": "q", **raw, "alternative": {"name": "x", "order": ["A", "C"]}}], list(runs))
    assert info.value.field == "claims[0].alternative.order" and "unknown variant 'C'" in info.value.message
    with pytest.raises(ConfigError, match="names its own: reads"):
        parse_claims([{"quote": "q", **{k: v for k, v in raw.items() if k != "reads"}}], list(runs))


def test_a_speed_is_read_as_rounds_to_the_curves_own_progress(tmp_path):
    """progress:F: different levels, same speed are equal; a curve that settles later is slower whatever its level."""
    rounds = [0, 10, 20, 30, 40]
    fast_high = [[2.0, 1.2, 1.0, 1.0, 1.0]] * 3  # 90 % of its own improvement (to 1.0) by round 20
    slow_low = [[2.0, 1.5, 0.8, 0.3, 0.1]] * 3  # settles at 0.2 (its last 25 %): 90 % of its 1.8 by round 30
    runs = {"A": write_curves(tmp_path, "A", fast_high, rounds), "B": write_curves(tmp_path, "B", slow_low, rounds)}
    speed = claim(kind="ordering", metric="f_gap", order=["A", "B"], at="progress:0.9").judge(runs)
    assert speed.verdict == "holds" and "A: 20 ± 0 (n=3); B: 30 ± 0 (n=3)" in speed.measured
    assert (
        claim(kind="ordering", metric="f_gap", order=["A", "B"], at="last:0.25").judge(runs).verdict == "does not hold"
    )
    flat = {"A": write_curves(tmp_path / "f", "A", [[1.0] * 5] * 3, rounds), "B": runs["B"]}
    assert (
        claim(kind="ordering", metric="f_gap", order=["A", "B"], at="progress:0.9").judge(flat).verdict
        == "not measured"
    )
    with pytest.raises(ConfigError, match="progress:F takes a fraction"):
        claim(kind="ordering", metric="f_gap", order=["A", "B"], at="progress:1.5")


def test_the_report_shows_where_an_orderings_arms_change_order(tmp_path):
    rounds = [0, 25, 50, 75, 100]
    a = [[1.0, 0.30, 0.20, 0.20, 0.20 + d] for d in (0, 0.01, 0.02)]
    b = [[1.0, 0.60, 0.40, 0.15, 0.10 + d] for d in (0, 0.01, 0.02)]
    runs = {"A": write_curves(tmp_path, "A", a, rounds), "B": write_curves(tmp_path, "B", b, rounds)}
    verdict = claim(kind="ordering", metric="f_gap", order=["A", "B"]).judge(runs)
    assert verdict.flips == "A vs B: the order changes at round 75 (reversed at the end)"
    row = ClaimResult(
        "p",
        "P",
        "F",
        "c",
        "q",
        "m",
        verdict.verdict,
        verdict.why,
        flips=verdict.flips,
        fractions={f"{f:.0%}": v for f, v in verdict.fractions},
    )
    assert (
        fractions_text(row)
        == "holds / holds / does not hold; A vs B: the order changes at round 75 (reversed at the end)"
    )
    steady = {"A": runs["A"], "B": write_curves(tmp_path / "s", "B", [[1.0, 0.9, 0.8, 0.7, 0.6]] * 3, rounds)}
    assert claim(kind="ordering", metric="f_gap", order=["A", "B"]).judge(steady).flips == ""


def test_a_target_beyond_the_model_is_not_reproducible_as_stated_with_the_ceiling_the_runs_reached(tmp_path):
    """Logistic regression on MNIST tops out below the paper's 95 %: not "not measured", not "does not hold"."""
    rounds = [0, 1, 2, 3]
    runs = {
        "A": write_curves(tmp_path, "A", [[0.9, 0.2, 0.09, 0.08]] * 3, rounds)
    }  # test_accuracy = 1 − f_gap: at most 0.92
    stated = claim(
        kind="reaches",
        variant="A",
        target="test_accuracy=0.95",
        value=3,
        bound="at_most",
        not_reproducible="multinomial logistic regression does not reach 95 % on MNIST",
    )
    verdict = stated.judge(runs)
    assert verdict.verdict == "not reproducible" and verdict.why.startswith(
        "as stated: multinomial logistic regression"
    )
    assert "best test_accuracy reached: A: 0.92 ± 0 (n=3)" in verdict.measured


def test_a_claim_given_twice_is_refused():
    raw = {"quote": "q", "kind": "ordering", "metric": "f_gap", "order": ["A", "B"]}
    with pytest.raises(ConfigError) as info:
        parse_claims([raw, {**raw}], ["A", "B"])
    assert info.value.field == "claims[1]" and "the same claim as claims[0]" in info.value.message


def test_a_hand_edited_or_copied_verdict_never_shows_as_genuine(tmp_path, no_plots):
    """The store is judged again from its runs before every report: an edited verdict is recomputed, a preset copied
    in without runs is dropped, one whose runs changed reads "not re-checked", malformed entries are one-line errors."""
    out = tmp_path / "out"
    a = tmp_path / "a.toml"
    a.write_text(TINY.format(paper="Paper A", quote="A converges", role="primary"))
    assert CliRunner().invoke(app, ["reproduce", str(a), "--out", str(out)]).exit_code == 0
    path = out / "verdicts.json"
    doc = json.loads(path.read_text())
    record = doc["presets"]["a"]
    record["claims"][0] |= {"verdict": "does not hold", "why": "edited"}
    doc["presets"]["copy"] = {**record, "name": "copy", "claims": record["claims"] * 1000}  # never run into out/copy
    doc["presets"]["ghost"] = {**record, "name": "ghost", "provenance": {}}  # claims verdicts with no runs named
    path.write_text(json.dumps(doc))
    assert CliRunner().invoke(app, ["reproduce", str(a), "--out", str(out), "--no-run"]).exit_code == 0
    store = json.loads(path.read_text())["presets"]
    assert store["a"]["claims"][0]["verdict"] == "holds"  # judged again from its runs
    assert "copy" not in store  # its folder out/copy does not exist
    assert store["ghost"]["claims"][0]["verdict"] == "not re-checked"
    md = (out / "report.md").read_text()
    assert "| Paper A | 1 | 0 | 0 | 0 | 0 | 0 | 1 |" in md  # a holds, ghost not re-checked; nothing counted twice
    # the runs changed since they were judged: the verdict is kept but not counted as a hold
    doc = json.loads(path.read_text())
    doc["presets"]["a"]["provenance"]["runs"]["a/fedshuffle/seed-0"] = "0" * 64
    path.write_text(json.dumps(doc))
    assert CliRunner().invoke(app, ["reproduce", str(a), "--out", str(out), "--no-run"]).exit_code == 0
    assert json.loads(path.read_text())["presets"]["a"]["claims"][0]["verdict"] == "holds"  # --no-run judges it afresh
    doc = json.loads(path.read_text())
    doc["presets"]["a"]["provenance"]["runs"]["a/fedshuffle/seed-0"] = "0" * 64
    path.write_text(json.dumps(doc))
    from fedshuffle.experiments import verdicts

    checked = verdicts.recheck(out, doc["presets"])
    assert (
        checked["a"]["claims"][0]["verdict"] == "not re-checked"
        and "other settings than when it was judged" in checked["a"]["claims"][0]["why"]
    )
    good = json.loads(path.read_text())
    for field, value, message in (
        ("verdict", 42, "42 is not a verdict; accepted: holds"),
        ("role", "boss", "'boss' is not a role"),
        ("paper", None, "expected text, got None"),
    ):
        broken = json.loads(json.dumps(good))
        broken["presets"]["a"]["claims"][0][field] = value
        path.write_text(json.dumps(broken))
        result = CliRunner().invoke(app, ["reproduce", str(a), "--out", str(out), "--no-run"])
        assert result.exit_code == 2 and f"presets['a'].claims[0].{field}: {message}" in " ".join(
            result.output.split()
        ), result.output
