/* Decode attention over a policy cache on the CPU: the C twin of kvcache/quant_attention.py's
 * attend_reference for a few query tokens (localctx.backends.torch.cpu_kernels.policy_attention
 * calls it and holds the layouts).
 *
 * The reference dequantizes every cached key and value to full precision, rotates every key
 * at its position and then attends. Here a unit of keys (one group of one KV head) is decoded
 * into a buffer that stays in L1, rotated and dotted with the queries of its head group, and the
 * values are decoded and summed the same way, so a step reads the 8- or 4-bit codes once and
 * writes nothing of the cache's size. One call, ``lc_attend``, runs three passes over the threads:
 *
 *   scores  s[hq * T + t][l] = rope(q[t, hq]) . rope(k_l, pos_l) * scale, or -inf when pos_l > qpos[t]
 *   softmax p = softmax(s) along l, in place
 *   values  out[t, hq] = sum_l p[hq * T + t][l] * v_l
 *
 * Key l runs over the quantized groups first (group i, token j: l = i * g + j), then the
 * full-precision tokens (l = G * g + n), as the reference orders them. With AVX-512, full-precision
 * tokens take the register path below (lc_scores_full, lc_values_full). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { LC_F32 = 0, LC_BF16 = 1, LC_F16 = 2 };
#define LC_MAX_D 256

typedef struct {
    int64_t T, Hq, Hkv, D;          /* query tokens, query heads, KV heads, head dim */
    int64_t threads;
    const float *q;                 /* [T, Hq, D] queries before RoPE, float32 */
    double scale;                   /* softmax scale */
    float *qr;                      /* [T, Hq, D] scratch: the queries rotated and scaled */
    const int64_t *q_pos;           /* [T] */
    /* quantized groups: G groups of g tokens, `bits` 4 or 8 */
    int64_t G, g, bits;
    const uint8_t *k_codes;         /* [G, Hkv, g, D * bits / 8] */
    const uint16_t *k_scale, *k_min;/* fp16 [G, Hkv, 1, D] (per channel over the group) */
    const uint8_t *v_codes;         /* [G, Hkv, g, D * bits / 8] */
    const uint16_t *v_scale, *v_min;/* fp16 [G, Hkv, g, D / g] (per token over g channels) */
    const int64_t *g_pos;           /* [G * g] in-cache positions */
    /* full-precision tokens, keys before RoPE */
    int64_t N, full_kind;           /* LC_F32, LC_BF16 or LC_F16 */
    const void *full_k, *full_v;    /* [N, Hkv, D] */
    const int64_t *full_pos;        /* [N] */
    const float *cos, *sin;         /* [positions, D / 2] float32 */
    float *scores;                  /* [Hq * T, L]: scores, then their softmax (the probabilities) */
    float *out;                     /* [T, Hq, D] float32 */
    int64_t failed;                 /* set when a thread's accumulator cannot be allocated */
} lc_args;

static inline float lc_f16(uint16_t h) {
#if defined(__FLT16_MAX__)
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) {  /* subnormal: normalise */
        exp = 113;
        while (!(man & 0x400)) { man <<= 1; exp--; }
        bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* n fp16 values to float32 */
static inline void lc_f16_row(const uint16_t *src, float *dst, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + i))));
#endif
    for (; i < n; i++) dst[i] = lc_f16(src[i]);
}

static inline float lc_bf16(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* one full-precision row of D values into x */
#define LC_INLINE static inline __attribute__((always_inline))

LC_INLINE void lc_full_row(const lc_args *a, const int64_t D, const void *base, int64_t n, int64_t h, float *x) {
    int64_t off = (n * a->Hkv + h) * D;
    if (a->full_kind == LC_F32) {
        memcpy(x, (const float *)base + off, D * sizeof(float));
    } else if (a->full_kind == LC_BF16) {
        const uint16_t *r = (const uint16_t *)base + off;
        for (int64_t d = 0; d < D; d++) x[d] = lc_bf16(r[d]);
    } else {
        const uint16_t *r = (const uint16_t *)base + off;
        for (int64_t d = 0; d < D; d++) x[d] = lc_f16(r[d]);
    }
}

#if defined(__AVX2__)
/* 32 packed bytes → their 64 4-bit codes in channel order, as two vectors of 32 bytes: split the
 * nibbles, interleave them per 128-bit lane, put the lanes in order */
LC_INLINE void lc_nibbles32(const uint8_t *row, __m256i codes[2]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    __m256i b = _mm256_loadu_si256((const __m256i *)row);
    __m256i lo = _mm256_and_si256(b, low4), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
    __m256i a = _mm256_unpacklo_epi8(lo, hi), c = _mm256_unpackhi_epi8(lo, hi);
    codes[0] = _mm256_permute2x128_si256(a, c, 0x20);
    codes[1] = _mm256_permute2x128_si256(a, c, 0x31);
}
#endif

/* one row of D codes as bytes in channel order (4-bit codes unpacked into `pairs`) */
LC_INLINE const uint8_t *lc_unpack(const uint8_t *restrict row, const int64_t D, int64_t bits, uint16_t *restrict pairs) {
    if (bits == 8) return row;
    uint8_t *w = (uint8_t *)pairs;
    int64_t i = 0;
#if defined(__AVX2__)
    for (; i + 32 <= D / 2; i += 32) {
        __m256i codes[2];
        lc_nibbles32(row + i, codes);
        _mm256_storeu_si256((__m256i *)(w + 2 * i), codes[0]);
        _mm256_storeu_si256((__m256i *)(w + 2 * i + 32), codes[1]);
    }
#endif
    for (; i < D / 2; i++) {
        w[2 * i] = row[i] & 0x0f;
        w[2 * i + 1] = row[i] >> 4;
    }
    return w;
}

/* a key row: x[d] = code[d] * scale[d] + min[d] (one scale and min per channel) */
LC_INLINE void lc_decode(const uint8_t *restrict row, const int64_t D, int64_t bits, const float *restrict scale,
                         const float *restrict min, float *restrict x) {
#if defined(__AVX512F__) && defined(__AVX2__)
    if (bits == 4 && D % 64 == 0) {  /* unpacked in registers, straight to float (no round trip through memory) */
        for (int64_t i = 0; i < D / 2; i += 32) {
            __m256i halves[2];
            lc_nibbles32(row + i, halves);
            for (int h = 0; h < 2; h++) {
                __m128i parts[2] = {_mm256_castsi256_si128(halves[h]), _mm256_extracti128_si256(halves[h], 1)};
                for (int q = 0; q < 2; q++) {
                    int64_t d = 2 * i + 32 * h + 16 * q;
                    __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[q]));
                    _mm512_storeu_ps(x + d, _mm512_fmadd_ps(codes, _mm512_loadu_ps(scale + d), _mm512_loadu_ps(min + d)));
                }
            }
        }
        return;
    }
#endif
    uint16_t pairs[LC_MAX_D / 2];
    const uint8_t *c = lc_unpack(row, D, bits, pairs);
#pragma omp simd
    for (int64_t d = 0; d < D; d++) x[d] = (float)c[d] * scale[d] + min[d];
}

/* a value row: one scale and min per `group` consecutive channels */
LC_INLINE void lc_decode_groups(const uint8_t *restrict row, const int64_t D, int64_t bits, int64_t group,
                                const float *restrict scale, const float *restrict min, float *restrict x) {
    uint16_t pairs[LC_MAX_D / 2];
    const uint8_t *c = lc_unpack(row, D, bits, pairs);
    for (int64_t cg = 0; cg < D / group; cg++) {
        float s = scale[cg], m = min[cg];
#pragma omp simd
        for (int64_t d = cg * group; d < (cg + 1) * group; d++) x[d] = (float)c[d] * s + m;
    }
}

/* exp(x) for x <= 0 by range reduction and a degree-7 polynomial (relative error ~1e-7), 0 for -inf;
 * written so the compiler vectorises it */
static inline float lc_exp(float x) {
    float y = x < -87.0f ? -87.0f : x;
    float n = __builtin_roundf(y * 1.44269504f);
    float r = y - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (0.166666672f + r * (0.0416666679f + r * (0.00833333377f
              + r * (0.00138888892f + r * 0.000198412701f))))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return x == -INFINITY ? 0.0f : p * two_n;
}

/* work units: (KV head, quantized group) then (KV head, block of LC_BLOCK full tokens) */
#define LC_BLOCK 16
#define LC_MAX_ROWS 256  /* rows a unit decodes at once: the group size, or LC_BLOCK */

static int64_t lc_units(const lc_args *a) {
    return a->Hkv * (a->G + (a->N + LC_BLOCK - 1) / LC_BLOCK);
}

typedef struct {
    int64_t h, first, rows;  /* KV head, first key index l, keys in the unit */
    const int64_t *pos;      /* their in-cache positions */
} lc_unit;

static lc_unit lc_unit_at(const lc_args *a, int64_t u) {
    int64_t h = u % a->Hkv, unit = u / a->Hkv;
    if (unit < a->G) return (lc_unit){h, unit * a->g, a->g, a->g_pos + unit * a->g};
    int64_t first = (unit - a->G) * LC_BLOCK, rows = a->N - first < LC_BLOCK ? a->N - first : LC_BLOCK;
    return (lc_unit){h, a->G * a->g + first, rows, a->full_pos + first};
}

/* the unit's keys (K) or values (V), decoded to float rows [rows][D] */
LC_INLINE void lc_load_rows(const lc_args *a, const int64_t D, lc_unit un, int values, float *restrict x) {
    int64_t unit = un.first / a->g, packed = D * a->bits / 8;
    if (un.first < a->G * a->g) {
        int64_t gh = unit * a->Hkv + un.h;
        const uint8_t *codes = (values ? a->v_codes : a->k_codes) + gh * a->g * packed;
        float sc[LC_MAX_D], mn[LC_MAX_D];
        if (!values) {  /* keys: one scale and min per channel for the whole group */
            lc_f16_row(a->k_scale + gh * D, sc, D);
            lc_f16_row(a->k_min + gh * D, mn, D);
        }
        for (int64_t j = 0; j < un.rows; j++) {
            if (values) {  /* values: per token, one scale and min per g channels */
                int64_t per = D / a->g;
                float s[LC_MAX_D], m[LC_MAX_D];
                lc_f16_row(a->v_scale + (gh * a->g + j) * per, s, per);
                lc_f16_row(a->v_min + (gh * a->g + j) * per, m, per);
                const uint8_t *row = codes + j * packed;
                if (a->g == 32) lc_decode_groups(row, D, a->bits, 32, s, m, x + j * D);  /* constant bounds */
                else lc_decode_groups(row, D, a->bits, a->g, s, m, x + j * D);
            } else {
                lc_decode(codes + j * packed, D, a->bits, sc, mn, x + j * D);
            }
        }
        return;
    }
    int64_t first = un.first - a->G * a->g;
    for (int64_t j = 0; j < un.rows; j++) lc_full_row(a, D, values ? a->full_v : a->full_k, first + j, un.h, x + j * D);
}

#if defined(__AVX512F__)
/* The full-precision tokens' fast path, for head dims that are a multiple of 32 up to 128: a row
 * is loaded straight into D/16 vector registers (converted from bf16 or fp16 there), rotated
 * there and dotted with each query of its head group; value rows are summed into registers for
 * up to 4 queries at a time (2 for D = 128). Same results as the generic loops up to float
 * rounding: the sums are taken in another order. */
#define LC_FAST_MAX_C 8  /* vector registers per row: D/16 for D <= 128 */

LC_INLINE void lc_full_vec(const void *base, int64_t off, const int64_t C, const int kind, __m512 *x) {
    for (int64_t c = 0; c < C; c++) {
        if (kind == LC_F32) {
            x[c] = _mm512_loadu_ps((const float *)base + off + 16 * c);
        } else {
            __m256i r = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + off + 16 * c));
            x[c] = kind == LC_BF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16))
                                   : _mm512_cvtph_ps(r);
        }
    }
}

/* start loading the same head's row LC_AHEAD rows on (the unit after next), so that it has arrived
 * from memory when its turn comes: the hardware prefetcher alone leaves the step waiting on it */
#define LC_AHEAD 32
LC_INLINE void lc_prefetch_row(const lc_args *a, const void *base, int64_t n, int64_t h, const int64_t D,
                               const int kind) {
    if (n >= a->N) return;
    const int64_t bytes = D * (kind == LC_F32 ? 4 : 2);
    const char *row = (const char *)base + (n * a->Hkv + h) * bytes;
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
}

LC_INLINE void lc_scores_full_k(const lc_args *a, const int64_t D, lc_unit un, int64_t last, const int kind) {
    const int64_t C = D / 16, HC = C / 2, half = D / 2, rep = a->Hq / a->Hkv, L = a->G * a->g + a->N;
    const int64_t n0 = un.first - a->G * a->g;
    for (int64_t j = 0; j < un.rows; j++) {
        __m512 x[LC_FAST_MAX_C];
        lc_full_vec(a->full_k, ((n0 + j) * a->Hkv + un.h) * D, C, kind, x);
        lc_prefetch_row(a, a->full_k, n0 + j + LC_AHEAD, un.h, D, kind);
        int64_t pos = un.pos[j] <= last ? un.pos[j] : 0;
        const float *cs = a->cos + pos * half, *sn = a->sin + pos * half;
        for (int64_t c = 0; c < HC; c++) {
            __m512 co = _mm512_loadu_ps(cs + 16 * c), si = _mm512_loadu_ps(sn + 16 * c), x1 = x[c], x2 = x[c + HC];
            x[c] = _mm512_fmsub_ps(x1, co, _mm512_mul_ps(x2, si));
            x[c + HC] = _mm512_fmadd_ps(x2, co, _mm512_mul_ps(x1, si));
        }
        for (int64_t t = 0; t < a->T; t++) {
            int visible = un.pos[j] <= a->q_pos[t];
            for (int64_t r = 0; r < rep; r++) {
                int64_t hq = un.h * rep + r;
                const float *qv = a->qr + (t * a->Hq + hq) * D;
                __m512 acc = _mm512_mul_ps(x[0], _mm512_loadu_ps(qv));
                for (int64_t c = 1; c < C; c++) acc = _mm512_fmadd_ps(x[c], _mm512_loadu_ps(qv + 16 * c), acc);
                a->scores[(hq * a->T + t) * L + un.first + j] = visible ? _mm512_reduce_add_ps(acc) : -INFINITY;
            }
        }
    }
}

/* queries q0 .. q0 + NQ - 1 of the unit's head group (query i: head un.h * rep + i % rep, token i / rep) */
LC_INLINE void lc_values_full_q(const lc_args *a, const int64_t D, lc_unit un, float *restrict acc, const int kind,
                                int64_t q0, const int64_t NQ) {
    const int64_t C = D / 16, rep = a->Hq / a->Hkv, L = a->G * a->g + a->N, n0 = un.first - a->G * a->g;
    __m512 o[4][LC_FAST_MAX_C];
    const float *p[4];
    for (int64_t i = 0; i < NQ; i++) {
        int64_t qi = q0 + i, hq = un.h * rep + qi % rep, t = qi / rep;
        p[i] = a->scores + (hq * a->T + t) * L + un.first;
        for (int64_t c = 0; c < C; c++) o[i][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < un.rows; j++) {
        __m512 x[LC_FAST_MAX_C];
        lc_full_vec(a->full_v, ((n0 + j) * a->Hkv + un.h) * D, C, kind, x);
        lc_prefetch_row(a, a->full_v, n0 + j + LC_AHEAD, un.h, D, kind);
        for (int64_t i = 0; i < NQ; i++) {
            __m512 w = _mm512_set1_ps(p[i][j]);
            for (int64_t c = 0; c < C; c++) o[i][c] = _mm512_fmadd_ps(w, x[c], o[i][c]);
        }
    }
    for (int64_t i = 0; i < NQ; i++) {
        int64_t qi = q0 + i, hq = un.h * rep + qi % rep, t = qi / rep;
        float *dst = acc + (t * a->Hq + hq) * D;
        for (int64_t c = 0; c < C; c++) _mm512_storeu_ps(dst + 16 * c, _mm512_add_ps(_mm512_loadu_ps(dst + 16 * c), o[i][c]));
    }
}

LC_INLINE void lc_values_full_k(const lc_args *a, const int64_t D, lc_unit un, float *restrict acc, const int kind) {
    const int64_t n_q = a->Hq / a->Hkv * a->T, per = D <= 64 ? 4 : 2;  /* accumulators that fit the registers */
    for (int64_t q0 = 0; q0 < n_q; q0 += per) {
        switch (n_q - q0 < per ? n_q - q0 : per) {
        case 4: lc_values_full_q(a, D, un, acc, kind, q0, 4); break;
        case 3: lc_values_full_q(a, D, un, acc, kind, q0, 3); break;
        case 2: lc_values_full_q(a, D, un, acc, kind, q0, 2); break;
        default: lc_values_full_q(a, D, un, acc, kind, q0, 1);
        }
    }
}

/* whether a unit takes the fast path */
LC_INLINE int lc_fast(const lc_args *a, const int64_t D, lc_unit un) {
    return D % 32 == 0 && D <= 16 * LC_FAST_MAX_C && un.first >= a->G * a->g;
}

LC_INLINE void lc_scores_full(const lc_args *a, const int64_t D, lc_unit un, int64_t last) {
    switch (a->full_kind) {
    case LC_F32: lc_scores_full_k(a, D, un, last, LC_F32); break;
    case LC_BF16: lc_scores_full_k(a, D, un, last, LC_BF16); break;
    default: lc_scores_full_k(a, D, un, last, LC_F16);
    }
}

LC_INLINE void lc_values_full(const lc_args *a, const int64_t D, lc_unit un, float *restrict acc) {
    switch (a->full_kind) {
    case LC_F32: lc_values_full_k(a, D, un, acc, LC_F32); break;
    case LC_BF16: lc_values_full_k(a, D, un, acc, LC_BF16); break;
    default: lc_values_full_k(a, D, un, acc, LC_F16);
    }
}
#endif

LC_INLINE void lc_scores_d(const lc_args *a, const int64_t D) {
    int64_t L = a->G * a->g + a->N, rep = a->Hq / a->Hkv, half = D / 2, n_units = lc_units(a), last = 0;
    for (int64_t t = 0; t < a->T; t++) last = a->q_pos[t] > last ? a->q_pos[t] : last;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < n_units; u++) {
        float k[LC_MAX_ROWS * LC_MAX_D];
        lc_unit un = lc_unit_at(a, u);
#if defined(__AVX512F__)
        if (lc_fast(a, D, un)) {
            lc_scores_full(a, D, un, last);
            continue;
        }
#endif
        lc_load_rows(a, D, un, 0, k);
        for (int64_t j = 0; j < un.rows; j++) {  /* rotate each key at its position (keys past every query: none) */
            int64_t pos = un.pos[j] <= last ? un.pos[j] : 0;
            const float *c = a->cos + pos * half, *s = a->sin + pos * half;
            float *x = k + j * D;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] - x2 * s[i];
                x[i + half] = x2 * c[i] + x1 * s[i];
            }
        }
        for (int64_t t = 0; t < a->T; t++) {
            for (int64_t r = 0; r < rep; r++) {
                int64_t hq = un.h * rep + r;
                const float *qv = a->qr + (t * a->Hq + hq) * D;
                float *row = a->scores + (hq * a->T + t) * L + un.first;
                for (int64_t j = 0; j < un.rows; j++) {
                    const float *x = k + j * D;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t d = 0; d < D; d++) acc += qv[d] * x[d];
                    row[j] = un.pos[j] <= a->q_pos[t] ? acc : -INFINITY;
                }
            }
        }
    }
}

/* probabilities from scores, row by row (each row has a visible key: the query's own) */
static void lc_softmax(const lc_args *a) {
    int64_t L = a->G * a->g + a->N;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < a->Hq * a->T; r++) {
        float *row = a->scores + r * L, top = -INFINITY, sum = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t l = 0; l < L; l++) top = row[l] > top ? row[l] : top;
#pragma omp simd reduction(+ : sum)
        for (int64_t l = 0; l < L; l++) {
            row[l] = lc_exp(row[l] - top);
            sum += row[l];
        }
        float inv = 1.0f / sum;
#pragma omp simd
        for (int64_t l = 0; l < L; l++) row[l] *= inv;
    }
}

/* out += probabilities x values, into this thread's `acc` (reduced by the caller). The unit's values
 * are decoded into `v`, then each query of the head group sums them with its probabilities in
 * registers (LC_Q queries at a time). */
#define LC_Q 4
LC_INLINE void lc_values_d(const lc_args *a, const int64_t D, float *restrict acc) {
    int64_t L = a->G * a->g + a->N, rep = a->Hq / a->Hkv, n_units = lc_units(a), n_q = rep * a->T;
#pragma omp for schedule(static)
    for (int64_t u = 0; u < n_units; u++) {
        float v[LC_MAX_ROWS * LC_MAX_D];
        if (!acc) continue;
        lc_unit un = lc_unit_at(a, u);
#if defined(__AVX512F__)
        if (lc_fast(a, D, un)) {
            lc_values_full(a, D, un, acc);
            continue;
        }
#endif
        lc_load_rows(a, D, un, 1, v);
        for (int64_t q0 = 0; q0 < n_q; q0 += LC_Q) {  /* query i: head un.h * rep + i % rep, token i / rep */
            int64_t nq = n_q - q0 < LC_Q ? n_q - q0 : LC_Q;
            const float *p[LC_Q];
            float o[LC_Q][LC_MAX_D];
            for (int64_t i = 0; i < LC_Q; i++) {
                int64_t qi = q0 + (i < nq ? i : 0), hq = un.h * rep + qi % rep, t = qi / rep;
                p[i] = a->scores + (hq * a->T + t) * L + un.first;
                for (int64_t d = 0; d < D; d++) o[i][d] = 0.0f;
            }
            for (int64_t j = 0; j < un.rows; j++) {
                const float *x = v + j * D;
                float p0 = p[0][j], p1 = p[1][j], p2 = p[2][j], p3 = p[3][j];
#pragma omp simd
                for (int64_t d = 0; d < D; d++) {
                    o[0][d] += p0 * x[d];
                    o[1][d] += p1 * x[d];
                    o[2][d] += p2 * x[d];
                    o[3][d] += p3 * x[d];
                }
            }
            for (int64_t i = 0; i < nq; i++) {
                int64_t qi = q0 + i, hq = un.h * rep + qi % rep, t = qi / rep;
                float *dst = acc + (t * a->Hq + hq) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; d++) dst[d] += o[i][d];
            }
        }
    }
}

/* the queries rotated at their positions and scaled, into qr */
static void lc_rotate_queries(lc_args *a) {
    int64_t D = a->D, half = D / 2;
    for (int64_t t = 0; t < a->T; t++) {
        const float *c = a->cos + a->q_pos[t] * half, *s = a->sin + a->q_pos[t] * half;
        for (int64_t hq = 0; hq < a->Hq; hq++) {
            const float *x = a->q + (t * a->Hq + hq) * D;
            float *y = a->qr + (t * a->Hq + hq) * D, scale = (float)a->scale;
            for (int64_t i = 0; i < half; i++) {
                y[i] = (x[i] * c[i] - x[i + half] * s[i]) * scale;
                y[i + half] = (x[i + half] * c[i] + x[i] * s[i]) * scale;
            }
        }
    }
}

/* The threads' partial sums are added in thread order, each thread summing a slice of the output
 * (not in whichever order threads finish): the same call gives the same bits however busy the
 * machine is. */
LC_INLINE void lc_attend_d(lc_args *a, const int64_t D) {
    int64_t n_out = a->T * a->Hq * D;
    lc_rotate_queries(a);
    float **accs = calloc(a->threads > 0 ? a->threads : 1, sizeof(float *));
    if (!accs) {
        a->failed = 1;
        return;
    }
#pragma omp parallel num_threads(a->threads)
    {
        int me = omp_get_thread_num(), team = omp_get_num_threads();
        lc_scores_d(a, D);
        lc_softmax(a);
        float *acc = calloc(n_out, sizeof(float));
        if (!acc) {
#pragma omp atomic write
            a->failed = 1;
        }
        lc_values_d(a, D, acc);
        accs[me] = acc;
#pragma omp barrier
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_out; i++) {
            float sum = 0.0f;
            for (int t = 0; t < team; t++)
                if (accs[t]) sum += accs[t][i];
            a->out[i] = sum;
        }
        free(acc);
    }
    free(accs);
}

/* the entry point; the common head dims get their own compiled copy (constant loop bounds) */
void lc_attend(lc_args *a) {
    switch (a->D) {
    case 64: lc_attend_d(a, 64); break;
    case 128: lc_attend_d(a, 128); break;
    default: lc_attend_d(a, a->D);
    }
}
