#!/usr/bin/env bash
# Extras for the metrics, deployment and container tests on a fresh CI machine (root, Debian 12,
# no systemd, no container registry): called by .ci/run before `make test`. Idempotent: a second
# run only checks what is already there (a few seconds).
#
#   1. apt: prometheus + promtool (tests/test_prometheus.py, tests/test_deploy.py), chromium
#      (tests/test_page.py), faketime (a wrong system clock: tests/test_sync_processes.py,
#      tests/test_auth_processes.py),
#      docker.io + docker-compose + debootstrap + iptables (tests/test_docker.py)
#   2. a Docker engine: started by hand (setsid dockerd) when `docker info` does not answer
#   3. stand-in base images (python:3.11-slim, localpython:3.11-slim-torchcpu, debian:bookworm-slim)
#      built from Debian packages by docker-offline-base.sh, since nothing can be pulled here
#      (about a minute, with the testbed's ../shared/tools/docker-offline-base.sh)
#   4. a stand-in for the prom/prometheus image the compose file names (Debian's package)
#
# Every part is best effort: what cannot be set up is reported here, and the tests that need it
# skip with the reason. Environment: SHARED (default ../shared), SKIP_DOCKER=1 to set up
# Prometheus only. Logs: /var/log/setup-extras-apt.log, /var/log/docker-offline-base.log.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
SHARED=${SHARED:-$ROOT/../shared}
DOCKER=/usr/bin/docker # Debian's client; a newer one on PATH may need buildx for BuildKit
export DEBIAN_FRONTEND=noninteractive
T0=$SECONDS
say() { echo "setup-extras: $*"; }

if [ "$(id -u)" != 0 ]; then
  say "not root: nothing installed (tests needing prometheus or docker will skip)"
  exit 0
fi

installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

# ---- 1. packages
pkgs=(prometheus chromium faketime)  # chromium: tests/test_page.py renders the swarm's page
# headless; faketime: the sync and auth process tests give a node a wrong system clock
[ "${SKIP_DOCKER:-0}" = 1 ] || pkgs+=(docker.io docker-compose debootstrap iptables)
need=()
for p in "${pkgs[@]}"; do installed "$p" || need+=("$p"); done
if [ ${#need[@]} -gt 0 ]; then
  say "apt-get install ${need[*]}"
  # the policy keeps package scripts from starting services (a stray prometheus on :9090)
  policy=/usr/sbin/policy-rc.d ours=0
  if [ ! -e $policy ]; then printf '#!/bin/sh\nexit 101\n' >$policy && chmod 755 $policy && ours=1; fi
  { apt-get update -q && apt-get install -y -q --no-install-recommends "${need[@]}"; } \
    >/var/log/setup-extras-apt.log 2>&1 \
    || { say "apt-get install failed:"; tail -15 /var/log/setup-extras-apt.log; }
  [ $ours = 1 ] && rm -f $policy
fi
command -v promtool >/dev/null && say "$(prometheus --version 2>&1 | head -1)"
[ "${SKIP_DOCKER:-0}" = 1 ] && exit 0

# ---- 2. the Docker engine
if [ ! -x "$DOCKER" ]; then
  say "no docker client; container tests will skip"
  exit 0
fi
if ! $DOCKER info >/dev/null 2>&1; then
  say "starting dockerd"
  setsid dockerd >/var/log/dockerd.log 2>&1 </dev/null &
  for _ in $(seq 60); do $DOCKER info >/dev/null 2>&1 && break; sleep 1; done
fi
if ! $DOCKER info >/dev/null 2>&1; then
  say "dockerd did not start (tail of /var/log/dockerd.log below); container tests will skip"
  tail -5 /var/log/dockerd.log 2>/dev/null
  exit 0
fi
say "docker engine $($DOCKER info --format '{{.ServerVersion}}'), $(docker-compose version --short 2>/dev/null)"

# ---- 3. stand-in base images
have_image() { $DOCKER image inspect "$1" >/dev/null 2>&1; }
if have_image python:3.11-slim && have_image localpython:3.11-slim-torchcpu \
  && have_image debian:bookworm-slim; then
  say "base images present"
else
  script=$SHARED/tools/docker-offline-base.sh
  if [ -f "$script" ]; then
    say "building stand-in base images with $script"
    bash "$script" >/var/log/docker-offline-base.log 2>&1 \
      || { say "stand-in base images failed:"; tail -20 /var/log/docker-offline-base.log; }
  else
    say "$script not found: no stand-in base images (docker test will skip)"
  fi
fi

# ---- 4. a stand-in for the compose file's Prometheus image
prom_image=$(grep -o 'prom/prometheus:[A-Za-z0-9._-]*' docker/compose.yaml | head -1)
if [ -n "$prom_image" ] && ! have_image "$prom_image" && have_image debian:bookworm-slim; then
  say "building $prom_image stand-in from Debian's prometheus package"
  $DOCKER build -q -t "$prom_image" -f docker/standins/prometheus.Dockerfile docker/standins \
    >/dev/null || say "$prom_image stand-in failed"
fi
say "done in $((SECONDS - T0))s"
