"""mamba_ssm's selective-scan CUDA kernel (`selective_scan_fn`, the public Mamba1 kernel) as a peer on the GPU
machine, which has nvcc but no network and no prebuilt wheel for its torch (2.11, CUDA 13; mamba_ssm's PyPI
source builds no CUDA extension unless asked, and its release wheels stop at older torch versions).

Two steps:
1. pack (on a machine with the mamba sources and PyPI): `git archive` of mamba_ssm's tag (csrc/selective_scan,
   mamba_ssm/ops/selective_scan_interface.py, LICENSE) plus the einops wheel its interface imports and a ninja
   binary wheel (torch's extension builder needs ninja), into one archive under .whl/ (about 270 KB), carried to the
   GPU machine with the rest of .whl/:
       python bench/mamba1_peer.py pack --mamba /path/to/state-spaces/mamba [--tag v2.3.2.post1]
2. build (on the GPU machine; `bash scripts/gpu_checks.sh mamba1_peer` calls it): the extension
   `selective_scan_cuda` compiled for this GPU's architecture only, with the nvcc flags of mamba_ssm's setup.py,
   by torch.utils.cpp_extension (ninja, the carried one when the machine has none; MAX_JOBS = the CPU count), into
   DEST; its interface file put beside the carried mamba_ssm Triton files (the package that `peers_env` puts on
   PYTHONPATH) and einops unpacked into DEST.
   Once per machine: a second call finds DEST/.built and only checks the import; a build cut short (the device
   call's time limit) goes on from its compiled objects. Prints where DEST is: put it on
   PYTHONPATH, then bench/selective_op.py finds `mamba_ssm.ops.selective_scan_interface` and adds its rows.
       python bench/mamba1_peer.py build [--archive .whl/mamba1_peer_src.tar.gz] [--dest /tmp/mamba1_peer]

The version must be that of the carried mamba_ssm Triton files (2.3.2.post1): the interface imports their
`mamba_ssm.utils.torch` and `mamba_ssm.ops.triton.layer_norm`.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile

ARCHIVE = ".whl/mamba1_peer_src.tar.gz"
SOURCES = ("csrc/selective_scan", "mamba_ssm/ops/selective_scan_interface.py", "LICENSE")
# mamba_ssm 2.3.2.post1 setup.py's nvcc flags (CUDA, not HIP), less the architectures: this GPU's only
NVCC_FLAGS = ["-O3", "-std=c++17", "-U__CUDA_NO_HALF_OPERATORS__", "-U__CUDA_NO_HALF_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
              "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-U__CUDA_NO_BFLOAT162_CONVERSIONS__",
              "--expt-relaxed-constexpr", "--expt-extended-lambda", "--use_fast_math", "-lineinfo"]


def pack(mamba: str, tag: str, out: str) -> None:
    src = subprocess.run(["git", "-C", mamba, "archive", "--format=tar", tag, *SOURCES], check=True,
                         capture_output=True).stdout
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "einops==0.8.2", "-d", tmp],
                       check=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--platform", "manylinux2014_x86_64", "--python-version", "3.12", "ninja==1.13.2", "-d", tmp],
                       check=True)
        wheels = sorted(glob.glob(os.path.join(tmp, "*.whl")))
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with tarfile.open(out, "w:gz") as tar:
            with tarfile.open(fileobj=io.BytesIO(src)) as t:
                for m in t.getmembers():
                    tar.addfile(m, t.extractfile(m) if m.isfile() else None)
            for wheel in wheels:
                tar.add(wheel, arcname="wheels/" + os.path.basename(wheel))
            info = tarfile.TarInfo("TAG")
            info.size = len(tag.encode())
            tar.addfile(info, io.BytesIO(tag.encode()))
    names = ", ".join(os.path.basename(w) for w in wheels)
    print(f"{out}: mamba {tag} ({', '.join(SOURCES)}) + {names}, {os.path.getsize(out)} bytes")


def check_import(dest: str) -> str:
    """The peer's import in a fresh process with DEST first on the path; its error, or ''."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([dest, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", "import torch, selective_scan_cuda, mamba_ssm; "
                        "from mamba_ssm.ops.selective_scan_interface import selective_scan_fn; "
                        "print('mamba_ssm', mamba_ssm.__version__, 'selective_scan_cuda from', "
                        "selective_scan_cuda.__file__)"], env=env, capture_output=True, text=True)
    print(r.stdout.strip())
    return "" if r.returncode == 0 else r.stderr.strip()[-2000:]


def build(archive: str, dest: str) -> int:
    import mamba_ssm  # the carried Triton files (gpu_checks.sh peers_env): the interface goes beside them
    import torch
    from torch.utils.cpp_extension import is_ninja_available, load

    if os.path.exists(os.path.join(dest, ".built")):
        err = check_import(dest)
        print(f"built before in {dest}" + (f"; the import fails:\n{err}" if err else ""))
        return 1 if err else 0
    if not os.path.exists(archive):
        print(f"{archive} is missing: make it with `python bench/mamba1_peer.py pack --mamba DIR` and carry .whl/")
        return 2
    src = os.path.join(dest, "src")
    if not os.path.exists(os.path.join(src, "TAG")):  # a build cut short keeps its sources and objects: ninja
        os.makedirs(src, exist_ok=True)               # goes on from them
        with tarfile.open(archive) as tar:
            tar.extractall(src, filter="data")
    with open(os.path.join(src, "TAG")) as f:
        tag = f.read().strip()
    if tag.lstrip("v") != mamba_ssm.__version__:
        print(f"the archive holds mamba {tag}, the carried mamba_ssm Triton files are {mamba_ssm.__version__}: "
              f"pack the same version")
        return 2
    with zipfile.ZipFile(glob.glob(os.path.join(src, "wheels", "einops-*.whl"))[0]) as z:
        z.extractall(dest)
    if not is_ninja_available():  # torch's extension builder needs ninja: the carried binary wheel's
        with zipfile.ZipFile(glob.glob(os.path.join(src, "wheels", "ninja-*.whl"))[0]) as z:
            z.extractall(os.path.join(src, "ninja"))
        (ninja,) = glob.glob(os.path.join(src, "ninja", "ninja-*.data", "scripts", "ninja"))
        os.chmod(ninja, 0o755)
        os.environ["PATH"] = os.path.dirname(ninja) + os.pathsep + os.environ["PATH"]
    major, minor = torch.cuda.get_device_capability()
    arch = f"{major}{minor}"
    csrc = os.path.join(src, "csrc", "selective_scan")
    sources = [os.path.join(csrc, "selective_scan.cpp")] + sorted(glob.glob(os.path.join(csrc, "*.cu")))
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count()))
    build_dir = os.path.join(dest, "build")
    os.makedirs(build_dir, exist_ok=True)
    t0 = time.perf_counter()
    print(f"compiling {len(sources)} files for sm_{arch} (MAX_JOBS {os.environ['MAX_JOBS']}) into {build_dir}",
          flush=True)
    load(name="selective_scan_cuda", sources=sources, extra_cflags=["-O3", "-std=c++17"],
         extra_cuda_cflags=NVCC_FLAGS + ["-gencode", f"arch=compute_{arch},code=sm_{arch}"],
         extra_include_paths=[csrc], build_directory=build_dir, verbose=False)
    (so,) = glob.glob(os.path.join(build_dir, "selective_scan_cuda*.so"))
    shutil.copy(so, dest)
    target = os.path.join(os.path.dirname(mamba_ssm.__file__), "ops", "selective_scan_interface.py")
    shutil.copy(os.path.join(src, "mamba_ssm", "ops", "selective_scan_interface.py"), target)
    print(f"built in {time.perf_counter() - t0:.0f} s: {os.path.basename(so)} in {dest}; interface -> {target}")
    err = check_import(dest)
    if err:
        print(f"the import fails:\n{err}")
        return 1
    open(os.path.join(dest, ".built"), "w").close()
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--mamba", required=True, help="a git clone of state-spaces/mamba")
    p.add_argument("--tag", default="v2.3.2.post1")
    p.add_argument("--out", default=ARCHIVE)
    b = sub.add_parser("build")
    b.add_argument("--archive", default=ARCHIVE)
    b.add_argument("--dest", default="/tmp/mamba1_peer")
    args = ap.parse_args()
    if args.cmd == "pack":
        pack(args.mamba, args.tag, args.out)
    else:
        sys.exit(build(args.archive, args.dest))


if __name__ == "__main__":
    main()
