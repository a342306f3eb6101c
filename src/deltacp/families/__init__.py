"""One home per model family: everything deltacp knows of a family lives in its module here.

    qwen3_5.py      Qwen3.5 dense, MoE and multimodal (gated attention shared with Qwen3-Next)
    qwen3_next.py   Qwen3-Next
    olmo_hybrid.py  OLMo-Hybrid
    bamba.py        Bamba (Mamba2)
    nemotron_h.py   Nemotron-H (Mamba2, attention, MLP / MoE blocks)
    granite_hybrid.py  Granite-4.0-H (Mamba2, attention, routed experts + shared MLP)
    falcon_h1.py    Falcon-H1 (Mamba2 and attention in parallel in every layer)
    kimi_linear.py  Kimi-Linear (KDA and MLA in `self_attn`, routed experts; on a GPU the eager backend only)
    bailing_hybrid.py  Bailing-Hybrid / Ling (KDA with the safe gate, MLA with RoPE and an output gate; on a GPU eager)
    qwen4_exp.py    Qwen4-Exp (GDN, indexed sparse attention, hyper-connections, PLE n-gram layers)
    glm5_next.py    GLM-5.3-Flash (KDA with the bounded gate, MLA with a pooled sparse indexer and "shared" layers,
                    Sinkhorn hyper-connections; its conditional class's text path)
    minimax.py      MiniMax-Text-01 (lightning attention as the scalar-decay recurrence without a conv, GQA, the
                    normed-input residual, routed experts)
    lara_mini.py    LaRA-mini (GDN with a float32-weight gated norm, sliding-window and NoPE full attention, MoE with
                    an ungated shared expert; in_proj stored fused)
    lfm2.py         LFM2, LFM2-MoE and LFM3 (no linear mixer: gated short convs as token layers with a conv halo, GQA
                    with q/k layernorms; sigmoid-routed experts with the expert bias, stored per expert as w1 / w3 / w2;
                    LFM3: sliding-window and full attention with their own rotary, a per-head sigmoid output gate,
                    sandwich norms)
    mamba2_lm.py    Mamba2 (the pure SSM: Mamba2 blocks only, no attention or MLP; the context reaches its layers by
                    pre-hooks)
    mamba.py        Mamba (Mamba1 blocks only: the selective scan as a head per channel of N state rows, x_proj's
                    partial products summed over the ranks where Ulysses or the 2-D layout split the channels; eager
                    or Triton; the causal LM's dropped keywords relayed)
    falcon_mamba.py FalconMamba (Mamba1 with weightless RMSNorms on dt, B and C)
    jamba.py        Jamba (Mamba1 with weighted RMSNorms on dt, B and C; NoPE GQA; routed experts, not
                    renormalised, with the aux loss)
    zamba2.py       Zamba2 (Mamba2 layers; hybrid layers whose shared attention blocks, cycled over num_mem_blocks and
                    tied across invocations, take per-invocation LoRA adapters: one parameter set, one FSDP2 unit)
    zamba.py        Zamba (Mamba1 layers of n_mamba_heads independent scans, x / z interleaved in in_proj, one contract
                    head each; hybrid layers running ONE tied NoPE attention block on concat(hidden, embeddings))
    recurrent_gemma.py  RecurrentGemma / Griffin (the RG-LRU as a diagonal recurrence reset at global position 0,
                    behind the recurrent block's conv halo (a token layer); local attention with its own partial
                    rotary; the logits' soft-cap in the kernels of the CP losses that replace the head)
    gdn.py          what every Gated DeltaNet mixer shares (layout, gates, recurrence, output path)
    attention.py    full attentions without an output gate (GQA, optional full-width q/k norms, any rotary)
    mamba2.py       what every Mamba2 mixer shares (layout, dt and decay, the SSD recurrence, output path)
    kda.py          what every Kimi delta attention mixer shares (layout, the KDA recurrence, sigmoid-gated norm)
    mla.py          multi-head latent attention (DeepSeek-V3's MLA: LoRA projections, value dim of its own)

A home holds the family's `Family` record (class names by role, its text config, whether its decoder norms take the
fused Triton glue, multimodal classes), registered with the registry beside it (`registry.py`), and its views
(`parallel/views.py`): the linear mixer's description (head layout, projections -> recurrence inputs -> output) and
the full attention's (projections, norms, rotary, output gate). The CP layer reads nothing else of a family. Adding a
family: a module here, its name in `registry.HOMES`, its conformance table (tests/conformance/tables.py; docs/design.md,
"Adding a family").
"""
