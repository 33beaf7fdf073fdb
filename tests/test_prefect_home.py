"""Where Prefect keeps its state when the ``rollflow`` command runs (flows/prefect_home.py).

Without PREFECT_HOME (and without a Prefect server in PREFECT_API_URL) Prefect writes its
database and profiles to ``~/.prefect``, shared by every run on the machine, and fails at
length when $HOME is missing. The command gives it ``<project>/.rollflow/prefect`` instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rollflow.flows.prefect_home import use_project_prefect_home

# `rollflow train` with a config that does not exist: the real entry, stopped in its first
# line (before Prefect's server starts); then Prefect, imported after it, names its home.
_REPORT_PREFECT_HOME = (
    "from rollflow.flows.cli import main\n"
    "code = main(['train', 'missing.toml'])\n"
    "from prefect.settings import get_current_settings\n"
    "print(get_current_settings().home)\n"
    "raise SystemExit(code)\n"
)


@pytest.mark.slow  # 7 s in a loaded suite run (docs/testing.md)
def test_cli_gives_prefect_a_home_under_the_working_folder_not_in_home(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env["HOME"] = str(home)
    result = subprocess.run(
        [sys.executable, "-c", _REPORT_PREFECT_HOME], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1 and "missing.toml" in result.stderr, result.stderr
    reported = Path(result.stdout.strip().splitlines()[-1])
    expected = (work / ".rollflow" / "prefect").resolve()
    assert reported.resolve() == expected, f"Prefect's home is {reported}, expected {expected}"
    assert expected.is_dir(), "the Prefect home is created before Prefect starts"
    assert not (home / ".prefect").exists(), "Prefect wrote to ~/.prefect"


def test_prefect_home_is_the_project_root_from_a_subfolder(tmp_path: Path) -> None:
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    sub = tmp_path / "experiments" / "a"
    sub.mkdir(parents=True)
    environ: dict[str, str] = {}
    chosen = use_project_prefect_home(environ, start=sub)
    assert chosen == (tmp_path / ".rollflow" / "prefect").resolve()
    assert environ["PREFECT_HOME"] == str(chosen) and chosen.is_dir()
    assert environ["PREFECT_SERVER_ANALYTICS_ENABLED"] == "false"


def test_a_users_prefect_home_or_server_is_left_alone(tmp_path: Path) -> None:
    own_home = {"PREFECT_HOME": str(tmp_path / "mine")}
    assert use_project_prefect_home(own_home, start=tmp_path) is None
    assert own_home["PREFECT_HOME"] == str(tmp_path / "mine")
    with_server = {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    assert use_project_prefect_home(with_server, start=tmp_path) is None
    assert "PREFECT_HOME" not in with_server
    assert not (tmp_path / ".rollflow").exists()


def test_a_server_set_in_the_users_prefect_profile_is_used(tmp_path: Path) -> None:
    """The newcomer's trap: ``prefect config set PREFECT_API_URL=...`` writes the user's
    profile, which a project home hid, so ``rollflow pipeline`` ran on a temporary server
    outside the user's UI."""
    (tmp_path / ".prefect").mkdir()
    (tmp_path / ".prefect" / "profiles.toml").write_text(
        'active = "local"\n[profiles.local]\nPREFECT_API_URL = "http://127.0.0.1:4200/api"\n'
        '[profiles.ephemeral]\nPREFECT_SERVER_ANALYTICS_ENABLED = "false"\n'
    )
    environ = {"HOME": str(tmp_path)}
    assert use_project_prefect_home(environ, start=tmp_path) is None
    assert "PREFECT_HOME" not in environ and not (tmp_path / ".rollflow").exists()
    other = {"HOME": str(tmp_path), "PREFECT_PROFILE": "ephemeral"}  # a profile without a server
    assert use_project_prefect_home(other, start=tmp_path) == tmp_path / ".rollflow" / "prefect"


TRIGGERS = "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED"


def test_the_temporary_servers_unused_services_are_off_unless_the_user_set_them(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    use_project_prefect_home(environ, start=tmp_path)
    assert environ[TRIGGERS] == "false"
    own = {TRIGGERS: "true"}
    use_project_prefect_home(own, start=tmp_path)
    assert own[TRIGGERS] == "true"
    older = {"PREFECT_API_SERVICES_TRIGGERS_ENABLED": "true"}  # the spelling Prefect still reads
    use_project_prefect_home(older, start=tmp_path)
    assert TRIGGERS not in older
    with_server = {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}  # a real server: its own services
    use_project_prefect_home(with_server, start=tmp_path)
    assert TRIGGERS not in with_server


# The real entry (stopped in its first line), then Prefect's temporary server's process as
# a flow starts it (the command Prefect's SubprocessASGIServer.start runs, not waited on
# to serve: its database's migrations are not what is checked); what that process was
# started with, from /proc once it runs uvicorn.
_REPORT_SERVER_ENVIRONMENT = (
    "import time\n"
    "from rollflow.flows.cli import main\n"
    "main(['train', 'missing.toml'])\n"
    "from prefect.server.api.server import SubprocessASGIServer\n"
    "server = SubprocessASGIServer()\n"
    "process = server._run_uvicorn_command()\n"
    "try:\n"
    "    deadline = time.monotonic() + 60\n"
    "    while b'uvicorn' not in open(f'/proc/{process.pid}/cmdline', 'rb').read():\n"
    "        assert time.monotonic() < deadline and process.poll() is None, 'uvicorn never started'\n"
    "        time.sleep(0.01)\n"
    "    print(open(f'/proc/{process.pid}/environ').read().replace(chr(0), chr(10)))\n"
    "finally:\n"
    "    process.kill()\n"
    "    process.wait()\n"
)


@pytest.mark.slow  # 27 s in a loaded suite run (docs/testing.md)
def test_the_services_setting_reaches_prefects_temporary_server(tmp_path: Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("PREFECT_API_URL", TRIGGERS)}
    env["PREFECT_HOME"] = str(tmp_path / "prefect")
    for given, expected in ((None, "false"), ("true", "true")):
        if given is not None:
            env[TRIGGERS] = given
        result = subprocess.run(
            [sys.executable, "-c", _REPORT_SERVER_ENVIRONMENT], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=240,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        seen = [line.split("=", 1)[1] for line in result.stdout.splitlines() if line.startswith(f"{TRIGGERS}=")]
        assert [value.lower() for value in seen] == [expected], result.stdout[-3000:]  # Prefect writes "False"


STARTUP = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def test_the_temporary_server_gets_a_generous_start_up_time_unless_the_user_set_one(tmp_path: Path) -> None:
    """Prefect's 20 s default timed out on the newcomer's first run on a loaded 2-core
    machine (its database being created); `make` gave 120 s, a plain `rollflow` did not."""
    environ: dict[str, str] = {}
    use_project_prefect_home(environ, start=tmp_path)
    assert environ[STARTUP] == "120"
    own = {STARTUP: "45"}
    use_project_prefect_home(own, start=tmp_path)
    assert own[STARTUP] == "45"
    (tmp_path / ".prefect").mkdir()
    (tmp_path / ".prefect" / "profiles.toml").write_text(f'active = "mine"\n[profiles.mine]\n{STARTUP} = 300\n')
    in_profile = {"HOME": str(tmp_path)}  # an environment variable would hide the profile's value
    use_project_prefect_home(in_profile, start=tmp_path)
    assert STARTUP not in in_profile
    with_server = {"PREFECT_API_URL": "http://127.0.0.1:4200/api"}  # no temporary server to wait for
    use_project_prefect_home(with_server, start=tmp_path)
    assert STARTUP not in with_server


@pytest.mark.slow
def test_a_temporary_server_that_does_not_start_in_time_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    """A real `rollflow eval` whose Prefect server gets no time at all to start (0 s: Prefect
    does not wait); it used to end in a RuntimeError traceback."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false", **{STARTUP: "0"})
    config = tmp_path / "eval.toml"
    config.write_text("[tracking]\nenabled = false\n")
    result = subprocess.run(
        [sys.executable, "-m", "rollflow.flows.cli", "eval", "--config", str(config), "--tasks", "1",
         "--base-url", "http://127.0.0.1:9/v1", "--api-model", "none", "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    ours = [line for line in result.stderr.splitlines() if line.startswith("rollflow eval:")]
    assert len(ours) == 1, result.stderr[-3000:]
    assert "Prefect's temporary API server did not start within 0 s" in ours[0], ours[0]
    assert f"raise {STARTUP}" in ours[0], ours[0]
