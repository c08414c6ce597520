#!/bin/sh
# Every step of the container images' builds, in one script: the Dockerfiles'
# RUN lines call this and nothing else, so what CI runs on the host
# (tests/integration/deploy/test_image_build.py) is what an image build runs.
# deploy/README.md ("Images") describes the stages and why.
#
#   build.sh toolchain                      gcc for the Cython fast path (the plane's build stage)
#   build.sh build-venv DIR                 pip, setuptools, Cython at the lock's versions
#   build.sh wheels SRC OUT plane|sidecar   burstgate-client's wheel (and burstgate's, compiled)
#   build.sh runtime VENV plane|sidecar     a pip-less venv with the lock's hash-checked pins
#   build.sh app VENV WHEELS plane|sidecar  the wheels into it, `pip check`, and a smoke run
#
# Environment: BUILD_VENV (default /opt/build: the build-venv the later
# stages use), PYTHON (default python3: the interpreter the venvs are made
# from), LOCK (default SRC/requirements/serve.txt, read by runtime from the
# working directory). BURSTGATE_DEPS_SITE: runtime links that site-packages
# instead of installing the lock (the test suite does: its venv is the same
# lock, installed, and it has no index to download from).
set -eu

BUILD_VENV=${BUILD_VENV:-/opt/build}
PYTHON=${PYTHON:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
SRC_ROOT=$(cd "$HERE/../.." && pwd)
LOCK=${LOCK:-$SRC_ROOT/requirements/serve.txt}

die() { echo "build.sh: $*" >&2; exit 2; }

kind_arg() {
    case "$1" in
        plane|sidecar) ;;
        *) die "KIND must be plane or sidecar, got '$1'" ;;
    esac
}

# The pins of the lock that the named packages need (tools/deploykit.py
# follows the lock's "# via" notes), as a hash-checked requirements file.
subset() {
    out=$1; shift
    "$PYTHON" "$SRC_ROOT/tools/deploykit.py" lock-subset "$LOCK" "$@" > "$out"
}

# pip from the build venv (the locked one) installs into a venv that has no
# pip of its own: nothing in the final image can install anything.
pip_into() {
    venv=$1; shift
    "$BUILD_VENV/bin/python" -m pip --python "$venv/bin/python" "$@"
}

stage=${1:-}
[ -n "$stage" ] || die "usage: build.sh toolchain|build-venv|wheels|runtime|app ... (see the top of $0)"
shift

case "$stage" in
toolchain)
    # Debian's compiler in the build stage only; the final stage copies the
    # venv out of it and has no compiler.
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev
    rm -rf /var/lib/apt/lists/*
    ;;
build-venv)
    [ $# -eq 1 ] || die "usage: build.sh build-venv DIR"
    tmp=$(mktemp)
    subset "$tmp" pip setuptools cython
    "$PYTHON" -m venv "$1"
    "$1/bin/python" -m pip install -q --no-cache-dir --require-hashes -r "$tmp"
    rm -f "$tmp"
    ;;
wheels)
    [ $# -eq 3 ] || die "usage: build.sh wheels SRC OUT plane|sidecar"
    kind_arg "$3"
    src=$1 out=$2
    if [ "$3" = plane ]; then set -- "$src/clients/python" "$src"; else set -- "$src/clients/python"; fi
    # --no-build-isolation: the build venv's locked setuptools and Cython
    # build them, not whatever an isolated build would download.
    "$BUILD_VENV/bin/python" -m pip wheel -q --no-cache-dir --no-deps --no-build-isolation \
        --no-index -w "$out" "$@"
    ;;
runtime)
    [ $# -eq 2 ] || die "usage: build.sh runtime VENV plane|sidecar"
    kind_arg "$2"
    venv=$1
    "$PYTHON" -m venv --without-pip "$venv"
    if [ -n "${BURSTGATE_DEPS_SITE:-}" ]; then
        site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
        echo "$BURSTGATE_DEPS_SITE" > "$site/_burstgate_deps.pth"
        exit 0
    fi
    tmp=$(mktemp)
    if [ "$2" = plane ]; then subset "$tmp" burstgate burstgate-client; else subset "$tmp" burstgate-client; fi
    # Hash-checked: pip refuses a file not in the lock, and a dependency the
    # subset missed (it must be in the file, with its hashes).
    pip_into "$venv" install -q --no-cache-dir --require-hashes -r "$tmp"
    rm -f "$tmp"
    ;;
app)
    [ $# -eq 3 ] || die "usage: build.sh app VENV WHEELS plane|sidecar"
    kind_arg "$3"
    venv=$1 wheels=$2 kind=$3
    if [ "$kind" = plane ]; then
        set -- "$wheels"/burstgate_client-*.whl "$wheels"/burstgate-[0-9]*.whl
    else
        set -- "$wheels"/burstgate_client-*.whl
    fi
    pip_into "$venv" install -q --no-cache-dir --no-deps --no-index "$@"
    pip_into "$venv" check
    sed "1s|.*|#!$venv/bin/python|" "$HERE/healthcheck.py" > "$venv/bin/burstgate-healthcheck"
    chmod 0755 "$venv/bin/burstgate-healthcheck"
    # A smoke run: the commands start, and the plane's fast path is the
    # compiled one (fastpath falls back to nothing: a missing build fails).
    if [ "$kind" = plane ]; then
        "$venv/bin/burstgate" --version
        "$venv/bin/burstgate" --help > /dev/null
        "$venv/bin/python" -c 'import fastpath; assert fastpath.IMPLEMENTATION == "cython"'
    else
        "$venv/bin/burstgate-sidecar" --help > /dev/null
    fi
    "$venv/bin/burstgate-healthcheck" --help > /dev/null
    ;;
*)
    die "unknown stage '$stage' (toolchain, build-venv, wheels, runtime, app)"
    ;;
esac
