#!/usr/bin/env bash
# make_bundle.sh: copies the built fuzz targets, their seed corpora, regression inputs and
# dictionaries, and run_campaign.sh into <repo>/fuzz-bundle/ (git-ignored), to run a campaign on
# a bigger machine without a compiler:
#
#   tests/fuzz/make_bundle.sh                      # builds build-fuzz first if needed
#   rsync -a fuzz-bundle/ bighost:fuzz-bundle/
#   ssh bighost 'cd fuzz-bundle && WORKERS=16 ./run_campaign.sh 10000000'
#   rsync -a bighost:fuzz-bundle/campaign/ campaign/      # logs, grown corpora, artifacts
#
# The binaries link the sanitizer and libFuzzer runtimes statically; what they load at run time
# (checked with ldd: libstdc++, libgcc_s, libm, libc, liblzma) is in every Debian 12 base
# system. There is no llvm-symbolizer there, so reports show module+offset only: reproduce an
# artifact here (`build-fuzz/tests/fuzz/fuzz_<target> <artifact>`) for a symbolized stack.
set -euo pipefail
FUZZ_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$FUZZ_DIR/../.." && pwd)"
BUILD_DIR="${BUILD_DIR:-$REPO/build-fuzz}"
BUNDLE="${BUNDLE:-$REPO/fuzz-bundle}"
TARGETS=(snapshot config replay)

# run_fuzz.sh configures and builds the targets; -runs=1 keeps its own run short.
FUZZ_RUNS=1 BUILD_DIR="$BUILD_DIR" bash "$FUZZ_DIR/run_fuzz.sh" 0 "${TARGETS[@]}" >/dev/null

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/corpus" "$BUNDLE/regressions"
for t in "${TARGETS[@]}"; do
  cp "$BUILD_DIR/tests/fuzz/fuzz_$t" "$BUNDLE/bin/"
  cp -r "$FUZZ_DIR/corpus/$t" "$BUNDLE/corpus/"
  if [ -d "$FUZZ_DIR/regressions/$t" ]; then cp -r "$FUZZ_DIR/regressions/$t" "$BUNDLE/regressions/"; fi
done
cp "$FUZZ_DIR"/*.dict "$FUZZ_DIR/run_campaign.sh" "$BUNDLE/"
git -C "$REPO" rev-parse HEAD >"$BUNDLE/COMMIT" 2>/dev/null || true

# Every shared library a target needs must resolve on this machine (the same Debian userland as
# the one the bundle goes to).
missing=$(for t in "${TARGETS[@]}"; do ldd "$BUNDLE/bin/fuzz_$t"; done | grep 'not found' || true)
if [ -n "$missing" ]; then
  echo "make_bundle: unresolved libraries:" >&2
  echo "$missing" >&2
  exit 1
fi
echo "make_bundle: $BUNDLE ($(du -sh "$BUNDLE" | cut -f1)); needs: $(for t in "${TARGETS[@]}"; do
  ldd "$BUNDLE/bin/fuzz_$t"; done | awk '/=>/ {print $1}' | sort -u | tr '\n' ' ')"
