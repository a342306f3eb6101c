"""Where the GDN kernels' rows lie: the chunk size, the two kinds of tensors, packed documents' chunk and document
tables, and the Triton helpers that load and store rows of either kind (shared by wy.py, chunk_h.py and
chunk_o.py). Imports triton: only on the Triton path.

Two kinds of tensors (all kernels of the op): per-chunk tensors (gc, ai, w, u, and chunk_h/chunk_o's h, vn, dh,
dvn, dvl, dw, dg) always have NT * BT rows, chunk c at rows c * BT ...; token tensors (the op's inputs q, k, v,
beta, do and outputs o, dq, dk, dv, dbeta) have as many rows. Packed documents (VARLEN, B = 1): the token tensors
are the packed row itself, and the chunk table `cidx` [NT, 2] int32 gives each chunk's first token and token count
(1..BT, a chunk never crosses a document boundary); rows past the count load as 0 and are not stored, which
equals the zero tail of a document laid out on its own. The per-chunk tensors keep BT rows per chunk, so a
partial chunk computes exactly what its zero-padded copy would (gc holds the last token's gate in its tail).
The state kernels (chunk_h.py) read the document table instead (`document_span`), once per program.

Head dims (K, V in contract_check.HEAD_DIMS, 96 and 192 among them): a tile spanning a whole head dim is
`padded(K)` wide (tl.arange needs a power of two), a blocked loop runs cdiv(dim, block) blocks; the columns past the
head dim load as 0 (so they add nothing to any product) and are not stored. The column masks are compile-time
optional (MC): where the block divides the dim (K = V = 128 at every configured block) the kernels compile without
them, exactly as before the masks existed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deltacp.ops.gdn.triton.launch import padded  # noqa: F401  (the width of a tile spanning a head dim)

BT = 64  # chunk size


@triton.jit
def load_tile(p, m_r, m_c, MR: tl.constexpr, MC: tl.constexpr):
    """A 2-D tile, rows outside m_r ([R, 1], if MR) and columns outside m_c ([1, C], if MC) loaded as 0; neither:
    an unmasked load."""
    if MR:
        if MC:
            return tl.load(p, mask=m_r & m_c, other=0.)
        else:
            return tl.load(p, mask=m_r, other=0.)
    else:
        if MC:
            return tl.load(p, mask=m_c, other=0.)
        else:
            return tl.load(p)


@triton.jit
def store_tile(p, x, m_r, m_c, MR: tl.constexpr, MC: tl.constexpr):
    if MR:
        if MC:
            tl.store(p, x, mask=m_r & m_c)
        else:
            tl.store(p, x, mask=m_r)
    else:
        if MC:
            tl.store(p, x, mask=m_c)
        else:
            tl.store(p, x)


@triton.jit
def load_rows(base, row0, stride, BR: tl.constexpr, D: tl.constexpr, nc=0, MC: tl.constexpr = False):
    """Rows row0 .. row0+BR of a [*, D] view with row stride `stride` (MC: columns >= nc load as 0)."""
    o_r = row0 + tl.arange(0, BR)
    o_c = tl.arange(0, D)
    m_c = (o_c < nc)[None, :]
    return load_tile(base + o_r[:, None] * stride + o_c[None, :], m_c, m_c, False, MC)


@triton.jit
def store_rows(base, row0, stride, b_x, BR: tl.constexpr, D: tl.constexpr, nc=0, MC: tl.constexpr = False):
    o_r = row0 + tl.arange(0, BR)
    o_c = tl.arange(0, D)
    m_c = (o_c < nc)[None, :]
    store_tile(base + o_r[:, None] * stride + o_c[None, :], b_x.to(base.dtype.element_ty), m_c, m_c, False, MC)


@triton.jit
def load_vec(base, row0, stride, BR: tl.constexpr):
    o_r = row0 + tl.arange(0, BR)
    return tl.load(base + o_r * stride).to(tl.float32)


@triton.jit
def chunk_tokens(cidx, i_t, r_packed, r_dense, BT: tl.constexpr, VARLEN: tl.constexpr):
    """Where rows of chunk i_t lie in a token tensor: (x0, r, n), the rows being x0 + r + arange.
    VARLEN: x0 = the chunk's first token (chunk table), r = r_packed (a row within the chunk), n = its token count
    (masks compare r + arange with n). Dense: x0 = 0, r = r_dense (the row in the tensor), n = BT (no masks): the
    address arithmetic is then exactly the dense kernel's."""
    if VARLEN:
        return tl.load(cidx + 2 * i_t).to(tl.int64), r_packed, tl.load(cidx + 2 * i_t + 1)
    else:
        return 0, r_dense, BT


@triton.jit
def document_span(docs, i_n, T, NT, VARLEN: tl.constexpr):
    """(first token, first chunk, end token, chunk count) of document i_n from the document table `docs`
    [N + 1, 2] int32 (each document's first token and first chunk; row N: the totals), or of the whole row (not
    VARLEN)."""
    if VARLEN:
        bos, c0 = tl.load(docs + 2 * i_n).to(tl.int64), tl.load(docs + 2 * i_n + 1)
        eos, c1 = tl.load(docs + 2 * i_n + 2).to(tl.int64), tl.load(docs + 2 * i_n + 3)
        return bos, c0, eos, c1 - c0
    else:
        return 0, 0, T, NT


@triton.jit
def load_tok(p, m, VARLEN: tl.constexpr):
    """A tile of a token tensor: rows outside the chunk's tokens (mask m, VARLEN only) load as 0."""
    if VARLEN:
        return tl.load(p, mask=m, other=0.)
    else:
        return tl.load(p)


@triton.jit
def store_tok(p, x, m, VARLEN: tl.constexpr):
    if VARLEN:
        tl.store(p, x, mask=m)
    else:
        tl.store(p, x)


@triton.jit
def load_tok_rows(base, row0, n, stride, BR: tl.constexpr, D: tl.constexpr, VARLEN: tl.constexpr, nc=0,
                  MC: tl.constexpr = False):
    """Rows row0 .. row0+BR of a token tensor (base and row0 from `chunk_tokens`); rows >= n are 0 (VARLEN),
    columns >= nc too (MC)."""
    o_r = row0 + tl.arange(0, BR)
    o_c = tl.arange(0, D)
    return load_tile(base + o_r[:, None] * stride + o_c[None, :], (o_r < n)[:, None], (o_c < nc)[None, :], VARLEN,
                     MC)


@triton.jit
def store_tok_rows(base, row0, n, stride, b_x, BR: tl.constexpr, D: tl.constexpr, VARLEN: tl.constexpr, nc=0,
                   MC: tl.constexpr = False):
    o_r = row0 + tl.arange(0, BR)
    o_c = tl.arange(0, D)
    store_tile(base + o_r[:, None] * stride + o_c[None, :], b_x.to(base.dtype.element_ty), (o_r < n)[:, None],
               (o_c < nc)[None, :], VARLEN, MC)


@triton.jit
def load_tok_vec(base, row0, n, stride, BR: tl.constexpr, VARLEN: tl.constexpr):
    o_r = row0 + tl.arange(0, BR)
    return load_tok(base + o_r * stride, o_r < n, VARLEN).to(tl.float32)


def chunk_rows(gc: torch.Tensor, chunks: torch.Tensor | None) -> tuple[int, bool]:
    """(rows of the per-chunk tensors, VARLEN) from the chunk-local gate cumsum (a per-chunk tensor) and the chunk
    table of packed documents ([NT, 2] int32 on the device, or None)."""
    Tc = gc.shape[1]
    if chunks is not None and (gc.shape[0] != 1 or chunks.shape != (Tc // BT, 2) or chunks.dtype != torch.int32
                               or chunks.device != gc.device):
        raise ValueError(f"packed documents need B = 1 and a chunk table [{Tc // BT}, 2] int32 on {gc.device}; got "
                         f"B = {gc.shape[0]}, {tuple(chunks.shape)} {chunks.dtype} on {chunks.device}")
    return Tc, chunks is not None
