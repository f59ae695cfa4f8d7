#!/usr/bin/env bash
# Runs the test suite against a given jax release in a virtual environment of its own,
# on a Python that release supports.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    cat <<'USAGE'
usage: bash tools/check_jax.sh [VERSION|newest] [--install-only|--reuse] [PYTEST_ARGS...]

Builds .venv-jax-VERSION with that jax release (default: newest, the newest the
package index has) and the project's test extras, on a Python >= 3.12 from this
machine, then runs `python -m pytest -q PYTEST_ARGS` there (the fast tier unless the
arguments say otherwise, e.g. `-m slow`).

  bash tools/check_jax.sh               # the newest jax, fast tier
  bash tools/check_jax.sh 0.11.2        # one release
  bash tools/check_jax.sh newest -m ""  # the newest jax, both tiers
  bash tools/check_jax.sh newest --install-only  # build the environment only
  bash tools/check_jax.sh newest --reuse -n auto # test in the one built before

Python: the first of $PYTHON, python3.13, python3.12 and pyenv's 3.13/3.12 installs
that is >= 3.12 (jax 0.11 and later need it). If there is none, this says so and
exits 0, having tested nothing.
USAGE
}

version="${1:-newest}"
case "$version" in
-h | --help | help)
    usage
    exit 0
    ;;
esac
[[ $# -gt 0 ]] && shift
mode=test
case "${1:-}" in
--install-only)
    mode=install
    shift
    ;;
--reuse)
    mode=reuse
    shift
    ;;
esac
if [[ "$version" != newest && ! "$version" =~ ^[0-9]+(\.[0-9]+){1,3}([a-z]+[0-9]*)?$ ]]; then
    echo "check_jax: '$version' is not a jax version (expected e.g. 0.12.0, or newest; --help for usage)" >&2
    exit 2
fi

candidates=()
[[ -n "${PYTHON:-}" ]] && candidates+=("$PYTHON")
candidates+=(python3.13 python3.12)
if command -v pyenv >/dev/null 2>&1; then
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(13|12)(\.|$)' | sort -rV); do
        candidates+=("$(pyenv prefix "$v")/bin/python")
    done
fi
python=""
for candidate in "${candidates[@]}"; do
    if command -v "$candidate" >/dev/null 2>&1 &&
        "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        python="$candidate"
        break
    fi
done
if [[ -z "$python" ]]; then
    echo "check_jax: no Python >= 3.12 on this machine, so jax ${version} was NOT tested" \
        "(jax 0.11 and later need Python 3.12)."
    exit 0
fi

venv=".venv-jax-${version}"
if [[ "$mode" != reuse || ! -x "$venv/bin/python" ]]; then
    rm -rf "$venv"
    "$python" -m venv "$venv"
    pins=()
    [[ "$version" != newest ]] && pins=("jax==${version}")
    log="$venv/pip.log"
    if ! "$venv/bin/pip" install -q -e ".[test,examples,docs,flax,orbax]" "${pins[@]}" >"$log" 2>&1; then
        if grep -q "No matching distribution" "$log"; then
            echo "check_jax: jax ${version} is not on the package index for Python" \
                "$("$python" -c 'import sys; print(sys.version.split()[0])') (pip's log: $log)" >&2
        else
            echo "check_jax: installing jax ${version} failed (pip's log: $log)" >&2
        fi
        exit 2
    fi
fi
[[ "$mode" == install ]] && exit 0
"$venv/bin/python" - <<'PY'
import sys, jax
print(f"check_jax: testing jax {jax.__version__} on Python {sys.version.split()[0]}")
PY
"$venv/bin/python" -m pytest -q "$@"
