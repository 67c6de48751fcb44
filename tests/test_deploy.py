"""The deployment files are valid and agree with the code: Prometheus configs and alert rules
(promtool), the Grafana dashboard (every metric it plots is one the collector exports), the
compose file, the Kubernetes manifests and the systemd unit (their ``node join`` arguments parse).
"""

from __future__ import annotations

import configparser
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from node.cli import _parser, join_config
from node.config import resolve_config
from tests.test_metrics import exported_names, full_node

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
PROM = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "murmuration-swarm.json"
COMPOSE = ROOT / "docker" / "compose.yaml"
METRIC = re.compile(r"\bmurmur_[a-z0-9_]+\b")


def promtool(*args: str, cwd: Path = PROM) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (apt-get install prometheus; see .ci/setup-extras.sh)")
    return subprocess.run(
        [exe, *args], cwd=cwd, capture_output=True, text=True, timeout=60, check=False
    )


def assert_ok(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_rules_are_valid_and_their_unit_tests_pass() -> None:
    assert_ok(promtool("check", "rules", "rules/murmuration.yml"))
    assert_ok(promtool("test", "rules", "tests/alerts.test.yml"))


@pytest.mark.parametrize("config", ["compose.yml", "volunteers.yml"])
def test_prometheus_configs_are_valid(config: str, tmp_path: Path) -> None:
    # a copy with the example target file in place, so file_sd's file is checked too
    work = tmp_path / "prometheus"
    shutil.copytree(PROM, work)
    example = work / "targets" / "volunteers.json.example"
    shutil.copy(example, work / "targets" / "volunteers.json")
    assert_ok(promtool("check", "config", config, cwd=work))


def test_kubernetes_prometheus_config_is_valid(tmp_path: Path) -> None:
    result = promtool("check", "config", "kubernetes.yml")
    if "kubernetes_sd_configs not found" not in result.stdout + result.stderr:
        assert_ok(result)
        return
    # Debian builds Prometheus without Kubernetes discovery: check everything else (the
    # relabelling above all) with the discovery swapped for a static target
    config = yaml.safe_load((PROM / "kubernetes.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["kubernetes_sd_configs"][0]["role"] == "pod"
    del job["kubernetes_sd_configs"]
    job["static_configs"] = [{"targets": ["10.0.0.1:7071"]}]
    config["rule_files"] = [str(PROM / "rules" / "*.yml")]
    (tmp_path / "k8s.yml").write_text(yaml.safe_dump(config))
    assert_ok(promtool("check", "config", "k8s.yml", cwd=tmp_path))


def test_volunteer_targets_example_is_file_sd_shaped() -> None:
    groups = json.loads((PROM / "targets" / "volunteers.json.example").read_text())
    for group in groups:
        assert set(group) == {"targets", "labels"}
        assert all(re.fullmatch(r"[\w.-]+:\d+", t) for t in group["targets"])


def exported() -> set[str]:
    names = exported_names(full_node())
    # histogram and summary families are referenced by their base name too
    return names | {re.sub(r"_(bucket|sum|count)$", "", n) for n in names}


def dashboard_exprs(dashboard: dict[str, Any]) -> list[str]:
    exprs = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            exprs.append(target["expr"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"])
    return exprs


def test_dashboard_loads_and_plots_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
    referenced = {m for e in dashboard_exprs(dashboard) for m in METRIC.findall(e)}
    assert referenced - exported() == set()
    # the swarm at a glance: each theme of the issue is on the dashboard
    for needed in (
        "murmur_loss_ema",
        "murmur_eval_loss",
        "murmur_tokens_total",
        "murmur_stage_replicas",
        "murmur_stage_throughput_samples_per_second",
        "murmur_sync_rounds_total",
        "murmur_replica_spread_rms",
        "murmur_recoveries_total",
        "murmur_activation_max",
        "murmur_activation_min",
        "murmur_grad_norm",
        "murmur_request_duration_seconds_bucket",
        "murmur_wire_bytes_total",
    ):
        assert needed in referenced, needed


def test_alert_rules_use_only_exported_metrics() -> None:
    rules = yaml.safe_load((PROM / "rules" / "murmuration.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    referenced = {m for e in exprs for m in METRIC.findall(e)}
    assert referenced - exported() == set()


def test_operators_guide_names_every_family_and_only_real_ones() -> None:
    text = (DEPLOY / "README.md").read_text()
    named = set(METRIC.findall(text))
    assert named - exported() == set()
    families = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in exported_names(full_node())}
    documented = {re.sub(r"_(bucket|sum|count|total)$", "", n) for n in named}
    assert {f for f in families if f.startswith("murmur_")} - documented == set()


def test_grafana_provisioning_points_at_the_mounted_dashboards() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    boards = yaml.safe_load((prov / "dashboards" / "murmuration.yml").read_text())
    path = boards["providers"][0]["options"]["path"]
    grafana = yaml.safe_load(COMPOSE.read_text())["services"]["grafana"]
    mounts = dict(v.split(":")[:2] for v in grafana["volumes"])
    assert mounts["../deploy/grafana/dashboards"] == path
    assert mounts["../deploy/grafana/provisioning"] == "/etc/grafana/provisioning"


def test_compose_file_agrees_with_its_prometheus_config() -> None:
    compose = yaml.safe_load(COMPOSE.read_text())
    services = compose["services"]
    nodes = {n for n, s in services.items() if s.get("image", "").startswith("${NODE_IMAGE")}
    assert nodes == {"head", "stage1", "stage2", "stage3"}
    assert all(services[n]["init"] is True for n in nodes)
    assert all("container_name" not in services[n] for n in nodes)  # --scale needs this
    assert services["grafana"]["profiles"] == ["grafana"]
    prom = yaml.safe_load((PROM / "compose.yml").read_text())
    sd = prom["scrape_configs"][0]["dns_sd_configs"][0]
    assert set(sd["names"]) == nodes
    assert sd["port"] == int(services["head"]["environment"]["MURMUR_NET_METRICS_PORT"])
    config_flag = next(a for a in services["prometheus"]["command"] if "config.file" in a)
    assert config_flag.endswith("/compose.yml")
    compose_cli = shutil.which("docker-compose")
    if compose_cli:  # the v1 command validates against its Compose Specification schema
        check = subprocess.run(
            [compose_cli, "-f", str(COMPOSE), "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert check.returncode == 0, check.stderr


def k8s_documents() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((DEPLOY / "kubernetes" / "kustomization.yaml").read_text())
    docs = []
    for name in kustomization["resources"]:
        docs += [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]
    return docs


def test_kubernetes_manifests_parse_and_fit_together() -> None:
    docs = k8s_documents()
    kinds = [d["kind"] for d in docs]
    assert kinds.count("StatefulSet") == 2 and "Service" in kinds and "Namespace" in kinds
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["clusterIP"] == "None"  # headless: stable per-pod DNS names
    for sts in (d for d in docs if d["kind"] == "StatefulSet"):
        spec = sts["spec"]
        template = spec["template"]
        assert spec["serviceName"] == service["metadata"]["name"]
        labels = template["metadata"]["labels"]
        assert spec["selector"]["matchLabels"].items() <= labels.items()
        assert service["spec"]["selector"].items() <= labels.items()
        notes = template["metadata"]["annotations"]
        container = template["spec"]["containers"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == ports["metrics"]
        env = {e["name"]: e.get("value", "10.1.2.3") for e in container["env"]}
        args = [a.replace("$(POD_IP)", env["POD_IP"]) for a in container["args"]]
        flags = join_config(_parser().parse_args(["join", *args]))
        assert flags.net.announce == "10.1.2.3" and not flags.net.zeroconf
        assert flags.net.bootstrap[0].split(".")[1] == f"{service['metadata']['name']}:7070"
        assert resolve_config(None, env, {}).net.metrics_port == ports["metrics"]


def test_systemd_unit_runs_a_valid_node_command() -> None:
    unit = configparser.ConfigParser(strict=True, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd" / "murmuration-node.service")
    assert {"Unit", "Service", "Install"} <= set(unit.sections())
    service = unit["Service"]
    assert service["KillSignal"] == "SIGTERM" and service["Restart"] == "on-failure"
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/node") and argv[1] == "join"
    args = _parser().parse_args(argv[1:])
    args.config = str(DEPLOY / "systemd" / "node.toml")  # the example the unit's comment installs
    config = join_config(args)
    assert config.net.metrics_port == 7071
    assert config.node.state_dir == "/var/lib/" + service["StateDirectory"]
