#!/usr/bin/env bash
# The fuzz corpora live in the repository as one archive per target (fuzz/corpus/TARGET.tar.gz):
# thousands of small inputs as separate files made every checkout and copy of the tree slow and
# several times larger on disk than their bytes. The unpacked folders are git-ignored.
#
#   scripts/fuzz-corpus.sh unpack [TARGET...]   archive -> fuzz/corpus/TARGET/ (kept if there)
#   scripts/fuzz-corpus.sh pack [TARGET...]     fuzz/corpus/TARGET/ -> archive (after a campaign)
#
# Without TARGET: every fuzz target. The archive is reproducible (sorted names, fixed times and
# owners), so packing an unchanged corpus changes nothing.
set -euo pipefail
cd "$(dirname "$0")/../fuzz/corpus"
what=${1:-}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(allocator_ops c_abi snapshot_reader)
for t in "${targets[@]}"; do
    case "$what" in
        unpack)
            if [ -d "$t" ]; then
                echo "fuzz-corpus: fuzz/corpus/$t is there already; kept"
            else
                tar -xzf "$t.tar.gz"
                echo "fuzz-corpus: fuzz/corpus/$t: $(find "$t" -type f | wc -l) inputs"
            fi
            ;;
        pack)
            [ -d "$t" ] || { echo "fuzz-corpus: no fuzz/corpus/$t to pack" >&2; exit 1; }
            tar --sort=name --mtime=2026-01-01 --owner=0 --group=0 --numeric-owner -cf - "$t" \
                | gzip -9n >"$t.tar.gz"
            echo "fuzz-corpus: fuzz/corpus/$t.tar.gz: $(find "$t" -type f | wc -l) inputs"
            ;;
        *)
            echo "usage: scripts/fuzz-corpus.sh unpack|pack [TARGET...]" >&2
            exit 2
            ;;
    esac
done
