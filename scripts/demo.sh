#!/usr/bin/env bash
# The README's first command: installs Pathways into .venv, brings up an embedded local
# cluster (a controller and two workers with 4 virtual CPU devices each, SQLite state) in
# the background, and submits the seed program as a job, streaming its output.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=""
# shellcheck source=scripts/ensure_venv.sh
. scripts/ensure_venv.sh
.venv/bin/pwctl up --islands 2 --devices 4
.venv/bin/pwctl island list
.venv/bin/pwctl submit examples/seed_program.py
cat >&2 <<'MSG'

The cluster keeps running. Next:
  .venv/bin/pwctl status --watch      # live view of islands, devices, queues and jobs
  .venv/bin/pwctl jobs list           # the job you just ran
  .venv/bin/pwctl down                # stop what `pwctl up` started
MSG
