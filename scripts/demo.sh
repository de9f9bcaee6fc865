#!/usr/bin/env bash
# cri-prober demo: a private containerd, a few demo pods, `cri-prober serve`, live transitions.
#
#   scripts/demo.sh [--seconds N] [--containerd 1.6|1.7|2.1] [--keep]
#   scripts/demo.sh --stop        # tear down a demo left running with --keep
#
# Needs root (containerd). Installs what it needs: Debian packages, a virtualenv in .venv.
# Everything runs on private sockets under $CRI_PROBER_DEMO_DIR (default /tmp/cri-prober-demo);
# no system containerd is touched. Metrics: $CRI_PROBER_DEMO_METRICS (default 127.0.0.1:9808).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
demo_dir=${CRI_PROBER_DEMO_DIR:-/tmp/cri-prober-demo}
metrics=${CRI_PROBER_DEMO_METRICS:-127.0.0.1:9808}
seconds=45
version=1.6
keep=0
stop_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds=$2; shift 2 ;;
    --containerd) version=$2; shift 2 ;;
    --keep) keep=1; shift ;;
    --stop) stop_only=1; shift ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "demo: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

bold() { printf '\n\033[1m==> %s\033[0m\n' "$*"; }
py=$repo/.venv/bin/python
cli=$repo/.venv/bin/cri-prober
api=unix://$demo_dir/api.sock
# The client commands read the API's address from here (no --address on every command).
export CRI_PROBER_ADDRESS=$api

teardown() {
  for name in serve grpc-target; do
    if [ -f "$demo_dir/$name.pid" ]; then
      kill "$(cat "$demo_dir/$name.pid")" 2>/dev/null || true
      rm -f "$demo_dir/$name.pid"
    fi
  done
  if [ -d "$demo_dir/containerd" ]; then
    # The virtualenv's python removes the pods over CRI (grpcio); python3 alone falls back to ctr.
    local testbed_py=python3
    if [ -x "$py" ]; then testbed_py=$py; fi
    "$testbed_py" scripts/testbed.py stop --dir "$demo_dir/containerd" >/dev/null 2>&1 || true
  fi
}

if [ "$stop_only" = 1 ]; then
  teardown
  rm -rf "$demo_dir"
  echo "demo stopped and removed ($demo_dir)"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "demo: needs root to run a private containerd (try: sudo $0)" >&2
  exit 1
fi
if [ -d "$demo_dir/containerd" ]; then
  echo "demo: a demo is already set up in $demo_dir; run '$0 --stop' first" >&2
  exit 1
fi

bold "Installing: Debian packages for containerd $version, and cri-prober into .venv"
python3 scripts/testbed.py install --version "$version" | sed 's/^/   /'
if [ ! -x "$py" ]; then
  python3 -m venv .venv 2>/dev/null || {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv .venv
  }
fi
echo "   pip: cri-prober and its dependencies into .venv (a minute or two the first time)"
if [ -t 1 ]; then
  # On a terminal pip shows its own progress bars (not through a pipe, which would hide them).
  "$py" -m pip install --disable-pip-version-check -e .
else
  "$py" -m pip install -q --disable-pip-version-check -e . 2>&1 | grep -v '^WARNING: Location' || true
fi

[ "$keep" = 1 ] || trap teardown EXIT
mkdir -p "$demo_dir"

bold "Starting a private containerd $version on $demo_dir/containerd/containerd.sock"
"$py" scripts/testbed.py start --dir "$demo_dir/containerd" --version "$version" >/dev/null
endpoint=unix://$demo_dir/containerd/containerd.sock
"$cli" version -r "$endpoint" | sed 's/^/   /'

bold "Creating demo pods (namespace demo)"
"$py" scripts/demo_pods.py grpc-target 50551 &
echo $! > "$demo_dir/grpc-target.pid"
"$py" scripts/demo_pods.py create "$demo_dir/containerd"

bold "Starting cri-prober serve with examples/demo/rules.yaml, and the static pod specs in examples/demo/manifests"
"$cli" serve -r "$endpoint" -c examples/demo/rules.yaml --listen "$api" \
  --probes-from manifests:examples/demo/manifests --node-name demo-node \
  --metrics-address "$metrics" --log-format json >"$demo_dir/serve.log" 2>&1 &
echo $! > "$demo_dir/serve.pid"
for _ in $(seq 1 100); do
  "$cli" health >/dev/null 2>&1 && break
  sleep 0.2
done
"$cli" health | sed 's/^/   cri-prober itself: /'
echo "   logs: $demo_dir/serve.log   metrics: http://$metrics/metrics"

bold "cri-prober ps"
"$cli" ps

bold "Probe transitions for ${seconds}s (cri-prober watch): web becomes ready, worker fails liveness,"
echo "    slow-starter passes startup, grpc-api flips every 15 s, shop (probes from its pod spec) becomes ready"
timeout --foreground "$seconds" "$cli" watch --since 0 || true

bold "cri-prober ps"
"$cli" ps

bold "Health of one container over the standard gRPC health protocol"
"$cli" health demo/web/httpd || true

# The worker's liveness fails about 25 s after it started: a short --seconds may end before.
for _ in $(seq 1 60); do
  "$cli" health demo/worker/main >/dev/null 2>&1 || break
  sleep 0.5
done
bold "Why the worker fails: cri-prober inspect demo/worker/main"
"$cli" inspect demo/worker/main || true

if [ "$keep" = 1 ]; then
  bold "Left running (--keep): paste these three lines, then try cri-prober ps, watch, inspect, health, check"
  cat <<TXT
export PATH=$repo/.venv/bin:\$PATH
export CRI_PROBER_ADDRESS=$api
export CONTAINER_RUNTIME_ENDPOINT=$endpoint

   containerd:   $endpoint   (cri-prober version -r $endpoint)
   metrics:      http://$metrics/metrics
   stop it all:  $0 --stop
TXT
else
  bold "Cleaning up. To try the commands yourself: $0 --keep, then paste the three lines it prints:"
  cat <<TXT
export PATH=$repo/.venv/bin:\$PATH
export CRI_PROBER_ADDRESS=$api
export CONTAINER_RUNTIME_ENDPOINT=$endpoint
TXT
fi
