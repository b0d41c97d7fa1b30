/* qcache's CPU encoder (qcache/native.py builds it with decode.c and calls it): the parts `codec.encode` stores, for
 * the three codecs a default cache codes on every flush and decode step.
 *
 * - qcache_encode_norm: `ValueCodec(norm=True)` (qcache/codec.py) codes a rotated token x [D] as Gaussian levels
 *   times one scale: starting from the token's RMS, `rounds` times, every channel takes the nearest level of
 *   x / scale (a tie goes to the lower level) and the scale becomes the least-squares one for those levels,
 *   <x, l> / <l, l>. In torch that is ~6 passes over the whole [tokens, D] tensor per round, each writing a
 *   temporary as large as the input; here each token is read once and kept in registers for every round. The
 *   arithmetic is the codec's (the same divisions, comparisons and products, 8 channels at a time); sums over a
 *   token's channels are taken in another order than torch's reductions, so a scale can differ from the torch
 *   encoder's in its last fp32 bit (and a code where that moves x / scale across a midpoint).
 *   x [n, D] fp32 contiguous (already rotated); levels [nlev] fp32 sorted ascending; codes [n, D] uint8 (one code
 *   per byte, packed by the caller); scale [n] fp32.
 * - qcache_encode_minmax: min-max tokens (the 8-bit window), bit for bit as the torch encoder.
 * - qcache_encode_keys: per-channel key blocks, bit for bit as the torch encoder.
 */
#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define MAXLEV 256
#define PARALLEL_MIN 65536  /* values: below this one thread codes them (a parallel region costs more) */

static inline int nearest_count(const float *mids, int nmid, float u) {
    /* the number of midpoints strictly below u: the index torch.bucketize(u, mids) gives (right=False) */
    if (nmid <= 15) {
        int k = 0;
        for (int i = 0; i < nmid; i++) k += u > mids[i];
        return k;
    }
    int lo = 0, hi = nmid;  /* first midpoint >= u */
    while (lo < hi) {
        int m = (lo + hi) >> 1;
        if (mids[m] < u) lo = m + 1; else hi = m;
    }
    return lo;
}

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 r; __builtin_memcpy(&r, p, sizeof r); return r; }

/* one token of D channels, D a multiple of 8: 8 channels at a time in vector registers */
static void token8(const float *v, int64_t D, const float *levels, const float *mids, int nmid, int64_t rounds,
                   uint8_t *c, float *scale) {
    v8 acc = {0};
    for (int64_t d = 0; d < D; d += 8) { v8 x = load8(v + d); acc += x * x; }
    float ss = 0.f;
    for (int i = 0; i < 8; i++) ss += acc[i];
    float s = sqrtf(ss / (float)D);
#ifdef __AVX2__
    float tab[16] = {0};
    for (int i = 0; i <= nmid && i < 16; i++) tab[i] = levels[i];
    const __m256 lo8 = _mm256_loadu_ps(tab), hi8 = _mm256_loadu_ps(tab + 8);
#endif
    for (int64_t r = 0; r < rounds; r++) {
        const float div = s < FLT_MIN ? FLT_MIN : s;
        v8 num = {0}, den = {0};
        for (int64_t d = 0; d < D; d += 8) {
            const v8 u = load8(v + d) / div;
            v8i k = {0};
            if (nmid <= 15) {
                for (int i = 0; i < nmid; i++) k -= (v8i)(u > mids[i]);  /* a true lane is -1 */
            } else {
                for (int j = 0; j < 8; j++) k[j] = nearest_count(mids, nmid, u[j]);
            }
            v8 l;
#ifdef __AVX2__
            if (nmid <= 15) {  /* up to 16 levels: two in-register table lookups */
                const __m256i ki = (__m256i)k;
                const __m256 lo = _mm256_permutevar8x32_ps(lo8, ki), hi = _mm256_permutevar8x32_ps(hi8, ki);
                l = (v8)_mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_cmpgt_epi32(ki, _mm256_set1_epi32(7))));
            } else
#endif
            for (int j = 0; j < 8; j++) l[j] = levels[k[j]];
            if (r == rounds - 1) for (int j = 0; j < 8; j++) c[d + j] = (uint8_t)k[j];
            num += load8(v + d) * l;
            den += l * l;
        }
        float n1 = 0.f, d1 = 0.f;
        for (int i = 0; i < 8; i++) { n1 += num[i]; d1 += den[i]; }
        s = n1 / d1;
    }
    *scale = s;
}

int qcache_encode_norm(const float *x, int64_t n, int64_t D, const float *levels, int64_t nlev, int64_t rounds,
                       uint8_t *codes, float *scale, int64_t threads) {
    if (nlev < 2 || nlev > MAXLEV || D <= 0 || D > 256 || rounds < 1) return 1;
    float mids[MAXLEV];
    for (int i = 0; i + 1 < nlev; i++) mids[i] = (levels[i + 1] + levels[i]) / 2;
    const int nmid = (int)nlev - 1;
    #pragma omp parallel for num_threads(threads) schedule(static) if (n * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        const float *v = x + t * D;
        uint8_t *c = codes + t * D;
        if (D % 8 == 0) {
            token8(v, D, levels, mids, nmid, rounds, c, scale + t);
            continue;
        }
        float ss = 0.f;
        for (int64_t d = 0; d < D; d++) ss += v[d] * v[d];
        float s = sqrtf(ss / (float)D);
        for (int64_t r = 0; r < rounds; r++) {
            const float div = s < FLT_MIN ? FLT_MIN : s;
            float num = 0.f, den = 0.f;
            for (int64_t d = 0; d < D; d++) {
                const int k = nearest_count(mids, nmid, v[d] / div);
                const float l = levels[k];
                c[d] = (uint8_t)k;
                num += v[d] * l;
                den += l * l;
            }
            s = num / den;
        }
        scale[t] = s;
    }
    return 0;
}

/* --- min-max tokens: `ValueCodec` without norm, codebook, outliers or clip search (qcache/quant.py's
 * quantize_grouped along the channels), fp16 scales. Exactly the torch encoder's arithmetic: a group's min and max,
 * its zero the fp16 value at or below the min and its scale the fp16 value at or above (max - zero) / qmax (at
 * least fp16's smallest normal), codes round-half-even((x - zero) / scale) clamped to [0, qmax]. */

/* fp16 by its bits (older compilers have no _Float16): fp32 -> fp16 rounds to nearest even, as torch's cast */
static inline uint16_t f16_from(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));  /* inf, nan */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  /* 65520 and up round to inf */
    if (ax < 0x38800000u) {  /* below 2^-14: a subnormal (or 0), in units of 2^-24, exact scaling then RNE */
        float a;
        __builtin_memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)nearbyintf(a * 16777216.f));  /* 1024 is the smallest normal */
    }
    uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffffu) >> 13));
    const uint32_t rest = ax & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;  /* a carry moves into the exponent, as it should */
    return (uint16_t)(sign | h);
}

static inline float f16_to(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
        const float f = (float)m * 5.9604644775390625e-08f;  /* 2^-24 */
        return sign ? -f : f;
    }
    const uint32_t x = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e - 15 + 127) << 23) | (m << 13));
    float f;
    __builtin_memcpy(&f, &x, 4);
    return f;
}

static inline uint16_t f16_down(float x) {  /* the largest fp16 <= x (x finite, in range) */
    const uint16_t b = f16_from(x);
    if (f16_to(b) <= x) return b;
    if (b == 0x0000u) return 0x8001u;
    return (uint16_t)((b & 0x8000u) ? b + 1 : b - 1);
}

static inline uint16_t f16_up(float x) {  /* the smallest fp16 >= x */
    const uint16_t b = f16_from(x);
    if (f16_to(b) >= x) return b;
    if (b == 0x8000u) return 0x0001u;
    return (uint16_t)((b & 0x8000u) ? b - 1 : b + 1);
}

/* x [n, D] fp32 contiguous; codes [n, D] uint8 (unpacked); scale, zero [n, D / group] fp16 (as uint16 bits).
 * Returns 2 when a group's range overflows fp16 (the caller's torch encoder raises then), 1 for bad arguments. */
int qcache_encode_minmax(const float *x, int64_t n, int64_t D, int64_t group, int64_t bits, uint8_t *codes,
                         uint16_t *scale, uint16_t *zero, int64_t threads) {
    if (D <= 0 || group <= 0 || D % group || bits < 1 || bits > 8) return 1;
    const int64_t ng = D / group;
    const float qmax = (float)((1 << bits) - 1), fmax16 = 65504.f, tiny16 = 6.103515625e-05f;
    int bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(|:bad) if (n * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        for (int64_t g = 0; g < ng; g++) {
            const float *v = x + t * D + g * group;
            float lo = v[0], hi = v[0];
            for (int64_t d = 1; d < group; d++) { lo = v[d] < lo ? v[d] : lo; hi = v[d] > hi ? v[d] : hi; }
            if (lo < -fmax16 || hi > fmax16) { bad = 1; continue; }
            if (lo == 0.f) lo = 0.f;  /* a zero minimum as +0, as torch's amin gives it */
            const uint16_t z = f16_down(lo);
            float s = (hi - f16_to(z)) / qmax;
            s = s < tiny16 ? tiny16 : s;
            const uint16_t sh = f16_up(s);
            const float zf = f16_to(z), sf = f16_to(sh);
            uint8_t *c = codes + t * D + g * group;
            for (int64_t d = 0; d < group; d++) {
                float u = nearbyintf((v[d] - zf) / sf);
                u = u < 0.f ? 0.f : (u > qmax ? qmax : u);
                c[d] = (uint8_t)u;
            }
            scale[t * ng + g] = sh;
            zero[t * ng + g] = z;
        }
    }
    return bad ? 2 : 0;
}

/* --- key blocks: `KeyCodec` without codebook, outliers, clip search or static ranges (quantize_grouped along the
 * tokens), fp16 scales, bit for bit as the torch encoder: per channel and block of `group` tokens, the min and max
 * over the block's valid tokens (a block of padding only: 0 and 0), fp16 zero at or below the min, fp16 scale at or
 * above (max - zero) / qmax, codes of every token (padding too) round-half-even and clamped.
 * x [B, H, n, D] fp32 contiguous; valid [B, n] uint8 or NULL (all valid); codes [B, H, n, D] uint8 (unpacked);
 * scale, zero [B, H, n / group, D] fp16 bits. Returns 2 where a range overflows fp16, 1 for bad arguments. */
int qcache_encode_keys(const float *x, const uint8_t *valid, int64_t B, int64_t H, int64_t n, int64_t D,
                       int64_t group, int64_t bits, uint8_t *codes, uint16_t *scale, uint16_t *zero,
                       int64_t threads) {
    if (D <= 0 || D > 1024 || group <= 0 || n % group || bits < 1 || bits > 8) return 1;
    const int64_t nb = n / group, items = B * H * nb;
    const float qmax = (float)((1 << bits) - 1), fmax16 = 65504.f, tiny16 = 6.103515625e-05f;
    int bad = 0;
    #pragma omp parallel for num_threads(threads) schedule(static) reduction(|:bad) if (n * B * H * D >= PARALLEL_MIN)
    for (int64_t it = 0; it < items; it++) {
        const int64_t b = it / (H * nb), j = it % nb;
        const int64_t row = it / nb;  /* b * H + h */
        const float *v = x + (row * n + j * group) * D;
        const uint8_t *ok = valid ? valid + b * n + j * group : NULL;
        float lo[1024], hi[1024], zf[1024], sf[1024];
        int any = 0;
        for (int64_t d = 0; d < D; d++) { lo[d] = INFINITY; hi[d] = -INFINITY; }
        for (int64_t t = 0; t < group; t++) {
            if (ok && !ok[t]) continue;
            any = 1;
            const float *r = v + t * D;
            for (int64_t d = 0; d < D; d++) {
                lo[d] = r[d] < lo[d] ? r[d] : lo[d];
                hi[d] = r[d] > hi[d] ? r[d] : hi[d];
            }
        }
        uint16_t *so = scale + it * D, *zo = zero + it * D;
        for (int64_t d = 0; d < D; d++) {
            float l = any ? lo[d] : 0.f, h = any ? hi[d] : 0.f;
            if (l < -fmax16 || h > fmax16) { bad = 1; l = h = 0.f; }
            if (l == 0.f) l = 0.f;  /* a zero minimum as +0, as torch's amin gives it */
            const uint16_t z = f16_down(l);
            float s = (h - f16_to(z)) / qmax;
            s = s < tiny16 ? tiny16 : s;
            const uint16_t sh = f16_up(s);
            zf[d] = f16_to(z);
            sf[d] = f16_to(sh);
            so[d] = sh;
            zo[d] = z;
        }
        uint8_t *c = codes + (row * n + j * group) * D;
        for (int64_t t = 0; t < group; t++) {
            const float *r = v + t * D;
            for (int64_t d = 0; d < D; d++) {
                float u = nearbyintf((r[d] - zf[d]) / sf[d]);
                u = u < 0.f ? 0.f : (u > qmax ? qmax : u);
                c[t * D + d] = (uint8_t)u;
            }
        }
    }
    return bad ? 2 : 0;
}
