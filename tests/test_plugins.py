"""Plugins are imported only with the consent of the person running the command (fedshuffle.plugins)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedshuffle import plugins
from fedshuffle.cli import app
from fedshuffle.core.errors import ConfigError

SRC = str(Path(__file__).resolve().parents[1] / "src")

CONFIG = """
[experiment]
name = "plugged"
plugins = [{names}]
[data]
client_sizes = [1, 2, 3]
[local]
lr = 0.1
[run]
rounds = 2
"""

#: a method of the user's own, appending this process's id to MARKER when imported
METHOD = '''
import os
import fedshuffle as fs

with open({marker!r}, "a") as f:
    f.write(f"{{os.getpid()}}\\n")


class Halved(fs.Method):
    """x <- x - 0.5 * sum(w_i Delta_i)."""

    def aggregate(self, rnd, params, state, payload):
        direction, state, extras = super().aggregate(rnd, params, state, payload)
        return 0.5 * direction, state, extras


fs.METHODS.add({name!r}, Halved, "FedAvg with a halved server direction", "a user's plugin",
               aggregation={{"normalization": "sum_one"}})
'''


def _folder(tmp_path: Path, module: str, body: str) -> Path:
    """``tmp_path`` with ``module.py`` (``body``) and ``c.toml`` naming it."""
    (tmp_path / f"{module}.py").write_text(body)
    (tmp_path / "c.toml").write_text(CONFIG.format(names=f'"{module}"'))
    return tmp_path


def _cli(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != plugins.ENVIRONMENT}
    environment.update({"PYTHONPATH": SRC, **(env or {})})
    return subprocess.run(
        [sys.executable, "-m", "fedshuffle", *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-2000:]
    return lines[0]


def test_show_in_a_folder_holding_the_plugin_imports_nothing_and_says_how_to_allow_it(tmp_path):
    folder = _folder(tmp_path, "evil", 'open("marker", "w").write("ran")\n')
    refused = _cli(folder, "show", "c.toml")
    assert refused.returncode == 2 and not (folder / "marker").exists()
    line = _one_line(refused.stderr)
    assert "experiment.plugins" in line and "--plugins evil" in line and "FEDSHUFFLE_PLUGINS=evil" in line
    allowed = _cli(folder, "show", "c.toml", "--plugins", "evil")
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    assert (folder / "marker").read_text() == "ran"
    assert _one_line(allowed.stderr) == "plugin: importing evil (consented by --plugins)"


def test_the_environment_consents_and_another_name_does_not(tmp_path):
    folder = _folder(tmp_path, "evil", 'open("marker", "w").write("ran")\n')
    other = _cli(folder, "show", "c.toml", "--plugins", "good,better", env={plugins.ENVIRONMENT: "evil2"})
    assert other.returncode == 2 and not (folder / "marker").exists()
    assert "--plugins evil" in _one_line(other.stderr)
    allowed = _cli(folder, "show", "c.toml", env={plugins.ENVIRONMENT: "other, evil"})
    assert allowed.returncode == 0 and (folder / "marker").exists(), allowed.stderr[-2000:]
    assert _one_line(allowed.stderr) == f"plugin: importing evil (consented by {plugins.ENVIRONMENT})"


@pytest.mark.parametrize(
    "body, shown",
    [
        ("raise SystemExit(0)\n", "SystemExit: 0"),
        ("import sys\nsys.exit()\n", "(SystemExit)"),
        ("raise RuntimeError('boom')\n", "RuntimeError: boom"),
        ("import no_such_module_anywhere\n", "ModuleNotFoundError"),
    ],
)
def test_a_plugin_that_exits_or_fails_on_import_is_one_line_and_exit_2(tmp_path, body, shown):
    folder = _folder(tmp_path, "quits", body)
    result = _cli(folder, "show", "c.toml", "--plugins", "quits")
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[0] == "plugin: importing quits (consented by --plugins)" and len(lines) == 2, result.stderr
    assert "experiment.plugins" in lines[1] and "'quits' failed" in lines[1] and shown in lines[1]


def test_a_consented_package_beside_the_config_runs_from_another_folder_and_in_worker_processes(tmp_path):
    """``myfl/`` beside ``mine.toml``, run from elsewhere without PYTHONPATH pointing there: the parent and each worker
    process import it from the config's folder; a package's name consents to its modules."""
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "myfl").mkdir(parents=True)
    elsewhere.mkdir()
    marker = tmp_path / "imports"
    (project / "myfl" / "__init__.py").write_text("")
    (project / "myfl" / "methods.py").write_text(METHOD.format(marker=str(marker), name="halved_fedavg"))
    (project / "mine.toml").write_text(CONFIG.format(names='"myfl.methods"') + '[method]\nname = "halved_fedavg"\n')
    result = _cli(
        elsewhere,
        "run",
        str(project / "mine.toml"),
        "--plugins",
        "myfl",
        "--seeds",
        "0,1",
        "--workers",
        "2",
        "--out",
        str(tmp_path / "out"),
        "--quiet",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"plugin: importing myfl.methods (consented by --plugins) from {project.resolve()}" in result.stderr
    assert result.stderr.count("plugin: importing") == 1  # announced once, by the command
    assert len(set(marker.read_text().split())) >= 2  # the command and its worker processes
    assert len(list((tmp_path / "out").rglob("summary.json"))) >= 1


def test_an_installed_entry_point_needs_no_other_consent(tmp_path):
    site = tmp_path / "site"
    (site / "ep_plugin_dist-1.0.dist-info").mkdir(parents=True)
    info = site / "ep_plugin_dist-1.0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-plugin-dist\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[fedshuffle.plugins]\nmine = ep_plugin\n")
    (site / "ep_plugin.py").write_text(f'open({str(tmp_path / "marker")!r}, "w").write("ran")\n')
    (tmp_path / "c.toml").write_text(CONFIG.format(names='"ep_plugin"'))
    result = _cli(tmp_path, "show", "c.toml", env={"PYTHONPATH": os.pathsep.join([SRC, str(site)])})
    assert result.returncode == 0, result.stderr[-2000:]
    assert (tmp_path / "marker").read_text() == "ran"
    announced = "plugin: importing ep_plugin (consented by the entry point of installed package ep-plugin-dist)"
    assert announced in result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "{config}", "--out", "{out}"],
        ["sweep", "{config}", "--out", "{out}", "--workers", "1"],
        ["data", "{config}", "--out", "{out}"],
        ["inspect", "--config", "{config}"],
        ["reproduce", "{config}", "--no-run", "--out", "{out}"],
        ["flower-app", "{config}", "{out}"],
        ["flower-split", "{config}", "--nodes", "2", "--out", "{out}"],
    ],
    ids=lambda argv: argv[0],
)
def test_every_command_reading_a_config_refuses_an_unconsented_plugin_and_takes_the_option(tmp_path, argv):
    module = f"never_{argv[0].replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(f'open({str(tmp_path / "marker")!r}, "w").write("ran")\n')
    (tmp_path / "c.toml").write_text(CONFIG.format(names=f'"{module}"'))
    args = [a.format(config=tmp_path / "c.toml", out=tmp_path / "out") for a in argv]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and not (tmp_path / "marker").exists(), result.output
    assert f"experiment.plugins: names plugin '{module}'" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()
    assert "--plugins" in CliRunner().invoke(app, [argv[0], "--help"]).output


def test_the_python_api_takes_consent_as_an_argument(tmp_path):
    (tmp_path / "api_plugin_x.py").write_text(f'open({str(tmp_path / "marker")!r}, "w").write("ran")\n')
    (tmp_path / "c.toml").write_text(CONFIG.format(names='"api_plugin_x"'))
    import fedshuffle as fs

    with pytest.raises(ConfigError) as err:
        fs.experiment(tmp_path / "c.toml")
    assert err.value.field == "experiment.plugins" and "fedshuffle.plugins.allow('api_plugin_x')" in err.value.message
    assert not (tmp_path / "marker").exists()
    experiment = fs.experiment(tmp_path / "c.toml", plugins=["api_plugin_x"])
    assert experiment.name == "plugged" and (tmp_path / "marker").read_text() == "ran"
    assert ("api_plugin_x", str(tmp_path.resolve())) in plugins.imported()


def test_bad_consent_is_one_line_naming_where_it_was_given(monkeypatch):
    with pytest.raises(ConfigError) as err:
        plugins.allow(["ok", "not a module"], "--plugins")
    assert err.value.field == "--plugins" and "'not a module'" in err.value.message
    monkeypatch.setenv(plugins.ENVIRONMENT, "a,../b")
    with pytest.raises(ConfigError) as err:
        plugins.load(["some_plugin_module"])
    assert err.value.field == plugins.ENVIRONMENT and "'../b'" in err.value.message
    result = CliRunner().invoke(app, ["show", "quickstart", "--plugins", "x;y"])
    assert result.exit_code == 2 and "--plugins: 'x;y' is not a module name" in result.output


def test_a_flower_app_carries_the_consent_given_when_it_was_written():
    from fedshuffle.integrations.flower.bundle import app_module

    text = app_module("1.2.3", ["myfl.methods"])
    compile(text, "app.py", "exec")
    assert 'allow(["myfl.methods"], "the Flower App (consented when it was written)")' in text
    assert text.index("allow(") < text.index("server = server_app")


def test_the_resume_line_repeats_the_consent(tmp_path):
    from fedshuffle.cli.common import resume_command

    plugins.allow("resumed_plugin_y", "--plugins")
    assert "--plugins " in resume_command("run", "c.toml", None, None, None, tmp_path)
    assert "resumed_plugin_y" in resume_command("run", "c.toml", None, None, None, tmp_path)


def test_worker_processes_import_only_the_plugins_consented_now(tmp_path, monkeypatch):
    """A module imported under one command's --plugins is not imported again by a later command's workers."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "earlier_plugin.py").write_text("")
    plugins.allow("earlier_plugin", "--plugins")
    try:
        plugins.load(["earlier_plugin"])
        assert ("earlier_plugin", "") in plugins.imported()
    finally:
        plugins.withdraw("--plugins")
    assert "earlier_plugin" not in dict(plugins.imported())
    sys.modules.pop("earlier_plugin", None)


@pytest.mark.parametrize(
    "failure, code, said",
    [
        (
            "raise RuntimeError('not in a worker')",
            2,
            "importing plugin 'fragile' failed (RuntimeError: not in a worker)",
        ),
        ("os._exit(1)", 3, "failed: a worker process ended abruptly"),
    ],
)
def test_a_worker_that_cannot_import_a_plugin_or_dies_ends_the_command_in_one_line(tmp_path, failure, code, said):
    """The plugin imports in the command but not in its worker processes: a failed import is the plugin's one-line
    error (exit 2), a worker that dies is one line (exit 3) — no traceback from the pool."""
    body = f"import os\nif os.getpid() != int(os.environ['PLUGIN_PARENT']):\n    {failure}\n"
    folder = _folder(tmp_path, "fragile", body)
    argv = ["run", "c.toml", "--plugins", "fragile", "--seeds", "0,1", "--workers", "2", "--out", "out", "--quiet"]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            f"import os, runpy, sys; os.environ['PLUGIN_PARENT'] = str(os.getpid()); "
            f"sys.argv = ['fedshuffle', *{argv!r}]; runpy.run_module('fedshuffle', run_name='__main__')",
        ],
        cwd=folder,
        env={**{k: v for k, v in os.environ.items() if k != plugins.ENVIRONMENT}, "PYTHONPATH": SRC},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == code, result.stderr[-3000:]
    assert said in result.stderr and "Traceback" not in result.stderr, result.stderr[-3000:]
