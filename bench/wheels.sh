#!/usr/bin/env bash
# Wheels for a GPU machine without network: builds the carry folders beside the repository root.
#
#   bash bench/wheels.sh            # -> .whl/ (everything but one big library), .whl_big/ and .whl_rl/
#
# The GPU image (python 3.12, torch 2.11) lacks the trainer's torchtitan 0.2.2, tyro, torchdata
# and datasets (and their few missing dependencies) and the optional QuACK kernels
# (`moe.expert_kernels = "quack"`), and fla-core (Gated DeltaNet on CUDA). One of QuACK's wheels, nvidia-cutlass-dsl-libs-cu13, is 92 MB,
# over what one device call carries (64 MiB with the repository): it is unpacked, repacked as an
# xz archive (61 MiB) and split in two, the first 40 MiB in .whl_big/, carried alone in a first
# call that only copies it to /tmp, the rest with .whl/ in the next call (while the machine is
# still warm):
#
#   call 1 (carry .whl_big):  cp .whl_big/cutlass_cu13.tar.xz.part1 /tmp/
#   call 2 (carry .whl):      source bench/wheels.sh --install && <the benchmark>
#
# Installed under a directory named site-packages: QuACK fingerprints only its own code for its
# kernel cache and treats code under a site-packages folder as installed libraries (elsewhere it
# rejects the CUTLASS DSL's functions as unkeyable). With --install (sourced) the wheels go to
# /tmp/tf/site-packages and PYTHONPATH points there.
set -u
SITE=/tmp/tf/site-packages
if [ "${1:-}" = --install ]; then
  mkdir -p "$SITE"
  for dir in .whl .whl_rl; do  # whichever the call carried
    if [ -d "$dir" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$dir"/*.whl
    fi
  done
  # after pip: --upgrade replaces whole top-level folders, and nvidia_cutlass_dsl/ is shared
  if [ -f /tmp/cutlass_cu13.tar.xz.part1 ]; then
    cat /tmp/cutlass_cu13.tar.xz.part1 .whl/cutlass_cu13.tar.xz.part2 | tar xJf - -C "$SITE"
  fi
  # the CUTLASS DSL's package dir is added by its .pth file, which --target does not read
  export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD"
  return 0 2>/dev/null || exit 0
fi
set -e
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64"
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d .whl "$@"
}
mkdir -p .whl .whl_big
# the trainer
download torchtitan==0.2.2 tyro docstring-parser typeguard shtab tomli torchdata datasets==3.6.0 dill==0.3.8 multiprocess==0.70.16
# QuACK (moe.expert_kernels = "quack")
download quack-kernels==0.6.5 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  torch-c-dlpack-ext==0.1.5
# Gated DeltaNet's kernels (the gdn extra)
download fla-core==0.6.0
big=$(ls .whl/nvidia_cutlass_dsl_libs_cu13-*.whl)
tmp=$(mktemp -d)
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$big" "$tmp"
tar cf - -C "$tmp" . | xz -9e -T2 > "$tmp.tar.xz"
head -c 40M "$tmp.tar.xz" > .whl_big/cutlass_cu13.tar.xz.part1
tail -c +$((40 * 1024 * 1024 + 1)) "$tmp.tar.xz" > .whl/cutlass_cu13.tar.xz.part2
rm -rf "$tmp" "$tmp.tar.xz" "$big"
# the rl suite (bench/replay_mismatch.py) in .whl_rl/, carried alone: the trainer's wheels, fla-core and
# transformers with what the GPU image lacks of its dependencies (QuACK's left out: one call's size)
mkdir -p .whl_rl
cp .whl/torchtitan-*.whl .whl/tyro-*.whl .whl/docstring_parser-*.whl .whl/typeguard-*.whl .whl/shtab-*.whl \
  .whl/tomli-*.whl .whl/torchdata-*.whl .whl/datasets-*.whl .whl/dill-*.whl .whl/multiprocess-*.whl \
  .whl/fla_core-*.whl .whl_rl/
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
  -d .whl_rl transformers==5.24.0 tokenizers huggingface_hub safetensors regex hf-xet httpx2 httpcore2 h11 anyio \
  idna click truststore typer shellingham annotated-doc
du -sh .whl .whl_big .whl_rl
