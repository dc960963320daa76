"""The papers' claims as data: each kind and decision rule on hand-made results, validation, and
``fedshuffle reproduce`` end to end on a tiny experiment."""

import json
import time

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError
from fedshuffle.experiments import reproduce as reproduce_module
from fedshuffle.experiments import reproduction_report
from fedshuffle.experiments.claims import CLAIMS, compare, parse_claims, Stat
from fedshuffle.experiments.results import write_metrics
from fedshuffle.experiments.schema import load_experiment, preset_names

QUOTE = "the paper's words"


def curves(tmp_path, label, finals, rounds=(0, 10, 20), start=1.0, mib=1.0):
    """One metrics.csv per seed: f_gap and test_accuracy go linearly from start to the final value."""
    files = []
    for seed, final in enumerate(finals):
        rows = []
        for k, r in enumerate(rounds):
            t = k / (len(rounds) - 1)
            rows.append(
                {
                    "round": r,
                    "f_gap": start + t * (final - start),
                    "test_accuracy": 1 - (start + t * (final - start)),
                    "mib_up": mib * r,
                    "mib_down": 0.0,
                    "epochs": r / 10,
                }
            )
        path = tmp_path / label / f"seed-{seed}" / "metrics.csv"
        path.parent.mkdir(parents=True)
        write_metrics(path, rows)
        files.append(path)
    return files


def claim(**raw):
    return parse_claims([{"quote": QUOTE, **raw}], ["A", "B", "C"])[0]


@pytest.mark.parametrize(
    ("a", "b", "verdict", "why"),
    [
        ([0.10, 0.11, 0.12], [0.50, 0.51, 0.52], "holds", "separated"),
        ([0.10, 0.30, 0.50], [0.35, 0.40, 0.45], "partly", "within 2 standard errors"),
        ([0.50, 0.51, 0.52], [0.10, 0.11, 0.12], "does not hold", "B is not worse than A"),
        ([0.10], [0.11], "holds", "single seed"),
        ([0.11], [0.10], "does not hold", "B is not worse than A"),
    ],
)
def test_ordering_decision_rule(tmp_path, a, b, verdict, why):
    runs = {"A": curves(tmp_path, "A", a), "B": curves(tmp_path, "B", b)}
    result = claim(kind="ordering", metric="f_gap", order=["A", "B"]).evaluate(runs)
    assert result.verdict == verdict and why in result.why
    assert f"n={len(a)}" in result.measured


def test_ordering_follows_the_metric_direction_tiers_and_budgets(tmp_path):
    runs = {
        "A": curves(tmp_path, "A", [0.1, 0.11]),
        "B": curves(tmp_path, "B", [0.3, 0.31]),
        "C": curves(tmp_path, "C", [0.5, 0.51]),
    }
    assert (
        claim(kind="ordering", metric="test_accuracy", order=["A", "B"]).evaluate(runs).verdict == "holds"
    )  # 0.9 > 0.7: higher is better
    assert claim(kind="ordering", metric="test_accuracy", order=["B", "A"]).evaluate(runs).verdict == "does not hold"
    assert claim(kind="ordering", metric="f_gap", order=["A", ["B", "C"]]).evaluate(runs).verdict == "holds"
    assert claim(kind="ordering", metric="f_gap", order=[["A", "C"], "B"]).evaluate(runs).verdict == "does not hold"
    assert claim(kind="ordering", metric="f_gap", order=["A", ["B", "C"]]).describe() == "final f_gap: A < {B, C}"
    # at round 10 the values are halfway from 1: A 0.55, B 0.65; past the end of the run there is no value
    assert "0.55" in claim(kind="ordering", metric="f_gap", order=["A", "B"], at="round=10").evaluate(runs).measured
    assert (
        claim(kind="ordering", metric="f_gap", order=["A", "B"], at="epochs=5").evaluate(runs).verdict == "not measured"
    )
    # best along the run of a curve that gets worse is its start
    worse = {"A": curves(tmp_path, "W", [2.0, 2.0]), "B": runs["B"]}
    assert (
        "A: 1 ± 0 (n=2)"
        in claim(kind="ordering", metric="f_gap", order=["A", "B"], at="best", scale="linear").evaluate(worse).measured
    )


def test_errors_that_go_to_zero_compare_on_a_log_scale(tmp_path):
    # a noise floor of 1e-7 against floors spread over 1e-5..3e-4: apart by orders of magnitude, yet not by 2 standard
    # errors of the values
    runs = {"A": curves(tmp_path, "A", [1e-7, 1.1e-7, 0.9e-7]), "B": curves(tmp_path, "B", [1e-5, 1e-4, 3e-4])}
    linear = claim(kind="ordering", metric="f_gap", order=["A", "B"], scale="linear").evaluate(runs)
    log = claim(kind="ordering", metric="f_gap", order=["A", "B"]).evaluate(runs)
    assert linear.verdict == "partly" and log.verdict == "holds"
    assert "A: 9.967e-08 ×/÷ 1.06 (geometric mean, n=3)" in log.measured


@pytest.mark.parametrize(
    ("finals", "raw", "verdict"),
    [
        ([0.100, 0.101, 0.099], {"value": 0.1, "tolerance": 0.01}, "holds"),
        ([0.095, 0.105, 0.1095], {"value": 0.1, "tolerance": 0.01}, "partly"),
        ([0.2, 0.2], {"value": 0.1, "tolerance": 0.5, "relative": True}, "does not hold"),
        ([1e-9, 2e-9], {"value": 1e-6, "bound": "at_most"}, "holds"),
        ([0.5], {"value": 0.4, "bound": "at_least"}, "holds"),
    ],
)
def test_value_decision_rule(tmp_path, finals, raw, verdict):
    result = claim(kind="value", variant="A", metric="f_gap", **raw).evaluate({"A": curves(tmp_path, "A", finals)})
    assert result.verdict == verdict, result
    assert ("single seed" in result.why) == (len(finals) == 1)


def test_reaches_first(tmp_path):
    # f_gap falls linearly from 1 at round 0 to the final value at round 20; the target 0.6 is first reached at round 10
    # or 20
    fast, slow = curves(tmp_path, "A", [0.1, 0.1, 0.1]), curves(tmp_path, "B", [0.5, 0.55, 0.5])
    never = curves(tmp_path, "C", [0.9, 0.9, 0.9])
    runs = {"A": fast, "B": slow, "C": never}
    first = claim(kind="reaches_first", first="A", second="B", target="f_gap=0.6")
    assert first.metric == "f_gap" and first.evaluate(runs).verdict == "holds"  # 10 vs 20 rounds, no spread
    assert (
        claim(kind="reaches_first", first="B", second="A", target="f_gap=0.6").evaluate(runs).verdict == "does not hold"
    )
    assert (
        claim(kind="reaches_first", first="A", second="C", target="f_gap=0.6").evaluate(runs).why
        == "C never reached it"
    )
    assert "never reached" in claim(kind="reaches_first", first="C", second="A", target="f_gap=0.6").evaluate(runs).why
    assert (
        claim(kind="reaches_first", first="A", second="B", target="f_gap=0.6", ratio=2.5).evaluate(runs).verdict
        == "does not hold"
    )
    assert (
        claim(kind="reaches_first", first="A", second="B", target="f_gap=0.6", by="mib").evaluate(runs).verdict
        == "holds"
    )


def test_compare_separates_by_k_standard_errors():
    a, b = Stat((1.0, 2.0, 3.0)), Stat((4.0, 5.0, 6.0))  # se = 1/√3 each, gap 3 = 3.67 se of the difference
    assert compare(a, b, 3.5, True) == "separated" and compare(a, b, 3.8, True) == "ordered"
    assert compare(b, a, 0, True) == "reversed" and compare(b, a, 2, False) == "separated"


@pytest.mark.parametrize(
    ("raw", "field", "words"),
    [
        ({"kind": "order"}, "claims[0].kind", "did you mean 'ordering'"),
        ({"kind": "ordering", "metric": "f_gapp", "order": ["A", "B"]}, "claims[0].metric", "accepted: "),
        ({"kind": "ordering", "metric": "f_gap", "order": ["A", "D"]}, "claims[0].order", "unknown variant 'D'"),
        ({"kind": "ordering", "metric": "f_gap", "order": ["A", "B"], "at": "rounds=5"}, "claims[0].at", "round=N"),
        (
            {"kind": "value", "metric": "f_gap", "variant": "X", "value": 1},
            "claims[0].variant",
            "accepted: 'A', 'B', 'C'",
        ),
        (
            {"kind": "value", "metric": "f_gap", "variant": "A", "value": 1, "bound": "below"},
            "claims[0].bound",
            "'within', 'at_most' or 'at_least'",
        ),
        (
            {"kind": "reaches_first", "first": "A", "second": "B", "target": "accuracy=0.9"},
            "claims[0].target",
            "unknown metric",
        ),
        (
            {"kind": "reaches_first", "first": "A", "second": "B", "target": "f_gap=0.1", "by": "hours"},
            "claims[0].by",
            "'round'",
        ),
    ],
)
def test_bad_claims_name_the_field_and_accepted_values(raw, field, words):
    with pytest.raises(ConfigError) as info:
        parse_claims([{"quote": QUOTE, **raw}], ["A", "B", "C"])
    assert info.value.field == field and words in info.value.message


def test_a_claim_has_a_role_primary_by_default():
    assert claim(kind="value", metric="f_gap", variant="A", value=0).role == "primary"
    assert claim(kind="value", metric="f_gap", variant="A", value=0, role="post_hoc").role == "post_hoc"
    with pytest.raises(ConfigError) as info:
        claim(kind="value", metric="f_gap", variant="A", value=0, role="secondary")
    assert (
        info.value.field == "claims[0].role"
        and "'primary', 'reduced', 'ablation', 'proxy', 'extrapolation', 'duplicate' or 'post_hoc'"
        in info.value.message
    )


def test_an_experiment_lists_its_deviations(tmp_path):
    path = tmp_path / "dev.toml"
    path.write_text(TINY.format(budget='deviations = ["batch size 50 is ours"]', metric="f_gap"))
    assert load_experiment(path).experiment.deviations == ["batch size 50 is ours"]
    path.write_text(TINY.format(budget='deviations = "one"', metric="f_gap"))
    with pytest.raises(ConfigError, match="experiment.deviations"):
        load_experiment(path)


def test_a_claim_without_the_papers_words_is_refused():
    with pytest.raises(ConfigError, match="claims.0..quote"):
        parse_claims([{"kind": "value", "metric": "f_gap", "variant": "A", "value": 0}], ["A"])


TINY = """
[experiment]
paper = "Tiny et al."
figure = "Fig. 0"
seeds = [0, 1]
{budget}
[problem]
name = "quadratic"
[data]
client_sizes = [1, 2]
[local]
lr = 0.02
[sampler]
name = "full"
[run]
rounds = 6
eval_every = 3
[[variants]]
label = "FedShuffle"
method = {{ name = "fedshuffle" }}
[[variants]]
label = "FedAvg"
method = {{ name = "fedavg" }}
[[claims]]
kind = "ordering"
quote = "FedShuffle dominates"
metric = "{metric}"
order = ["FedShuffle", "FedAvg"]
[[claims]]
kind = "value"
quote = "converges"
metric = "f_gap"
variant = "FedShuffle"
value = 1e9
bound = "at_most"
"""


def test_a_preset_with_a_bad_claim_is_refused_at_load_time(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(TINY.format(budget="", metric="f_gab"))
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    assert info.value.field == "claims[0].metric" and "did you mean 'f_gap'" in info.value.message


def test_reproduce_runs_judges_and_reports(tmp_path, monkeypatch):
    from fedshuffle.experiments import report

    def tiny_plot(
        groups, out_stem, **_
    ):  # the figure itself is tested with `fedshuffle run`; a stand-in keeps this test fast
        out_stem.with_suffix(".png").write_bytes(b"\x89PNG stand-in")
        return [out_stem.with_suffix(".png")]

    monkeypatch.setattr(report, "plot_runs", tiny_plot)
    cfg, gpu = tmp_path / "tiny.toml", tmp_path / "big.toml"
    cfg.write_text(TINY.format(budget="", metric="f_gap"))
    gpu.write_text(TINY.format(budget='budget = "gpu"', metric="f_gap"))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["reproduce", str(cfg), str(gpu), "--out", str(out), "--budget", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    claims = json.loads(result.stdout)["claims"]
    assert [(c["preset"], c["verdict"]) for c in claims][1:] == [
        ("tiny", "holds"),
        ("big", "not run"),
        ("big", "not run"),
    ]
    assert claims[0]["verdict"] in ("holds", "partly", "does not hold") and "FedShuffle:" in claims[0]["measured"]
    assert {"preset", "claim", "measured", "verdict"} <= set(claims[0]) and "sized for a GPU" in claims[2]["why"]
    assert (
        sorted(p.name for p in (out / "tiny").glob("*/seed-*")) == ["seed-0", "seed-0", "seed-1", "seed-1"]
        and not (out / "big").exists()
    )
    md, page = (out / "report.md").read_text(), (out / "report.html").read_text()
    assert "“FedShuffle dominates”" in md and "## tiny: Tiny et al., Fig. 0" in md and "**not run**" in md
    assert "data:image/png;base64,iVBORyBzdGFuZC1pbg==" in page and "<blockquote>“converges”</blockquote>" in page

    def seconds():
        return json.loads((out / "verdicts.json").read_text())["seconds"]

    spent = seconds()
    assert (
        set(spent) == {"tiny"}
        and spent["tiny"]["runs"] > 0
        and "running it took" in md
        and "Wall time of 1 presets" in md
    )
    # again: the runs are kept and the verdicts are the same; the time of continuing them adds to the time they took,
    # also when the call is interrupted
    again = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(out), "--json"])
    assert again.exit_code == 0 and json.loads(again.stdout)["claims"] == claims[:2]
    continued = seconds()
    assert continued["tiny"]["runs"] >= spent["tiny"]["runs"]

    def interrupted(*_, **__):
        time.sleep(0.3)
        raise KeyboardInterrupt

    run_experiment = reproduce_module.run_experiment
    monkeypatch.setattr(reproduce_module, "run_experiment", interrupted)
    assert CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(out)]).exit_code == 130
    monkeypatch.setattr(reproduce_module, "run_experiment", run_experiment)
    continued = seconds()
    assert continued["tiny"]["runs"] >= spent["tiny"]["runs"] + 0.3
    # judged without running: what is there, and the others said to be missing; the time running took is kept
    judged = CliRunner().invoke(app, ["reproduce", str(cfg), str(gpu), "--out", str(out), "--json", "--no-run"])
    rows = json.loads(judged.stdout)["claims"]
    assert rows[:2] == claims[:2] and rows[2]["verdict"] == "not run" and "no finished results in" in rows[2]["why"]
    assert seconds() == continued
    # a folder holding another experiment is refused
    cfg.write_text(TINY.format(budget="", metric="f_gap").replace("lr = 0.02", "lr = 0.01"))
    refused = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(out)])
    assert refused.exit_code == 2 and "holds another experiment" in refused.output


def test_every_preset_carries_claims_that_validate():
    for name in preset_names():
        experiment = load_experiment(name)  # parses the claims against its variants and the metrics
        claims = parse_claims(experiment.claims, [v.label for v in experiment.variants])
        assert claims, f"{name} has no [[claims]]"
        assert all(c.kind in CLAIMS and c.quote for c in claims)


def test_no_sentence_of_a_paper_is_primary_in_two_presets():
    """One primary per statement: a sentence about several panels (Yang et al.'s "In this two figures", three models in
    each) is judged once per panel, each panel in its own preset; a cut-down twin, a subset or a demonstration holds
    none of it (reduced, duplicate)."""
    holders: dict[tuple[str, str, str], list[str]] = {}
    for name in preset_names():
        experiment = load_experiment(name)
        meta = experiment.experiment
        for claim in experiment.claims:
            if claim.get("role", "primary") == "primary":
                key = (meta.paper, claim["quote"], claim.get("figure") or meta.figure)
                holders.setdefault(key, []).append(name)
    twice = {key: names for key, names in holders.items() if len(set(names)) > 1}
    assert not twice, twice


def test_a_reduced_twin_holds_no_primary_claim():
    """A preset cut down for a CPU from a paper-scale one (NAME-cpu beside NAME) reports its claims as reduced."""
    names = set(preset_names())
    twins = [n for n in names if n.endswith("-cpu") and n.removesuffix("-cpu") in names]
    assert len(twins) >= 4
    for name in twins:
        roles = {c.get("role", "primary") for c in load_experiment(name).claims}
        assert "primary" not in roles and "reduced" in roles, (name, roles)


def test_the_python_api_reports_presets_it_does_not_run(tmp_path):
    from fedshuffle import api

    gpu = tmp_path / "big.toml"
    gpu.write_text(TINY.format(budget='budget = "gpu"', metric="f_gap"))
    rows = api.reproduce(str(gpu), out=tmp_path / "o", budget="cpu")
    assert [r["verdict"] for r in rows] == ["not run", "not run"] and rows[1][
        "claim"
    ] == "FedShuffle: final f_gap ≤ 1e+09"
    # holds, partly, does not hold, not measured, not reproducible, not run, not re-checked
    assert "| Tiny et al. | 0 | 0 | 0 | 0 | 0 | 2 | 0 |" in (tmp_path / "o" / "report.md").read_text()
    with pytest.raises(ConfigError, match="--budget: unknown 'tpu'; accepted: cpu, gpu"):
        api.reproduce(str(gpu), out=tmp_path / "o", budget="tpu")


def test_the_report_gives_a_methods_own_quantities_per_round(tmp_path, monkeypatch):
    """FedCDR's prox residual (a metric of kind "method") appears per evaluated round, averaged over seeds."""
    from fedshuffle.experiments import report, reproduce

    monkeypatch.setattr(report, "plot_runs", lambda groups, out_stem, **_: [])
    cfg = tmp_path / "cdr.toml"
    cfg.write_text(
        TINY.format(budget="", metric="loss")
        .replace(
            'name = "fedshuffle" }', 'name = "fedcdr", exact_prox = false, prox_solver = "lbfgs", prox_tol = 1e-9 }'
        )
        .replace('name = "full"', 'name = "cyclic"\ncohort = 1')
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["reproduce", str(cfg), "--out", str(out)])
    assert result.exit_code == 0, result.output
    [diag] = reproduce.diagnostics("cdr", out / "cdr")
    assert (diag.variant, diag.metric, diag.rounds) == ("FedShuffle", "prox_residual", [3, 6])
    seeds = [
        pd.read_csv(p)
        for p in sorted((out / "cdr").glob("*/seed-*/metrics.csv"))
        if pd.read_csv(p)["prox_residual"].notna().any()
    ]
    expected = [float(np.mean([s.loc[s["round"] == r, "prox_residual"].item() for s in seeds])) for r in (3, 6)]
    assert len(seeds) == 2 and diag.values == pytest.approx(expected, rel=1e-12) and max(diag.values) <= 1e-9
    md = (out / "report.md").read_text()
    assert "### cdr, FedShuffle: prox_residual per round" in md and f"| 6 | {diag.values[1]:.4g} |" in md
    assert "prox_residual per round (mean over seeds)" in (out / "report.html").read_text()
    assert [len(reproduction_report.shown_rows(n)) for n in (3, 26, 27, 1000)] == [
        3,
        26,
        26,
        26,
    ] and reproduction_report.shown_rows(1000)[-1] == 999
