"""The multi-LoRA Triton kernels, shrink (h = x @ A[slot].T) and expand (y += s * h @ Bt[slot],
with DoRA's gain epilogue), launched by metrale.ops.lora_launch (docs/DESIGN.md: the design).
Each program reads its module's descriptor row (int64, DESC_COLS columns, offsets in elements):
0 a_off  1 a_slot_stride  2 a_row_stride  3 b_off  4 b_slot_stride  5 b_row_stride
6 out_dim  7 y_col  8 rank_off  9 rank_stride  10 scale_off  11 scale_stride
12 dora_off  13 dora_stride  14 gain_off  15 gain_slot_stride
"""

from metrale.ops.triton_utils import device_function, tl

DESC_COLS = 16


@device_function
def _rows(pid_t, T, slot_ptr, order_ptr, SORTED: tl.constexpr, BLOCK_T: tl.constexpr):
    """(token, slot) of the program's BLOCK_T rows: row i is token i, or token order[i] if
    SORTED (T then counts the order's rows; a -1 entry pads a slot's run); slot -1 past T
    and on padding."""
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)  # [BT]
    row_ok = rows < T
    if SORTED:
        tok = tl.load(order_ptr + rows, mask=row_ok, other=-1).to(tl.int64)  # [BT]
        row_ok = row_ok & (tok >= 0)
        tok = tl.maximum(tok, 0)
    else:
        tok = rows.to(tl.int64)
    return tok, tl.load(slot_ptr + tok, mask=row_ok, other=-1).to(tl.int32)  # [BT], [BT]


def shrink_kernel(
    x_ptr, pool_ptr, h_ptr, slot_ptr, order_ptr, desc_ptr, rank_ptr,
    T, IN, R, x_stride, h_stride, split_stride, k_per_split,
    ATOMIC: tl.constexpr, SORTED: tl.constexpr, F32_DOT: tl.constexpr, ALIGN: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program (BLOCK_T rows, K split, module), per distinct slot among its rows:
    h[tok, m*R + r] (+)= x[tok, k_lo:k_hi] @ A[s, r, k_lo:k_hi] for r < rank, added into one
    zeroed h if ATOMIC, else into split pid_k's own partial rows (split_stride apart)."""
    pid_t, pid_k, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tok, slot = _rows(pid_t, T, slot_ptr, order_ptr, SORTED, BLOCK_T)
    d = desc_ptr + m * 16  # DESC_COLS (a global int is no constexpr to Triton)
    # offsets read from memory carry no alignment facts: without these hints, no vector loads
    a_base = pool_ptr + tl.multiple_of(tl.load(d + 0), ALIGN)
    a_slot_stride = tl.multiple_of(tl.load(d + 1), ALIGN)
    a_row_stride = tl.multiple_of(tl.load(d + 2), ALIGN)
    rank_tab, rank_stride = rank_ptr + tl.load(d + 8), tl.load(d + 9)
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, IN)
    offs_k, offs_r = tl.arange(0, BLOCK_K), tl.arange(0, BLOCK_R)
    big = 2147483647  # "no slot left" sentinel for the min-reduction below
    s = tl.min(tl.where(slot >= 0, slot, big))
    while s < big:  # once per distinct slot among this program's rows
        rank = tl.minimum(tl.load(rank_tab + s * rank_stride), R)
        sel = slot == s  # [BT] rows served in this iteration
        a_slot = a_base + s.to(tl.int64) * a_slot_stride
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + offs_r  # [BR]
            r_ok = r < rank
            acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
            for k0 in range(k_lo, k_hi, BLOCK_K):
                k = k0 + offs_k  # [BK]
                k_ok = k < k_hi
                xt = tl.load(x_ptr + tok[:, None] * x_stride + k[None, :],
                             mask=sel[:, None] & k_ok[None, :], other=0.0)  # [BT, BK]
                at = tl.load(a_slot + r[None, :] * a_row_stride + k[:, None],
                             mask=k_ok[:, None] & r_ok[None, :], other=0.0)  # [BK, BR]
                if BLOCK_T == 1:
                    prod = xt.to(tl.float32)[:, :, None] * at.to(tl.float32)[None, :, :]
                    acc += tl.sum(prod, axis=1)  # [1, BK, BR] -> [1, BR]
                elif F32_DOT:
                    acc = tl.dot(xt.to(tl.float32), at.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xt.to(at.dtype), at, acc)
            h_ptrs = (h_ptr + pid_k * split_stride + tok[:, None] * h_stride + m * R
                      + r[None, :])  # [BT, BR]
            h_mask = sel[:, None] & r_ok[None, :]
            if ATOMIC:
                tl.atomic_add(h_ptrs, acc, mask=h_mask)
            else:
                tl.store(h_ptrs, acc, mask=h_mask)
        s = tl.min(tl.where(slot > s, slot, big))


def expand_kernel(
    y_ptr, pool_ptr, h_ptr, slot_ptr, order_ptr, desc_ptr, rank_ptr, scale_ptr,
    dora_ptr, gain_ptr, bias_ptr,
    T, R, y_stride, h_stride, n_split, split_stride,
    SORTED: tl.constexpr, F32_DOT: tl.constexpr, ALIGN: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Program (BLOCK_T rows, BLOCK_N output columns, module), per distinct slot among its
    rows: y[tok, y_col + n] += scale * h @ Bt[s, :rank, n], h summed over n_split partials in
    a fixed order; a DoRA slot stores g * (y - bias + scale * acc) + bias (y holds x W^T + bias)."""
    pid_t, pid_n, m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    d = desc_ptr + m * 16  # DESC_COLS (a global int is no constexpr to Triton)
    # offsets and dims read from memory carry no alignment facts; without these hints (for
    # the masks too) the compiler issues 2-byte loads and stores
    out_dim = tl.multiple_of(tl.load(d + 6), ALIGN)
    if pid_n * BLOCK_N >= out_dim:
        return  # the grid is sized for the widest module of the group
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < out_dim
    b_base = pool_ptr + tl.multiple_of(tl.load(d + 3), ALIGN)
    b_slot_stride = tl.multiple_of(tl.load(d + 4), ALIGN)
    b_row_stride = tl.multiple_of(tl.load(d + 5), ALIGN)
    y_col = tl.multiple_of(tl.load(d + 7), ALIGN)
    rank_tab, rank_stride = rank_ptr + tl.load(d + 8), tl.load(d + 9)
    scale_tab, scale_stride = scale_ptr + tl.load(d + 10), tl.load(d + 11)
    dora_tab, dora_stride = dora_ptr + tl.load(d + 12), tl.load(d + 13)
    gain_base, gain_stride = gain_ptr + tl.load(d + 14), tl.load(d + 15)
    tok, slot = _rows(pid_t, T, slot_ptr, order_ptr, SORTED, BLOCK_T)
    offs_r = tl.arange(0, BLOCK_R)
    big = 2147483647
    s = tl.min(tl.where(slot >= 0, slot, big))
    while s < big:
        rank = tl.minimum(tl.load(rank_tab + s * rank_stride), R)
        sel = slot == s  # [BT]
        # y, the scale and the DoRA flag depend only on the slot: loaded here, their latency
        # overlaps the rank's and the matmul's instead of following them (a decode step's
        # expand is a chain of dependent loads, not bandwidth)
        y_ptrs = y_ptr + tok[:, None] * y_stride + y_col + n[None, :]  # [BT, BN]
        y_mask = sel[:, None] & n_ok[None, :]
        y_old = tl.load(y_ptrs, mask=y_mask, other=0.0).to(tl.float32)
        scale = tl.load(scale_tab + s * scale_stride)
        dora = tl.load(dora_tab + s * dora_stride)
        if rank > 0:
            b_slot = b_base + s.to(tl.int64) * b_slot_stride
            acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for r0 in range(0, rank, BLOCK_R):
                r = r0 + offs_r  # [BR]
                r_ok = r < rank
                h_ptrs = h_ptr + tok[:, None] * h_stride + m * R + r[None, :]  # [BT, BR]
                h_mask = sel[:, None] & r_ok[None, :]
                ht = tl.load(h_ptrs, mask=h_mask, other=0.0)  # [BT, BR] fp32
                for sp in range(1, n_split):  # split-K partials, summed in a fixed order
                    ht += tl.load(h_ptrs + sp * split_stride, mask=h_mask, other=0.0)
                bt = tl.load(b_slot + r[:, None] * b_row_stride + n[None, :],
                             mask=r_ok[:, None] & n_ok[None, :], other=0.0)  # [BR, BN]
                if BLOCK_T == 1:
                    acc += tl.sum(ht[:, :, None] * bt.to(tl.float32)[None, :, :], axis=1)
                elif F32_DOT:
                    acc = tl.dot(ht.to(tl.float32), bt.to(tl.float32), acc, input_precision="ieee")
                else:
                    acc = tl.dot(ht.to(bt.dtype), bt, acc)
            if dora != 0:
                # DoRA: g * (x W^T + s * delta) + bias; y_old holds x W^T + bias
                g = tl.load(gain_base + s.to(tl.int64) * gain_stride + n, mask=n_ok,
                            other=1.0)  # [BN] float32
                if HAS_BIAS:
                    b = tl.load(bias_ptr + y_col + n, mask=n_ok, other=0.0).to(tl.float32)
                    y_new = g[None, :] * (y_old - b[None, :] + scale * acc) + b[None, :]
                else:
                    y_new = g[None, :] * (y_old + scale * acc)
            else:
                y_new = y_old + scale * acc
            tl.store(y_ptrs, y_new.to(y_ptr.dtype.element_ty), mask=y_mask)
        s = tl.min(tl.where(slot > s, slot, big))
