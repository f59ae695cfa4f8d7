#!/usr/bin/env bash
# Runs the test suite against a given jax release (default: the newest the package
# index has) in a virtual environment of its own, on a Python that release supports.
#
#   bash tools/check_jax.sh            # the newest jax
#   bash tools/check_jax.sh 0.12.0.1   # one release
#
# jax 0.11 and later need Python >= 3.12: the first of $PYTHON, python3.13,
# python3.12 and pyenv's 3.13/3.12 installs that is new enough is used. If there is
# none, this says so and exits 0 (nothing was tested). The notebook test is skipped
# here (it is run by the main test command).
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-newest}"

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
rm -rf "$venv"
"$python" -m venv "$venv"
if [[ "$version" == newest ]]; then
    pins=()
else
    pins=("jax==${version}")
fi
"$venv/bin/pip" install -q -e ".[test,examples,docs,flax,orbax]" "${pins[@]}"
"$venv/bin/python" - <<'PY'
import sys, jax
print(f"check_jax: testing jax {jax.__version__} on Python {sys.version.split()[0]}")
PY
"$venv/bin/python" -m pytest -q --ignore=tests/test_notebook.py
