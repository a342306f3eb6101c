"""The resources every Triton kernel of deltacp's recurrences asks of a Hopper GPU, found on any machine (no GPU
needed): shared memory per program, registers per thread and spilled bytes, at the released head shapes.

Two steps, each in its own process:
1. record: the ops run forward + backward under TRITON_INTERPRET=1 at each shape (a few chunks of tokens: the launch
   configuration depends on the head shape, not on the length), with every launch recorded instead of run: the
   kernel, its argument types, its constexpr values, num_warps and num_stages;
2. compile: each distinct launch compiled by Triton for sm_90 (`triton.compile` with an explicit GPUTarget: Triton's
   own compiler and its bundled ptxas, the same passes a GPU machine runs), its shared memory read from the compiled
   kernel's metadata and registers / spills from `ptxas -v` on its PTX.

A kernel that needs more shared memory than an H100 / H200 program may have (232,448 bytes) cannot launch there
(Triton raises OutOfResources); spilled registers go to local memory. The numbers are those of the Triton installed
here (the GPU machine may run another: 2026-12-06 the H100's Triton 3.6.0 refused exactly the 246,784 bytes this
tool finds for KDA's state kernel with Triton 3.9.0).

    python bench/kernel_resources.py                       # every op at its shapes; exit 1 on a kernel over the limit
    python bench/kernel_resources.py --ops kda --json out.jsonl
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

HOPPER_SHARED_LIMIT = 232448  # bytes per program on sm_90 (H100, H200): the limit Triton checks at launch

# op -> {label: shape}; the released shapes of each family's recurrence
SHAPES = {
    "ssd": {  # (H, G, N, P): Nemotron-H-8B (128 x 64, 8 groups, state 128), the one-group state-256 Mamba2 hybrids
        "nemotron-h-8b": dict(H=128, G=8, N=128, P=64),
        "bamba/granite (N=256)": dict(H=128, G=1, N=256, P=64),
    },
    "kda": {"kimi-linear-48b (32 x 128)": dict(H=32, K=128, V=128)},
    "gdn": {"qwen3.5 (16 x 128)": dict(Hk=16, Hv=16, K=128, V=128),
            "olmo-hybrid (96 x 192)": dict(Hk=30, Hv=30, K=96, V=192)},
    # the selected attention of the indexed attention layers (not a recurrence): Qwen4-Exp's 16 query heads over 2
    # KV heads of 256, blocks of 64; GLM-5.3-Flash's absorbed MLA, 64 heads over its one 512-wide latent (one tensor
    # as the keys and the values, as its layers pass it), pools of 16
    "selected": {"qwen4-exp (16 / 2 x 256, blocks of 64)": dict(H=16, KV=2, D=256, size=64),
                 "glm-5.3-flash (64 / 1 x 512, pools of 16)": dict(H=64, KV=1, D=512, size=16, shared=True)},
    # Mamba1's selective scan: the launches depend on N, not on the channels I (a runtime argument; recorded at a
    # few blocks): Falcon-Mamba-7B, Mamba-2.8B and Jamba all have N = 16
    "selective": {"falcon-mamba-7b / jamba (N = 16)": dict(I=96, N=16)},
}
DTYPES = ("bfloat16", "float32")
# the dtypes an op's GPU path takes where fewer: the GDN Triton backend takes bf16 q/k/v/beta only on a GPU
# (`check_triton_contract`); its float32 launches run under the interpreter alone
GPU_DTYPES = {"gdn": ("bfloat16",)}
# module switches of an op's kernels recorded in a pass of their own (each at the setting given here, the other
# switches as the source has them): the launches a setting adds (its own kernels, other constexprs) are compiled
# too, whichever setting the source has
# (KDA's OPERANDS16 0: the state kernels on fp32 operands, which the summary's M and unnormalised q, k run anyway;
# STATE16 2: h, dh, vn and dvn in scaled fp16, every launch its level 1 makes too; off in the source until timed)
SWITCHES = {"kda": {"WY_SPLIT": 0, "OPERANDS16": 0, "STATE16": 2},
            "selective": {"BC_TOKEN_MAJOR": ("chunk_state", "state_pass", "chunk_out")}}
T = 192  # three chunks of 64


def _inputs(op, shape, dtype):
    import torch

    from deltacp.ops.recurrence import RecurrenceInputs

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    if op == "ssd":
        H, G, N, P = (shape[k] for k in "HGNP")
        x = RecurrenceInputs(r(1, T, G, N).to(dt), r(1, T, G, N).to(dt), r(1, T, H, P).to(dt), -r(1, T, H).abs(),
                             r(1, T, H).abs(), r(1, T, H))  # q, k, x, g, the value scale (dt), the skip weight (D)
        return x, r(1, H, N, P), (1, T, H, P)
    if op == "kda":
        H, K, V = (shape[k] for k in "HKV")
        x = RecurrenceInputs(r(1, T, H, K).to(dt), r(1, T, H, K).to(dt), r(1, T, H, V).to(dt),
                             -r(1, T, H, K).abs(), torch.rand(1, T, H, generator=g))
        return x, r(1, H, K, V), (1, T, H, V)
    if op == "selective":
        I, N = shape["I"], shape["N"]
        A = -r(1, I, N).abs()
        x = RecurrenceInputs(r(1, T, I).to(dt), r(1, T, I).abs().to(dt), A, r(1, T, N).to(dt), r(1, T, N).to(dt),
                             r(1, I), r(1, T, I).to(dt))  # x, dt, A, B, C, D, z
        return x, r(1, 1, I * N, 1), (1, T, 1, I)
    Hk, Hv, K, V = (shape[k] for k in ("Hk", "Hv", "K", "V"))
    x = RecurrenceInputs(r(1, T, Hk, K).to(dt), r(1, T, Hk, K).to(dt), r(1, T, Hv, V).to(dt),
                         -r(1, T, Hv).abs(), torch.rand(1, T, Hv, generator=g).to(dt))
    return x, r(1, Hv, K, V), (1, T, Hv, V)


def _recurrence(op):
    if op == "selective":
        from deltacp.ops.selective.triton import TritonSelectiveScan

        return TritonSelectiveScan()
    if op == "ssd":
        from deltacp.ops.ssd.triton import TritonScalarDecay

        return TritonScalarDecay()
    if op == "kda":
        from deltacp.ops.kda.triton import TritonKimiDeltaRule

        return TritonKimiDeltaRule(qk_l2norm=True, scale=None)
    from deltacp.ops.gdn.triton import TritonGDNBackend
    from deltacp.ops.recurrence import GatedDeltaRule

    return GatedDeltaRule(TritonGDNBackend(), qk_l2norm=True)


def _record_selected(shape, dtype):
    """The selected attention forward + backward."""
    import torch

    from deltacp.ops.selected_attention import triton_selected_attention
    from deltacp.testing.selection import random_selection

    dt = getattr(torch, dtype)
    H, KV, D, size = (shape[k] for k in ("H", "KV", "D", "size"))
    sel = random_selection(torch.tensor([0, T]), 1, T, size, 2, 0, "cpu")
    q, k, v = (torch.randn(1, T, h, D).to(dt).requires_grad_() for h in (H, KV, KV))
    if shape.get("shared"):
        v = k
    leaves = (q, k) if v is k else (q, k, v)
    torch.autograd.grad(triton_selected_attention(q, k, v, sel, D ** -0.5).float().sum(), leaves)


def _type_of(value) -> str | None:
    """Triton's signature type of a runtime argument (None: a constexpr)."""
    import torch

    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64",
             torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.bool: "i1"}
    if isinstance(value, torch.Tensor):
        return "*" + names[value.dtype]
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return "i64" if abs(value) >= 2**31 else "i32"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"argument of type {type(value).__name__}")


def record(ops) -> list[dict]:
    """Run the ops under the interpreter with launches recorded (not run); the distinct launches."""
    import torch
    from triton.runtime import interpreter

    launches, seen = [], set()

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        options = {k: v for k, v in kwargs.items() if k not in names}
        annotations = {p: getattr(self.fn, "__annotations__", {}).get(p) for p in names}
        signature, constexprs = {}, {}
        for name in names:
            value = values.get(name)
            is_constexpr = "constexpr" in str(annotations[name])
            kind = None if is_constexpr else _type_of(value)
            if kind is None:
                constexprs[name] = value if not isinstance(value, torch.dtype) else str(value)
            else:
                signature[name] = kind
        entry = dict(module=self.fn.__module__, kernel=self.fn.__name__, signature=signature, constexprs=constexprs,
                     num_warps=options.get("num_warps", 4), num_stages=options.get("num_stages", 3))
        if options.get("maxnreg") is not None:  # a launch capping its registers a thread (ptxas' .maxnreg)
            entry["maxnreg"] = options["maxnreg"]
        key = json.dumps(entry, sort_keys=True)
        if key not in seen:
            seen.add(key)
            launches.append(dict(entry, where=record.where))
        return None

    interpreter.InterpretedFunction.run = run
    if "kda" in ops:  # the KDA launchers take a whole chunk per program on CPU tensors (the tests); here the GPU's
        from deltacp.ops.kda.triton import kernels as kda_kernels

        kda_kernels.INTERPRETER_BR = 0
    for op in ops:
        module = None if op not in SWITCHES else importlib.import_module(f"deltacp.ops.{op}.triton.kernels")
        for switch in (None, *SWITCHES.get(op, {})):
            if switch is not None:
                before = getattr(module, switch)
                setattr(module, switch, SWITCHES[op][switch])
            for label, shape in SHAPES[op].items():
                for dtype in GPU_DTYPES.get(op, DTYPES):
                    setting = "" if switch is None else f" {switch}={SWITCHES[op][switch]}"
                    record.where = f"{op} {label} {dtype}{setting}"
                    if op == "selected":
                        _record_selected(shape, dtype)
                        continue
                    rec = _recurrence(op)
                    x, h0, out_shape = _inputs(op, shape, dtype)
                    leaves = x.map(lambda t: t.detach().requires_grad_())
                    h0 = h0.requires_grad_()
                    o, ht = rec.forward(leaves, initial_state=h0, output_final_state=True)
                    torch.autograd.grad((o.float().sum() + ht.float().sum()),
                                        [t for t in (*leaves.tensors, h0) if t is not None and t.requires_grad],
                                        allow_unused=True)
                    with torch.no_grad():
                        rec.summary(x)
                    rec.initial_state_grad(x, torch.ones(out_shape, dtype=x.tensors[2].dtype))
            if switch is not None:
                setattr(module, switch, before)
    return launches


def _ptxas_usage(ptx: str, arch: int = 90) -> dict:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a", src, "-o",
                              os.path.join(d, "k.o")], capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spill.group(1)) if spill else None,
            "spill_loads": int(spill.group(2)) if spill else None}


def compile_launch(launch: dict, arch: int = 90) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    params = [p.name for p in fn.params]
    signature = {p: launch["signature"].get(p, "constexpr") for p in params}
    constexprs = {(params.index(k),): v for k, v in launch["constexprs"].items()}
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    try:
        k = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                           options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"],
                                    **({"maxnreg": launch["maxnreg"]} if "maxnreg" in launch else {})})
    except Exception as e:  # noqa: BLE001  (a kernel that does not compile is reported as such)
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    return {"shared": k.metadata.shared, **_ptxas_usage(k.asm["ptx"], arch)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--json")
    ap.add_argument("--record", help=argparse.SUPPRESS)  # internal: step 1, writing the launches to this file
    args = ap.parse_args()
    if args.record:
        with open(args.record, "w") as f:
            json.dump(record(args.ops), f)
        return 0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "launches.json")
        env = dict(os.environ, TRITON_INTERPRET="1")
        subprocess.run([sys.executable, __file__, "--record", path, "--ops", *args.ops], env=env, check=True)
        with open(path) as f:
            launches = json.load(f)
    over = []
    print(f"{'kernel':<32} {'where':<38} {'warps':>5} {'stages':>6} {'shared B':>9} {'regs':>5} {'spill':>6}")
    with concurrent.futures.ProcessPoolExecutor(max_workers=os.cpu_count()) as pool:
        results = list(pool.map(compile_launch, launches))
    for launch, res in zip(launches, results):
        row = {**launch, **res}
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(row) + "\n")
        if "error" in res:
            print(f"{launch['kernel']:<32} {launch['where']:<38} {res['error']}")
            over.append(f"{launch['kernel']} ({launch['where']}): {res['error']}")
            continue
        flag = "  OVER THE LIMIT" if res["shared"] > HOPPER_SHARED_LIMIT else ""
        print(f"{launch['kernel']:<32} {launch['where']:<38} {launch['num_warps']:>5} {launch['num_stages']:>6} "
              f"{res['shared']:>9} {res['registers'] or '?':>5} {res['spill_stores'] or 0:>6}{flag}", flush=True)
        if flag:
            over.append(f"{launch['kernel']} ({launch['where']}): {res['shared']} B of shared memory > "
                        f"{HOPPER_SHARED_LIMIT}")
    for msg in over:
        print("FAIL", msg)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
