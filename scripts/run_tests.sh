#!/usr/bin/env bash
# The test suite as two pytest sessions side by side: the modules that run their own Ray and
# Slurm clusters in one, everything else in the other.
#
# Why: most of the suite waits (ranks and daemons starting, clusters forming, deadlines) rather
# than computes, so two sessions finish in about the time of the longer one. They cannot disturb
# each other: each session marks its ranks and has its own pool registry (tests/conftest.py), and
# the SSH, Ray and Slurm test harnesses record what they build and reap only what a dead run left.
# The Slurm modules stay in one session (each cluster's controller takes Slurm's default port).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CLUSTERS=(
    tests/test_ray.py
    tests/test_ray_cluster.py
    tests/test_slurm.py
    tests/test_slurm_cluster.py
    tests/test_gpus.py
)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$PY" -m pytest -p no:cacheprovider "${CLUSTERS[@]}" "$@" >"$log" 2>&1 &
clusters=$!
ignored=()
for module in "${CLUSTERS[@]}"; do
    ignored+=("--ignore=$module")
done
"$PY" -m pytest "${ignored[@]}" "$@"
rest=$?
wait "$clusters"
clustered=$?
echo "=================== the cluster modules, a session of their own ==================="
cat "$log"
exit $((rest != 0 || clustered != 0))
