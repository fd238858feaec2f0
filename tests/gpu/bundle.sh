#!/usr/bin/env bash
# tests/gpu/bundle.sh: packs shardtrain for a bare GPU machine (no Open MPI, HDF5, OpenBLAS or Boost
# installed; CUDA toolkit and driver present) into .gpu-bundle/, which `bash tests/gpu/run.sh` uses.
# Run it here, before carrying .gpu-bundle to the device machine (64 MiB carry limit).
#
#   1. Builds build-gpu/shardtrain, gpu_tests, attention_bench and kernel_bench with MARCH=x86-64-v3 (AVX2/FMA: not
#      -march=native, whose instructions the device's CPU may lack; build/ is left alone).
#   2. .gpu-bundle/libexec: shardtrain, gpu_tests, attention_bench, kernel_bench and the CUDA plugin libshardtrain_cuda.so beside them
#      (strip --strip-debug; the binaries dlopen it from their own directory), Open MPI's orterun / orted
#      and, when installed, HDF5's h5diff (run.sh compares checkpoint files with it where h5py is missing);
#      .gpu-bundle/bin: wrappers that set LD_LIBRARY_PATH and OPAL_PREFIX (Open MPI relocated, in
#      Debian's layout lib/x86_64-linux-gnu/openmpi/lib/openmpi3, share/openmpi, etc/) and exec them.
#   3. .gpu-bundle/lib: every shared library they and the kept MCA / PMIx plugins need (ldd,
#      transitively), except glibc, the NVIDIA driver and the large CUDA libraries (cuBLAS,
#      cuBLASLt, NCCL: run.sh finds the device's own in /usr/local/cuda/lib64, ldconfig, or pip
#      nvidia-* wheels). Network plugins (UCX, OFI, verbs, PSM) and OpenSHMEM are left out.
#   4. Fallbacks: glibc/ (this machine's loader and libc, used by the wrappers when the device's
#      glibc is older than the bundle needs), cuda-fallback/libcudart (small), nccl-stub/libnccl.so.2
#      (every NCCL call fails: lets the binaries start without NCCL; run.sh then uses --gpu-comm mpi).
#   5. fortunes/: the corpus files of `make data`. Files over 1 MiB are stored as .xz;
#      .gpu-bundle/unpack.sh restores them (run.sh calls it).
#   6. Self-test: a copy of the bundle at another path, in a mount namespace where the system's
#      Open MPI, HDF5, OpenBLAS, Boost, ... are hidden: ldd resolves inside the bundle; a 2-rank CPU
#      training run and gpu_tests work under a scrubbed environment, with and without glibc/.
#   Prints the size; fails if over 60 MiB.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
B=$ROOT/.gpu-bundle
BUILD=${GPU_BUILD:-build-gpu}
MARCH=${MARCH:-x86-64-v3}
LIMIT_MIB=60
FORTUNES_DIR=/usr/share/games/fortunes
FORTUNES=(fortunes literature riddles science wisdom people politics work education computers)
# Plugins not needed on one node (and whose libraries are large or probe network hardware).
SKIP_PLUGINS='ucx|ofi|openib|psm|verbs|mtl_|pml_cm|spml|sshmem|memheap|scoll|atomic_'
die() { echo "bundle: error: $*" >&2; exit 1; }

# ---- 1. build ---------------------------------------------------------------------------------
echo "bundle: building $BUILD/shardtrain, $BUILD/gpu_tests and the CUDA plugin (MARCH=$MARCH)"
make -s -j"$(nproc)" BUILD="$BUILD" MARCH="$MARCH" "$BUILD/shardtrain" "$BUILD/gpu_tests" "$BUILD/attention_bench" \
  "$BUILD/kernel_bench" "$BUILD/libshardtrain_cuda.so" ||
  die "$BUILD: build failed (no CUDA plugin without nvcc)"
NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)

# Open MPI's installation paths, relative to its prefix (Debian: /usr).
ompi_path() { ompi_info --parsable --path "$1" | awk -F: -v k="$1" '$2 == k && !f {print $3; f = 1}'; }
OMPI_PREFIX=$(ompi_path prefix)
PKGLIBDIR=$(ompi_path pkglibdir)
PKGDATADIR=$(ompi_path pkgdatadir)
SYSCONFDIR=$(ompi_path sysconfdir)
PKGLIB_REL=${PKGLIBDIR#"$OMPI_PREFIX"/}
PKGDATA_REL=${PKGDATADIR#"$OMPI_PREFIX"/}
PMIX_DIR=$(dirname "$(readlink -f "$(ldconfig -p | awk '$1 == "libpmix.so.2" && !f {print $NF; f = 1}')")")/pmix2
[ -d "$PMIX_DIR" ] || PMIX_DIR=/usr/lib/x86_64-linux-gnu/pmix2

rm -rf "$B"
mkdir -p "$B"/{bin,libexec,lib,glibc,cuda-fallback,nccl-stub,etc,fortunes,pmix2/lib/pmix,pmix2/share} \
  "$B/$PKGLIB_REL" "$B/$PKGDATA_REL"
gitexclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$gitexclude")"
grep -qxF '/.gpu-bundle/' "$gitexclude" 2>/dev/null || echo '/.gpu-bundle/' >>"$gitexclude"

# ---- 2. binaries and wrappers -----------------------------------------------------------------
strip --strip-debug -o "$B/libexec/shardtrain" "$BUILD/shardtrain"
strip --strip-debug -o "$B/libexec/gpu_tests" "$BUILD/gpu_tests"
strip --strip-debug -o "$B/libexec/attention_bench" "$BUILD/attention_bench"
strip --strip-debug -o "$B/libexec/kernel_bench" "$BUILD/kernel_bench"
strip --strip-debug -o "$B/libexec/libshardtrain_cuda.so" "$BUILD/libshardtrain_cuda.so"
cp "$(readlink -f "$(command -v orterun)")" "$B/libexec/orterun"
cp "$(readlink -f "$(command -v orted)")" "$B/libexec/orted"
# HDF5's h5diff (hdf5-tools), when installed: run.sh stage 4b compares checkpoint files with it where
# the device's Python has no h5py.
H5DIFF=$(command -v h5diff || true)
if [ -n "$H5DIFF" ]; then cp "$(readlink -f "$H5DIFF")" "$B/libexec/h5diff"; fi

wrapper() {  # wrapper NAME TARGET: bin/NAME runs libexec/TARGET
  cat >"$B/bin/$1" <<EOF
#!/bin/sh
# Made by tests/gpu/bundle.sh: runs libexec/$2 with the bundle's libraries and relocated Open MPI.
# GPU_BUNDLE_LIBPATH (set by tests/gpu/run.sh): library directories (bundle, CUDA, NCCL);
# GPU_BUNDLE_OWN_GLIBC=1: run under the bundle's glibc (the machine's is older).
d=\$(CDPATH= cd -- "\$(dirname -- "\$0")/.." && pwd -P)
export OPAL_PREFIX="\$d" OPAL_SYSCONFDIR="\$d/etc" PMIX_PREFIX="\$d/pmix2" PMIX_INSTALL_PREFIX="\$d/pmix2"
export PMIX_MCA_mca_base_component_path="\$d/pmix2/lib/pmix"
# Without ssh/rsh, Open MPI's default launcher refuses to start even on one node: use 'isolated'.
command -v ssh >/dev/null 2>&1 || command -v rsh >/dev/null 2>&1 || export OMPI_MCA_plm="\${OMPI_MCA_plm:-isolated}"
lp=\${GPU_BUNDLE_LIBPATH:-\$d/lib:/usr/local/cuda/lib64:\$d/cuda-fallback}
if [ "\${GPU_BUNDLE_OWN_GLIBC:-0}" = 1 ]; then
  exec "\$d/glibc/ld-linux-x86-64.so.2" --library-path "\$d/glibc:\$lp" --argv0 "\$0" "\$d/libexec/$2" "\$@"
fi
LD_LIBRARY_PATH="\$lp\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "\$d/libexec/$2" "\$@"
EOF
  chmod +x "$B/bin/$1"
}
wrapper shardtrain shardtrain
wrapper gpu_tests gpu_tests
wrapper attention_bench attention_bench
wrapper kernel_bench kernel_bench
wrapper mpirun orterun
wrapper orterun orterun
wrapper orted orted
if [ -e "$B/libexec/h5diff" ]; then wrapper h5diff h5diff; fi

# ---- 3. Open MPI / PMIx plugins and data files ------------------------------------------------
for p in "$PKGLIBDIR"/*.so; do
  [[ $(basename "$p") =~ $SKIP_PLUGINS ]] || cp "$p" "$B/$PKGLIB_REL/"
done
cp -r "$PKGDATADIR"/. "$B/$PKGDATA_REL/"
cp -r "$SYSCONFDIR"/. "$B/etc/"
if [ -d "$PMIX_DIR/lib/pmix" ]; then cp "$PMIX_DIR"/lib/pmix/*.so "$B/pmix2/lib/pmix/"; fi
if [ -d "$PMIX_DIR/share" ]; then cp -r "$PMIX_DIR"/share/. "$B/pmix2/share/"; fi
for f in "${FORTUNES[@]}"; do
  [ -s "$FORTUNES_DIR/$f" ] || die "missing $FORTUNES_DIR/$f: run 'make deps'"
  cp "$FORTUNES_DIR/$f" "$B/fortunes/"
done

# ---- 4. shared libraries ----------------------------------------------------------------------
mapfile -t GLIBC_LIBS < <(dpkg -L libc6 | grep -E '/lib[^/]*\.so(\.[0-9]+)*$' | xargs -n1 basename | sort -u)
is_glibc() { local n; for n in "${GLIBC_LIBS[@]}"; do [ "$n" = "$1" ] && return 0; done; return 1; }
mapfile -t ELFS < <(find "$B/libexec" "$B/$PKGLIB_REL" "$B/pmix2/lib" -type f \( -name '*.so' -o -perm -u+x \))
declare -A SEEN=()
while read -r name path; do
  [ -n "${SEEN[$name]:-}" ] && continue
  SEEN[$name]=1
  [ "$path" = "not" ] && die "$name: not found by ldd"
  case $name in
    libcuda.so* | libnvidia* | libcublas.so* | libcublasLt.so* | libnccl.so*) continue ;;  # device's own
    libcudart.so*) cp -L "$path" "$B/cuda-fallback/$name" ;;
    *) if is_glibc "$name"; then cp -L "$path" "$B/glibc/$name"; else cp -L "$path" "$B/lib/$name"; fi ;;
  esac
done < <(for e in "${ELFS[@]}"; do ldd "$e"; done | awk '$2 == "=>" {print $1, $3}')
# The CUDA libraries run.sh must find on the device, and what was built.
for n in "${!SEEN[@]}"; do echo "$n"; done | grep -E '^lib(cudart|cublas|cublasLt|nccl)\.so' | sort >"$B/CUDA_NEEDED"
{
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src include Makefile 2>/dev/null || echo ' + uncommitted changes')"
  os=$(sed -n 's/^PRETTY_NAME=//p' /etc/os-release | tr -d '"')
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $os, MARCH=$MARCH, $("$NVCC" --version | tail -1)"
} >"$B/BUILD_INFO"
cp -L /lib64/ld-linux-x86-64.so.2 "$B/glibc/ld-linux-x86-64.so.2"
# Newest glibc symbol version any bundled file needs (run.sh compares it with the machine's).
find "$B/libexec" "$B/lib" "$B/$PKGLIB_REL" "$B/pmix2/lib" -type f -print0 |
  xargs -0 objdump -T 2>/dev/null | grep -o 'GLIBC_2\.[0-9]*' | sort -uV | tail -1 | sed 's/GLIBC_//' >"$B/GLIBC_REQUIRED"

# NCCL stub: the NCCL functions the binaries call, each failing with ncclSystemError.
stub=$(mktemp -d)
{
  echo '/* made by tests/gpu/bundle.sh: stands in for a missing libnccl.so.2; every call fails */'
  echo 'static const char msg[] = "NCCL stub (tests/gpu/bundle.sh): no libnccl.so.2 on this machine; use --gpu-comm mpi";'
  nm -D --undefined-only "$B/libexec/libshardtrain_cuda.so" | awk '{print $2}' | grep '^nccl' | sort -u |
    while read -r s; do
      case $s in
        ncclGetErrorString | ncclGetLastError) echo "const char* $s(void* a) { (void)a; return msg; }" ;;
        *) echo "int $s(void) { return 2; }" ;;
      esac
    done
} >"$stub/nccl_stub.c"
gcc -shared -fPIC -O1 -Wl,-soname,libnccl.so.2 -o "$B/nccl-stub/libnccl.so.2" "$stub/nccl_stub.c"
rm -rf "$stub"

# ---- 5. compress the large files --------------------------------------------------------------
cat >"$B/unpack.sh" <<'EOF'
#!/bin/sh
# Made by tests/gpu/bundle.sh: restores the bundle's large files from their .xz copies (once).
d=$(CDPATH= cd -- "$(dirname -- "$0")" && pwd -P)
find "$d" -name '*.xz' | while read -r f; do
  t=${f%.xz}
  [ -e "$t" ] && continue
  if command -v xz >/dev/null 2>&1; then xz -dc "$f" >"$t.part"
  else python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$f" "$t.part"
  fi && chmod 755 "$t.part" && mv "$t.part" "$t" || { echo "unpack: cannot restore $t" >&2; exit 1; }
done
EOF
chmod +x "$B/unpack.sh"
find "$B" -type f -size +1024k -print0 | xargs -0 -r xz -6 -T0

# ---- 6. self-test, at another path, with the system's libraries hidden ----------------------
echo "bundle: self-test"
T=$(mktemp -d "${TMPDIR:-/tmp}/gpu-bundle-test.XXXXXX")
trap 'rm -rf "$T"' EXIT
cp -a "$B" "$T/b"
"$T/b/unpack.sh"
bad=0
while read -r e; do  # every dependency resolves inside the bundle (or is glibc, CUDA, the driver)
  while read -r name path; do
    case $path in "$T"/b/* | /usr/local/cuda*) continue ;; esac
    [ -e "$T/b/glibc/$name" ] && continue
    echo "  unresolved in the bundle: $(basename "$e") needs $name => $path"
    bad=1
  done < <(LD_LIBRARY_PATH="$T/b/lib:/usr/local/cuda/lib64:$T/b/cuda-fallback" ldd "$e" | awk '$2 == "=>" {print $1, $3}')
done < <(find "$T/b/libexec" "$T/b/lib" "$T/b/$PKGLIB_REL" "$T/b/pmix2/lib" -type f ! -name '*.xz')
[ "$bad" = 0 ] || die "libraries outside the bundle"
echo "  ldd: every library of the binaries and plugins resolves inside the bundle (or glibc / CUDA)"

# Hide the system's copies of everything bundled (needs a private mount namespace: unshare -m).
hide=()
cache=$(ldconfig -p)
for n in $(find "$B/lib" -type f -printf '%f\n' | sed 's/\.xz$//'); do
  p=$(awk -v n="$n" '$1 == n && !found {print $NF; found = 1}' <<<"$cache")
  if [ -n "$p" ]; then hide+=("$(readlink -f "$p")"); fi
done
hide+=("$(readlink -f "$(command -v orterun)")" "$(readlink -f "$(command -v orted)")")
for f in ssh rsh; do if command -v "$f" >/dev/null; then hide+=("$(readlink -f "$(command -v "$f")")"); fi; done
{
  echo 'set -e'
  for f in "${hide[@]}"; do echo "mount --bind /dev/null '$f'"; done
  for d in "$PKGLIBDIR" "$PMIX_DIR" "$SYSCONFDIR" "$PKGDATADIR" "$FORTUNES_DIR"; do echo "mount -t tmpfs none '$d'"; done
} >"$T/hide.sh"
NO_DRIVER=1  # without an NVIDIA driver, a faked device makes the plugin load and fail in cudaSetDevice
if ldconfig -p | grep -q 'libcuda\.so\.1'; then NO_DRIVER=0; fi
cat >"$T/test.sh" <<EOF
set -e
cd "$T"
E=(env -i PATH=/usr/bin:/bin HOME="$T" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
   OMPI_MCA_btl_vader_single_copy_mechanism=none)
for own in 0 1; do
  "\${E[@]}" GPU_BUNDLE_OWN_GLIBC=\$own b/bin/mpirun --oversubscribe --bind-to none -np 2 b/bin/shardtrain --mode prepare \
    --input b/fortunes/fortunes --input b/fortunes/riddles --out c.tok >prep.log 2>&1 || { cat prep.log; exit 1; }
  "\${E[@]}" GPU_BUNDLE_OWN_GLIBC=\$own b/bin/mpirun --oversubscribe --bind-to none -np 2 "$T/b/bin/shardtrain" --device cpu \
    --model tiny --data c.tok --seq-len 32 --global-batch 8 --steps 3 --eval-batches 1 --threads 1 >train.log 2>&1 \
    || { cat train.log; exit 1; }
  grep -q '^done: 3 steps' train.log || { cat train.log; exit 1; }
  echo "  2-rank CPU training under mpirun, GPU_BUNDLE_OWN_GLIBC=\$own: \$(grep -m1 '^done:' train.log)"
  "\${E[@]}" GPU_BUNDLE_OWN_GLIBC=\$own b/bin/mpirun -np 1 "$T/b/bin/gpu_tests" --gtest_color=no >gt.log 2>&1 \
    || { tail -20 gt.log; exit 1; }
  echo "  gpu_tests, GPU_BUNDLE_OWN_GLIBC=\$own: \$(grep -E '^\[  (PASSED|SKIPPED|FAILED) ?\] [0-9]+ test' gt.log | tr '\n' ' ')"
  if [ "$NO_DRIVER" = 1 ]; then  # the plugin is found in libexec/ (also through the glibc/ loader) and loads
    "\${E[@]}" GPU_BUNDLE_OWN_GLIBC=\$own SHARDTRAIN_FAKE_CUDA_DEVICES=1 b/bin/mpirun --oversubscribe --bind-to none -np 1 \
      "$T/b/bin/shardtrain" --device cuda --gpu-comm mpi --model tiny --data c.tok --seq-len 32 --global-batch 8 --steps 1 \
      --threads 1 >plugin.log 2>&1 && { cat plugin.log; exit 1; }
    grep -q 'CUDA error: cudaSetDevice' plugin.log || { cat plugin.log; exit 1; }
    echo "  CUDA plugin, GPU_BUNDLE_OWN_GLIBC=\$own: loads from libexec/; without a driver: \$(grep -m1 -o 'CUDA error: cudaSetDevice.*' plugin.log | cut -c1-90)"
  fi
done
EOF
if unshare -m true 2>/dev/null; then
  unshare -m bash -c "bash '$T/hide.sh' && bash '$T/test.sh'" || die "self-test failed"
  echo "  (system Open MPI, PMIx, HDF5, OpenBLAS, Boost, ..., ssh and fortunes were hidden: unshare -m)"
else
  bash "$T/test.sh" || die "self-test failed"
  echo "  (unshare -m not permitted: the system's libraries were not hidden; ldd check above only)"
fi

# ---- size -------------------------------------------------------------------------------------
bytes=$(du -sb "$B" | cut -f1)
if [ -e "$B/libexec/h5diff" ] && [ "$bytes" -gt $((LIMIT_MIB * 1048576)) ]; then
  # h5diff is optional (run.sh falls back to shardtrain --mode inspect): dropped, with the serial
  # HDF5 library that only it needs, rather than the bundle failing its limit.
  rm -f "$B/libexec/h5diff" "$B/bin/h5diff" "$B"/lib/libhdf5_serial.so*
  echo "  h5diff left out: the bundle would exceed $LIMIT_MIB MiB with it"
  bytes=$(du -sb "$B" | cut -f1)
fi
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
echo "bundle: $B: $mib MiB ($(find "$B" -type f | wc -l) files; needs glibc >= $(cat "$B/GLIBC_REQUIRED") or uses its own)"
du -sh "$B"/* | sort -h | tail -5 | sed 's/^/  /'
awk -v b="$bytes" -v l="$LIMIT_MIB" 'BEGIN {exit !(b <= l * 1048576)}' || die "bundle is $mib MiB, over $LIMIT_MIB MiB"
