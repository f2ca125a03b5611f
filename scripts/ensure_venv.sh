# Sourced by demo.sh and test.sh: makes .venv and installs the project with the extras in $EXTRAS
# ("", or "[dev,bench]" for the tests), but only when .venv is new, pyproject.toml changed since
# the last install, or no install so far had those extras (an install with more extras covers
# fewer: demo.sh after test.sh installs nothing), so that both commands work offline once
# installed. Each install leaves a stamp: .venv/.installed[-EXTRAS] holding "SHA256 extras".
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
extras="${EXTRAS//[^a-z,]/}"

installed_already() {  # a stamp of this pyproject.toml with every extra asked for
  local f hash have e ok
  for f in .venv/.installed .venv/.installed-*; do
    [ -f "$f" ] || continue
    read -r hash have < "$f" || [ -n "${hash:-}" ] || continue
    [ "$hash" = "$want" ] || continue
    [ -n "${have:-}" ] || { have="${f#.venv/.installed}"; have="${have#-}"; }  # older stamps: extras in the name
    ok=1
    for e in ${extras//,/ }; do
      case ",$have," in *",$e,"*) ;; *) ok=0 ;; esac
    done
    [ "$ok" = 1 ] && return 0
  done
  return 1
}

if ! installed_already || ! .venv/bin/python -c "import pwctl" 2> /dev/null; then
  if ! .venv/bin/python -m pip install -q --disable-pip-version-check -e ".${EXTRAS}" > .venv/install.log 2>&1; then
    cat .venv/install.log >&2
    exit 1
  fi
  echo "$want $extras" > ".venv/.installed${extras:+-${extras//,/-}}"
fi
