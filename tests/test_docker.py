"""The compose swarm for real: build the node image, bring up docker/compose.yaml (head,
three block stages, one of them scaled), and check that the containers find each other by
zeroconf, train, are scraped by the Prometheus in compose, and leave cleanly on ``stop``.

Needs a Docker engine and a compose command. Without a registry (CI, this machine) the base
images are local stand-ins built by ``.ci/setup-extras.sh``; the test runs that script once
when they are missing. Skipped, with the reason, only when no Docker engine can run.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from node.demo import free_port
from tests.helpers import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(720)]

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
# Debian's client (20.10) does BuildKit builds without the buildx plugin a newer one wants
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else shutil.which("docker")
TORCH_STANDIN = "localpython:3.11-slim-torchcpu"
# the compose file's default Prometheus image (setup-extras.sh tags its stand-in so)
PROMETHEUS_IMAGE = re.findall(r"prom/prometheus:[\w.-]+", COMPOSE_FILE.read_text())[0]
NODE_IMAGE = "murmuration/node:test"  # one tag for every run, so layers are reused
EXPECTED_REPLICAS = {"0": 1, "1": 2, "2": 2, "3": 1}  # stage1 scaled to 2; stage2 has 2


def run(cmd: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.stdout


def have_image(name: str) -> bool:
    assert DOCKER is not None
    return subprocess.run([DOCKER, "image", "inspect", name], capture_output=True).returncode == 0


def engine_or_skip() -> str:
    if DOCKER is None:
        pytest.skip("no docker client installed (.ci/setup-extras.sh installs docker.io)")
    if subprocess.run([DOCKER, "info"], capture_output=True, timeout=30).returncode != 0:
        if os.geteuid() == 0:
            subprocess.run(["bash", str(ROOT / ".ci" / "setup-extras.sh")], timeout=900)
        if subprocess.run([DOCKER, "info"], capture_output=True, timeout=30).returncode != 0:
            pytest.skip("no Docker engine is running and none could be started here")
    return DOCKER


def compose_command(docker: str) -> list[str]:
    if subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    v1 = shutil.which("docker-compose")
    if v1 is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed")
    return [v1]


def ensure_base_images() -> None:
    """Stand-ins where no registry can be reached; the script is idempotent."""
    if have_image("python:3.11-slim") and have_image(PROMETHEUS_IMAGE):
        return
    if os.geteuid() == 0:
        subprocess.run(["bash", str(ROOT / ".ci" / "setup-extras.sh")], timeout=900)
    missing = [i for i in ("python:3.11-slim", PROMETHEUS_IMAGE) if not have_image(i)]
    if missing:
        pytest.fail(f"images {missing} are missing and .ci/setup-extras.sh could not build them")


class ComposeSwarm:
    """One compose project with its own name and host ports; always taken down."""

    def __init__(self, compose: list[str]) -> None:
        self.project = f"murmurtest{secrets.token_hex(3)}"
        self.head_port = free_port()
        self.prometheus_port = free_port()
        standin = have_image(TORCH_STANDIN)
        self.env = {
            **os.environ,
            "PATH": f"/usr/bin:{os.environ.get('PATH', '')}",
            "DOCKER_BUILDKIT": "1",
            "COMPOSE_DOCKER_CLI_BUILD": "1",
            "NODE_IMAGE": NODE_IMAGE,
            "SWARM_NAME": self.project,
            "HEAD_PORT": str(self.head_port),
            "PROMETHEUS_PORT": str(self.prometheus_port),
            # the CPU torch wheel baked into the stand-in replaces PyTorch's CPU index here
            **({"BASE_IMAGE": TORCH_STANDIN, "TORCH_INDEX_URL": ""} if standin else {}),
        }
        self.cmd = [*compose, "-p", self.project, "-f", str(COMPOSE_FILE)]

    def __call__(self, *args: str, timeout_s: float = 120) -> str:
        return run([*self.cmd, *args], timeout_s, self.env)

    def containers(self) -> dict[str, dict[str, Any]]:
        ids = self("ps", "-a", "-q").split()  # -a: v2 lists only running ones otherwise
        assert DOCKER is not None
        out = json.loads(run([DOCKER, "inspect", *ids], 30)) if ids else []
        return {c["Name"].lstrip("/"): c for c in out}

    def logs(self) -> str:
        try:
            return self("logs", "--no-color", "--tail", "25", timeout_s=60)
        except (AssertionError, subprocess.TimeoutExpired) as e:
            return str(e)


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def query(port: int, promql: str) -> list[dict[str, Any]]:
    q = urllib.parse.urlencode({"query": promql})
    body = get_json(f"http://127.0.0.1:{port}/api/v1/query?{q}")
    assert body["status"] == "success", body
    result: list[dict[str, Any]] = body["data"]["result"]
    return result


@pytest.fixture
def swarm() -> Iterator[ComposeSwarm]:
    docker = engine_or_skip()
    ensure_base_images()
    s = ComposeSwarm(compose_command(docker))
    try:
        yield s
    finally:
        try:
            s("down", "-v", "--timeout", "5", timeout_s=120)
        except (AssertionError, subprocess.TimeoutExpired) as e:
            print(f"compose down failed: {e}")


def test_compose_swarm_trains_and_prometheus_scrapes_every_node(swarm: ComposeSwarm) -> None:
    t0 = time.monotonic()
    swarm("build", "head", timeout_s=600)  # one image serves every node service
    t_build = time.monotonic() - t0
    swarm("up", "-d", "--no-build", "--scale", "stage1=2", timeout_s=180)
    num_nodes = sum(EXPECTED_REPLICAS.values())
    try:
        observed = check_swarm(swarm, num_nodes)
    except AssertionError:
        print(swarm.logs())
        raise
    # `stop` sends SIGTERM through init: every node leaves its peers and exits 0
    swarm("stop", "-t", "20", timeout_s=120)
    codes = {n: c["State"]["ExitCode"] for n, c in swarm.containers().items()}
    assert set(codes.values()) == {0}, codes
    observed.update(build_s=round(t_build, 1), total_s=round(time.monotonic() - t0, 1))
    print(f"\ncompose swarm observed: {json.dumps(observed)}")


def check_swarm(swarm: ComposeSwarm, num_nodes: int) -> dict[str, Any]:
    containers = swarm.containers()
    assert len(containers) == num_nodes + 1, sorted(containers)  # + prometheus
    assert all(c["State"]["Running"] for c in containers.values())
    head = f"http://127.0.0.1:{swarm.head_port}/status"

    def discovered() -> bool:
        stages = get_json(head)["stages"]  # itself included; stage 2 from a summary
        return {k: v["ready"] for k, v in stages.items()} == EXPECTED_REPLICAS

    wait_for(discovered, 150, f"the head to see replicas {EXPECTED_REPLICAS} (zeroconf)")
    done = lambda: get_json(head)["counters"].get("microbatches_completed", 0)  # noqa: E731
    first = wait_for(lambda: done() >= 10 and done(), 180, "10 completed microbatches")
    st = get_json(head)
    assert st["ready"] and not st["address"].startswith("127.")  # a container address

    prom = swarm.prometheus_port

    def all_targets_up() -> list[str]:
        active = get_json(f"http://127.0.0.1:{prom}/api/v1/targets")["data"]["activeTargets"]
        up = [t["labels"]["service"] for t in active if t["health"] == "up"]
        return up if len(active) == len(up) == num_nodes else []

    targets = wait_for(all_targets_up, 90, f"{num_nodes} Prometheus targets up")
    wait_for(
        lambda: len(query(prom, "murmur_node_ready == 1")) == num_nodes,
        60,
        "every node ready in Prometheus",
    )
    replicas = {
        r["metric"]["stage"]: int(float(r["value"][1]))
        for r in query(prom, "max by (stage) (murmur_stage_replicas)")
    }
    assert replicas == EXPECTED_REPLICAS

    def completed() -> float:
        result = query(prom, 'sum(murmur_microbatches_total{outcome="completed"})')
        return float(result[0]["value"][1]) if result else 0.0

    scraped = wait_for(lambda: completed() >= first and completed(), 60, "scraped microbatches")
    loss = float(query(prom, "min(murmur_loss_ema)")[0]["value"][1])
    assert 0.0 < loss < 10.0
    rules = get_json(f"http://127.0.0.1:{prom}/api/v1/rules")["data"]["groups"]
    assert [g["name"] for g in rules] == ["murmuration"]
    return {
        "containers": len(containers),
        "head_view": {k: v["ready"] for k, v in get_json(head)["stages"].items()},
        "completed_at_status": first,
        "completed_in_prometheus": scraped,
        "targets_up": sorted(targets),
        "replicas_in_prometheus": replicas,
        "loss_ema": round(loss, 3),
    }
