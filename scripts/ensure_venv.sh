# Sourced by demo.sh and test.sh: makes .venv and installs the project with the extras in $EXTRAS
# ("", or "[dev,bench]" for the tests), but only when .venv is new or pyproject.toml changed since the last install
# with those extras, so that both commands work offline once installed.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.installed${EXTRAS:+-${EXTRAS//[^a-z]/}}"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] || ! .venv/bin/python -c "import pwctl" 2> /dev/null; then
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${EXTRAS}" > .venv/install.log 2>&1; then
    cat .venv/install.log >&2
    exit 1
  fi
  echo "$want" > "$stamp"
fi
