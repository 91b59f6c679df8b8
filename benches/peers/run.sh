#!/usr/bin/env bash
# The peer benchmark: the same FedAvg jobs in `anchorage sim` and in Flower's simulation engine
# (Ray) with PyTorch on the CPU, side by side (wall, peak memory, accuracy, ratios), plus the
# training step against PyTorch and FedAvg against the memory bandwidth. See benches/README.md.
#
#   benches/peers/run.sh [--quick] [--jobs NAME,NAME] [--flower-cpus N] [--skip-flower] [--skip-micro]
#
# --quick runs only the two 10-client jobs. Needs python3 (3.10+) with venv, and the real MNIST
# files: ANCHORAGE_DATA (default ../shared/data beside the repository). The virtual environment
# (.venv here, from PyPI) and the outputs (out/ here, or PEERS_OUT) are not in git.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
data="${ANCHORAGE_DATA:-$root/../shared/data}"
out="${PEERS_OUT:-$here/out}"
# The exact versions measured (PyPI's torch wheel is its CUDA build; it runs on the CPU here).
FLWR=1.41.0
TORCH=2.15.0

[ -f "$data/mnist/train-images-idx3-ubyte.gz" ] || { echo "no MNIST under $data (set ANCHORAGE_DATA)" >&2; exit 1; }
venv="$here/.venv"
if ! "$venv/bin/python" -c "import flwr, torch, ray; assert flwr.__version__ == '$FLWR' and torch.__version__.startswith('$TORCH')" 2>/dev/null; then
    echo "making $venv: flwr[simulation]==$FLWR torch==$TORCH (from PyPI; a few GB)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check "flwr[simulation]==$FLWR" "torch==$TORCH"
fi
"$venv/bin/python" -c "import flwr, torch, ray, numpy; print(f'flwr {flwr.__version__}, torch {torch.__version__}, ray {ray.__version__}, numpy {numpy.__version__}')"

echo "building anchorage (release)"
(cd "$root" && cargo build --release --quiet -p anchorage)
target="${CARGO_TARGET_DIR:-$root/target}"
anchorage="$target/release/anchorage"

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), load average $(cut -d' ' -f1-3 /proc/loadavg)"
exec "$venv/bin/python" "$here/compare.py" --anchorage "$anchorage" --data-dir "$data" --out "$out" "$@"
