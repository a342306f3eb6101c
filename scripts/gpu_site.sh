#!/usr/bin/env bash
# Builds .whl/gpu_site.tar.xz: the public kernels that scripts/gpu_checks.sh compares deltacp with, for the GPU
# machine's Python 3.12 (x86-64), which reaches no package index. Run it on a machine with PyPI; the archive (about
# 47 MiB) travels with a device call and gpu_checks.sh unpacks it into /tmp/gpu_site.
#   site312/          pip install --target of the wheels below, without their console scripts, byte code, the
#                     `kernels` package (transformers would try the Hub for kernels) or z3's second copy of its library
#   mamba_ssm_triton/ mamba_ssm 2.3.2.post1's Triton files from its sdist, with a package root that only sets the
#                     version (the real root imports the CUDA selective-scan extension, which is not built here)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PKGS=(
  flash-linear-attention==0.6.0 fla-core==0.6.0 liger-kernel==0.8.5
  flash-qla==0.1.3 tilelang==0.1.15 apache-tvm-ffi==0.1.12 torch-c-dlpack-ext==0.1.5 z3-solver==4.15.4.0
  transformers==5.25.0 huggingface_hub==2.4.0 httpx2==2.17.0 httpcore2==2.17.0 click==8.5.1 tomlkit==0.15.3
  truststore==0.10.5 hf-xet==1.8.0 regex==2026.12.2
)
PLATFORM=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORM[@]}" \
  -d "$work/wheels" "${PKGS[@]}"
python3 -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi abi3 \
  --abi cp312 --abi none "${PLATFORM[@]}" --target "$work/site312" "$work"/wheels/*.whl
rm -rf "$work/site312/bin"
find "$work/site312" -name __pycache__ -prune -exec rm -rf {} +
(cd "$work/site312/z3/lib" && rm libz3.so && ln -s libz3.so.4.15 libz3.so)
python3 -m pip download -q --no-deps --no-binary=:all: --no-build-isolation -d "$work/sdist" mamba-ssm==2.3.2.post1 \
  2>/dev/null || curl -sSfL -o "$work/sdist/mamba_ssm-2.3.2.post1.tar.gz" --create-dirs \
  https://files.pythonhosted.org/packages/af/48/aa7bec0efc7453fa0512276c0069c854bf684219050294266534bfef34bb/mamba_ssm-2.3.2.post1.tar.gz
tar -xzf "$work"/sdist/mamba_ssm-2.3.2.post1.tar.gz -C "$work"
m="$work/mamba_ssm_triton/mamba_ssm"
mkdir -p "$m/ops"
cp -r "$work/mamba_ssm-2.3.2.post1/mamba_ssm/ops/triton" "$m/ops/"
cp -r "$work/mamba_ssm-2.3.2.post1/mamba_ssm/utils" "$m/"
cp "$work/mamba_ssm-2.3.2.post1/mamba_ssm/ops/__init__.py" "$m/ops/"
echo '__version__ = "2.3.2.post1"  # the Triton kernels only (scripts/gpu_site.sh)' > "$m/__init__.py"
mkdir -p .whl
XZ_OPT="-6 -T0" tar -cJf .whl/gpu_site.tar.xz -C "$work" site312 mamba_ssm_triton
ls -l .whl/gpu_site.tar.xz
