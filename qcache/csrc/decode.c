/* qcache's CPU decode attention over packed codes (qcache/native.py builds and calls this file).
 *
 * One query token per head attends over the quantized region of one layer, reading every packed byte once:
 * each work item is a chunk of tokens of one (batch row, kv head). For each tile of TILE tokens it unpacks the key
 * codes, dequantizes them with their block's per-channel scale and zero (signs and 1/sqrt(b) of the Hadamard
 * rotation folded in by the caller), un-rotates them with an in-place Walsh-Hadamard butterfly over blocks of
 * `rot_block` channels, re-applies RoPE by angle addition (block-start cos/sin times the in-block offset's), and
 * scores the G query rows sharing the kv head. The chunk keeps flash-decoding partials: the running max of its
 * scores, the sum of exp(score - max) and the exp-weighted sum of its values (still in rotated value space). The
 * caller combines the chunks with the full-precision tokens and un-rotates the values once.
 *
 * Layouts (all fp32 unless said; strides in elements, the last dimension contiguous):
 *   kcodes [B, H, T, kbytes] uint8, byte planes as qcache/quant.py packs them (channel order, pair order of RoPE)
 *   kscale, kzero [B, H, T / group, D]   per-channel block ranges (sign- and norm-folded), contiguous
 *   klev [2^kbits]                        key level of each code, in units of a step (NULL: the code itself)
 *   bcos, bsin [B, T / group, h]          cos/sin of each block start (h = rotary channels / 2; NULL: no RoPE)
 *   ocos, osin [h, group]                 cos/sin of each offset within a block, transposed, unit scale
 *   vcodes [B, H, T, vbytes] uint8
 *   vscale, vzero [B, H, T, D / vgroup]   per-token group ranges (vzero NULL: norm values, level * scale)
 *   vlev [2^vbits]
 *   query [B, H, G, D] (pre-scaled by nothing); bias [B, bias_t] additive over the region's tokens, or NULL
 *   out_m, out_l [B, H, NC, G]; out_acc [B, H, NC, G, D]
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define TILE 8
#define MAXD 256
#define MAXG 64

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

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline float hmax8(v8 a) {
    float m = a[0];
    for (int i = 1; i < 8; i++) m = a[i] > m ? a[i] : m;
    return m;
}

static inline v8 load8(const float *p) { v8 r; memcpy(&r, p, sizeof r); return r; }

int qcache_decode_attention(
    int B, int H, int G, int D, int T, int group, int kbits, int vbits, int vgroup, int rot_block, int rh,
    int chunk, int threads, float scaling,
    const uint8_t *kcodes, int64_t kc_b, int64_t kc_h, int64_t kc_t,
    const float *kscale, const float *kzero, const float *klev,
    const float *bcos, const float *bsin, const float *ocos, const float *osin,
    const uint8_t *vcodes, int64_t vc_b, int64_t vc_h, int64_t vc_t,
    const float *vscale, const float *vzero, const float *vlev,
    const float *query, const float *bias, int64_t bias_b,
    float *out_m, float *out_l, float *out_acc)
{
    if (D > MAXD || D % 8 || G > MAXG || group % TILE || chunk % TILE || T % group || TILE != 8) return 1;
    const int NC = (T + chunk - 1) / chunk, nb = T / group, ng = D / vgroup;
    const long items = (long)B * H * NC;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (long it = 0; it < items; it++) {
        const int c = it % NC, h = (it / NC) % H, b = it / ((long)NC * H);
        const float *q = query + ((long)b * H + h) * G * D;
        v8 x[MAXD];
        v8i ci[MAXD];
        v8 s[MAXG];
        uint8_t row[MAXD];
        float v[MAXD];
        float m[MAXG], l[MAXG];
        float *acc = out_acc + (((long)b * H + h) * NC + c) * G * D;
        for (int g = 0; g < G; g++) { m[g] = -INFINITY; l[g] = 0.f; }
        memset(acc, 0, sizeof(float) * G * D);
        const int t_end = (c + 1) * chunk < T ? (c + 1) * chunk : T;
        for (int t0 = c * chunk; t0 < t_end; t0 += TILE) {
            const int blk = t0 / group, r0 = t0 % group;
            const float *sc = kscale + (((long)b * H + h) * nb + blk) * D;
            const float *zr = kzero + (((long)b * H + h) * nb + blk) * D;
            const uint8_t *kt = kcodes + b * kc_b + h * kc_h + (long)t0 * kc_t;
            if (kbits == 4 && !klev) {  /* 4 bytes of 8 tokens at a time: channels j..j+3 and j+D/2..j+D/2+3 */
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
            }
            if (kbits == 4 && !klev) {
            } else if (klev) {
                for (int ch = 0; ch < D; ch++) {
                    v8 lv;
                    for (int i = 0; i < TILE; i++) lv[i] = klev[ci[ch][i]];
                    x[ch] = zr[ch] + lv * sc[ch];
                }
            } else {
                for (int ch = 0; ch < D; ch++) x[ch] = zr[ch] + __builtin_convertvector(ci[ch], v8) * sc[ch];
            }
            for (int w = 1; w < rot_block; w <<= 1)  /* Walsh-Hadamard butterflies within blocks of rot_block */
                for (int base = 0; base < D; base += 2 * w)
                    for (int j = base; j < base + w; j++) {
                        v8 a = x[j], e = x[j + w];
                        x[j] = a + e; x[j + w] = a - e;
                    }
            if (bcos) {
                const float *bc = bcos + ((long)b * nb + blk) * rh, *bs = bsin + ((long)b * nb + blk) * rh;
                for (int j = 0; j < rh; j++) {
                    v8 oc = load8(ocos + (long)j * group + r0), os = load8(osin + (long)j * group + r0);
                    v8 cs = bc[j] * oc - bs[j] * os, sn = bs[j] * oc + bc[j] * os;
                    v8 x1 = x[j], x2 = x[j + rh];
                    x[j] = x1 * cs - x2 * sn; x[j + rh] = x2 * cs + x1 * sn;
                }
            }
            for (int g = 0; g < G; g++) {
                v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};  /* four chains: the adds' latency, not one long chain */
                const float *qg = q + g * D;
                for (int ch = 0; ch < D; ch += 4) {
                    a0 += qg[ch] * x[ch]; a1 += qg[ch + 1] * x[ch + 1];
                    a2 += qg[ch + 2] * x[ch + 2]; a3 += qg[ch + 3] * x[ch + 3];
                }
                v8 sg = (a0 + a1) + (a2 + a3);
                sg *= scaling;
                if (bias) sg += load8(bias + b * bias_b + t0);
                s[g] = sg;
                float top = hmax8(sg);  /* one rescale per tile and query row */
                if (top > m[g]) {
                    float f = expf(m[g] - top);
                    l[g] *= f;
                    float *ag = acc + g * D;
                    for (int ch = 0; ch < D; ch++) ag[ch] *= f;
                    m[g] = top;
                }
                for (int i = 0; i < TILE; i++) { s[g][i] = expf(s[g][i] - m[g]); l[g] += s[g][i]; }
            }
            for (int i = 0; i < TILE; i++) {  /* values, one token at a time */
                const long t = t0 + i;
                unpack_row(vcodes + b * vc_b + h * vc_h + t * vc_t, D, vbits, row);
                const float *vs = vscale + (((long)b * H + h) * T + t) * ng;
                if (vzero) {
                    const float *vz = vzero + (((long)b * H + h) * T + t) * ng;
                    for (int ch = 0; ch < D; ch++) v[ch] = vz[ch / vgroup] + vlev[row[ch]] * vs[ch / vgroup];
                } else {
                    for (int ch = 0; ch < D; ch++) v[ch] = vlev[row[ch]] * vs[0];
                }
                for (int g = 0; g < G; g++) {
                    const float p = s[g][i];
                    float *ag = acc + g * D;
                    for (int ch = 0; ch < D; ch++) ag[ch] += p * v[ch];
                }
            }
        }
        for (int g = 0; g < G; g++) {
            out_m[(((long)b * H + h) * NC + c) * G + g] = m[g];
            out_l[(((long)b * H + h) * NC + c) * G + g] = l[g];
        }
    }
    return 0;
}
