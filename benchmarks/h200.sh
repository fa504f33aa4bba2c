#!/usr/bin/env bash
# Everything an H200 session runs, in one device call (the device has no network: it builds against
# its preinstalled jax/jaxlib, nanobind and scikit-build-core):
#   bash benchmarks/h200.sh [build] [test] [attn-test] [sanitize] [attn-sanitize] [selfcheck]
#                           [bench] [bench-quick] [attn-bench] [attn-bench-quick] [prefill-test]
#                           [prefill-bench] [prefill-bench-quick] [serve-h200] [ncu] [attn-ncu]
#                           [soft-fp8] [wheel] [gather-probe] [attn-probe] [attn-phases] [attn-pdl]
#                           [rs-probe] [attn-ab]
# Logs and a tarball of benchmarks/results go to $OUT (or ./h200-out).
set -uo pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-$PWD/h200-out}
mkdir -p "$OUT"
stages=${*:-build test sanitize selfcheck bench}
status=0

stage() {  # name command...: runs, logs to $OUT/<name>.log, remembers failure
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - t0)) s"
  [ "$rc" = 0 ] || status=1
}

for s in $stages; do
  case $s in
    build)
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
      python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
      stage build bash -c 'python3 -m pip install --no-build-isolation --no-deps . &&
        python3 -P -c "import jax_kimi_mla as m; assert m.HAS_CUDA_MODULE; print(\"CUDA module OK\")"' ;;
    test)
      # The whole suite; over 8 processes where pytest-xdist is installed (the GPU is shared:
      # 175 s on the H200 instead of over 380 s in one process).
      workers=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8 -p xdist")
      stage test python3 -P -m pytest -q -rfEs --durations=15 -p no:cacheprovider --continue-on-collection-errors $workers ;;
    attn-test)
      # The decode attention on the GPU: the kernel against the reference, and the layer on it.
      stage attn-test python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_decode_attention.py \
        tests/test_layer.py tests/test_docs.py -k "cuda or layer or docs" ;;
    attn-sanitize)
      # Hostile tables and lengths, NaN blocks, every format and split count, under memcheck.
      stage attn-sanitize compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
        python3 -P -m pytest -q -p no:cacheprovider tests/test_decode_attention.py -k cuda ;;
    sanitize)
      # Hostile slots/positions, T = 0, every op and format, RoPE on and off, on the GPU.
      stage sanitize compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 20 \
        python3 -P -m pytest -q -p no:cacheprovider tests/test_ops.py \
        -k "cuda and (test_op_matches_reference or duplicate or test_cuda_matches_cpu_handler)" ;;
    selfcheck)
      stage selfcheck python3 -P -m jax_kimi_mla ;;
    bench)
      stage bench python3 -P benchmarks/bench.py --out "$OUT/results" &&
        tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results" ;;
    bench-quick)
      stage bench python3 -P benchmarks/bench.py --quick --out "$OUT/results" &&
        tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results" ;;
    attn-bench|attn-bench-quick)
      quick=$([ "$s" = attn-bench-quick ] && echo --quick)
      stage attn-bench python3 -P benchmarks/bench_attention.py $quick --out "$OUT/attn" &&
        tar czf "$OUT/attn.tgz" -C "$OUT" attn && rm -rf "$OUT/attn" ;;
    prefill-test)
      # Prefill attention on cuDNN (and its fallbacks) against the reference, the layer on it.
      stage prefill-test python3 -P -m pytest -q -rfEs -p no:cacheprovider tests/test_prefill_attention.py \
        tests/test_layer.py tests/test_bench_prefill.py ;;
    prefill-bench|prefill-bench-quick)
      quick=$([ "$s" = prefill-bench-quick ] && echo --quick)
      stage prefill-bench python3 -P benchmarks/bench_prefill.py $quick --out "$OUT/prefill" &&
        tar czf "$OUT/prefill.tgz" -C "$OUT" prefill && rm -rf "$OUT/prefill" ;;
    serve-h200)
      # The serve loop at Kimi-K3 TP8 layer shapes, prompts up to 32k, every cache format.
      stage serve-h200 python3 -P examples/serve_loop.py --preset h200 ;;
    ncu)
      # Nsight Compute counters of the kernel at the sizes that miss issue 4's targets.
      metrics=smsp__issue_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,dram__bytes.sum
      metrics=$metrics,gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
      metrics=$metrics,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
      for stall in long_scoreboard barrier not_selected wait math_pipe_throttle short_scoreboard; do
        metrics=$metrics,smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio
      done
      for case in "prefill_fp8_rope 8192 96" "prefill_fp8_ds_mla_rope 8192 96" "prefill_bf16_rope 8192 96" \
                  "decode_fp8_rope 4096 96" "prefill_bf16_nope 8192 96" "prefill_bf16_nope 8192 12" "decode_bf16_nope 1 12"; do
        stage "ncu-${case// /-}" ncu --clock-control none --kernel-name regex:epilogue_kernel --launch-skip 2 \
          --launch-count 1 --metrics "$metrics" python3 -P benchmarks/run_once.py $case
      done ;;
    attn-ncu)
      # Nsight Compute counters of the decode attention kernel (the memory-bound grid and B = 1).
      metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__inst_executed.sum
      metrics=$metrics,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread
      metrics=$metrics,l1tex__data_pipe_lsu_wavefronts_mem_shared.avg.pct_of_peak_sustained_elapsed
      metrics=$metrics,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
      metrics=$metrics,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
      for stall in long_scoreboard barrier short_scoreboard mio_throttle lg_throttle math_pipe_throttle wait not_selected dispatch_stall; do
        metrics=$metrics,smsp__average_warps_issue_stalled_${stall}_per_issue_active.ratio
      done
      for case in "bf16 64 16384 12" "fp8 64 16384 12" "fp8_ds_mla 64 16384 12" "bf16 1 4096 12"; do
        stage "attn-ncu-${case// /-}" ncu --clock-control none --kernel-name regex:attention_kernel --launch-skip 2 \
          --launch-count 1 --metrics "$metrics" python3 -P benchmarks/run_once.py attention $case
      done ;;
    soft-fp8)
      # The build whose CUDA kernels convert fp8 by bit arithmetic (JAX_KIMI_MLA_SOFTWARE_FP8=ON)
      # against the CPU handlers, as `test` checks the default (sm_89+ instruction) build: both then
      # give the CPU handlers' bits. The default build is reinstalled after.
      stage soft-fp8 bash -c 'CMAKE_ARGS=-DJAX_KIMI_MLA_SOFTWARE_FP8=ON python3 -m pip install --no-build-isolation --no-deps . &&
        python3 -P -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_nonfinite.py \
          tests/test_decode_attention.py tests/test_gather_cache.py -k cuda; rc=$?
        CMAKE_ARGS=-DJAX_KIMI_MLA_SOFTWARE_FP8=OFF python3 -m pip install --no-build-isolation --no-deps . > /dev/null
        exit $rc' ;;
    wheel)
      # The binary wheel proven on the GPU: built offline by scripts/build_wheel.sh (default
      # architectures), installed into a fresh venv, and the CUDA tests run from a copy of tests/
      # outside the source tree. The device has no network: the venv sees python3's jax and pytest
      # through a .pth, after its own site-packages, added once the wheel is in (pip would otherwise
      # take the source install it then sees for the wheel's requirement, and install nothing).
      stage wheel bash -c 'set -e; work=$(mktemp -d)
        JKM_WHEEL_NO_ISOLATION=1 bash scripts/build_wheel.sh "$work/dist"
        python3 -m venv "$work/venv"
        "$work/venv/bin/pip" install --quiet --no-deps --disable-pip-version-check "$work"/dist/jax_kimi_mla-*.whl
        python3 -c "import jax, os; print(os.path.dirname(os.path.dirname(jax.__file__)))" \
          > "$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_path(\"purelib\"))")/device-jax.pth"
        cp -r tests "$work/tests"; cd "$work"
        "$work/venv/bin/python" -c "import jax_kimi_mla as m; assert m.HAS_CUDA_MODULE and \"$work/venv\" in m.__file__, m.__file__; print(\"wheel\", m.__version__, \"from\", m.__file__)"
        "$work/venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_decode_attention.py \
          tests/test_gather_cache.py tests/test_nonfinite.py tests/test_padded_rows.py -k cuda' ;;
    gather-probe)
      # The gather kernel alone (no extension build, about 45 s): the production kernel and the
      # candidates of benchmarks/probes/gather_bulk.cuh, each checked bit for bit and timed
      # against a device copy and a gather-free stream of the same bytes
      # (benchmarks/probes/gather_cache.cu), the production one twice for
      # the run-to-run spread, then the candidate's checks under compute-sanitizer.
      inc=(-I ffi/include -I "$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')")
      bin=$(mktemp -d) bulk=-DJKM_GATHER_SOURCE='"gather_bulk.cuh"'
      build() { nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a "${inc[@]}" "${@:2}" -o "$bin/$1" \
                  benchmarks/probes/gather_cache.cu 2>&1 | grep -E " error"; }
      build production & build bulk "$bulk" & build bulk16 "$bulk" -DJKM_GATHER_BULK_WARPS=16 &
      build bulk2cta "$bulk" -DJKM_GATHER_BULK_CTAS=2 & wait
      for name in production bulk bulk16 bulk2cta; do stage "gather-probe-$name" "$bin/$name"; done
      stage gather-probe-production-again "$bin/production"
      # The same traffic in several load/store patterns, beside cudaMemcpy (about 15 s).
      nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -o "$bin/copy_patterns" \
        benchmarks/probes/copy_patterns.cu && stage copy-patterns "$bin/copy_patterns"
      stage gather-probe-memcheck compute-sanitizer --tool memcheck --error-exitcode 99 --print-limit 10 \
        "$bin/bulk" --check-only ;;
    attn-pdl)
      # combine_kernel by programmatic dependent launch (B, the default) against the plain launch (A:
      # points.py --plain-combine), A B A B in one process each: the op's span (first start to last
      # end) and its summed kernel time, then each kernel apiece; its tests first.
      points="small bf16 H=12 B=1 ctx=4096,small fp8_ds_mla H=12 B=1 ctx=4096,small bf16 H=12 B=8 ctx=16384"
      points="$points,memory bf16 H=12 B=16 ctx=16384,memory fp8 H=12 B=16 ctx=16384"
      stage attn-pdl bash -c "python3 -P -m pytest -q -p no:cacheprovider tests/test_decode_attention.py -k programmatic &&
        for tag in A B A B; do
          python3 -P benchmarks/points.py --tag \$tag --kernels \$([ \$tag = A ] && echo --plain-combine) \
            --attention '$points'
        done" ;;
    rs-probe)
      # rs's tile loop alone (benchmarks/probes/ds_rs_tile_loop.cu, no extension build, about 1 min):
      # fp8_ds_mla, plain fp8 with A from registers, and plain fp8 with S^T from shared memory
      # (E4M3 x E4M3; the rope chunk 64- or 128-byte swizzled), each checked against a float64
      # reference and timed from L2 and from HBM, twice.
      bin=$(mktemp -d)
      rs_build() { nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I ffi/include "${@:2}" -o "$bin/$1" \
                     benchmarks/probes/ds_rs_tile_loop.cu 2>&1 | grep -E " error"; }
      rs_build ds & rs_build fp8 -DJKM_RS_FP8 & rs_build fp8-ss -DJKM_RS_FP8_SS &
      rs_build fp8-ss-pe128 -DJKM_RS_FP8_SS -DJKM_RS_PE_SW128 & wait
      for name in ds fp8 fp8-ss fp8-ss-pe128 ds fp8 fp8-ss fp8-ss-pe128; do stage "rs-probe-$name" "$bin/$name"; done ;;
    attn-ab)
      # Decode attention kernel changes against the tree, on the phase-stamped probe (no extension
      # build): variant A is the tree, and each patch of $AB_PATCH (space-separated, for example
      # `git diff main my-branch > devrun/ab.patch`, sent with the run tool's carry) the tree with
      # that patch, named after its file. Every variant in turn over $AB_CASES from HBM, twice, then
      # once over $AB_L2_CASES from L2 (PROBE_L2_BLOCKS=256: the loop with memory out of the way);
      # PROBE_KERNELS=$AB_KERNELS (default: each format's default kernel). AB_TEST=1 first installs
      # the first patch's extension (it stays installed) and runs the decode attention's CUDA tests
      # on it. About 2-4 minutes (a run that hangs is stopped after 2).
      if [ -z "${AB_PATCH:-}" ]; then echo "attn-ab needs AB_PATCH, patches against the tree"; status=1; continue; fi
      ab=$(mktemp -d) variants=(A) patches=()
      mkdir "$ab/A" && cp -r ffi benchmarks "$ab/A/"
      for file in $AB_PATCH; do
        name=$(basename "$file" .patch) patches+=("$(realpath "$file")")
        mkdir "$ab/$name" && cp -r ffi benchmarks "$ab/$name/" && variants+=("$name")
        patch -d "$ab/$name" -p1 -s < "$file" || { echo "$file does not apply to the tree"; status=1; continue 2; }
      done
      jax_inc=$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')
      pipeline=$(command -v cuobjdump >/dev/null && command -v nvdisasm >/dev/null && echo --pipeline)
      for v in "${variants[@]}"; do
        nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DJKM_SM90A_BUILT -DJKM_PHASE_STAMPS \
          -I "$ab/$v/ffi/include" -I "$jax_inc" -o "$ab/attn-$v" "$ab/$v/benchmarks/probes/decode_attention.cu" 2>&1 |
          grep -E " error" &
        # This machine's ptxas on the variant's rs kernels: registers, spills, serialized wgmmas.
        python3 scripts/wgmma_report.py "$ab/$v/ffi/cuda/decode_attention_cuda.cu" --kernel rs_attention $pipeline \
          > "$ab/wgmma-$v.txt" 2>&1 &
      done
      if [ "${AB_TEST:-0}" = 1 ]; then
        mkdir "$ab/tree" && cp -r . "$ab/tree/" && patch -d "$ab/tree" -p1 -s < "${patches[0]}"
        stage attn-ab-test bash -c "cd '$ab/tree' && python3 -m pip install -q --no-build-isolation --no-deps . &&
          timeout 300 python3 -P -m pytest -q -p no:cacheprovider -n 8 -p xdist tests/test_decode_attention.py tests/test_padded_rows.py -k cuda"
      fi
      wait
      for v in "${variants[@]}"; do echo "=== attn-ab-$v wgmma_report"; cat "$ab/wgmma-$v.txt"; done | tee "$OUT/attn-ab-wgmma.log"
      for run in 1 2; do
        for v in "${variants[@]}"; do
          stage "attn-ab-$v-$run" timeout 120 env PROBE_KERNELS="${AB_KERNELS:-default}" "$ab/attn-$v" \
            ${AB_CASES:-fp8:64:16384:12:2 fp8:16:16384:12:8 ds:64:16384:12:2 ds:16:16384:12:8}
        done
      done
      for v in "${variants[@]}"; do
        stage "attn-ab-$v-l2" timeout 60 env PROBE_L2_BLOCKS=256 PROBE_KERNELS="${AB_KERNELS:-default}" "$ab/attn-$v" \
          ${AB_L2_CASES:-fp8:64:16384:12:2 ds:64:16384:12:2}
      done ;;
    attn-probe|attn-phases)
      # The decode attention kernels alone (no extension build; benchmarks/probes/decode_attention.cu).
      # attn-probe: the kernel choices mma, default and rs on the same inputs,
      # each against attention_kernel, timed at B 64 x 16k and B = 1. attn-phases (-DJKM_PHASE_STAMPS, about
      # 90 s): where the default kernels' time goes beyond streaming their tiles, each CTA's phases
      # and how the CTAs start and end.
      inc=(-I ffi/include -I "$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')")
      bin=$(mktemp -d)
      if [ "$s" = attn-probe ]; then flags=() run=("$bin/attn"); else
        flags=(-DJKM_PHASE_STAMPS)
        run=(env PROBE_KERNELS=default "$bin/attn" ds:64:16384:12:2 ds:16:16384:12:8 ds:128:16384:12:1
             bf16:64:16384:12:2 bf16:16:16384:12:8 bf16:128:4096:12:1 fp8:64:16384:12:2 fp8:16:16384:12:8
             bf16:1:4096:12:64)
      fi
      nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DJKM_SM90A_BUILT "${flags[@]}" "${inc[@]}" \
        -o "$bin/attn" benchmarks/probes/decode_attention.cu 2>&1 | grep -E " error"
      stage "$s" "${run[@]}" ;;
    *) echo "unknown stage $s"; status=1 ;;
  esac
done
exit $status
