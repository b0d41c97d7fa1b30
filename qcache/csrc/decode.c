/* qcache's CPU decode attention over packed codes (qcache/native.py builds and calls this file).
 *
 * One query token per head attends over everything one layer holds, in one call: the quantized region read from
 * its packed codes, the full-precision tokens (the sinks, or the sinks and an unquantized residual) and the 8-bit
 * residual window read from its codes. Nothing is dequantized into memory; the only writes are each work item's
 * flash-decoding partials and the output.
 *
 * Work items are chunks of `chunk` tokens of the region of one (batch row, kv head), plus one item per (batch row,
 * kv head) for the full-precision tokens and the window. A region item, for each tile of TILE tokens, unpacks the key
 * codes, dequantizes them with their block's per-channel scale and zero (times the Hadamard rotation's signs and
 * 1/sqrt(b), `kfold`, applied once per block), un-rotates them with an in-place Walsh-Hadamard butterfly over blocks
 * of `krot` channels, re-applies RoPE by angle addition (block-start cos/sin times the in-block offset's) and scores
 * the G query rows sharing the kv head; values are unpacked and weighted into the item's online softmax (running
 * max, sum of exp(score - max), exp-weighted sum of values, still in rotated value space). The full-precision item
 * scores its tokens as they are and the window's from their 8-bit codes: a window key is z + s * c per token
 * (rotated by R when `wkfold` is set), so its score is s * (c . q R) + z * sum(q R), with q R the butterfly of q
 * times the fold, computed once; a window value is z + s * c per token, weighted as (p s) c plus p z. Its sums are in
 * the values' own space. A second pass merges each query row's partials: the region's weighted sum un-rotated once
 * (butterfly of the sum times `vfold`), the full-precision item's added, divided by the total weight.
 *
 * Layouts: every tensor is a `qc_tensor`, a pointer, strides in elements of its batch row, head and token (or key
 * block) and a dtype (F32, BF16, F16 or U8); the last dimension is contiguous.
 *   kcodes [B, H, T, kbytes] U8, byte planes as qcache/quant.py packs them (channel order, pair order of RoPE)
 *   kscale, kzero [B, H, T / group, D]    per-channel block ranges, in the stored scale dtype
 *   klev [2^kbits] fp32                    key level of each code, in units of a step (NULL: the code itself)
 *   kfold [D] fp32, krot                   the key rotation's signs / sqrt(b) and its block (krot 0: unrotated)
 *   bcos, bsin [B, T / group, >= rh] fp32  cos/sin of each block start (rh = rotary channels / 2; NULL: no RoPE)
 *   ocos, osin [rh, group] fp32            cos/sin of each offset within a block, transposed, unit scale
 *   vcodes [B, H, T, vbytes] U8; vscale, vzero [B, H, T, D / vgroup] (vzero NULL: norm values, level * scale)
 *   vlev [2^vbits] fp32 (NULL: the code itself); vfold [D], vrot: the value rotation the output un-rotates
 *   fk, fv [B, H, nf, D]                   full-precision tokens: the first S are sinks, the rest follow the region
 *   wkc, wvc [B, H, nw, D] U8; wks, wkz, wvs, wvz [B, H, nw, 1]: the 8-bit window (nw 0: none)
 *   wkfold [D], wkrot                      the window keys' rotation (wkrot 0: unrotated)
 *   query [B, H, G, D] fp32 contiguous; bias [B, S + T + nf - S + nw] additive F32 or U8 mask (0: masked), or NULL
 *   out [B, H, G, D] fp32 contiguous
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define TILE 8
#define MAXD 256
#define MAXG 64

enum { F32 = 0, BF16 = 1, F16 = 2, U8 = 3 };

typedef struct {
    const void *p;
    int64_t sb, sh, st, dtype;
} qc_tensor;

typedef struct {
    int64_t B, H, G, D, T, S, group, kbits, vbits, vgroup, rh, chunk, threads;
    double scaling;
    qc_tensor kcodes, kscale, kzero;
    const float *klev, *kfold;
    int64_t krot;
    qc_tensor bcos, bsin;
    const float *ocos, *osin;
    qc_tensor vcodes, vscale, vzero;
    const float *vlev, *vfold;
    int64_t vrot;
    qc_tensor fk, fv;
    int64_t nf;
    qc_tensor wkc, wks, wkz, wvc, wvs, wvz;
    int64_t nw;
    const float *wkfold;
    int64_t wkrot;
    const float *query;
    qc_tensor bias;
    float *out;
} qc_args;

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 vsel(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, man = h & 1023, u;
    if (e == 0) {
        float f = (float)man * 5.9604644775390625e-8f;  /* zero or subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    u = e == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((e + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline int64_t at(const qc_tensor *t, int64_t b, int64_t h, int64_t i) {
    return b * t->sb + h * t->sh + i * t->st;
}

static inline float ld(const qc_tensor *t, int64_t i) {
    switch (t->dtype) {
    case BF16: {
        uint32_t u = (uint32_t)((const uint16_t *)t->p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    case F16: return h2f(((const uint16_t *)t->p)[i]);
    case U8: return ((const uint8_t *)t->p)[i];
    default: return ((const float *)t->p)[i];
    }
}

static inline __attribute__((always_inline)) void ldrow(const qc_tensor *t, int64_t i, int n, float *out) {  /* n elements from index i, as fp32 */
    if (t->dtype == F32) {
        memcpy(out, (const float *)t->p + i, sizeof(float) * n);
    } else if (t->dtype == BF16) {
        const uint16_t *s = (const uint16_t *)t->p + i;
        for (int j = 0; j < n; j++) {
            uint32_t u = (uint32_t)s[j] << 16;
            memcpy(out + j, &u, 4);
        }
    } else if (t->dtype == F16) {
        const uint16_t *s = (const uint16_t *)t->p + i;
        for (int j = 0; j < n; j++) out[j] = h2f(s[j]);
    } else {
        const uint8_t *s = (const uint8_t *)t->p + i;
        for (int j = 0; j < n; j++) out[j] = s[j];
    }
}

static void unpack_row(const uint8_t *p, int D, int bits, uint8_t *out) {
    if (bits == 4) {
        int m = D / 2;
        for (int j = 0; j < m; j++) { out[j] = p[j] & 15; out[j + m] = p[j] >> 4; }
    } else if (bits == 2) {
        int m = D / 4;
        for (int j = 0; j < m; j++) {
            uint8_t b = p[j];
            out[j] = b & 3; out[j + m] = (b >> 2) & 3; out[j + 2 * m] = (b >> 4) & 3; out[j + 3 * m] = b >> 6;
        }
    } else if (bits == 3) {
        int m = D / 8;
        for (int j = 0; j < m; j++) {
            uint32_t w = (uint32_t)p[j] | ((uint32_t)p[j + m] << 8) | ((uint32_t)p[j + 2 * m] << 16);
            for (int i = 0; i < 8; i++) out[i * m + j] = (w >> (3 * i)) & 7;
        }
    } else {
        memcpy(out, p, D);
    }
}

static inline v8 load8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }

typedef uint8_t v8b __attribute__((vector_size(8)));

static inline v8i bytes8(const uint8_t *p) {  /* 8 bytes, zero-extended */
#ifdef __AVX2__
    return (v8i)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
#else
    v8b r;
    memcpy(&r, p, 8);
    return __builtin_convertvector(r, v8i);
#endif
}

/* the codes of one packed row as 8-channel index vectors in channel order (idx[k]: channels 8k..8k+7); 0 where a
 * plane of this width and head_dim is not a whole number of 8-byte loads (the caller then unpacks bytewise) */
static inline int code_slices(const uint8_t *p, int D, int bits, v8i *idx) {
    if (bits == 8) {
        for (int k = 0; k < D / 8; k++) idx[k] = bytes8(p + 8 * k);
    } else if (bits == 4 && D % 16 == 0) {
        const int n = D / 16;
        for (int k = 0; k < n; k++) { v8i u = bytes8(p + 8 * k); idx[k] = u & 15; idx[n + k] = u >> 4; }
    } else if (bits == 2 && D % 32 == 0) {
        const int n = D / 32;
        for (int k = 0; k < n; k++) {
            v8i u = bytes8(p + 8 * k);
            idx[k] = u & 3; idx[n + k] = (u >> 2) & 3; idx[2 * n + k] = (u >> 4) & 3; idx[3 * n + k] = u >> 6;
        }
    } else if (bits == 3 && D % 64 == 0) {
        const int m = D / 8, n = D / 64;
        for (int k = 0; k < n; k++) {
            v8i w = bytes8(p + 8 * k) | (bytes8(p + m + 8 * k) << 8) | (bytes8(p + 2 * m + 8 * k) << 16);
            for (int i = 0; i < 8; i++) idx[i * n + k] = (w >> (3 * i)) & 7;
        }
    } else {
        return 0;
    }
    return 1;
}

/* the level of each code of n index vectors, in place (as fp32 bits): the code itself (mode 0), a lane permute of
 * a table of up to 8 or 16 levels (modes 1, 2: AVX2), else a lookup per lane (mode 3) */
static inline __attribute__((always_inline)) void levels_row(v8i *idx, int n, int mode, const float *lev,
                                                             const v8 *table) {
    switch (mode) {
    case 0:
        for (int k = 0; k < n; k++) idx[k] = (v8i)__builtin_convertvector(idx[k], v8);
        break;
#ifdef __AVX2__
    case 1:
        for (int k = 0; k < n; k++) idx[k] = (v8i)_mm256_permutevar8x32_ps((__m256)table[0], (__m256i)idx[k]);
        break;
    case 2:
        for (int k = 0; k < n; k++) {
            v8 lo = (v8)_mm256_permutevar8x32_ps((__m256)table[0], (__m256i)idx[k]);
            v8 hi = (v8)_mm256_permutevar8x32_ps((__m256)table[1], (__m256i)idx[k]);
            idx[k] = (v8i)vsel(idx[k] > 7, hi, lo);
        }
        break;
#endif
    default:
        for (int k = 0; k < n; k++) {
            v8 r;
            for (int i = 0; i < 8; i++) r[i] = lev[idx[k][i]];
            idx[k] = (v8i)r;
        }
    }
    (void)table;
}

static inline int levels_mode(const float *lev, int nlev) {
#ifdef __AVX2__
    if (lev && nlev <= 16) return nlev <= 8 ? 1 : 2;
#endif
    return lev ? 3 : 0;
}

static inline float hmax8(v8 a) {
    float m = a[0];
    for (int i = 1; i < 8; i++) m = a[i] > m ? a[i] : m;
    return m;
}

static inline float hsum8(v8 a) {
    return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
}


/* exp on 8 lanes (Cephes' expf: n = round(x log2 e), x - n ln 2 in two parts, a degree-6 polynomial, times 2^n);
 * within 2 ulp of expf; 0 below -87.3 (where expf is subnormal or 0), NaN stays NaN */
static inline v8 vexp(v8 x) {
    const v8 lo = (v8){0} - 87.3365448f, hi = (v8){0} + 88.3762626f, magic = (v8){0} + 12582912.f;
    v8i under = x < lo;
    x = vsel(x > hi, hi, x);
    x = vsel(under, lo, x);
    v8 t = x * 1.44269504088896341f + magic;
    v8 n = t - magic;
    v8i ni = (v8i)t - (v8i)magic;
    x = x - n * 0.693359375f;
    x = x - n * -2.12194440e-4f;
    v8 z = x * x;
    v8 p = 1.9875691500E-4f * x + 1.3981999507E-3f;
    p = p * x + 8.3334519073E-3f;
    p = p * x + 4.1665795894E-2f;
    p = p * x + 1.6666665459E-1f;
    p = p * x + 5.0000001201E-1f;
    v8 y = p * z + x + 1.f;
    y = y * (v8)((ni + 127) << 23);
    return (v8)((v8i)y & ~under);
}

static inline float dot(const float *x, const float *y, int D) {  /* D a multiple of 8 */
    v8 a0 = {0}, a1 = {0};
    int ch = 0;
    for (; ch + 16 <= D; ch += 16) { a0 += load8(x + ch) * load8(y + ch); a1 += load8(x + ch + 8) * load8(y + ch + 8); }
    if (ch < D) a0 += load8(x + ch) * load8(y + ch);
    return hsum8(a0 + a1);
}

static void butterfly(float *x, int D, int block) {  /* x H within blocks of `block` channels (H Sylvester, ±1) */
    for (int w = 1; w < block; w <<= 1)
        for (int base = 0; base < D; base += 2 * w)
            for (int j = base; j < base + w; j++) {
                float a = x[j], e = x[j + w];
                x[j] = a + e; x[j + w] = a - e;
            }
}

/* `n` (1 to 3) butterfly stages w, 2w, 4w of 8-token tiles x[D], the 2^n entries each touches held in registers */
static inline __attribute__((always_inline)) void bf_pass(v8 *x, int D, int w, int n) {
    const int span = w << n, m = 1 << n;
    for (int base = 0; base < D; base += span)
        for (int j = base; j < base + w; j++) {
            v8 r[8];
            for (int k = 0; k < m; k++) r[k] = x[j + k * w];
            for (int st = 1; st < m; st <<= 1)
                for (int k = 0; k < m; k++)
                    if (!(k & st)) { v8 p = r[k], e = r[k + st]; r[k] = p + e; r[k + st] = p - e; }
            for (int k = 0; k < m; k++) x[j + k * w] = r[k];
        }
}

/* acc[g][ch] += sum over the tile's tokens i of p[g][i] * v[i][ch], for n (1 to 4) query rows from g0: each
 * 8-channel slice of the n rows stays in registers over the tile */
static inline __attribute__((always_inline)) void acc_rows(float *acc, int D, const float *vt, const v8 *s, int g0,
                                                           int n) {
    for (int ch = 0; ch < D; ch += 8) {
        v8 r[4];
        for (int k = 0; k < n; k++) r[k] = load8(acc + (g0 + k) * D + ch);
        for (int i = 0; i < TILE; i++) {
            const v8 vv = load8(vt + i * MAXD + ch);
            for (int k = 0; k < n; k++) r[k] += s[g0 + k][i] * vv;
        }
        for (int k = 0; k < n; k++) memcpy(acc + (g0 + k) * D + ch, &r[k], sizeof(v8));
    }
}

/* the additive bias of 8 consecutive tokens from index i of row b (a U8 mask: 0 where attended, else -FLT_MAX) */
static inline v8 bias8(const qc_tensor *bias, int64_t b, int64_t i) {
    if (bias->dtype == U8) {
        const uint8_t *m = (const uint8_t *)bias->p + b * bias->sb + i;
        v8 r;
        for (int k = 0; k < TILE; k++) r[k] = m[k] ? 0.f : -FLT_MAX;
        return r;
    }
    return load8((const float *)bias->p + b * bias->sb + i);
}

static inline float bias1(const qc_tensor *bias, int64_t b, int64_t i) {
    if (!bias->p) return 0.f;
    if (bias->dtype == U8) return ((const uint8_t *)bias->p)[b * bias->sb + i] ? 0.f : -FLT_MAX;
    return ((const float *)bias->p)[b * bias->sb + i];
}

/* the online softmax of one tile of scores s[g] (TILE lanes each): rescale the running sums where the maximum grows,
 * then exp(s - max) into s[g] */
static inline void tile_softmax(int G, int D, v8 *s, float *m, float *l, float *acc, float *pz) {
    for (int g = 0; g < G; g++) {
        float top = hmax8(s[g]);  /* one rescale per tile and query row */
        if (top > m[g]) {
            float f = expf(m[g] - top);
            l[g] *= f;
            if (pz) pz[g] *= f;
            float *ag = acc + g * D;
            for (int ch = 0; ch < D; ch++) ag[ch] *= f;
            m[g] = top;
        }
        v8 e = vexp(s[g] - (m[g] == -INFINITY ? 0.f : m[g]));
        s[g] = e;
        l[g] += hsum8(e);
    }
}

static void region_item(const qc_args *a, int b, int h, int c, float *m, float *l, float *acc) {
    const int G = a->G, D = a->D, T = a->T, group = a->group, kbits = a->kbits, vbits = a->vbits, rh = a->rh;
    const int vgroup = a->vgroup, ng = D / vgroup;
    const float scaling = (float)a->scaling;
    const float *q = a->query + ((int64_t)b * a->H + h) * G * D;
    const uint8_t *kc = (const uint8_t *)a->kcodes.p + b * a->kcodes.sb + h * a->kcodes.sh;
    const int64_t kc_t = a->kcodes.st;
    const uint8_t *vc = (const uint8_t *)a->vcodes.p + b * a->vcodes.sb + h * a->vcodes.sh;
    v8 x[MAXD];
    v8i ci[MAXD];
    v8 s[MAXG];
    uint8_t row[MAXD];
    float vt[TILE * MAXD], sc[MAXD], zr[MAXD], vs[MAXD], vz[MAXD];
    int cur = -1;
    const int nvlev = 1 << vbits, vslices = vgroup % 8 == 0;  /* value slices of 8 channels lie in one group */
    const int vmode = levels_mode(a->vlev, nvlev);
    v8 vtable[2] = {{0}, {0}};
    if (a->vlev && nvlev <= 16) memcpy(vtable, a->vlev, sizeof(float) * nvlev);
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }
    memset(acc, 0, sizeof(float) * G * D);
    const int t_end = (c + 1) * a->chunk < T ? (c + 1) * a->chunk : T;
    for (int t0 = c * a->chunk; t0 < t_end; t0 += TILE) {
        const int blk = t0 / group, r0 = t0 % group;
        if (blk != cur) {  /* the block's ranges, with the rotation's signs and norm folded in */
            ldrow(&a->kscale, at(&a->kscale, b, h, blk), D, sc);
            ldrow(&a->kzero, at(&a->kzero, b, h, blk), D, zr);
            if (a->kfold)
                for (int ch = 0; ch < D; ch++) { sc[ch] *= a->kfold[ch]; zr[ch] *= a->kfold[ch]; }
            cur = blk;
        }
        const uint8_t *kt = kc + (int64_t)t0 * kc_t;
        if (kbits == 4 && !a->klev) {  /* 4 bytes of 8 tokens at a time: channels j..j+3 and j+D/2..j+D/2+3 */
            const int half = D / 2;
            for (int j = 0; j < half; j += 4) {
                v8i w;
                for (int i = 0; i < TILE; i++) { uint32_t u; memcpy(&u, kt + i * kc_t + j, 4); w[i] = (int32_t)u; }
                for (int k = 0; k < 4; k++) {
                    const int lo = j + k, hi = j + k + half;
                    x[lo] = zr[lo] + __builtin_convertvector((w >> (8 * k)) & 15, v8) * sc[lo];
                    x[hi] = zr[hi] + __builtin_convertvector((w >> (8 * k + 4)) & 15, v8) * sc[hi];
                }
            }
        } else {
            for (int i = 0; i < TILE; i++) {
                unpack_row(kt + i * kc_t, D, kbits, row);
                for (int ch = 0; ch < D; ch++) ci[ch][i] = row[ch];
            }
            if (a->klev) {
                for (int ch = 0; ch < D; ch++) {
                    v8 lv;
                    for (int i = 0; i < TILE; i++) lv[i] = a->klev[ci[ch][i]];
                    x[ch] = zr[ch] + lv * sc[ch];
                }
            } else {
                for (int ch = 0; ch < D; ch++) x[ch] = zr[ch] + __builtin_convertvector(ci[ch], v8) * sc[ch];
            }
        }
        for (int w = 1; w < a->krot; w <<= 3) {  /* Walsh-Hadamard butterflies within blocks of krot */
            const int left = a->krot / w;
            if (left >= 8) bf_pass(x, D, w, 3);
            else if (left == 4) bf_pass(x, D, w, 2);
            else bf_pass(x, D, w, 1);
        }
        if (a->bcos.p) {
            const float *bc = (const float *)a->bcos.p + b * a->bcos.sb + blk * a->bcos.st;
            const float *bs = (const float *)a->bsin.p + b * a->bsin.sb + blk * a->bsin.st;
            for (int j = 0; j < rh; j++) {
                v8 oc = load8(a->ocos + (int64_t)j * group + r0), os = load8(a->osin + (int64_t)j * group + r0);
                v8 cs = bc[j] * oc - bs[j] * os, sn = bs[j] * oc + bc[j] * os;
                v8 x1 = x[j], x2 = x[j + rh];
                x[j] = x1 * cs - x2 * sn; x[j + rh] = x2 * cs + x1 * sn;
            }
        }
        const v8 bias = a->bias.p ? bias8(&a->bias, b, a->S + t0) : (v8){0};
        for (int g = 0; g < G; g++) {
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};  /* four chains: the adds' latency, not one long chain */
            const float *qg = q + g * D;
            for (int ch = 0; ch < D; ch += 4) {
                a0 += qg[ch] * x[ch]; a1 += qg[ch + 1] * x[ch + 1];
                a2 += qg[ch + 2] * x[ch + 2]; a3 += qg[ch + 3] * x[ch + 3];
            }
            s[g] = ((a0 + a1) + (a2 + a3)) * scaling + bias;
        }
        tile_softmax(G, D, s, m, l, acc, NULL);
        for (int i = 0; i < TILE; i++) {  /* the tile's values, dequantized */
            const int64_t t = t0 + i;
            float *v = vt + i * MAXD;
            ldrow(&a->vscale, at(&a->vscale, b, h, t), ng, vs);
            if (vslices && code_slices(vc + t * a->vcodes.st, D, vbits, ci)) {
                levels_row(ci, D / 8, vmode, a->vlev, vtable);
                if (a->vzero.p) {
                    ldrow(&a->vzero, at(&a->vzero, b, h, t), ng, vz);
                    for (int gi = 0, k = 0; gi < ng; gi++) {
                        const float z = vz[gi], sg = vs[gi];
                        for (int e = 0; e < vgroup; e += 8, k++) {
                            v8 r = z + (v8)ci[k] * sg;
                            memcpy(v + 8 * k, &r, sizeof r);
                        }
                    }
                } else {
                    const float sg = vs[0];
                    for (int k = 0; k < D / 8; k++) {
                        v8 r = (v8)ci[k] * sg;
                        memcpy(v + 8 * k, &r, sizeof r);
                    }
                }
                continue;
            }
            unpack_row(vc + t * a->vcodes.st, D, vbits, row);
            if (a->vzero.p) {
                ldrow(&a->vzero, at(&a->vzero, b, h, t), ng, vz);
                for (int gi = 0; gi < ng; gi++) {
                    const float z = vz[gi], sg = vs[gi];
                    const uint8_t *rg = row + gi * vgroup;
                    float *vg = v + gi * vgroup;
                    if (a->vlev) for (int ch = 0; ch < vgroup; ch++) vg[ch] = z + a->vlev[rg[ch]] * sg;
                    else for (int ch = 0; ch < vgroup; ch++) vg[ch] = z + (float)rg[ch] * sg;
                }
            } else {
                for (int ch = 0; ch < D; ch++) v[ch] = a->vlev[row[ch]] * vs[0];
            }
        }
        for (int g0 = 0; g0 < G; g0 += 4) {  /* weighted into the sums, four query rows at a time */
            switch (G - g0) {
            case 1: acc_rows(acc, D, vt, s, g0, 1); break;
            case 2: acc_rows(acc, D, vt, s, g0, 2); break;
            case 3: acc_rows(acc, D, vt, s, g0, 3); break;
            default: acc_rows(acc, D, vt, s, g0, 4);
            }
        }
    }
}

/* the full-precision tokens and the 8-bit window of one (batch row, kv head); qr: scratch of G * D floats */
static void fp_item(const qc_args *a, int b, int h, float *m, float *l, float *acc, float *qr) {
    const int G = a->G, D = a->D;
    const int64_t nf = a->nf, n = a->nf + a->nw, S = a->S, T = a->T;
    const float scaling = (float)a->scaling;
    const float *q = a->query + ((int64_t)b * a->H + h) * G * D;
    float qsum[MAXG], pz[MAXG], kv[MAXD], sw[TILE], zw[TILE];
    v8 s[MAXG];
    for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; pz[g] = 0.f; }
    memset(acc, 0, sizeof(float) * G * D);
    if (a->nw) {  /* the query in the window keys' space: q R = (q H) * fold */
        memcpy(qr, q, sizeof(float) * G * D);
        for (int g = 0; g < G; g++) {
            float *r = qr + g * D;
            if (a->wkfold) {
                butterfly(r, D, (int)a->wkrot);
                for (int ch = 0; ch < D; ch++) r[ch] *= a->wkfold[ch];
            }
            float sum = 0.f;
            for (int ch = 0; ch < D; ch++) sum += r[ch];
            qsum[g] = sum;
        }
    }
    for (int64_t t0 = 0; t0 < n; t0 += TILE) {
        const int cnt = n - t0 < TILE ? (int)(n - t0) : TILE;
        for (int i = 0; i < TILE; i++) {
            const int64_t t = t0 + i;
            if (i >= cnt) {
                for (int g = 0; g < G; g++) s[g][i] = -INFINITY;
            } else if (t < nf) {
                ldrow(&a->fk, at(&a->fk, b, h, t), D, kv);
                const float bias = bias1(&a->bias, b, t < S ? t : t + T);
                for (int g = 0; g < G; g++) s[g][i] = dot(q + g * D, kv, D) * scaling + bias;
            } else {
                const int64_t r = t - nf;
                ldrow(&a->wkc, at(&a->wkc, b, h, r), D, kv);
                const float sk = ld(&a->wks, at(&a->wks, b, h, r)), zk = ld(&a->wkz, at(&a->wkz, b, h, r));
                const float bias = bias1(&a->bias, b, T + nf + r);
                for (int g = 0; g < G; g++) s[g][i] = (sk * dot(qr + g * D, kv, D) + zk * qsum[g]) * scaling + bias;
            }
        }
        tile_softmax(G, D, s, m, l, acc, pz);
        for (int i = 0; i < cnt; i++) {
            const int64_t t = t0 + i;
            if (t < nf) {
                ldrow(&a->fv, at(&a->fv, b, h, t), D, kv);
                for (int g = 0; g < G; g++) {
                    const float p = s[g][i];
                    float *ag = acc + g * D;
                    for (int ch = 0; ch < D; ch++) ag[ch] += p * kv[ch];
                }
            } else {
                const int64_t r = t - nf;
                ldrow(&a->wvc, at(&a->wvc, b, h, r), D, kv);
                sw[i] = ld(&a->wvs, at(&a->wvs, b, h, r));
                zw[i] = ld(&a->wvz, at(&a->wvz, b, h, r));
                for (int g = 0; g < G; g++) {
                    const float p = s[g][i], ps = p * sw[i];
                    float *ag = acc + g * D;
                    for (int ch = 0; ch < D; ch++) ag[ch] += ps * kv[ch];
                    pz[g] += p * zw[i];
                }
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int ch = 0; ch < D; ch++) acc[g * D + ch] += pz[g];
}

int qcache_decode_attention(const qc_args *a) {
    const int64_t B = a->B, H = a->H, G = a->G, D = a->D, T = a->T;
    if (D > MAXD || D % 8 || G > MAXG || G < 1 || a->group % TILE || a->chunk % TILE || (a->group && T % a->group))
        return 1;
    if (D % a->vgroup || (!a->vzero.p && !a->vlev) || (a->nw && !(a->wkc.p && a->wvc.p)) || (a->nf && !a->fk.p))
        return 1;
    const int64_t NC = (T + a->chunk - 1) / a->chunk, NI = NC + 1;  /* item NC of each (b, h): fp and window */
    float *scratch = malloc(sizeof(float) * (B * H * NI * G * (D + 2) + B * H * G * D));
    if (!scratch) return 2;
    float *pm = scratch, *pl = pm + B * H * NI * G, *pacc = pl + B * H * NI * G, *qr = pacc + B * H * NI * G * D;
    const int64_t items = B * H * NI;
#pragma omp parallel num_threads(a->threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {  /* the fp items first: they are the longest */
            const int64_t bh = it % (B * H), c = (it / (B * H) + NC) % NI;  /* c = NC first */
            const int b = (int)(bh / H), h = (int)(bh % H);
            const int64_t o = bh * NI + c;
            if (c == NC) fp_item(a, b, h, pm + o * G, pl + o * G, pacc + o * G * D, qr + bh * G * D);
            else region_item(a, b, h, (int)c, pm + o * G, pl + o * G, pacc + o * G * D);
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < B * H * G; r++) {  /* merge: each query row's partials */
            const int64_t bh = r / G, g = r % G;
            float top = -INFINITY, den = 0.f, reg[MAXD];
            for (int64_t c = 0; c < NI; c++) top = fmaxf(top, pm[(bh * NI + c) * G + g]);
            memset(reg, 0, sizeof(float) * D);
            for (int64_t c = 0; c < NC; c++) {
                const int64_t o = (bh * NI + c) * G + g;
                const float w = pm[o] == -INFINITY ? 0.f : expf(pm[o] - top);
                const float *ac = pacc + o * D;
                den += w * pl[o];
                for (int ch = 0; ch < D; ch++) reg[ch] += w * ac[ch];
            }
            if (a->vfold) {  /* un-rotate the region's values once: (sum P V R) R^T = butterfly of (sum * fold) */
                for (int ch = 0; ch < D; ch++) reg[ch] *= a->vfold[ch];
                butterfly(reg, (int)D, (int)a->vrot);
            }
            const int64_t o = (bh * NI + NC) * G + g;
            const float w = pm[o] == -INFINITY ? 0.f : expf(pm[o] - top);
            const float *ac = pacc + o * D;
            den += w * pl[o];
            float *out = a->out + r * D;
            for (int ch = 0; ch < D; ch++) out[ch] = (reg[ch] + w * ac[ch]) / den;
        }
    }
    free(scratch);
    return 0;
}
