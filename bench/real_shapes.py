"""Real Qwen3.5 shapes on one GPU: the longest sequence a training step fits, deltacp vs transformers.

    python bench/real_shapes.py --sizes 0.8B 2B 4B 9B 27B          # the table (about 4 minutes on an H200)
    python bench/real_shapes.py --sizes 0.8B --lengths 8192 16384 --impls deltacp

Each size is the released text model (deltacp.models.presets: vocabulary 248,320), randomly initialised, bf16
parameters and bf16 gradients resident on the GPU; optimizer states are left out (they do not grow with the
sequence, and under FSDP2 they shard over dp x cp). One training step = forward + backward of the mean
next-token loss over one row, full activation checkpointing (every decoder layer), as users run each:

- transformers: `model(input_ids, labels=input_ids).loss.backward()` after `gradient_checkpointing_enable()`,
  SDPA attention, and whatever GDN kernel transformers picks on this stack (printed: flash-linear-attention
  when installed, with its Hopper backward guard BYPASSED because it refuses to run otherwise; the logits of
  the whole row are materialised and upcast by transformers' loss);
- deltacp: `parallelize_qwen3_5_cp` (cp = 1, p2p, Triton GDN), `apply_activation_checkpointing`, and
  `cp_causal_lm_loss` (the chunked linear cross-entropy: no [tokens, vocab] logits).

Peak memory is measured (allocated, CUDA caching allocator with expandable segments) at each of --lengths;
a step that runs out of memory is reported as OOM. Both implementations' memory is linear in the length
(flash/efficient SDPA, checkpointed layers) once the activations dominate, so the longest length is PROJECTED
along the slope between the two longest measured peaks to the device's memory less --margin-gib, and
then VERIFIED by one step at the projection rounded down to a multiple of 1024 when the time that step is
expected to take is under --verify-budget-s (else the row says "projected"). tokens/s: median of --repeat
steps at the longest measured length (CUDA events, one warm-up step). cp > 1: per-rank projection from the
same line, with parameters and gradients sharded over the cp ranks (FSDP2) and activations divided by cp.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import emit, time_cuda  # noqa: E402


def build_model(size: str, layers: int | None, device):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from deltacp.models.presets import qwen3_5_preset

    fields = qwen3_5_preset(size)
    if layers is not None:
        fields.update(num_hidden_layers=layers, layer_types=fields["layer_types"][:layers])
    return build_bf16(Qwen3_5ForCausalLM, Qwen3_5TextConfig(**fields), device)


def build_bf16(cls, config, device):
    """`cls(config)` in training mode, bf16, on `device`, SDPA attention, seeded (every stack the same weights)."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    return model.train()


def gdn_kernel_of(model) -> str:
    """Which chunked GDN function transformers' layer calls (its module), for the table's caption."""
    layer = next(layer.linear_attn for layer in model.model.layers if hasattr(layer, "linear_attn"))
    fn = getattr(layer, "chunk_gated_delta_rule", None)
    if fn is None:
        import transformers.models.qwen3_5.modeling_qwen3_5 as modeling

        fn = getattr(modeling, "chunk_gated_delta_rule", None) or getattr(modeling, "torch_chunk_gated_delta_rule")
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__name__', '?')}"


def transformers_step(model, ids):
    def step():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    return step


def deltacp_step(model, ids, mesh):
    from deltacp import shard_batch_for_cp
    from deltacp.losses import cp_causal_lm_loss

    batch = shard_batch_for_cp(ids, mesh)

    def step():
        cp_causal_lm_loss(model, batch["target_ids"], mesh, input_ids=batch["input_ids"],
                          position_ids=batch["position_ids"], use_cache=False).backward()
        model.zero_grad(set_to_none=True)
    return step


def free():
    gc.collect()
    torch.cuda.empty_cache()


def measure(make_step, length: int, vocab: int, device, repeat: int) -> dict:
    ids = torch.randint(0, vocab, (1, length), device=device, generator=torch.Generator(device).manual_seed(1))
    free()
    try:
        stats = time_cuda(make_step(ids), warmup=1, repeat=repeat)
        return dict(length=length, ok=True, **stats, tokens_per_s=length / (stats["median_ms"] / 1e3))
    except torch.OutOfMemoryError:
        return dict(length=length, ok=False)
    finally:
        free()


def marginal_line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """peak = a + b * length through the two longest measured points -> (a, b).

    The peak of a short step is often set by fixed-size work (the vocabulary-sized head gradient), that of a
    long one by the per-token activations, so a line through all points understates the slope; the slope
    between the two longest points is the marginal cost per token, which only grows with the length."""
    (x0, y0), (x1, y1) = points[-2], points[-1]
    b = (y1 - y0) / (x1 - x0)
    return y1 - b * x1, b


def run_impl(args, impl: str, model, size: str, mesh, device, capacity_gib: float) -> dict:
    vocab = model.config.vocab_size
    if impl == "transformers":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        make = lambda ids: transformers_step(model, ids)  # noqa: E731
    else:
        make = lambda ids: deltacp_step(model, ids, mesh)  # noqa: E731
    rows = []
    for length in args.lengths:
        row = measure(make, length, vocab, device, args.repeat)
        rows.append(row)
        print(f"  {size} {impl} {length}: " + (f"{row['median_ms']:.0f} ms, peak {row['peak_gib']:.2f} GiB"
                                                if row["ok"] else "OOM"), flush=True)
        if not row["ok"]:
            break
    ok = [r for r in rows if r["ok"]]
    result = dict(bench="real_shapes", size=size, impl=impl, layers=model.config.num_hidden_layers,
                  params_b=sum(p.numel() for p in model.parameters()) / 1e9, points=rows, capacity_gib=capacity_gib)
    if len(ok) >= 2:
        a, b = marginal_line([(r["length"], r["peak_gib"]) for r in ok])
        projected = int((capacity_gib - args.margin_gib - a) / b) // 1024 * 1024
        result.update(fit_a_gib=a, fit_gib_per_token=b, projected_len=projected)
        last = ok[-1]
        expected_s = last["median_ms"] / 1e3 * (projected / last["length"]) ** 1.5  # attention grows faster
        if projected > last["length"] and expected_s <= args.verify_budget_s:
            check = measure(make, projected, vocab, device, 1)
            result.update(verified=check["ok"], verified_peak_gib=check.get("peak_gib"),
                          verified_ms=check.get("median_ms"))
            print(f"  {size} {impl} verify {projected}: " + ("ran, peak %.2f GiB" % check["peak_gib"]
                                                             if check["ok"] else "OOM"), flush=True)
        state_gib = 2 * 2 * result["params_b"] * 1e9 / 2**30  # bf16 parameters + bf16 gradients
        result["cp_projection"] = {
            cp: int(cp * (capacity_gib - args.margin_gib - (a - state_gib + state_gib / cp)) / b) // 1024 * 1024
            for cp in (2, 4, 8)}
    if ok:
        result.update(tps_len=ok[-1]["length"], tokens_per_s=ok[-1]["tokens_per_s"], step_ms=ok[-1]["median_ms"])
    if impl == "transformers":
        model.gradient_checkpointing_disable()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["0.8B", "2B", "4B", "9B", "27B"])
    parser.add_argument("--impls", nargs="+", default=["transformers", "deltacp"],
                        choices=["transformers", "deltacp"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--margin-gib", type=float, default=4.0)
    parser.add_argument("--verify-budget-s", type=float, default=25.0)
    parser.add_argument("--no-fla", action="store_true", help="do not import flash-linear-attention")
    parser.add_argument("--require-deltacp", action="store_true",
                        help="exit 1 unless deltacp's step runs at every length (a check, not only a table)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/real_shapes.py needs a CUDA GPU")
    fla_label = "not installed"
    if not args.no_fla:
        from fla_ref import load_fla

        loaded = load_fla(bypass_hopper_guard=True)
        fla_label = loaded[0] if loaded else "not installed"
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29700 + os.getpid() % 1000))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl")
    from torch.distributed.device_mesh import DeviceMesh

    from deltacp import parallelize_qwen3_5_cp
    from deltacp.models.checkpointing import apply_activation_checkpointing

    mesh = DeviceMesh.from_group(dist.group.WORLD, "cuda", mesh_dim_names=("cp",))
    device = torch.device("cuda", 0)
    capacity_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    results, kernel = [], "?"
    try:
        for size in args.sizes:
            model = build_model(size, args.layers, device)
            for impl in args.impls:
                if impl == "deltacp":
                    model = parallelize_qwen3_5_cp(model, mesh, linear_attention_cp_mode="p2p",
                                                   linear_attention_backend="triton")
                    apply_activation_checkpointing(model, policy="full")
                else:
                    kernel = gdn_kernel_of(model)
                result = run_impl(args, impl, model, size, mesh, device, capacity_gib)
                result["gdn_kernel"] = kernel if impl == "transformers" else "deltacp triton"
                results.append(result)
                emit(result, args.json)
            del model
            free()
    finally:
        print(f"\nOne training step (fwd+bwd, full activation checkpointing, bf16 params+grads, no optimizer "
              f"states) on {torch.cuda.get_device_name(0)} ({capacity_gib:.1f} GiB, margin {args.margin_gib} GiB); "
              f"transformers' GDN kernel: {kernel}; FLA: {fla_label}")
        print(f"{'size':>5} {'impl':<12} {'peaks GiB at ' + '/'.join(str(n // 1024) + 'K' for n in args.lengths):<28} "
              f"{'GiB/1K tok':>10} {'longest':>18} {'tok/s (len)':>18} {'cp2/4/8 (projected)':>24}")
        for r in results:
            peaks = "/".join(f"{p['peak_gib']:.1f}" if p["ok"] else "OOM" for p in r["points"])
            if "projected_len" in r:
                tag = "verified" if r.get("verified") else ("OOM at proj." if r.get("verified") is False
                                                             else "projected")
                longest = f"{r['projected_len'] // 1024}K {tag}"
                per_k = f"{r['fit_gib_per_token'] * 1024:.3f}"
                cps = "/".join(f"{v // 1024}K" for v in r["cp_projection"].values())
            else:
                ok = [p for p in r["points"] if p["ok"]]
                longest = f"{ok[-1]['length'] // 1024}K measured" if ok else f"< {r['points'][0]['length'] // 1024}K"
                per_k, cps = "-", "-"
            tps = f"{r['tokens_per_s']:.0f} ({r['tps_len'] // 1024}K)" if "tokens_per_s" in r else "-"
            print(f"{r['size']:>5} {r['impl']:<12} {peaks:<28} {per_k:>10} {longest:>18} {tps:>18} {cps:>24}")
        dist.destroy_process_group()
    failed = [f"{r['size']} at {p['length']}" for r in results if r["impl"] == "deltacp"
              for p in r["points"] if not p["ok"]]
    if args.require_deltacp and (failed or not results):
        sys.exit(f"deltacp's step ran out of memory: {', '.join(failed) or 'nothing ran'}")


if __name__ == "__main__":
    main()
