"""Decode attention from the packed codes with Triton kernels (CUDA tensors; CPU tensors under TRITON_INTERPRET=1).

`decode_attention` has the contract and the numbers (fp32 throughout) of `qcache.kernels.decode_attention`: the
attention of one query token per head (the G query rows that share a kv head) over [sinks | quantized region |
residual]. The quantized region is read by two kernels, split-K over the token axis (flash-decoding):

- `_chunk_kernel`, one program per (batch row, kv head, chunk of tokens), walks its chunk in tiles of `_BLOCK_T`
  tokens. Per tile it unpacks the key codes of every channel, dequantizes them with their block's per-channel scale
  and zero (`zero + level * scale`, levels uniform or from a codebook), un-rotates them when the keys are rotated
  (`x_rot @ R.T` as fp32 `tl.dot`s in slices of `_K_SLICE` channels, per token and before RoPE, which does not
  commute with the rotation), re-applies RoPE by angle addition from the block-start and offset factors
  (`qcache.rope.compose`), scores the G query rows and folds the tile into an online softmax: running max, sum, and
  the weighted sum of the dequantized values, left in rotated value space. It writes those three partials per chunk.
- `_reduce_kernel`, one program per (batch row, kv head, query row), combines the chunks' partials.

The full-precision sinks and residual (a few hundred tokens at most), their merge with the region's partials and the
values' un-rotation (once, on the [B, H, G, D] output: (P V R) R^T = P V) are a few torch operations around them.

Layout the kernels assume (qcache/quant.py, qcache/codec.py): codes packed in planes along the channel axis (for
b = 2, 4 bits channel c sits in byte c mod (D b / 8) at bit b * (c div (D b / 8)); 8 bits: byte c; 3 bits: in the
24-bit word j = c mod (D / 8) made of bytes j, D/8 + j and D/4 + j, at bit 3 * (c div (D / 8))); key scale/zero [B,
H, n_blocks, D], one per channel per block of `KeyCodec.group` tokens; values per token: `ValueCodec(norm=True)` one
scale [B, H, n, 1] on the levels of `v_consts["codebook"]`, or (min-max) a scale and zero per group of
`ValueCodec.group` channels. RoPE pairs channel i with i + R/2 (R <= D: the channels past R pass through). Every
stored tensor is read through its strides (views of the store need not be contiguous). Outliers and static key
ranges are not read, nor head dims past 256 (128 with rotated keys: the kernel keeps R^T, fp32 [D, D], in shared
memory): `unsupported` says so, and `decode_attention` raises instead of computing something else.

Triton is imported on first use, not with qcache; TRITON_INTERPRET is read then (when the kernels are defined).
"""

from __future__ import annotations

import torch

from .codec import KeyCodec, ValueCodec

__all__ = ["unsupported", "decode_attention"]

_BLOCK_T = 32  # tokens per tile (the M of the key un-rotation's dot, the K of the values' one)
_K_SLICE = 64  # channels per slice of the key un-rotation's dot (bounds the [slice, group] tile of R^T)
_MAX_D = 256  # head dims up to this many channels (register tiles of [tokens, D] fp32)
# rotated keys: the kernel holds R^T (fp32, [D, D]) in shared memory, 92 KB with the rest at D = 128 (sm_90, one
# stage); at D = 256 that is 313 KB, more than any GPU's 228 KB
_MAX_D_ROTATED = 128
_NUM_WARPS, _NUM_STAGES = 4, 1  # one stage: software pipelining would multiply the shared memory (190 KB at D = 128)
_BITS = (2, 3, 4, 8)  # widths whose packing the kernels unpack
_PROGRAMS_PER_SM = 4  # chunk the tokens so that about this many programs per multiprocessor run

_KERNELS: dict = {}  # "chunk", "reduce", "interpreted": defined on first use (`_kernels`)
_IMPORT_ERROR: list[str] = []


def _kernels() -> dict:
    """The jitted kernels, defined (and triton imported) on first use. Raises ImportError without triton."""
    # the jitted functions resolve the names they use (tl, each other) in this module's globals
    global tl, _codes, _keys, _rt, _chunk_kernel, _reduce_kernel
    if _KERNELS:
        return _KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _codes(row_ptr, t_off, cols, mask, D: tl.constexpr, BITS: tl.constexpr):
        """int32 codes [tokens, cols] of channels `cols` of packed rows (`row_ptr + t_off`: the token's first byte;
        the bytes of a row are contiguous in the store, stride 1)."""
        if BITS == 3:
            m = D // 8
            j = cols % m
            b0 = tl.load(row_ptr + t_off + j, mask=mask, other=0).to(tl.int32)
            b1 = tl.load(row_ptr + t_off + m + j, mask=mask, other=0).to(tl.int32)
            b2 = tl.load(row_ptr + t_off + 2 * m + j, mask=mask, other=0).to(tl.int32)
            word = b0 | (b1 << 8) | (b2 << 16)
            return (word >> (3 * (cols // m))) & 7
        else:
            w = D * BITS // 8
            byte = tl.load(row_ptr + t_off + cols % w, mask=mask, other=0).to(tl.int32)
            return (byte >> (BITS * (cols // w))) & ((1 << BITS) - 1)

    @triton.jit
    def _keys(kc_ptr, kc_t, ks_ptr, kz_ptr, ks_blk, ks_d, klev_ptr, t, cols, mask, K_GROUP,
              D: tl.constexpr, K_BITS: tl.constexpr, K_CODEBOOK: tl.constexpr):
        """fp32 keys [tokens, cols] as stored (rotated space with a rotation): zero + level * scale of their block."""
        code = _codes(kc_ptr, t * kc_t, cols, mask, D, K_BITS)
        blk = t // K_GROUP
        scale = tl.load(ks_ptr + blk * ks_blk + cols * ks_d, mask=mask, other=0.0).to(tl.float32)
        zero = tl.load(kz_ptr + blk * ks_blk + cols * ks_d, mask=mask, other=0.0).to(tl.float32)
        if K_CODEBOOK:
            level = tl.load(klev_ptr + code, mask=mask, other=0.0)
        else:
            level = code.to(tl.float32)
        return zero + level * scale

    @triton.jit
    def _rt(rot_ptr, rot_r, rot_c, d, cols, cmask, D: tl.constexpr):
        """The slice [d, cols] of R^T (R[c, d] at row d, column c), zero outside the head."""
        return tl.load(rot_ptr + cols[None, :] * rot_r + d[:, None] * rot_c,
                       mask=cmask[None, :] & (d[:, None] < D), other=0.0)

    @triton.jit
    def _chunk_kernel(
        q_ptr, q_b, q_h, q_g, q_d,
        kc_ptr, kc_b, kc_h, kc_t,
        ks_ptr, kz_ptr, ks_b, ks_h, ks_blk, ks_d, klev_ptr,
        rot_ptr, rot_r, rot_c,
        bc_ptr, bs_ptr, bc_b, bc_j, bc_i, oc_ptr, os_ptr, oc_r, oc_i,
        vc_ptr, vc_b, vc_h, vc_t,
        vs_ptr, vz_ptr, vs_b, vs_h, vs_t, vs_g, vlev_ptr,
        bias_ptr, bias_b, bias_t,
        m_ptr, l_ptr, acc_ptr,
        H, G, T, CHUNK, NC, K_GROUP, V_GROUP, F, HALF, scaling,
        D: tl.constexpr, DP: tl.constexpr, KS: tl.constexpr, HP: tl.constexpr, TAIL_P: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr,
        K_BITS: tl.constexpr, K_CODEBOOK: tl.constexpr, K_ROT: tl.constexpr,
        V_BITS: tl.constexpr, V_NORM: tl.constexpr, V_CODEBOOK: tl.constexpr,
        HAS_ROPE: tl.constexpr, HAS_TAIL: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        pid_bh = tl.program_id(0)
        pid_c = tl.program_id(1)
        b = (pid_bh // H).to(tl.int64)
        h = (pid_bh % H).to(tl.int64)
        kc_ptr += b * kc_b + h * kc_h
        ks_ptr += b * ks_b + h * ks_h
        kz_ptr += b * ks_b + h * ks_h
        vc_ptr += b * vc_b + h * vc_h
        vs_ptr += b * vs_b + h * vs_h
        vz_ptr += b * vs_b + h * vs_h
        q_ptr += b * q_b + h * q_h

        g = tl.arange(0, BLOCK_G)
        gmask = g < G
        dv = tl.arange(0, DP)
        dmask = dv < D
        # the column groups of a head: [0, HALF) and [HALF, 2 HALF) are RoPE pairs, [2 HALF, D) passes through
        # (without RoPE the whole head is the pass-through group)
        if HAS_ROPE:
            ia = tl.arange(0, HP)
            amask = ia < HALF
            q_a = tl.load(q_ptr + g[:, None] * q_g + ia[None, :] * q_d, mask=gmask[:, None] & amask[None, :], other=0.0)
            q_b2 = tl.load(q_ptr + g[:, None] * q_g + (ia[None, :] + HALF) * q_d,
                           mask=gmask[:, None] & amask[None, :], other=0.0)
            tail0 = 2 * HALF
        else:
            tail0 = 0
        if HAS_TAIL:
            ic = tl.arange(0, TAIL_P)
            cmask = ic + tail0 < D
            q_c = tl.load(q_ptr + g[:, None] * q_g + (ic[None, :] + tail0) * q_d,
                          mask=gmask[:, None] & cmask[None, :], other=0.0)

        m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([BLOCK_G, DP], dtype=tl.float32)
        start = pid_c * CHUNK
        end = tl.minimum(start + CHUNK, T)
        for t0 in range(start, end, BLOCK_T):
            tt = t0 + tl.arange(0, BLOCK_T)
            tvalid = tt < end
            t = tt[:, None]
            tmask = tvalid[:, None]
            # pre-RoPE keys of the column groups: [t, HALF) pairs x1 | x2, the pass-through x3
            if K_ROT:  # un-rotated per token: x @ R^T, as dots over slices of KS stored channels
                if HAS_ROPE:
                    x1 = tl.zeros([BLOCK_T, HP], dtype=tl.float32)
                    x2 = tl.zeros([BLOCK_T, HP], dtype=tl.float32)
                if HAS_TAIL:
                    x3 = tl.zeros([BLOCK_T, TAIL_P], dtype=tl.float32)
                for sl in tl.static_range(DP // KS):
                    d = sl * KS + tl.arange(0, KS)
                    x = _keys(kc_ptr, kc_t, ks_ptr, kz_ptr, ks_blk, ks_d, klev_ptr, t, d[None, :],
                              tmask & (d[None, :] < D), K_GROUP, D, K_BITS, K_CODEBOOK)  # [tokens, KS] rotated
                    if HAS_ROPE:
                        x1 += tl.dot(x, _rt(rot_ptr, rot_r, rot_c, d, ia, amask, D), input_precision="ieee")
                        x2 += tl.dot(x, _rt(rot_ptr, rot_r, rot_c, d, ia + HALF, amask, D), input_precision="ieee")
                    if HAS_TAIL:
                        x3 += tl.dot(x, _rt(rot_ptr, rot_r, rot_c, d, ic + tail0, cmask, D), input_precision="ieee")
            else:
                if HAS_ROPE:
                    x1 = _keys(kc_ptr, kc_t, ks_ptr, kz_ptr, ks_blk, ks_d, klev_ptr, t, ia[None, :],
                               tmask & amask[None, :], K_GROUP, D, K_BITS, K_CODEBOOK)
                    x2 = _keys(kc_ptr, kc_t, ks_ptr, kz_ptr, ks_blk, ks_d, klev_ptr, t, ia[None, :] + HALF,
                               tmask & amask[None, :], K_GROUP, D, K_BITS, K_CODEBOOK)
                if HAS_TAIL:
                    x3 = _keys(kc_ptr, kc_t, ks_ptr, kz_ptr, ks_blk, ks_d, klev_ptr, t, ic[None, :] + tail0,
                               tmask & cmask[None, :], K_GROUP, D, K_BITS, K_CODEBOOK)
            # scores [G, tokens] of the query rows against this tile's keys, one column group at a time
            s = tl.zeros([BLOCK_G, BLOCK_T], dtype=tl.float32)
            if HAS_ROPE:
                # cos/sin of position (block start + offset) by angle addition (qcache.rope.compose)
                j = t // F
                r = t % F
                fmask = tmask & amask[None, :]
                bcos = tl.load(bc_ptr + b * bc_b + j * bc_j + ia[None, :] * bc_i, mask=fmask, other=0.0)
                bsin = tl.load(bs_ptr + b * bc_b + j * bc_j + ia[None, :] * bc_i, mask=fmask, other=0.0)
                ocos = tl.load(oc_ptr + r * oc_r + ia[None, :] * oc_i, mask=fmask, other=0.0)
                osin = tl.load(os_ptr + r * oc_r + ia[None, :] * oc_i, mask=fmask, other=0.0)
                cos = bcos * ocos - bsin * osin
                sin = bsin * ocos + bcos * osin
                k1 = x1 * cos - x2 * sin
                k2 = x2 * cos + x1 * sin
                s += tl.dot(q_a, tl.trans(k1), input_precision="ieee")
                s += tl.dot(q_b2, tl.trans(k2), input_precision="ieee")
            if HAS_TAIL:
                s += tl.dot(q_c, tl.trans(x3), input_precision="ieee")
            s = s * scaling
            if HAS_BIAS:
                s += tl.load(bias_ptr + b * bias_b + tt * bias_t, mask=tvalid, other=0.0)[None, :]
            s = tl.where(tvalid[None, :], s, float("-inf"))

            # the tile's values [tokens, D], in rotated space with a rotation
            vmask = tmask & dmask[None, :]
            vcode = _codes(vc_ptr, t * vc_t, dv[None, :], vmask, D, V_BITS)
            if V_NORM:
                level = tl.load(vlev_ptr + vcode, mask=vmask, other=0.0)
                vscale = tl.load(vs_ptr + t * vs_t, mask=tmask, other=0.0).to(tl.float32)
                v = level * vscale
            else:
                grp = dv[None, :] // V_GROUP
                vscale = tl.load(vs_ptr + t * vs_t + grp * vs_g, mask=vmask, other=0.0).to(tl.float32)
                vzero = tl.load(vz_ptr + t * vs_t + grp * vs_g, mask=vmask, other=0.0).to(tl.float32)
                if V_CODEBOOK:
                    level = tl.load(vlev_ptr + vcode, mask=vmask, other=0.0)
                else:
                    level = vcode.to(tl.float32)
                v = vzero + level * vscale

            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new

        row = (pid_bh * NC + pid_c) * G + g
        tl.store(m_ptr + row, m_i, mask=gmask)
        tl.store(l_ptr + row, l_i, mask=gmask)
        tl.store(acc_ptr + row[:, None] * D + dv[None, :], acc, mask=gmask[:, None] & dmask[None, :])

    @triton.jit
    def _reduce_kernel(m_ptr, l_ptr, acc_ptr, out_m_ptr, out_l_ptr, out_acc_ptr, G, NC,
                       D: tl.constexpr, DP: tl.constexpr, BLOCK_C: tl.constexpr):
        """Combine the chunks' (max, sum, weighted sum) of one (batch row, kv head, query row)."""
        pid = tl.program_id(0)  # (b * H + h) * G + g
        bh = pid // G
        g = pid % G
        dv = tl.arange(0, DP)
        dmask = dv < D
        m_all = tl.full([], float("-inf"), dtype=tl.float32)
        l_all = tl.zeros([], dtype=tl.float32)
        acc = tl.zeros([DP], dtype=tl.float32)
        for c0 in range(0, NC, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            cmask = c < NC
            row = (bh * NC + c) * G + g
            m = tl.load(m_ptr + row, mask=cmask, other=float("-inf"))
            l_c = tl.load(l_ptr + row, mask=cmask, other=0.0)
            a = tl.load(acc_ptr + row[:, None] * D + dv[None, :], mask=cmask[:, None] & dmask[None, :], other=0.0)
            m_new = tl.maximum(m_all, tl.max(m, axis=0))
            alpha = tl.exp(m_all - m_new)
            w = tl.exp(m - m_new)
            l_all = l_all * alpha + tl.sum(w * l_c, axis=0)
            acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
            m_all = m_new
        tl.store(out_m_ptr + pid, m_all)
        tl.store(out_l_ptr + pid, l_all)
        tl.store(out_acc_ptr + pid * D + dv, acc, mask=dmask)

    from triton import knobs

    _KERNELS.update(chunk=_chunk_kernel, reduce=_reduce_kernel, interpreted=bool(knobs.runtime.interpret))
    return _KERNELS


def _triton_error() -> str | None:
    """Why triton cannot be used here (None: it imports)."""
    if _KERNELS:
        return None
    if not _IMPORT_ERROR:
        try:
            _kernels()
        except ImportError as err:
            _IMPORT_ERROR.append(f"{type(err).__name__}: {err}")
    return _IMPORT_ERROR[0] if _IMPORT_ERROR else None


def _interpreted() -> bool:
    """Whether the kernels run in Triton's interpreter (TRITON_INTERPRET=1 when they were defined)."""
    return bool(_kernels()["interpreted"])


def _pow2(n: int, least: int = 16) -> int:
    return max(least, 1 << max(n - 1, 0).bit_length())


def unsupported(k_codec: KeyCodec, v_codec: ValueCodec, q) -> str | None:
    """None when the Triton kernels read this quantized region (`q`: a `qcache.kernels.Quantized`) with these
    codecs on its device; else why not, in one line."""
    error = _triton_error()
    if error is not None:
        return f"triton is not importable ({error})"
    codes = q.k.get(k_codec.prefix + "codes")
    if codes is None:
        return f"no key codes {k_codec.prefix + 'codes'!r} in the quantized region (parts: {sorted(q.k)})"
    if k_codec.outliers or v_codec.outliers:
        return f"outliers (keys {k_codec.outliers}, values {v_codec.outliers} per group; allowed: 0)"
    if k_codec.static:
        return "static key ranges (allowed: per-block key scales, static=False)"
    for name, codec in (("key", k_codec), ("value", v_codec)):
        if codec.bits not in _BITS:
            return f"{name} bits={codec.bits} (allowed: {list(_BITS)})"
    D = q.k[k_codec.prefix + "scale"].shape[-1]
    if D > _MAX_D or D % 8:
        return f"head_dim {D} (allowed: a multiple of 8 up to {_MAX_D})"
    if k_codec.rotation and D > _MAX_D_ROTATED:
        return (f"head_dim {D} with rotated keys (allowed: up to {_MAX_D_ROTATED} channels, the un-rotation's R^T sits "
                f"in shared memory; unrotated keys up to {_MAX_D})")
    if not v_codec.norm and D % v_codec.group:
        return f"value groups of {v_codec.group} channels do not tile head_dim {D}"
    for name, codec, consts in (("key", k_codec, q.k_consts), ("value", v_codec, q.v_consts)):
        if codec.codebook:
            cb = consts.get("codebook")
            if cb is None or cb.numel() != 2**codec.bits:
                return (f"the {name} codec needs a codebook of {2**codec.bits} levels; got "
                        f"{None if cb is None else cb.numel()}")
        if codec.rotation:
            rot = consts.get("rotation")
            if rot is None or tuple(rot.shape) != (D, D):
                return f"the {name} codec needs a rotation [{D}, {D}]; got {None if rot is None else tuple(rot.shape)}"
    if q.rope is not None:
        block_cos, _, off_cos, _ = q.rope
        half = block_cos.shape[-1]
        if 2 * half > D or off_cos.shape[-1] != half:
            return f"RoPE factors of width {half} / {off_cos.shape[-1]} for head_dim {D} (allowed: equal, <= {D // 2})"
        if block_cos.shape[1] * off_cos.shape[0] < codes.shape[2]:
            return (f"RoPE factors for {block_cos.shape[1] * off_cos.shape[0]} positions, the region holds "
                    f"{codes.shape[2]} tokens")
    if codes.device.type != "cuda" and not _interpreted():
        return (f"tensors on {codes.device.type}: the Triton kernels run on CUDA tensors (on CPU only under "
                "TRITON_INTERPRET=1)")
    return None


def _chunk_tokens(T: int, rows: int, device: torch.device) -> int:
    """Tokens per program: whole tiles, enough chunks for about `_PROGRAMS_PER_SM` programs per multiprocessor."""
    tiles = -(-T // _BLOCK_T)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    chunks = max(1, -(-_PROGRAMS_PER_SM * sms // rows))
    return -(-tiles // chunks) * _BLOCK_T


def _levels(codec, consts: dict, step_units: bool, device) -> torch.Tensor:
    """fp32 levels of a codebook codec: in units of a uniform step (codebook x (2^bits - 1), as
    `quant.dequantize`) or as stored (`ValueCodec(norm=True)`: in units of the token's scale)."""
    cb = consts["codebook"].float().to(device)
    return (cb * (cb.numel() - 1) if step_units else cb).contiguous()


def decode_attention(query: torch.Tensor, fp_k: torch.Tensor, fp_v: torch.Tensor, bias: torch.Tensor | None,
                     q, n_sink: int, scaling: float, k_codec: KeyCodec, v_codec: ValueCodec, *,
                     chunk: int | None = None) -> torch.Tensor:
    """`qcache.kernels.decode_attention` (same arguments, same fp32 result [B, H, G, D]) by the Triton kernels.

    chunk: tokens of the quantized region per program (a positive multiple of 32; None: sized to the device).
    Raises ValueError naming the reason when `unsupported` refuses the configuration."""
    reason = unsupported(k_codec, v_codec, q)
    if reason is not None:
        raise ValueError(f"the Triton decode kernel cannot read this layer's codes: {reason}")
    B, H, G, D = query.shape
    kc = q.k[k_codec.prefix + "codes"]
    T = kc.shape[2]
    S = n_sink
    if kc.shape[:2] != (B, H) or q.k[k_codec.prefix + "scale"].shape[-1] != D:
        raise ValueError(f"query of shape {tuple(query.shape)} for key codes of shape {tuple(kc.shape)} and head_dim "
                         f"{q.k[k_codec.prefix + 'scale'].shape[-1]}; allowed: [B, H, G, D] of the region's B, H, D")
    if fp_k.shape[:2] != (B, H) or fp_k.shape != fp_v.shape or fp_k.shape[-1] != D or not 0 <= S <= fp_k.shape[2]:
        raise ValueError(f"full-precision keys {tuple(fp_k.shape)} / values {tuple(fp_v.shape)} with {S} sinks for "
                         f"a query of shape {tuple(query.shape)}")
    if bias is not None and (bias.dim() != 4 or bias.shape[1:3] != (1, 1) or bias.shape[-1] != fp_k.shape[2] + T):
        raise ValueError(f"bias of shape {tuple(bias.shape)}; allowed: [B, 1, 1, {fp_k.shape[2] + T}]")
    if chunk is not None and (chunk <= 0 or chunk % _BLOCK_T):
        raise ValueError(f"chunk={chunk} tokens; allowed: a positive multiple of {_BLOCK_T}")
    query = query.float()
    if bias is not None:
        bias = bias.float().expand(B, 1, 1, bias.shape[-1])
    device = query.device
    s_fp = (query @ fp_k.float().transpose(-1, -2)) * scaling  # [B, H, G, S + R]
    if bias is not None:
        s_fp = s_fp + torch.cat([bias[..., :S], bias[..., S + T:]], dim=-1)
    if T == 0:
        return torch.softmax(s_fp, dim=-1) @ fp_v.float()

    kernels = _kernels()
    ks, kz = q.k[k_codec.prefix + "scale"], q.k[k_codec.prefix + "zero"]
    klev = _levels(k_codec, q.k_consts, True, device) if k_codec.codebook else query
    rot = q.k_consts["rotation"].float() if k_codec.rotation else query
    rot_strides = (rot.stride(0), rot.stride(1)) if k_codec.rotation else (0, 0)
    if q.rope is not None:
        bc, bs, oc, os_ = (t.float().contiguous() for t in q.rope)  # [B or 1, nb, R/2] x 2, [F, R/2] x 2
        half = bc.shape[-1]
        bc_strides = (bc.stride(0) if bc.shape[0] > 1 else 0, bc.stride(1), bc.stride(2))
        oc_strides, F = (oc.stride(0), oc.stride(1)), oc.shape[0]
    else:
        bc = bs = oc = os_ = query
        half, bc_strides, oc_strides, F = 0, (0, 0, 0), (0, 0), 1
    tail = D - 2 * half
    vc, vs = q.v[v_codec.prefix + "codes"], q.v[v_codec.prefix + "scale"]
    vz = vs if v_codec.norm else q.v[v_codec.prefix + "zero"]
    if vz.stride() != vs.stride():  # one set of strides is passed for both
        vs, vz = vs.contiguous(), vz.contiguous()
    vlev = _levels(v_codec, q.v_consts, not v_codec.norm, device) if v_codec.codebook else query
    for name, t in (("key codes", kc), ("value codes", vc)):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} with last stride {t.stride(-1)}; allowed: rows of contiguous bytes (stride 1)")
    if ks.stride() != kz.stride():  # one set of strides is passed for both
        ks, kz = ks.contiguous(), kz.contiguous()
    region_bias = bias[:, 0, 0, S:S + T] if bias is not None else query
    bias_strides = (region_bias.stride(0), region_bias.stride(1)) if bias is not None else (0, 0)

    chunk = chunk or _chunk_tokens(T, B * H, device)
    NC = -(-T // chunk)
    m = torch.empty(B * H * NC * G, device=device, dtype=torch.float32)
    l_ = torch.empty_like(m)
    acc = torch.empty(B * H * NC * G, D, device=device, dtype=torch.float32)
    DP = _pow2(D)
    kernels["chunk"][(B * H, NC)](
        query, *query.stride(),
        kc, kc.stride(0), kc.stride(1), kc.stride(2),
        ks, kz, ks.stride(0), ks.stride(1), ks.stride(2), ks.stride(3), klev,
        rot, *rot_strides,
        bc, bs, *bc_strides, oc, os_, *oc_strides,
        vc, vc.stride(0), vc.stride(1), vc.stride(2),
        vs, vz, vs.stride(0), vs.stride(1), vs.stride(2), vs.stride(3), vlev,
        region_bias, *bias_strides,
        m, l_, acc,
        H, G, T, chunk, NC, k_codec.group, v_codec.group, F, half, float(scaling),
        D=D, DP=DP, KS=min(DP, _K_SLICE), HP=_pow2(half), TAIL_P=_pow2(tail), BLOCK_T=_BLOCK_T, BLOCK_G=_pow2(G),
        K_BITS=k_codec.bits, K_CODEBOOK=k_codec.codebook, K_ROT=k_codec.rotation,
        V_BITS=v_codec.bits, V_NORM=v_codec.norm, V_CODEBOOK=v_codec.codebook,
        HAS_ROPE=q.rope is not None, HAS_TAIL=tail > 0, HAS_BIAS=bias is not None,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES,
    )
    m_q = torch.empty(B, H, G, device=device, dtype=torch.float32)
    l_q = torch.empty_like(m_q)
    acc_q = torch.empty(B, H, G, D, device=device, dtype=torch.float32)
    kernels["reduce"][(B * H * G,)](m, l_, acc, m_q, l_q, acc_q, G, NC, D=D, DP=DP,
                                    BLOCK_C=min(_pow2(NC, least=1), 16))
    # merge with the full-precision tokens [sinks | residual]
    top = m_q if s_fp.shape[-1] == 0 else torch.maximum(m_q, s_fp.amax(-1))  # [B, H, G]
    p_fp = torch.exp(s_fp - top[..., None])
    w = torch.exp(m_q - top)
    denom = w * l_q + p_fp.sum(-1)
    num = v_codec.unrotate(w[..., None] * acc_q, q.v_consts) + p_fp @ fp_v.float()
    return num / denom[..., None]
