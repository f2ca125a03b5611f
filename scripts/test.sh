#!/usr/bin/env bash
# Installs the project with its dev tools into .venv and runs the checks and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# System packages some tests need: Slurm and munge (tests/test_slurm.py runs a real Slurm),
# iproute2 (tests/hosts.py: separate hosts from network namespaces), tmux (tests/test_watch_tmux.py:
# `pwctl status --watch` in a real terminal), openssl (tests/tlscerts.py: a throwaway CA for the TLS
# tests), postgresql (tests/test_postgres.py). Installed only when missing,
# and only as root with apt-get; otherwise those tests skip and say why. Nothing is fetched when
# everything is there, so this works offline once installed.
missing=()
command -v slurmctld > /dev/null || missing+=(slurm-wlm)
command -v munged > /dev/null || missing+=(munge)
command -v ip > /dev/null || missing+=(iproute2)
command -v tmux > /dev/null || missing+=(tmux)
command -v openssl > /dev/null || missing+=(openssl)
# postgresql: tests/test_postgres.py (the controller on PostgreSQL, in a throwaway server)
command -v initdb > /dev/null || compgen -G "/usr/lib/postgresql/*/bin/initdb" > /dev/null || missing+=(postgresql)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get > /dev/null; then
    mkdir -p .venv
    echo "installing ${missing[*]} (log: .venv/apt.log)" >&2
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        "${missing[@]}"; } > .venv/apt.log 2>&1 \
      || echo "could not install ${missing[*]} (see .venv/apt.log): the tests needing them skip" >&2
  else
    echo "not installing ${missing[*]} (needs root and apt-get): the tests needing them skip" >&2
  fi
fi

EXTRAS="[dev,bench]"  # bench: optax, for the tests that run the benchmark suites (tests/test_bench_*.py)
# shellcheck source=scripts/ensure_venv.sh
. scripts/ensure_venv.sh
.venv/bin/ruff check .
.venv/bin/mypy
# The suite in parallel: most of a test's time is its processes starting and waiting on each other
# (one pytest process leaves a 2-core machine about half idle), so it runs on two pytest-xdist
# workers, or one per core up to four. Whole files per worker (`--dist loadfile`): a module's shared
# cluster is set up once. Files go in collection order, which puts the longest first
# (tests/conftest.py). PW_TEST_WORKERS overrides the count (0: one process, no xdist).
workers=${PW_TEST_WORKERS:-$(.venv/bin/python -c 'import os; print(min(4, max(2, len(os.sched_getaffinity(0)))))')}
if [ "$workers" -gt 0 ]; then
  set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
.venv/bin/python -m pytest -q "$@"
