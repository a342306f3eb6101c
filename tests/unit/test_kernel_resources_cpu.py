"""Every Triton launch the recurrences' tables ask for can launch on a Hopper GPU: bench/kernel_resources.py records
each op's launches at the released head shapes under the interpreter and compiles them for sm_90 here (no GPU), and
no kernel may fail to compile or need more shared memory per program than an H100 / H200 gives (Triton raises
OutOfResources at launch there). A launch table edited on a machine with no GPU is checked before any device runs it.
Every LAUNCH entry's kernel must have been launched, those that only a module switch runs included (the tool records
a pass at each of `kernel_resources.SWITCHES`' settings).
"""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

pytest.importorskip("triton", reason="triton is not installed: nothing to compile")

import kernel_resources  # noqa: E402

# the kernel modules whose LAUNCH tables the tool reads, per op; a LAUNCH entry's kernel is <prefix>_<entry>_kernel
# but where named here (SSD's two state scans are one kernel run each way)
MODULES = {"ssd": "deltacp.ops.ssd.triton.kernels", "kda": "deltacp.ops.kda.triton.kernels",
           "selective": "deltacp.ops.selective.triton.kernels"}
KERNEL = {("ssd", "state_fwd"): "ssd_state_scan_kernel", ("ssd", "state_bwd"): "ssd_state_scan_kernel"}


def test_every_launch_fits_a_hopper_program(tmp_path):
    out = tmp_path / "launches.jsonl"
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_resources.py"), "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    for op in kernel_resources.SHAPES:  # every op recorded some launches (a silent recording failure fails here)
        assert any(r["where"].startswith(f"{op} ") for r in rows), f"no launch recorded for {op}"
    for r in rows:
        assert "error" not in r, r
        assert 0 <= r["shared"] <= kernel_resources.HOPPER_SHARED_LIMIT, r
        assert r["registers"] is not None and r["registers"] <= 255, r
    # the launches compiled are the source's tables' (num_warps, num_stages and blocks of each op's bf16 entries)
    for op, name in MODULES.items():
        table = importlib.import_module(name).LAUNCH
        for entry, cfg in table.items():
            if "/" in entry or "num_warps" not in cfg:
                continue
            kernel = KERNEL.get((op, entry), f"{'sel' if op == 'selective' else op}_{entry}_kernel")
            seen = [r for r in rows if r["kernel"] == kernel and r["where"].startswith(f"{op} ")
                    and "bfloat16" in r["where"]]
            assert seen, f"{op}: LAUNCH[{entry!r}]'s kernel {kernel} was not launched at any recorded bf16 shape"
            assert any(r["num_warps"] == cfg["num_warps"] and r["num_stages"] == cfg["num_stages"]
                       and all(r["constexprs"].get(k) == v for k, v in cfg.items() if k.startswith("B"))
                       for r in seen), (kernel, cfg, [(r["num_warps"], r["num_stages"]) for r in seen])
