#!/usr/bin/env bash
# The test suite, its modules shared among two workers (pytest-xdist, a module given whole to
# whichever worker is free, so that its module-scoped fixtures are made once).
#
# Why: most of the suite waits (ranks and daemons starting, clusters forming, deadlines) rather
# than computes, so two workers finish in about half the time of one. Workers cannot disturb
# each other: each marks its ranks and has its own pool registry (tests/conftest.py), the SSH,
# Ray and Slurm test harnesses take their subnets under one lock, their daemons' ports are in
# their own network namespaces or picked free, and they reap only what a dead run left.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
exec "$PY" -m pytest -p no:cacheprovider -n 2 --dist loadfile --durations=25 "$@"
