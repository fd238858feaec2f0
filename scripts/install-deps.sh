#!/usr/bin/env bash
# Installs every Debian package shardtrain needs to build, test and run its demo.
# Idempotent; runs as root without prompts (uses sudo when not root).
set -euo pipefail

PKGS=(
  build-essential make pkg-config
  openmpi-bin libopenmpi-dev          # MPI runtime and mpicxx
  libhdf5-openmpi-dev hdf5-tools      # parallel HDF5 (checkpoints), h5dump
  libboost-program-options-dev        # CLI and INI job files
  nlohmann-json3-dev                  # config.json, canonical config JSON, metrics
  libopenblas-dev                     # CPU GEMM
  libdeflate-dev                      # CRC-32 of checkpoint shards and data files (PCLMULQDQ; zlib's table code is ~10x slower)
  libgtest-dev                        # unit tests
  libsentencepiece-dev                # SentencePiece tokenizers: train (--mode tokenizer), encode (--mode prepare), generate
  fortunes                            # default English corpus for `make demo` and tests
  python3 python3-venv                # verification clients (h5py, transformers) in a venv
  shellcheck                          # lints jobs/*.sbatch and the test scripts (tests/e2e/test_jobs_scripts.sh)
  slurmctld slurmd slurm-client munge # make slurm-test starts its own private cluster (tests/slurm/run.sh); the system services
                                      # stay down without /etc/slurm/slurm.conf
)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PKGS[@]} packages already installed"
  exit 0
fi
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
