#!/usr/bin/env bash
# The CUDA backend is a plugin (libshardtrain_cuda.so beside the binaries), loaded on first need:
#  * no executable links a CUDA library (ldd); the plugin does, and every shardtrain symbol it
#    needs is exported by the executables that may load it (-rdynamic);
#  * a 2-rank CPU training run, --device auto (no GPU here) and --device cpu, maps no libcublas,
#    libcublasLt, libnccl or libcudart (/proc/<pid>/maps of both ranks while they train);
#  * the plugin hidden (SHARDTRAIN_CUDA_PLUGIN=/nonexistent) or broken: --device cuda fails on every
#    rank naming it; present: it loads and the CUDA runtime's own error comes back (no GPU here).
# A CPU-only build (make CUDA=0) has no plugin: only the ldd check and "built without CUDA".
source "$(dirname "$0")/common.sh"
DIR=$(dirname "$BIN")
PLUGIN=$DIR/libshardtrain_cuda.so
CUDA_RE='lib(cublas|cublasLt|nccl|cudart)\.so'

for b in shardtrain unit_tests mpi_tests gpu_tests; do
  [ -e "$DIR/$b" ] || continue
  ! ldd "$DIR/$b" | grep -E "$CUDA_RE|libcuda\.so" || fail "$b links CUDA libraries"
done
echo "ok: ldd: no executable links libcublas, libcublasLt, libnccl, libcudart or libcuda"

DATA=$(test_corpus)
A2=(--model tiny --data "$DATA" --seq-len 16 --global-batch 4 --steps 2 --threads 1)
if [ ! -e "$PLUGIN" ]; then
  expect_fail no_cuda_build "this shardtrain was built without CUDA" 2 "${A2[@]}" --device cuda
  echo "ok: CPU-only build: no plugin, --device cuda refused"
  exit 0
fi

# (grep reads all of ldd's output: a `| grep -q` may exit first, and pipefail then fails on ldd's SIGPIPE)
grep -qE 'libcublas\.so' <<<"$(ldd "$PLUGIN")" || fail "the plugin does not link cuBLAS"
undef=$(nm -D --undefined-only "$PLUGIN" | awk '$1 == "U" {print $2}' | grep '10shardtrain' | sort -u)
for b in shardtrain gpu_tests unit_tests; do
  missing=$(comm -23 <(echo "$undef") <(nm -D --defined-only "$DIR/$b" | awk '{print $3}' | sort -u) | c++filt)
  [ -z "$missing" ] || fail "$b does not export what the plugin needs: $missing"
done
echo "ok: the plugin links cuBLAS; shardtrain, gpu_tests and unit_tests export the $(echo "$undef" | wc -l) shardtrain symbols it uses"

# CPU training: look at both ranks' mappings after a few steps (the device is chosen by then),
# then stop the job with SIGUSR1 (it finishes the step and exits 75).
for dev in auto cpu; do
  m=$WORK/train-$dev.jsonl
  $MPIRUN -np 2 "$BIN" --model tiny --data "$DATA" --seq-len 32 --global-batch 8 --steps 100000 --log-every 1 \
    --eval-every 0 --eval-batches 1 --threads 1 --device "$dev" --metrics "$m" >"$WORK/train-$dev.log" 2>&1 &
  job=$!
  for _ in $(seq 1 600); do
    [ -f "$m" ] && [ "$(grep -c '"loss"' "$m")" -ge 3 ] && break
    kill -0 "$job" 2>/dev/null || break
    sleep 0.1
  done
  mapfile -t ranks < <(pgrep -P "$job" || true)
  maps=()
  for p in "${ranks[@]}"; do
    [ "$(readlink "/proc/$p/exe")" = "$BIN" ] && maps+=("$(cat "/proc/$p/maps")")
  done
  for p in "${ranks[@]}"; do kill -USR1 "$p" 2>/dev/null || true; done
  rc=0
  timeout -k 5 60 tail --pid="$job" -f /dev/null || true
  wait "$job" || rc=$?
  [ "${#maps[@]}" = 2 ] || { cat "$WORK/train-$dev.log"; fail "--device $dev: found ${#maps[@]} ranks of 2 while training"; }
  [ "$rc" = 75 ] || { cat "$WORK/train-$dev.log"; fail "--device $dev: exit status $rc after SIGUSR1, expected 75"; }
  grep -q "device cpu" "$WORK/train-$dev.log" || { cat "$WORK/train-$dev.log"; fail "--device $dev did not run on the CPU"; }
  for mp in "${maps[@]}"; do
    grep -q libopenblas <<<"$mp" || fail "--device $dev: maps without OpenBLAS (not a rank?)"
    ! grep -oE "[^ ]*($CUDA_RE|libshardtrain_cuda\.so)[^ ]*" <<<"$mp" | sort -u | grep . ||
      fail "--device $dev: a rank mapped CUDA libraries while training on the CPU"
  done
  echo "ok: --device $dev, 2 ranks training on the CPU: no CUDA library (nor the plugin) in either rank's maps"
done

# The plugin hidden: the reason names it, on every rank.
export SHARDTRAIN_CUDA_PLUGIN=/nonexistent
expect_fail plugin_hidden "[CUDA: the CUDA backend plugin /nonexistent (SHARDTRAIN_CUDA_PLUGIN) does not exist]" 2 \
  "${A2[@]}" --device cuda
# ... and where the device count is faked (SHARDTRAIN_FAKE_CUDA_DEVICES), the factory's dlerror.
export SHARDTRAIN_FAKE_CUDA_DEVICES=2
expect_fail plugin_hidden_factory "cannot load the CUDA backend plugin /nonexistent (SHARDTRAIN_CUDA_PLUGIN): /nonexistent: cannot open shared object file" 2 \
  "${A2[@]}" --device cuda --gpu-comm mpi
echo "not an ELF file" >"$WORK/libbroken.so"
export SHARDTRAIN_CUDA_PLUGIN=$WORK/libbroken.so
expect_fail plugin_broken "cannot load the CUDA backend plugin $WORK/libbroken.so (SHARDTRAIN_CUDA_PLUGIN): $WORK/libbroken.so: " 2 \
  "${A2[@]}" --device cuda --gpu-comm mpi
unset SHARDTRAIN_CUDA_PLUGIN
# The plugin beside the binary loads (RTLD_NOW: every symbol resolves) and, without a driver,
# reports the CUDA runtime's error. Only where there is no NVIDIA driver (with one, this would train).
if ! grep -q 'libcuda\.so\.1' <<<"$(ldconfig -p)"; then
  expect_fail plugin_loads "CUDA device 0: CUDA error: cudaSetDevice" 2 "${A2[@]}" --device cuda --gpu-comm mpi
  ! grep -q "cannot load the CUDA backend plugin" "$WORK/plugin_loads.log" || fail "plugin_loads: the plugin did not load"
fi
unset SHARDTRAIN_FAKE_CUDA_DEVICES
echo "ok: --device cuda with the plugin hidden, broken, or present without a GPU: refused on every rank, naming why"
