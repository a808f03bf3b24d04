#!/usr/bin/env bash
# The test suite: the modules that run a Slurm cluster in one pytest session, one after another,
# and beside it every other module shared among two workers (pytest-xdist, a module given whole
# to whichever worker is free, so that its module-scoped fixtures are made once).
#
# Why: most of the suite waits (ranks and daemons starting, clusters forming, deadlines) rather
# than computes, so sessions side by side finish in about the time of the longest. They cannot
# disturb each other: each marks its ranks and has its own pool registry (tests/conftest.py), and
# the SSH, Ray and Slurm test harnesses take their subnets under one lock and reap only what a
# dead run left. Two Slurm clusters at once do disturb each other (a job's step requeued, a
# step's tasks never starting), so the Slurm modules share one session.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
SLURM=(
    tests/test_slurm.py
    tests/test_slurm_cluster.py
    tests/test_gpus.py
)
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"$PY" -m pytest -p no:cacheprovider --durations=10 "${SLURM[@]}" "$@" >"$log" 2>&1 &
slurm=$!
ignored=()
for module in "${SLURM[@]}"; do
    ignored+=("--ignore=$module")
done
"$PY" -m pytest -p no:cacheprovider -n 2 --dist loadfile --durations=25 "${ignored[@]}" "$@"
rest=$?
wait "$slurm"
slurmed=$?
echo "=================== the Slurm modules, a session of their own ==================="
cat "$log"
exit $((rest != 0 || slurmed != 0))
