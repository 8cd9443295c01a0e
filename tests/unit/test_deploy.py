"""The deployment files are checked: schemas, the commands they run, and how they fit.

- Every Kubernetes manifest under ``deploy/k8s/`` validates against the Kubernetes JSON
  schemas that ``kubernetes-validate`` ships (strict: an unknown field is an error), the
  ServiceMonitor against the schema vendored in ``tests/unit/schemas/`` (a CRD is not in
  the core schemas). ``docker-compose.yml`` validates against the Compose Specification
  schema that ``check-jsonschema`` ships. Both packages work offline.
- Every command a manifest, the compose file or the Dockerfile runs is parsed by the real
  click CLI (``runledger.cli:main``): the command exists, each option exists on it, each
  value converts, each ``RUNLEDGER_*`` variable is one of its options' variables.
- The pieces fit: selectors, port names, probe paths and ports, Secret and ConfigMap
  references, and terminationGracePeriodSeconds against the worker's drain.
- The Grafana dashboard's PromQL names only metrics (and labels) of the metrics contract.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import click
import jsonschema
import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema

from runledger.cli import main

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ROLES_SQL = ROOT / "deploy" / "roles.sql"
DASHBOARD = ROOT / "deploy" / "grafana" / "runledger.json"
SERVICEMONITOR_SCHEMA = Path(__file__).parent / "schemas" / "servicemonitor-monitoring-v1.json"

# The Kubernetes version the manifests are validated against (kubernetes-validate 1.37).
K8S_VERSION = "1.37"

# RUNLEDGER_* variables in the files that no CLI option reads, and the module that reads each.
NON_CLI_ENV = {"RUNLEDGER_PROVIDER_URL": ROOT / "service/runledger/demo/flows.py"}

# The metrics contract (the worker's /metrics): name -> (type, labels).
CONTRACT_METRICS: dict[str, tuple[str, frozenset[str]]] = {
    "runledger_runs_claimed_total": ("counter", frozenset({"flow"})),
    "runledger_takeovers_total": ("counter", frozenset({"flow", "holder"})),
    "runledger_runs_finished_total": ("counter", frozenset({"flow", "status"})),
    "runledger_calls_total": ("counter", frozenset({"flow", "tool", "outcome"})),
    "runledger_lease_renewals_total": ("counter", frozenset()),
    "runledger_leases_lost_total": ("counter", frozenset()),
    "runledger_stale_writes_refused_total": ("counter", frozenset()),
    "runledger_claim_seconds": ("histogram", frozenset()),
    "runledger_call_seconds": ("histogram", frozenset({"tool"})),
    "runledger_runs_active": ("gauge", frozenset()),
    "runledger_queue_depth": ("gauge", frozenset({"flow", "status"})),
    "runledger_write_batches_total": ("counter", frozenset({"kind"})),
    "runledger_batched_writes_total": ("counter", frozenset({"kind"})),
    "runledger_write_batches_failed_total": ("counter", frozenset({"kind"})),
}
# Labels Prometheus adds to every scraped series (the ServiceMonitor's target labels).
TARGET_LABELS = frozenset({"instance", "job", "namespace", "pod", "service", "container"})


# --- loading ----------------------------------------------------------------------------


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.name, doc))
    return docs


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = [
        d for _, d in _manifests() if d["kind"] == kind and name in (None, d["metadata"]["name"])
    ]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def _entrypoint() -> list[str]:
    match = re.search(r"^ENTRYPOINT\s+(\[.*\])\s*$", DOCKERFILE.read_text(), re.M)
    assert match, "deploy/Dockerfile has no exec-form ENTRYPOINT"
    entry: list[str] = json.loads(match.group(1))
    return entry


def _dockerfile_cmd() -> list[str]:
    match = re.search(r"^CMD\s+(\[.*\])\s*$", DOCKERFILE.read_text(), re.M)
    assert match, "deploy/Dockerfile has no exec-form CMD"
    cmd: list[str] = json.loads(match.group(1))
    return cmd


def _containers(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    spec = doc["spec"]["template"]["spec"]
    return [*spec.get("initContainers", []), *spec["containers"]]


# --- the CLI check ----------------------------------------------------------------------


@dataclass
class Invocation:
    command: str
    params: dict[str, Any]


def _option_names(cmd: click.Command) -> set[str]:
    names: set[str] = set()
    for p in cmd.params:
        if isinstance(p, click.Option):
            names.update(p.opts)
            names.update(p.secondary_opts)
    return names


def _envvars(cmd: click.Command) -> set[str]:
    found: set[str] = set()
    for p in cmd.params:
        env = getattr(p, "envvar", None)
        if isinstance(env, str):
            found.add(env)
        elif env:
            found.update(env)
    return found


def check_invocation(
    argv: Sequence[str],
    env: Mapping[str, str] | None = None,
    secret_env: Sequence[str] = (),
) -> Invocation:
    """Parse ``runledger ARGV`` with the real CLI and the given environment.

    Fails (AssertionError or click.UsageError) when the command or an option does not
    exist, a value does not convert, or a RUNLEDGER_* variable is read by no option.
    ``secret_env``: variables whose value is not in the file (a secretKeyRef)."""
    assert argv, "no command"
    ctx = click.Context(main)
    cmd = main.get_command(ctx, argv[0])
    assert cmd is not None, f"runledger has no command {argv[0]!r}"
    assert not isinstance(cmd, click.Group), f"{argv[0]} is a group"
    args = list(argv[1:])
    envvars = _envvars(cmd)
    env = env or {}
    for var in [*env, *secret_env]:
        if var.startswith("RUNLEDGER_") and var not in envvars:
            assert var in NON_CLI_ENV, f"runledger {argv[0]} reads no variable {var}"
    cli_env = {k: v for k, v in env.items() if k in envvars}
    with pytest.MonkeyPatch.context() as mp:
        for var in envvars:
            mp.delenv(var, raising=False)
        for var, value in cli_env.items():
            mp.setenv(var, value)
        parsed = cmd.make_context(argv[0], args, parent=ctx)
    return Invocation(command=argv[0], params=dict(parsed.params))


def test_the_cli_check_refuses_what_the_cli_refuses() -> None:
    with pytest.raises(AssertionError, match="no command"):
        check_invocation(["wurker"])
    with pytest.raises(click.NoSuchOption):
        check_invocation(["worker", "--flows", "m:f", "--grace-secs", "3"])
    with pytest.raises(click.BadParameter):
        check_invocation(["worker", "--flows", "m:f", "--concurrency", "0"])
    with pytest.raises(click.BadParameter):
        check_invocation(["worker", "--flows", "m:f"], env={"RUNLEDGER_CONCURRENCY": "lots"})
    with pytest.raises(AssertionError, match="RUNLEDGER_GRACE"):
        check_invocation(["worker", "--flows", "m:f"], env={"RUNLEDGER_GRACE": "3"})
    with pytest.raises(click.NoSuchOption):  # the worker's option, not migrate's
        check_invocation(["migrate", "--http-port", "9090"])
    ok = check_invocation(["worker", "--flows", "m:f", "--http-port=9090"])
    assert ok.params["http_port"] == 9090


# --- schemas ----------------------------------------------------------------------------


def _validate_manifest(doc: dict[str, Any]) -> None:
    if doc.get("apiVersion") == "monitoring.coreos.com/v1":
        schema = json.loads(SERVICEMONITOR_SCHEMA.read_text())
        assert doc["kind"] == "ServiceMonitor", "only the ServiceMonitor CRD is vendored"
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_manifest_validates_against_its_schema() -> None:
    docs = _manifests()
    kinds = sorted(d["kind"] for _, d in docs)
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "Job",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceMonitor",
    ]
    for filename, doc in docs:
        try:
            _validate_manifest(doc)
        except Exception as exc:
            pytest.fail(f"{filename}: {doc['kind']} does not validate: {exc}")


@pytest.mark.parametrize(
    ("kind", "mutate"),
    [
        # a typo in a field name (strict schemas refuse unknown fields)
        ("Deployment", lambda d: d["spec"]["template"]["spec"].update(terminationGrace=45)),
        (
            "Deployment",
            lambda d: d["spec"]["template"]["spec"]["containers"][0].update(livenesProbe={}),
        ),
        ("Job", lambda d: d["spec"].update(backoffLimit="six")),
        ("PodDisruptionBudget", lambda d: d["spec"].update(maxUnavailabel=1)),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(intervall="15s")),
        ("ServiceMonitor", lambda d: d["spec"]["endpoints"][0].update(interval="15 seconds")),
    ],
)
def test_the_schemas_refuse_a_broken_manifest(kind: str, mutate: Any) -> None:
    doc = copy.deepcopy(_one(kind))
    mutate(doc)
    with pytest.raises(jsonschema.ValidationError):
        _validate_manifest(doc)


def _compose_validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(get_builtin_schema("vendor.compose-spec"))


def test_the_compose_file_validates_against_the_compose_specification() -> None:
    errors = sorted(_compose_validator().iter_errors(_compose()), key=str)
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors)


def test_the_compose_schema_refuses_a_broken_file() -> None:
    broken = _compose()
    broken["services"]["worker"]["healthcheck"]["intervall"] = "5s"
    assert not _compose_validator().is_valid(broken)


# --- the commands the files run ---------------------------------------------------------


def _container_argv(container: Mapping[str, Any]) -> list[str]:
    command = container.get("command", _entrypoint())
    assert command == ["runledger"], f"{container['name']} runs {command}, not runledger"
    args: list[str] = container.get("args", [])
    return args


def _container_env(
    container: Mapping[str, Any],
) -> tuple[dict[str, str], list[str]]:
    values: dict[str, str] = {}
    secret: list[str] = []
    for ref in container.get("envFrom", []):
        cm = _one("ConfigMap", ref["configMapRef"]["name"])
        values.update(cm["data"])
    for item in container.get("env", []):
        if "value" in item:
            values[item["name"]] = item["value"]
        else:
            secret.append(item["name"])
    return values, secret


def _invocations_k8s() -> Iterator[tuple[str, dict[str, Any], Invocation]]:
    for kind in ("Job", "Deployment"):
        doc = _one(kind)
        for container in _containers(doc):
            env, secret = _container_env(container)
            argv = _container_argv(container)
            yield kind, container, check_invocation(argv, env, secret)


def test_every_manifest_command_exists_in_the_cli() -> None:
    seen = {(kind, inv.command) for kind, _, inv in _invocations_k8s()}
    assert seen == {("Job", "migrate"), ("Deployment", "worker")}


def test_every_compose_command_exists() -> None:
    services = _compose()["services"]
    image_services = {name for name, s in services.items() if s.get("build", {}).get("dockerfile")}
    assert image_services == {"migrate", "provider", "worker"}
    for name in sorted(image_services):
        service = services[name]
        env = {k: str(v) for k, v in service.get("environment", {}).items()}
        if "entrypoint" in service:
            # The fake provider: a module of the package, with its own argparse options.
            entry = service["entrypoint"]
            assert entry[:2] == ["python", "-m"], entry
            out = subprocess.run(
                [sys.executable, "-m", entry[2], "--help"],
                capture_output=True,
                text=True,
                check=True,
                timeout=60,
            ).stdout
            for option in (t for t in entry[3:] if t.startswith("--")):
                assert option in out, f"{entry[2]} has no option {option}"
        else:
            check_invocation(service["command"], env)
    # The image's default command, too.
    check_invocation(_dockerfile_cmd())


def test_the_variables_no_option_reads_are_read_by_their_module() -> None:
    for var, module in NON_CLI_ENV.items():
        assert var in module.read_text(), f"{module} does not read {var}"


# --- how the pieces fit -----------------------------------------------------------------


def _worker() -> tuple[dict[str, Any], dict[str, Any], Invocation]:
    [(_, container, inv)] = [x for x in _invocations_k8s() if x[0] == "Deployment"]
    return _one("Deployment"), container, inv


def test_the_worker_serves_its_probes_on_its_http_port() -> None:
    _, container, inv = _worker()
    port = int(inv.params["http_port"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": port}
    probes = {
        kind: (container[kind]["httpGet"]["path"], container[kind]["httpGet"]["port"])
        for kind in ("livenessProbe", "readinessProbe", "startupProbe")
    }
    assert probes == {
        "livenessProbe": ("/livez", "metrics"),
        "readinessProbe": ("/readyz", "metrics"),
        "startupProbe": ("/livez", "metrics"),
    }
    assert inv.params["log_json"] is True


def test_termination_grace_exceeds_the_drain() -> None:
    deployment, _, inv = _worker()
    grace = inv.params["grace_seconds"]  # argv, else the ConfigMap, else the CLI default
    assert grace == 30
    assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > grace
    worker = _compose()["services"]["worker"]
    compose_grace = check_invocation(worker["command"], worker["environment"]).params
    stop = re.fullmatch(r"(\d+)s", worker["stop_grace_period"])
    assert stop, worker["stop_grace_period"]
    assert int(stop.group(1)) > compose_grace["grace_seconds"]


def test_selectors_ports_and_references_fit() -> None:
    deployment = _one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    pdb = _one("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdb["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]
    service = _one("Service")
    assert service["spec"]["selector"].items() <= pod_labels.items()
    [service_port] = service["spec"]["ports"]
    container_ports = {p["name"] for c in _containers(deployment) for p in c.get("ports", [])}
    assert service_port["targetPort"] in container_ports
    monitor = _one("ServiceMonitor")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [service_port["name"]]
    assert [e["path"] for e in monitor["spec"]["endpoints"]] == ["/metrics"]
    # Every secretKeyRef and configMapRef names something in deploy/k8s/.
    secret = _one("Secret")
    for kind in ("Job", "Deployment"):
        for container in _containers(_one(kind)):
            for item in container.get("env", []):
                if "valueFrom" in item:
                    ref = item["valueFrom"]["secretKeyRef"]
                    assert ref["name"] == secret["metadata"]["name"]
                    assert ref["key"] in secret["stringData"]
            for ref in container.get("envFrom", []):
                _one("ConfigMap", ref["configMapRef"]["name"])


def test_the_pods_run_as_non_root_with_resources() -> None:
    for kind in ("Job", "Deployment"):
        spec = _one(kind)["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for container in _containers(_one(kind)):
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert container["resources"]["requests"]
            assert container["resources"]["limits"]["memory"]


def test_the_worker_logs_in_as_the_worker_user_of_roles_sql() -> None:
    secret = _one("Secret")["stringData"]
    worker_user = urlsplit(secret["worker-url"]).username
    assert worker_user == "runledger_worker_login"
    # roles.sql builds the user names as ROLE || '_login' over the three roles.
    sql = ROLES_SQL.read_text()
    assert "v_role || '_login'" in sql
    assert "'runledger_worker'" in sql


def test_the_compose_workers_are_health_checked_on_livez() -> None:
    worker = _compose()["services"]["worker"]
    inv = check_invocation(worker["command"], worker["environment"])
    test = worker["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    compile(test[3], "<healthcheck>", "exec")  # the script is Python
    [url] = re.findall(r"http://[^'\"]+", test[3])
    parts = urlsplit(url)
    assert (parts.path, parts.port) == ("/livez", int(inv.params["http_port"]))


# --- the Grafana dashboard --------------------------------------------------------------


def _expressions(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            # "query" of the datasource variable is the plugin type, not PromQL.
            is_promql = key in ("expr", "definition") or (key == "query" and value != "prometheus")
            if is_promql and isinstance(value, str):
                yield value
            else:
                yield from _expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from _expressions(item)


def promql_problems(expr: str) -> list[str]:
    """Metric and label names in EXPR that are not in the metrics contract."""
    problems: list[str] = []
    used: list[str] = []
    for name in re.findall(r"\brunledger_[a-z_]+\b", expr):
        base = name
        if CONTRACT_METRICS.get(name, ("", frozenset()))[0] == "histogram":
            problems.append(f"{name}: a histogram's series are _bucket, _sum and _count")
            continue
        for suffix in ("_bucket", "_sum", "_count"):
            stem = name.removesuffix(suffix)
            if name.endswith(suffix) and CONTRACT_METRICS.get(stem, ("",))[0] == "histogram":
                base = stem
        if base not in CONTRACT_METRICS:
            problems.append(f"{name}: not a metric of the contract")
            continue
        used.append(base)
    labels = set(TARGET_LABELS)
    for base in used:
        kind, metric_labels = CONTRACT_METRICS[base]
        labels |= metric_labels | ({"le"} if kind == "histogram" else set())
    named = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        named.update(x.strip() for x in group.split(",") if x.strip())
    for selector in re.findall(r"\{([^}]*)\}", expr):
        named.update(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", selector))
    problems.extend(f"label {label!r}: no metric in the query has it" for label in named - labels)
    return problems


def test_the_promql_check_can_fail() -> None:
    assert promql_problems("rate(runledger_runs_claimed_total[5m])") == []
    assert promql_problems("rate(runledger_runs_claimed[5m])")
    assert promql_problems("histogram_quantile(0.5, rate(runledger_claim_seconds[5m]))")
    assert promql_problems("sum by (tool) (rate(runledger_runs_claimed_total[5m]))")
    assert promql_problems('runledger_queue_depth{state="queued"}')


def test_the_dashboard_queries_only_contract_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(_expressions(dashboard))
    assert len(exprs) >= 10
    problems = {e: p for e in exprs if (p := promql_problems(e))}
    assert not problems, json.dumps(problems, indent=2)
    shown = {
        m
        for e in exprs
        for m in CONTRACT_METRICS
        if re.search(rf"\b{m}(_total|_bucket|_sum|_count)?\b", e)
    }
    assert shown == set(CONTRACT_METRICS), f"not on the dashboard: {set(CONTRACT_METRICS) - shown}"
    # Every panel that queries has a data source; ids are unique.
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel.get("targets"):
            assert panel["datasource"]["uid"] == "${datasource}"
