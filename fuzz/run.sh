#!/usr/bin/env bash
# Coverage-guided fuzzing of npattn.sdpa for a bounded time; see fuzz/README.md.
#
#   bash fuzz/run.sh [SECONDS]          # default 600
#   bash fuzz/run.sh replay FILE...     # run saved inputs once each, describing each call
#
# Builds the extension with clang (AddressSanitizer + libFuzzer coverage) into
# its own venv, from a copy of the tree, then runs fuzz/fuzz_sdpa.py under
# atheris with one worker. Corpus and findings go to $FUZZ_OUT
# (default /tmp/npattn-fuzz): corpus/ and crashes/.
set -euo pipefail

CALLER_DIR=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3}
VENV=${FUZZ_VENV:-/tmp/npattn-fuzz-venv}
OUT=${FUZZ_OUT:-/tmp/npattn-fuzz}

# atheris's libFuzzer runtime comes from a recent LLVM; clang >= 15 builds the
# core (clang 14 rejects __builtin_cpu_supports("f16c")).
pick_clang() {
    local c
    for c in ${CC:-} clang-19 clang-18 clang-17 clang-16 clang-15 clang; do
        command -v "$c" >/dev/null 2>&1 && { echo "$c"; return; }
    done
    echo "no clang found: apt-get install clang-19" >&2
    return 1
}

build() {
    local clang src
    clang=$(pick_clang)
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q atheris numpy ml_dtypes pytest
    src=$(mktemp -d)
    tar -cf - --exclude=./.git --exclude=./build --exclude=./dist --exclude=./.venv --exclude='*.egg-info' \
        --exclude='*.so' --exclude='*.o' --exclude=__pycache__ . | tar -C "$src" -xf -
    echo "+ building npattn with $clang (-fsanitize=address,fuzzer-no-link)"
    (cd "$src" && CC=$clang LDSHARED="$clang -shared" \
        CFLAGS="-fsanitize=address,fuzzer-no-link -fno-omit-frame-pointer -g -O1" \
        LDFLAGS="-fsanitize=address,fuzzer-no-link" \
        "$VENV/bin/pip" install -q --no-deps --force-reinstall .)
    rm -rf "$src"
}

# The ASan + libFuzzer runtime that atheris ships, preloaded into Python.
runtime() {
    "$VENV/bin/python" -c 'import atheris, os; print(os.path.join(os.path.dirname(os.path.dirname(atheris.__file__)), "asan_with_fuzzer.so"))'
}

run_fuzzer() {
    LD_PRELOAD="$(runtime)" ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1 \
        "$VENV/bin/python" "$ROOT/fuzz/fuzz_sdpa.py" "$@"
}

if [ "${1:-}" = replay ]; then
    shift
    [ -x "$VENV/bin/python" ] || build
    rc=0
    for f in "$@"; do  # one at a time: libFuzzer reads several arguments as corpus dirs
        case $f in /*) ;; *) f="$CALLER_DIR/$f" ;; esac
        FUZZ_DESCRIBE=1 run_fuzzer "$f" || rc=1
    done
    exit "$rc"
fi

seconds=${1:-600}
build
mkdir -p "$OUT/corpus" "$OUT/crashes"
echo "+ fuzzing for ${seconds}s; corpus $OUT/corpus, findings $OUT/crashes"
run_fuzzer -max_total_time="$seconds" -max_len=256 -rss_limit_mb=6144 -print_final_stats=1 \
    -artifact_prefix="$OUT/crashes/" "$OUT/corpus"
