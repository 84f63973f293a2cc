#!/usr/bin/env bash
# Wheels of berth's dependencies, for a benchmark host with no package index (a borrowed
# many-core machine): fetched here for that host's Python, carried there, installed there
# without pip reaching anything.
#
#   bench/offline_wheels.sh DIR [PYTHON_VERSION]        # here (default 3.12)
#   # there, in a checkout of berth:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl
#   PYTHONPATH=/tmp/site:$PWD bash bench/many_cores.sh OUT
#
# x86-64 Linux only. nkeys is published as a source archive alone, so its (pure Python)
# wheel is built here.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:?usage: bench/offline_wheels.sh DIR [PYTHON_VERSION]}
py=${2:-3.12}
mkdir -p "$dir"

# The [project] dependencies, but nkeys (built below), and pynacl (what nkeys needs).
mapfile -t deps < <(python3 - <<'EOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    deps = tomllib.load(f)["project"]["dependencies"]
print("\n".join(d for d in deps if not d.startswith("nkeys")))
print("pynacl")
EOF
)
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
           manylinux1 musllinux_1_1; do
    platforms+=(--platform "${tag}_x86_64")
done
python3 -m pip download -q --only-binary=:all: --python-version "$py" --implementation cp \
    "${platforms[@]}" --platform any -d "$dir" "${deps[@]}"
python3 -m pip wheel -q --no-deps -w "$dir" "nkeys>=0.2"
ls "$dir" | wc -l | xargs echo "wheels in $dir:"
