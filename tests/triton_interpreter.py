"""Patches of Triton's CPU interpreter (TRITON_INTERPRET=1) for the tests that run the real kernels on the CPU;
`patch()` applies them, once per process, before the first launch.

- bf16 products: Triton 3.6 to 3.9's interpreter multiplies bf16 dot operands as raw uint16 bits; they are widened
  to fp32 first (what the tensor cores compute: exact products, fp32 accumulation).
- Nested device calls: the interpreter re-patches the whole `triton.language` namespace (every builtin, through
  `inspect.getmembers`) at each call of a `@triton.jit` helper from inside a kernel, once per program and call site,
  although the launch has already patched the same modules; that took about 40 % of an interpreted GDN fwd+bwd.
  Inside a launch, a helper whose language modules the launch has patched runs without re-patching (the launch's
  own patch and its restore are untouched). Results are bitwise those of the unpatched interpreter
  (`tests/unit/test_triton_contract.py::test_interpreter_patch_is_bitwise_neutral`).
- With it, the numpy dtype of a Triton dtype read from a table built once (the interpreter builds its 19-entry dict
  at every call, a few hundred thousand calls per test: about 4 % of an interpreted GDN fwd+bwd); the same dtypes.
"""

from __future__ import annotations

import inspect


def _widen_bf16_dot(it, tl, np) -> None:
    orig = it.InterpreterBuilder.create_dot

    def widen(h):
        return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype == tl.bfloat16 else h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16 or b.dtype == tl.bfloat16:
            return it.TensorHandle(np.matmul(widen(a), widen(b), dtype=d.data.dtype) + d.data, d.dtype.scalar)
        return orig(self, a, b, d, input_precision, max_num_imprecise_acc)

    it.InterpreterBuilder.create_dot = create_dot


def _patch_nested_calls_once(it, tl) -> None:
    orig_patch, orig_launch = it._patch_lang, it.GridExecutor.__call__
    launch_state = {"depth": 0, "patched": frozenset()}  # inside a launch: the language modules it patched

    def langs_of(fn):
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))

    def patch_lang(fn):
        langs = langs_of(fn)
        if launch_state["depth"] and langs <= launch_state["patched"]:
            return it._LangPatchScope()  # nothing set: nothing to restore
        scope = orig_patch(fn)
        if launch_state["depth"]:
            launch_state["patched"] |= langs
        return scope

    def launch(self, *args, **kwargs):
        outer = launch_state["patched"]
        launch_state["depth"] += 1
        launch_state["patched"] = frozenset()
        try:
            return orig_launch(self, *args, **kwargs)
        finally:
            launch_state["depth"] -= 1
            launch_state["patched"] = outer

    it._patch_lang, it.GridExecutor.__call__ = patch_lang, launch


def _table_np_dtypes(it, tl, np) -> None:
    orig = it._get_np_dtype
    table = {t: orig(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16, tl.uint16,
                                  tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5, tl.float8e5b16,
                                  tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        found = table.get(tt_dtype)
        return found if found is not None else orig(tt_dtype)

    it._get_np_dtype = get_np_dtype


def patch(nested_calls: bool = True) -> None:
    """Apply the patches (idempotent). `nested_calls=False`: the bf16 fix alone (the neutrality test's baseline)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as it

    if not getattr(it, "_deltacp_bf16_dot", False):
        _widen_bf16_dot(it, tl, np)
        it._deltacp_bf16_dot = True
    if nested_calls and not getattr(it, "_deltacp_nested_calls", False):
        _patch_nested_calls_once(it, tl)
        it._deltacp_nested_calls = True
        _table_np_dtypes(it, tl, np)
