#!/usr/bin/env bash
# The ingest scaling curve of issue 32 on a many-core machine, at two sizes, in one go (estimated at 9-11 minutes
# on 16 cores with the page-cost check's ~40 s, not yet measured): medload at 1, 2, 4, ... workers up to every core next to pydicom read+decode in as many processes.
#   1. the issue's own size, every contender of the ingest section: 2,048 files of 512 x 512 (1 GB);
#   2. an archive-sized point, the curve's rows only: 16,384 files (8 GB), where each of 16 workers has
#      about 1,000 files rather than 128, so a worker's start-up (docs/benchmarks.md) no longer dominates.
# Usage: bash benchmarks/ingest_curve.sh OUT_DIR   (writes page-cache-cost.json, ingest-2048.{json,png},
#        ingest-16384.{json,png})
set -eu
out=${1:?usage: bash benchmarks/ingest_curve.sh OUT_DIR}
mkdir -p "$out"
here=$(dirname "$0")
nproc
# what a new page of page cache costs this machine (a VM that hands free memory to its host charges the writer)
python "$here/page_cache_cost.py" --json "$out/page-cache-cost.json"
python "$here/ingest.py" --series 16 --slices 128 --repeats 3 --codec blosc2-lz4 --json "$out/ingest-2048.json" --plot "$out/ingest-2048.png"
python "$here/ingest.py" --series 64 --slices 256 --repeats 2 --json "$out/ingest-16384.json" --plot "$out/ingest-16384.png" \
    --only 'medload ingest \([0-9]+ workers?(, pinned to 1 core)?\)$|pydicom read\+decode \([0-9]+ procs?\)$'
