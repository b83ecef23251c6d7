#!/usr/bin/env bash
# GPU check of the sm90 backends on ONE Hopper GPU (H100/H200), on a fresh image, < 10 min.
#
# Usage (from the repository root), on the lent H200: see docs/runbook.md "First GPU run".
#   python3 benchmarks/gpu_carry.py pack       # here: wheels + drops' src/ in parts
#   then one device call per part, back to back; the last one runs
#   MOE_EP_CARRY_PARTS=/tmp/moe_ep_parts bash benchmarks/gpu_check.sh [OUT_DIR]
# or, on a machine that has the drops materialized and the wheels in a folder:
#   MOE_EP_WHEELS=wheels/ benchmarks/gpu_check.sh [OUT_DIR]
#   benchmarks/gpu_check.sh --help          # prints this header, runs nothing
#
# Steps (each prints what it found; nothing is fetched from a network):
#   0. with MOE_EP_CARRY_PARTS: checks the carried parts against their manifest (sha256) and
#      unpacks the wheels (to $MOE_EP_WHEELS, default /tmp/moe_ep_wheels) and vendor/*/src;
#   1. checks the GPU (compute capability 9.0) and that python3's torch sees it
#      (MOE_EP_GPU_CHECK_NO_GPU=1 skips this: a rehearsal on a CPU machine);
#   2. installs the carried wheels python3 lacks or has older (gpu_carry.py install: one pip
#      --no-deps call), then checks that hatchling, editables, rich, pytest, pytest-timeout,
#      numpy, cutlass, nvshmem.core, cuda.bindings and tvm_ffi import; a missing one is
#      reported and the tests needing it skip;
#   3. installs moe-ep-core, both backend packages and the drops editable, --no-deps;
#   4. only with MOE_EP_PUSH_BUILD=1 (adds up to 240 s): builds and loads the push drop's two
#      TVM-FFI modules (moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda.build; nvcc, curand headers from torch's cu13 wheels)
#      into $MOE_EP_PUSH_CACHE (default /tmp/moe_ep_push_cache) and asks the a2a module whether
#      GPU 0 has NVLink-native atomics to itself; the push GPU tests of step 5 run only then;
#   5. runs the tests that need a GPU (pytest -m gpu): the fp8, bf16, MXFP4 and NVFP4 pull
#      (and push) kernels against the oracle (tests/backends/test_sm90_gpu.py), the GPU stagers and
#      weight preparation, CUDA quantization; sm100 ones skip (they wait for Blackwell,
#      sm100_mxfp8_mxfp4_bf16_cutedsl's included). The CPU
#      suite is not rerun here: it passed under the image's torch 2.11 on a CPU machine;
#   5b. runs each portable kernel on the GPU (NCCL, EP1) against the oracle (`moe-ep run
#      --check`): the portable CUDA path, never run before;
#   6. times one forward of the pull kernel (and the push kernel with MOE_EP_PUSH_BUILD=1)
#      against the portable fp8 backend at EP1 (MOE_EP_GPU_CHECK_SHAPE="T,H,I,E,K").
# Logs go to OUT_DIR (default $OUT, else ./gpu_check_out). Exit status: pytest's.
# Every step's cap is cut to what is left of MOE_EP_GPU_CHECK_BUDGET_S (default 560 s), so
# the summary is written before the device tool's 600 s limit. MOE_EP_PUSH_BUILD=1 needs
# its own call (build + push tests + benchmark: up to about 6 more minutes).
# Never run on a GPU yet (see docs/backends.md). Rehearsed on CPU (2026-12-01) in a venv
# like the image (python3 + torch 2.11, no cutlass-dsl / nvshmem4py / tvm-ffi / hatchling)
# with MOE_EP_GPU_CHECK_NO_GPU=1: steps 0-6 ran (docs/runbook.md).
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
  exit 0
fi

OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
WHEELS="${MOE_EP_WHEELS:-}"
export PYTHONUNBUFFERED=1
# NVSHMEM's own warnings (transport or heap trouble in a container) land in the test logs.
export NVSHMEM_DEBUG="${NVSHMEM_DEBUG:-WARN}"
START=$(date +%s)
say() { printf '[gpu_check %4ds] %s\n' "$(( $(date +%s) - START ))" "$*" | tee -a "$OUT_DIR/summary.txt"; }
# The whole check ends inside MOE_EP_GPU_CHECK_BUDGET_S (default 560: the device tool stops a
# command at 600 s, and a killed step leaves no summary): each step's cap is its own limit or
# what is left of the budget, whichever is less.
BUDGET="${MOE_EP_GPU_CHECK_BUDGET_S:-560}"
cap() { local left=$(( BUDGET - ($(date +%s) - START) )); (( left < $1 )) && echo $(( left > 10 ? left : 10 )) || echo "$1"; }

if [ -n "${MOE_EP_CARRY_PARTS:-}" ]; then
  say "0/6 carried parts in $MOE_EP_CARRY_PARTS: check and unpack (benchmarks/gpu_carry.py)"
  WHEELS="${WHEELS:-/tmp/moe_ep_wheels}"
  "$PY" benchmarks/gpu_carry.py assemble --parts "$MOE_EP_CARRY_PARTS" --wheels "$WHEELS" \
    2>&1 | tee -a "$OUT_DIR/summary.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { say "the carried parts are incomplete; nothing run"; exit 4; }
fi

say "1/6 GPU"
if [ "${MOE_EP_GPU_CHECK_NO_GPU:-0}" = "1" ]; then
  say "  MOE_EP_GPU_CHECK_NO_GPU=1: rehearsal without a GPU (installs, scripts; GPU tests skip)"
else
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv,noheader \
  | tee -a "$OUT_DIR/summary.txt" || { say "nvidia-smi failed: no GPU here"; exit 2; }
"$PY" - <<'EOF' || { say "python3's torch does not see a Hopper GPU"; exit 2; }
import sys, torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
cap = torch.cuda.get_device_capability(0)
print(f"torch {torch.__version__}, cuda:0 {torch.cuda.get_device_name(0)} sm_{cap[0]}{cap[1]}, "
      f"python {sys.version.split()[0]}")
sys.exit(0 if cap == (9, 0) else 1)
EOF
fi

say "2/6 python packages"
if [ -n "$WHEELS" ]; then
  "$PY" benchmarks/gpu_carry.py install --wheels "$WHEELS" 2>&1 | tee -a "$OUT_DIR/summary.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || say "  installing the carried wheels FAILED"
fi
MISSING=()
for pair in hatchling:hatchling editables:editables rich:rich pytest:pytest \
            pytest_timeout:pytest-timeout numpy:numpy cutlass:nvidia-cutlass-dsl nvshmem.core:nvshmem4py-cu13 \
            cuda.bindings:cuda-bindings tvm_ffi:apache-tvm-ffi; do
  mod="${pair%%:*}"; pkg="${pair#*:}"
  if "$PY" -c "import $mod" >>"$OUT_DIR/pip.log" 2>&1; then
    say "  $pkg: imports"
  else
    say "  $pkg: MISSING or fails to import (see pip.log); tests needing it skip"; MISSING+=("$pkg")
  fi
done

say "3/6 moe-ep packages (editable, --no-deps)"
if ! "$PY" -m pip install -q --no-deps --no-build-isolation \
    -e packages/moe-ep-core -e packages/moe-ep-backends-sm90 -e packages/moe-ep-backends-sm100 \
    -e vendor/sm90_pull_cutedsl -e vendor/sm90_pull_nvfp4 \
    -e vendor/sm90_push_cuda -e vendor/sm90_push_cuda_deps \
    -e vendor/sm100_cutedsl_megamoe -e vendor/sm100_next_cutedsl_megamoe \
    >>"$OUT_DIR/pip.log" 2>&1; then
  say "editable install failed (hatchling/editables missing?); see pip.log"; exit 3
fi
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT_DIR/summary.txt"
from moe_ep.registry import available_kernels
for k in available_kernels():
    if k.name.startswith("sm90") or k.name == "any_fp8_fp8_bf16_torch":
        print(f"  {k.name}: available={k.available} {k.reason}")
EOF

if [ "${MOE_EP_PUSH_BUILD:-0}" = "1" ]; then
  say "4/6 push modules: nvcc build + tvm_ffi load ($(cap 240) s cap)"
  export MOE_EP_PUSH_CACHE="${MOE_EP_PUSH_CACHE:-/tmp/moe_ep_push_cache}"
  timeout "$(cap 240)" "$PY" - <<'EOF' 2>&1 | tee "$OUT_DIR/push_build.txt"
import time
from moe_ep_sm90.kernels.sm90_fp8_fp8_bf16_push_cuda import build as push_build
start = time.perf_counter()
s = push_build.find_sources()
built = push_build.build_modules(s)
print(f"built {built.a2a.name}, {built.gemm.name} in {time.perf_counter() - start:.1f} s")
a2a, gemm = push_build.load_modules(built)
print("loaded; sm90_push_p2p_native_atomics(0, 0) =", a2a.sm90_push_p2p_native_atomics(0, 0))
EOF
else
  say "4/6 push module build skipped (set MOE_EP_PUSH_BUILD=1)"
fi

# Only the tests that cannot run without a GPU (marker `gpu`: the sm90 kernels against the
# oracle, the GPU stagers, CUDA quantization); the CPU suite passed under the image's torch
# 2.11 on a CPU machine (docs/runbook.md), and its compile checks would take minutes here.
T5=$(cap 300)
say "5/6 GPU tests (pytest -m gpu; sm100 ones skip on Hopper), $T5 s cap"
export CUTE_DSL_CACHE_DIR="${CUTE_DSL_CACHE_DIR:-/tmp/moe_ep_cute_cache}"
timeout "$T5" "$PY" -m pytest tests -m "gpu and not slow" -q -rs \
  -p no:cacheprovider --timeout 240 2>&1 | tee "$OUT_DIR/pytest.log"
RC=${PIPESTATUS[0]}
say "pytest exit status $RC"

say "5b/6 portable kernels on CUDA (NCCL, EP1) vs the oracle: moe-ep run --check ($(cap 90) s cap)"
# Scripts that spawn ranks run from a file: spawned children re-import the parent's main
# module by path, which a script read from stdin does not have.
cat > "$OUT_DIR/portable_cuda.py" <<'EOF'
from moe_ep.cli import main

if __name__ == "__main__":  # spawned ranks re-import this file
    for kernel in ("any_bf16_bf16_bf16_torch", "any_fp8_fp8_bf16_torch",
                   "any_mxfp8_mxfp8_bf16_torch", "any_nvfp4_nvfp4_bf16_torch",
                   "any_fp8_fp4_bf16_torch"):
        code = main(["run", "--world-size", "1", "--kernel", kernel, "--check", "--iters", "3"])
        print(f"  {kernel}: exit {code}", flush=True)
EOF
timeout "$(cap 90)" "$PY" "$OUT_DIR/portable_cuda.py" 2>&1 | tee "$OUT_DIR/portable_cuda.txt"

BENCH_CAP=120; [ "${MOE_EP_PUSH_BUILD:-0}" = "1" ] && BENCH_CAP=240
BENCH_CAP=$(cap "$BENCH_CAP")
say "6/6 benchmark: one EP1 forward, pull (and push) vs portable fp8 (${BENCH_CAP} s cap)"
cat > "$OUT_DIR/bench.py" <<'EOF'
import os, time, torch
from moe_ep.spawn import spawn_local

T, H, I, E, K = map(int, os.environ.get("MOE_EP_GPU_CHECK_SHAPE", "2048,4096,1024,32,8").split(","))

def bench(rank, world, kernel):
    from moe_ep import BootstrapConfig, FleetParams, MoEEpLayer, MoEEpTensors, MoEWeightPack
    from moe_ep.registry import get_kernel
    ok, why = get_kernel(kernel).availability()
    if not ok:
        return f"unavailable: {why}"
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=g) * 0.02).to(torch.bfloat16)
    backend = kernel
    if kernel.startswith("sm90_fp8_fp8_bf16_pull"):
        from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig
        backend = Sm90_Fp8_Fp8_Bf16_PullCutedsl_MegaMoeConfig(top_k=K)
    elif kernel.startswith("sm90_fp8_fp8_bf16_push"):
        from moe_ep_sm90 import Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig
        backend = Sm90_Fp8_Fp8_Bf16_PushCuda_MegaMoeConfig(top_k=K)
    layer = MoEEpLayer(BootstrapConfig(world_size=1, rank=0),
                       FleetParams(num_experts=E, max_tokens_per_rank=T, hidden_size=H),
                       MoEWeightPack(w13=w13, w2=w2), backend)
    try:
        layer.warmup()
        dev = layer.device
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).to(dev)
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(dev)
        w = torch.rand(T, K, generator=g).to(dev)
        t = MoEEpTensors(hidden_states=x, topk_ids=ids, topk_weights=w)
        for _ in range(3):
            layer.forward(t)
        if dev.type != "cuda":  # rehearsal without a GPU: wall clock
            t0 = time.perf_counter()
            for _ in range(10):
                layer.forward(t)
            return (time.perf_counter() - t0) * 100
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); start.record()
        for _ in range(10):
            layer.forward(t)
        end.record(); torch.cuda.synchronize()
        return start.elapsed_time(end) / 10
    finally:
        layer.destroy()

if __name__ == "__main__":  # spawned ranks re-import this file
    print(f"shape: T={T} H={H} I={I} E={E} top-{K}, EP1, mean of 10 forwards after 3 warm-ups")
    res = {}
    kernels = ["any_fp8_fp8_bf16_torch", "sm90_fp8_fp8_bf16_pull_cutedsl"]
    if os.environ.get("MOE_EP_PUSH_BUILD") == "1":
        kernels.append("sm90_fp8_fp8_bf16_push_cuda")
    for kernel in kernels:
        try:
            res[kernel] = spawn_local(bench, 1, kernel, timeout_s=110.0)[0]
        except Exception as exc:  # report and go on: the benchmark is not a test
            res[kernel] = f"failed: {type(exc).__name__}: {str(exc)[:300]}"
        print(f"  {kernel}: {res[kernel] if isinstance(res[kernel], str) else f'{res[kernel]:.3f} ms'}")
    base = res["any_fp8_fp8_bf16_torch"]
    for kernel in kernels[1:]:
        if isinstance(base, float) and isinstance(res[kernel], float):
            print(f"  speed-up {kernel} vs portable: {base / res[kernel]:.2f}x")
EOF
timeout "$BENCH_CAP" "$PY" "$OUT_DIR/bench.py" 2>&1 | tee "$OUT_DIR/bench.txt"

say "done in $(( $(date +%s) - START )) s; missing packages: ${MISSING[*]:-none}"
exit "$RC"
