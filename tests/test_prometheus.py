"""A real Prometheus scraping real ``node join`` processes on 127.0.0.1.

Three daemons (a head and two block stages) serve ``--metrics-port``; Debian's ``prometheus``
scrapes them every second with the project's alert rules loaded, and the test asks its HTTP
API until the swarm's series are there and sane: tokens increasing, loss finite, peers and
replicas per stage right, thermometers and wire traffic present. Skipped, with the reason,
where no ``prometheus`` binary can be found (``.ci/setup-extras.sh`` installs it).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from node.demo import LocalSwarm, free_port, wait_ready
from tests.helpers import FAST_SWARM, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus" / "rules"
FAST = {
    **FAST_SWARM,
    "train.eval_interval_s": "15",
    "train.microbatch_deadline_s": "6",
    "train.max_in_flight": "4",
    "swarm.num_block_stages": "2",
}


@pytest.fixture
def prometheus_bin() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("no prometheus binary (apt-get install prometheus; see .ci/setup-extras.sh)")
    return exe


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[LocalSwarm, list[int]]]:
    swarm = LocalSwarm(tmp_path, FAST)
    ports: list[int] = []
    try:
        for stage in (0, 1, 2):
            ports.append(free_port())
            swarm.start_node(stage, extra=["--metrics-port", str(ports[-1])])
        yield swarm, ports
    finally:
        swarm.stop(grace_s=5.0)


@pytest.fixture
def prometheus(prometheus_bin: str, tmp_path: Path, nodes: Any) -> Iterator[int]:
    _, ports = nodes
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES / "*.yml")],
        "scrape_configs": [
            {
                "job_name": "murmuration",
                "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in ports]}],
            }
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            prometheus_bin,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def api(port: int, path: str, **params: str) -> Any:
    url = f"http://127.0.0.1:{port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body["data"]


def series(port: int, promql: str) -> dict[str, float]:
    """An instant query as {value of the first label that differs, or '': value}."""
    out = {}
    for r in api(port, "query", query=promql)["result"]:
        labels = {k: v for k, v in r["metric"].items() if k not in ("__name__", "job")}
        key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        out[key] = float(r["value"][1])
    return out


def test_prometheus_scrapes_a_training_swarm(nodes: Any, prometheus: int) -> None:
    swarm, ports = nodes
    for address in swarm.addresses:
        wait_ready(address, 90, swarm)
    prom = prometheus
    head = f"127.0.0.1:{ports[0]}"

    def targets_up() -> bool:
        active = api(prom, "targets")["activeTargets"]
        return len(active) == 3 and all(t["health"] == "up" for t in active)

    wait_for(targets_up, 30, "3 targets up")
    tokens = wait_for(
        lambda: series(prom, "murmur_tokens_total > 0"), 90, "tokens counted by the head"
    )
    assert list(tokens) == [f"instance={head}"]
    t1 = tokens[f"instance={head}"]
    wait_for(
        lambda: series(prom, "murmur_tokens_total")[f"instance={head}"] > t1,
        60,
        "tokens increasing",
    )
    loss = wait_for(lambda: series(prom, "murmur_loss"), 30, "the loss")
    assert all(math.isfinite(v) and 0.0 < v < 10.0 for v in loss.values()), loss
    # every node sees one ready replica of each stage, itself included
    replicas = series(prom, "murmur_stage_replicas")
    assert len(replicas) == 9 and set(replicas.values()) == {1.0}, replicas
    peers = series(prom, f'murmur_peers_known{{instance="{head}"}}')
    assert peers == {
        f"instance={head},stage=0": 0,
        f"instance={head},stage=1": 1,
        f"instance={head},stage=2": 1,
    }
    completed = series(prom, 'murmur_microbatches_total{outcome="completed"}')
    assert completed[f"instance={head},outcome=completed"] > 0
    # thermometers of the block stages, and traffic on the wire
    act = series(prom, "murmur_activation_max")
    assert {k.split("stage=")[1] for k in act} == {"0", "1", "2"}
    assert all(math.isfinite(v) for v in act.values())
    sent = series(prom, 'sum by (kind) (murmur_wire_bytes_total{direction="sent"})')
    assert sent["kind=forward"] > 0 and sent["kind=hello"] > 0, sent
    # requests read by a block node's server (the head's forwards) count on its side
    block = f"127.0.0.1:{ports[1]}"
    got = series(prom, f'murmur_wire_bytes_total{{instance="{block}",direction="received"}}')
    assert got[f"direction=received,instance={block},kind=forward"] > 0, got
    latency = series(prom, "sum(murmur_request_duration_seconds_count)")
    assert latency[""] > 0
    # the alert rules load and evaluate against these series without errors
    groups = api(prom, "rules")["groups"]
    assert groups and all(r["health"] != "err" for g in groups for r in g["rules"]), groups
