/* Fused CPU epilogues of the portable kernels (moe-ep's own code; built by cpu_fused.py).
 *
 * Each function computes, element for element, the same sequence of fp32 operations as the
 * eager torch code it replaces (moe_ep/backends/portable/experts.py `_swiglu`, comm.py
 * `combine`), in one pass over memory instead of one pass per eager op. Built with
 * -ffp-contract=off so that no multiply-add is fused and every product and sum rounds as
 * the eager ops do. Rows are split over `threads` OpenMP threads (built with -fopenmp, the
 * process's libgomp is torch's own, so the pool is shared; without OpenMP it runs serially);
 * every row is computed alone, so the split never changes a bit. The one exception is exp() inside silu: a polynomial of our own (about
 * 1 ulp in fp32), where ATen uses SLEEF; the bf16 result differs from eager in rare last
 * bits (the tests bound it). The loops are plain C that the compiler vectorizes; with
 * AVX-512 (F + BF16) each row's 16-wide body is written out with intrinsics instead,
 * the same operations lane for lane, so both give the same bits (tested element by
 * element) and machines with and without AVX-512 agree.
 */
#include <stdint.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MOE_EP_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOE_EP_AVX2 1
#endif

typedef union {
    float f;
    uint32_t u;
    int32_t i;
} bits32;

static inline float bf16_to_f32(uint16_t b) {
    bits32 v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

/* Round to nearest even, NaN stays NaN (quietened), as torch's float -> bfloat16 cast. */
static inline uint16_t f32_to_bf16(float f) {
    bits32 v;
    v.f = f;
    uint32_t rounded = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16;
    uint32_t quiet_nan = (v.u >> 16) | 0x40u;
    return (uint16_t)(((v.u & 0x7fffffffu) > 0x7f800000u) ? quiet_nan : rounded);
}

/* exp(x) in fp32: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial
 * (Cephes expf coefficients), times 2^(n-1) built in the exponent bits, times 2 (so that
 * n = 128 still has a normal scale). Overflows to +inf above 88.72 like expf; below -86 it
 * returns about exp(-86) instead of a smaller value, which makes no difference to the only
 * use, 1 + exp(x). NaN propagates. */
#define EXP_SCALAR(v) (v)
/* r = c - n ln2 in two steps (ln2's high part exact in n * ln2_hi), then exp(r) - 1 - r's
 * polynomial p by Horner, in the fma and constants of the caller's width (FMA, C). */
#define EXP_REDUCE_HORNER(FMA, C, n, c, r, p)                                                   \
    do {                                                                                       \
        r = FMA(n, C(-0.693145751953125f), c);                                                 \
        r = FMA(n, C(-1.428606765330187045e-06f), r);                                          \
        p = C(1.9875691500e-4f);                                                               \
        p = FMA(p, r, C(1.3981999507e-3f));                                                    \
        p = FMA(p, r, C(8.3334519073e-3f));                                                    \
        p = FMA(p, r, C(4.1665795894e-2f));                                                    \
        p = FMA(p, r, C(1.6666665459e-1f));                                                    \
        p = FMA(p, r, C(5.0000001201e-1f));                                                    \
    } while (0)

static inline float exp_f32(float x) {
    float c = x < -86.0f ? -86.0f : x;
    c = c > 88.72283935546875f ? 88.72283935546875f : c;
    c = c == c ? c : 0.0f;
    float n = __builtin_fmaf(c, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
    float r, p;
    EXP_REDUCE_HORNER(__builtin_fmaf, EXP_SCALAR, n, c, r, p);
    p = __builtin_fmaf(p, r * r, r) + 1.0f;
    bits32 scale;
    scale.i = ((int32_t)n + 126) << 23;
    float e = (p * scale.f) * 2.0f;
    e = x > 88.72283935546875f ? __builtin_inff() : e;
    return x == x ? e : x;
}

/* silu of every bf16 value (indexed by its bits), by the scalar formula: silu of a bf16 g
 * is one load instead of an exp and a division (1.3-1.6x faster SwiGLU, same bits). Filled
 * when the library is loaded (65536 formula evaluations, well under a millisecond). */
static float silu_of_bf16[65536];

__attribute__((constructor)) static void fill_silu_of_bf16(void) {
    for (uint32_t b = 0; b < 65536; b++) {
        float x = bf16_to_f32((uint16_t)b);
        silu_of_bf16[b] = x / (1.0f + exp_f32(-x));
    }
}

#ifdef MOE_EP_AVX512
/* AVX-512 twins of the scalar helpers above, lane for lane the same bits (the tests compare
 * every element of the vector body with the scalar loop). Written out because the compiler's
 * own vectorization of the scalar code ran 1.5x slower: it cannot use vscalefps for the
 * 2^n scaling (no clamps or exponent arithmetic needed) nor vcvtneps2bf16 for the rounding. */
static inline __m512 bf16x16_to_f32(const uint16_t *p) {
    __m256i v = _mm256_loadu_si256((const __m256i *)p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

/* vcvtneps2bf16 rounds to nearest even and quietens NaN as f32_to_bf16 does, but flushes
 * subnormal inputs to zero: a vector holding one takes the exact integer path instead. */
static inline __m256i f32x16_to_bf16(__m512 v) {
    __m512 a = _mm512_abs_ps(v);
    __mmask16 sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(1.17549435e-38f), _CMP_LT_OQ) &
                    _mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    if (__builtin_expect(sub == 0, 1)) return (__m256i)_mm512_cvtneps_pbh(v);
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    return _mm512_cvtepi32_epi16(rounded); /* subnormals and zeros only: no NaN here */
}

/* exp_f32 on 16 lanes. Clamping to [-104, 89] keeps n small (exact rounding) and still
 * gives 0 below (the scalar code's exp(-86) is as invisible in 1 + exp) and inf above
 * 88.72 (p * 2^128 overflows for every p there), as expf; NaN needs no care: silu divides
 * x itself, which carries it. p * 2^n by vscalefps equals the scalar (p * 2^(n-1)) * 2
 * for every normal result. */
static inline __m512 exp_f32x16(__m512 x) {
    __m512 c = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(c, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r, p;
    EXP_REDUCE_HORNER(_mm512_fmadd_ps, _mm512_set1_ps, n, c, r, p);
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The first inter - inter % 16 outputs of one row of moe_ep_swiglu_bf16; returns how many.
 * `scaled` (alpha and clamp applied) is a constant at each call, so each variant compiles
 * to its own loop. */
static inline __attribute__((always_inline)) int64_t swiglu_row_avx512(
    const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t inter, int32_t scaled,
    float alpha, float clamp) {
    const __m512 a = _mm512_set1_ps(alpha), hi = _mm512_set1_ps(clamp);
    const __m512 lo = _mm512_set1_ps(-clamp), one = _mm512_set1_ps(1.0f);
    int64_t j = 0;
    for (; j + 16 <= inter; j += 16) {
        __m512 x = bf16x16_to_f32(g + j), y = bf16x16_to_f32(u + j);
        __m512 s;
        if (scaled) { /* min / max return their second operand if either is NaN: NaN stays */
            x = _mm512_min_ps(hi, _mm512_mul_ps(x, a));
            y = _mm512_max_ps(lo, _mm512_min_ps(hi, _mm512_mul_ps(y, a)));
            __m512 e = exp_f32x16(_mm512_sub_ps(_mm512_setzero_ps(), x));
            s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        } else {
            __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(g + j)));
            s = _mm512_i32gather_ps(bits, silu_of_bf16, 4);
        }
        _mm256_storeu_si256((__m256i *)(out + j), f32x16_to_bf16(_mm512_mul_ps(s, y)));
    }
    return j;
}
#endif

#ifdef MOE_EP_AVX2
/* f32_to_bf16 on 8 lanes, packed into 8 uint16: the same rounding. Its NaN rule is left out:
 * a NaN made from bf16 operands (and alpha) has a zero low half, which the rounding keeps as
 * the same quiet NaN. */
static inline __m128i f32x8_to_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* exp_f32 on 8 lanes, operation for operation the same (the same bits). */
static inline __m256 exp_f32x8(__m256 x) {
    __m256 c = _mm256_blendv_ps(x, _mm256_set1_ps(-86.0f),
                                _mm256_cmp_ps(x, _mm256_set1_ps(-86.0f), _CMP_LT_OQ));
    const __m256 top = _mm256_set1_ps(88.72283935546875f), magic = _mm256_set1_ps(12582912.0f);
    c = _mm256_blendv_ps(c, top, _mm256_cmp_ps(c, top, _CMP_GT_OQ));
    c = _mm256_and_ps(c, _mm256_cmp_ps(c, c, _CMP_ORD_Q)); /* NaN -> 0 */
    const __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(c, _mm256_set1_ps(1.44269504088896341f), magic),
                                   magic);
    __m256 r, p;
    EXP_REDUCE_HORNER(_mm256_fmadd_ps, _mm256_set1_ps, n, c, r, p);
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256 scale = _mm256_castsi256_ps(_mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(126)), 23));
    __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, scale), _mm256_set1_ps(2.0f));
    e = _mm256_blendv_ps(e, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, top, _CMP_GT_OQ));
    return _mm256_blendv_ps(e, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

static inline __m256 bf16x8_to_f32(const uint16_t *p) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* The first inter - inter % 8 outputs of one row of moe_ep_swiglu_bf16 from `j` on, the
 * scalar loops' operations on 8 lanes; returns where it stopped. Without alpha and clamp
 * (`scaled` 0, a constant at each call) silu(g) is looked up in the table. */
static inline __attribute__((always_inline)) int64_t swiglu_row_avx2(
    const uint16_t *g, const uint16_t *u, uint16_t *out, int64_t j, int64_t inter,
    int32_t scaled, float alpha, float clamp) {
    const __m256 a = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(clamp);
    const __m256 lo = _mm256_set1_ps(-clamp), sign = _mm256_set1_ps(-0.0f);
    for (; j + 8 <= inter; j += 8) {
        __m256 y = bf16x8_to_f32(u + j), s;
        if (scaled) { /* a compare with NaN is false: NaN stays, as in the scalar loop */
            __m256 x = _mm256_mul_ps(bf16x8_to_f32(g + j), a);
            y = _mm256_mul_ps(y, a);
            x = _mm256_blendv_ps(x, hi, _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
            y = _mm256_blendv_ps(y, hi, _mm256_cmp_ps(y, hi, _CMP_GT_OQ));
            y = _mm256_blendv_ps(y, lo, _mm256_cmp_ps(y, lo, _CMP_LT_OQ));
            const __m256 e = exp_f32x8(_mm256_xor_ps(x, sign));
            s = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
        } else {
            const __m256i bits =
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(g + j)));
            s = _mm256_i32gather_ps(silu_of_bf16, bits, 4);
        }
        _mm_storeu_si128((__m128i *)(out + j), f32x8_to_bf16(_mm256_mul_ps(s, y)));
    }
    return j;
}
#endif

/* h[i, :] = bf16(silu(g) * u) for the rows of gu = [g | u] (each `inter` wide), in fp32:
 * with has_alpha, g and u are first multiplied by alpha; with has_clamp, g <= clamp and
 * -clamp <= u <= clamp. silu(x) = x / (1 + exp(-x)). Row strides in elements. */
void moe_ep_swiglu_bf16(const uint16_t *gu, int64_t ld_gu, uint16_t *h, int64_t ld_h,
                        int64_t rows, int64_t inter, int32_t has_alpha, float alpha,
                        int32_t has_clamp, float clamp, int32_t threads) {
    alpha = has_alpha ? alpha : 1.0f;
    clamp = has_clamp ? clamp : __builtin_inff();
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *restrict g = gu + i * ld_gu;
        const uint16_t *restrict u = g + inter;
        uint16_t *restrict out = h + i * ld_h;
        int64_t j0 = 0; /* where the scalar loops start: after the vector body, if any */
#ifdef MOE_EP_AVX512
        j0 = has_alpha || has_clamp ? swiglu_row_avx512(g, u, out, inter, 1, alpha, clamp)
                                    : swiglu_row_avx512(g, u, out, inter, 0, alpha, clamp);
#endif
#ifdef MOE_EP_AVX2
        j0 = has_alpha || has_clamp ? swiglu_row_avx2(g, u, out, j0, inter, 1, alpha, clamp)
                                    : swiglu_row_avx2(g, u, out, j0, inter, 0, alpha, clamp);
#endif
        if (!has_alpha && !has_clamp) {
            for (int64_t j = j0; j < inter; j++) {
                float x = bf16_to_f32(g[j]);
                float s = x / (1.0f + exp_f32(-x));
                out[j] = f32_to_bf16(s * bf16_to_f32(u[j]));
            }
            continue;
        }
        for (int64_t j = j0; j < inter; j++) {
            /* alpha = 1 and clamp = inf when not given: both exact no-ops (NaN stays NaN),
             * so one branch-free loop serves every variant. */
            float x = bf16_to_f32(g[j]) * alpha;
            float y = bf16_to_f32(u[j]) * alpha;
            x = x > clamp ? clamp : x;
            y = y > clamp ? clamp : y;
            y = y < -clamp ? -clamp : y;
            float s = x / (1.0f + exp_f32(-x));
            out[j] = f32_to_bf16(s * y);
        }
    }
}

#define COMBINE_CHUNK 512

#ifdef MOE_EP_AVX512
/* The first hidden - hidden % 16 columns of one output row of moe_ep_combine_bf16, the sum
 * kept in a register across the slots (the scalar loop below keeps it in memory); returns
 * how many. Same operations in the same order: one product and one sum rounding per term. */
static int64_t combine_row_avx512(const uint16_t *y, int64_t ld_y, const int64_t *p,
                                  const float *wt, uint16_t *o, int64_t k, int64_t hidden) {
    const __m512 zero = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= hidden; c += 16) {
        __m512 acc = p[0] < 0 ? zero
                              : _mm512_mul_ps(bf16x16_to_f32(y + p[0] * ld_y + c),
                                              _mm512_set1_ps(wt[0]));
        for (int64_t j = 1; j < k; j++) {
            __m512 term = p[j] < 0 ? zero
                                   : _mm512_mul_ps(bf16x16_to_f32(y + p[j] * ld_y + c),
                                                   _mm512_set1_ps(wt[j]));
            acc = _mm512_add_ps(acc, term);
        }
        _mm256_storeu_si256((__m256i *)(o + c), f32x16_to_bf16(acc));
    }
    return c;
}
#endif

#define COMBINE_CHUNK 512

/* out[t, :] = bf16(sum over slots j in order of term_j) in fp32, term_j = float(y[pos[t, j],
 * :]) * w[t, j] (one rounding), or +0 for a padded slot (pos[t, j] < 0: no row is read, so
 * another token's inf / NaN cannot leak in); ((term_0 + term_1) + term_2) + ..., then RNE.
 * pos [n, k] int64 and w [n, k] fp32 are contiguous; y and out rows have strides ld_y,
 * ld_out (elements). */
void moe_ep_combine_bf16(const uint16_t *y, int64_t ld_y, const int64_t *pos, const float *w,
                         uint16_t *out, int64_t ld_out, int64_t n, int64_t k, int64_t hidden,
                         int32_t threads) {
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t t = 0; t < n; t++) {
        float acc[COMBINE_CHUNK];
        const int64_t *p = pos + t * k;
        const float *wt = w + t * k;
        uint16_t *restrict o = out + t * ld_out;
        int64_t first = 0; /* where the scalar loop starts: after the vector body, if any */
#ifdef MOE_EP_AVX512
        first = combine_row_avx512(y, ld_y, p, wt, o, k, hidden);
#endif
        for (int64_t c0 = first; c0 < hidden; c0 += COMBINE_CHUNK) {
            int64_t m = hidden - c0 < COMBINE_CHUNK ? hidden - c0 : COMBINE_CHUNK;
            for (int64_t j = 0; j < k; j++) {
                const uint16_t *restrict r = y + (p[j] < 0 ? 0 : p[j] * ld_y) + c0;
                float wj = wt[j];
                if (p[j] < 0) {
                    for (int64_t c = 0; c < m; c++) acc[c] = j == 0 ? 0.0f : acc[c] + 0.0f;
                } else if (j == 0) {
                    for (int64_t c = 0; c < m; c++) acc[c] = bf16_to_f32(r[c]) * wj;
                } else {
                    for (int64_t c = 0; c < m; c++) acc[c] = acc[c] + bf16_to_f32(r[c]) * wj;
                }
            }
            for (int64_t c = 0; c < m; c++) o[c0 + c] = f32_to_bf16(acc[c]);
        }
    }
}

/* The calling thread's OpenMP thread count (torch's libgomp when built with -fopenmp):
 * -1 without OpenMP. */
int32_t moe_ep_omp_max_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return -1;
#endif
}

/* Set the calling thread's OpenMP thread count (its own ICV only; other threads keep
 * theirs). No-op without OpenMP. */
void moe_ep_omp_set_threads(int32_t n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

/* ---------------------------------------------------------------------------------------
 * Expert GEMM for few rows per expert: out[q, j] = sum_k x[q, k] * w_e[j, k] for the rows q
 * of each group (one local expert e), reading each weight element once per block of up to
 * EG_ROWS rows, in its stored width (bf16, or e4m3 / e2m1 codes with their block scales,
 * dequantized in registers as code * scale: the recipes' dequantize, one fp32 product).
 *
 * The sum has one fixed order, whatever the SIMD width, thread count or tiling: 16 fp32
 * accumulators per output, lane l taking the elements k = 16c + p(l) of every 16-chunk c in
 * increasing c, each by one fused multiply-add (fmaf: one rounding), starting at +0, where
 * p(l) = 2l for l < 8 and 2(l - 8) + 1 above (even elements, then odd: the order in which a
 * bf16 pair or a byte of two e2m1 codes splits without shuffles); K is padded to a multiple
 * of 16 with x = w = 0 (fmaf(0, 0, a) = a + 0); then t_j = a_j + a_{j+8}, u_j = t_j + t_{j+4},
 * v_j = u_j + u_{j+2}, sum = v_0 + v_1; then times alpha (when given, one product) and
 * rounded to bf16 (RNE) or stored as fp32. The AVX-512F body, the AVX2 body and the scalar
 * twin compute exactly this (tests compare them bit for bit and with a float64 emulation of
 * the definition).
 *
 * Work: each group's rows in blocks of EG_ROWS, each block's outputs in tiles of EG_COLS
 * columns; the (group, block, tile) items go to the OpenMP threads dynamically. Within an
 * item, EG_SUB rows at a time (the tile's weights stay in L2 after the first), EG_NR weight
 * rows at a time, EG_KC elements of K at a time, the register-blocked micro-kernel (EG_MR
 * rows x EG_NR weight rows, 2 x 8 lanes each: 12 ymm accumulators; AVX-512F: EG_MR512 x
 * EG_NR512, one zmm each, bf16 K blocks of EG_KC512) runs over every EG_MR rows: bf16
 * weights straight from where they are stored (a shift or a mask per 8 lanes), the
 * quantized ones (and bf16's K tail) decoded once per K block into an L1 buffer of fp32;
 * the AVX-512F body decodes quantized codes in registers instead, whole rows at a time, in
 * tiles of up to 4 rows x 4 weight rows or 8 x 2 (eg_rows_q512). The weights stream from
 * DRAM once per item and stay in L1 or L2 for the later row tiles.
 * Every output is one item's, so the split never changes a bit.
 */
enum { EG_X_BF16 = 0, EG_X_F32 = 1, EG_X_E4M3 = 2 }; /* E4M3: codes, the block-scaled AMX order */
enum { EG_W_BF16 = 0, EG_W_E4M3 = 1, EG_W_E2M1 = 2, EG_W_BF16_K16 = 3, EG_W_E4M3_K16 = 4 };
/* the K16 kinds: eg_item_k16 */
enum { EG_S_NONE = 0, EG_S_F32 = 1, EG_S_E8M0 = 2, EG_S_E4M3 = 3 };
enum { EG_OUT_BF16 = 0, EG_OUT_F32 = 1 };
int32_t moe_ep_vector_bodies(void);
/* moe_ep_expert_gemm_v2's vector: EG_BODY_AUTO is, for bf16 x and weights, the AMX body where
 * the CPU has AMX, else the dot body where it has AVX-512 BF16 (AVX2 for groups of few
 * rows); else AVX-512F but AVX2 for bf16 blocks of few rows. */
enum {
    EG_BODY_SCALAR = 0,
    EG_BODY_AVX2 = 1,
    EG_BODY_AVX512 = 2,
    EG_BODY_AUTO = 3,
    EG_BODY_BF16DOT = 4,        /* AVX-512 BF16 vdpbf16ps: bf16 x and w only, its own order */
    EG_BODY_BF16DOT_SCALAR = 5, /* its scalar twin */
    EG_BODY_KSEQ = 6,           /* AVX2 + FMA, rows in the lanes: bf16 x and w only, the k order */
    EG_BODY_KSEQ_SCALAR = 7,    /* its scalar twin */
    EG_BODY_AMX = 8,            /* AMX-BF16 tdpbf16ps: bf16 x and w only, its own order */
    EG_BODY_AMX_SCALAR = 9      /* its scalar twin */
};

#define EG_LANES 16
#define EG_KC 256       /* K elements of each weight row per block (multiple of 16) */
#define EG_NR 2         /* weight rows multiplied together */
#define EG_MR 3         /* activation rows multiplied together (12 accumulator registers) */
#define EG_MR512 4      /* the AVX-512 body's rows and weight rows (16 zmm accumulators) */
#define EG_NR512 4
#define EG_KC512 1024   /* the AVX-512 body's K block of bf16 weights read where stored */
/* EG_BODY_AUTO's choice: the AVX2 body for bf16 row blocks of at most this many rows
 * (measured 1 thread, 16 experts, N = K = 2048: 1-2 rows 3.6-3.9 ms AVX2 vs 4.3-4.9 ms
 * AVX-512; 4 rows 7.2 vs 5.5; the quantized decode is faster on AVX-512 at every count). */
#define EG_AVX2_ROWS 2
/* EG_BODY_AUTO takes EG_BODY_BF16DOT for bf16 x and bf16 weights where the CPU has it. */
#define EG_AUTO_BF16DOT 1
#define EG_NR_MAX 4     /* the most weight rows of any body's tile (EG_NR512) */
#define EG_COLS 32      /* output columns per work item (a multiple of every body's NR) */
#define EG_SUB 24       /* rows multiplied together (a multiple of every body's MR: x in L1) */
#define EG_ROWS 96      /* rows per work item (a multiple of EG_SUB) */

/* Rows and weight rows of a body's register tile (the scalar twin follows the AVX2 one). */
#define EG_HALF_ROWS 4 /* the AVX2 body's quantized row blocks of at least this many rows:
                         * half-lane tiles (eg_tile_avx2_half; measured, 1 thread, Zen 3:
                         * level at 3 rows, 1.07-1.33x faster at 4-24) */
#define EG_HMR 4 /* rows and weight rows of the half-lane tile (12 accumulators) */
#define EG_HNR 3
#define EG_BODY_AVX2_HALF 100 /* eg_rows' own: the AVX2 body in half-lane tiles */
static inline int64_t eg_mr(int32_t body) {
    return body == EG_BODY_AVX512 ? EG_MR512 : body == EG_BODY_AVX2_HALF ? EG_HMR : EG_MR;
}
static inline int64_t eg_nr(int32_t body) {
    return body == EG_BODY_AVX512 ? EG_NR512 : body == EG_BODY_AVX2_HALF ? EG_HNR : EG_NR;
}

static float e4m3_value[256]; /* e4m3fn byte -> fp32, exact; 0x7f / 0xff -> quiet NaN */
static const float e2m1_value[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

__attribute__((constructor(101))) static void fill_e4m3_value(void) {
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t e = (b >> 3) & 15u, m = b & 7u;
        bits32 v;
        if (e == 15 && m == 7) {
            v.u = 0x7fc00000u;
        } else if (e == 0) {
            v.f = (float)m * (1.0f / 512.0f); /* subnormal: m * 2^-9, exact */
            v.u |= (b & 0x80u) << 24;
        } else {
            v.u = ((b & 0x80u) << 24) | ((e + 120u) << 23) | (m << 20);
        }
        e4m3_value[b] = v.f;
    }
}

static inline float e8m0_value(uint8_t b) {
    bits32 v; /* as moe_ep.quant.e8m0_to_float32: 0 -> 2^-127 (subnormal), 255 -> NaN */
    v.u = b == 0 ? 0x00400000u : b == 255 ? 0x7fc00000u : (uint32_t)b << 23;
    return v.f;
}

/* ---- FC2-input requantization: quantize, then dequantize, in one pass (fake quant) ----
 * moe_ep.quant's rules, the same fp32 operations in the same order (the recipes'
 * `requantize`), per row of x and block of `block` elements along it; the values written
 * to out as fp32 or rounded to bf16 (f32_to_bf16). Non-finite blocks come out all NaN,
 * as there. */
#define FQ_NVFP4 0     /* e2m1, e4m3 scale per 16, norm_const (quantize_nvfp4) */
#define FQ_MXFP8 1     /* e4m3, E8M0 scale per 32, ceil rule (quantize_mxfp8) */
#define FQ_FP8_F32 2   /* e4m3, fp32 scale amax / 448 per block (quantize_fp8_blockwise) */
#define FQ_FP8_UE8M0 3 /* e4m3, power-of-two scale, ceil rule (scale_format="ue8m0") */
#define FQ_FP8_HYBRID 4 /* e4m3, fp32 scale max(amax * fp32(1/448), 1e-30) (mxfp4_hybrid) */

/* fp32 -> float8_e4m3fn byte, round to nearest even, as torch's cast (c10's
 * fp8e4m3fn_from_fp32_value: past 464 and NaN -> 0x7f, the sign kept). */
static inline uint8_t fq_e4m3(float f) {
    bits32 v;
    v.f = f;
    const uint32_t sign = v.u & 0x80000000u;
    uint32_t u = v.u ^ sign;
    uint8_t r;
    if (u >= 1087u << 20) {
        r = 0x7f;
    } else if (u < 121u << 23) { /* below 2^-6: e4m3's subnormals, rounded by an fp32 add */
        bits32 d, x;
        d.u = 141u << 23;
        x.u = u;
        x.f = x.f + d.f;
        r = (uint8_t)(x.u - d.u);
    } else {
        u += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + ((u >> 20) & 1u);
        r = (uint8_t)(u >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

/* amax |x| over n elements, NaN if any is NaN (torch's amax / amin propagate it), +0 for
 * zeros of either sign. */
static inline float fq_amax(const float *x, int64_t n) {
    float m = 0.0f;
    int nan = 0;
    for (int64_t i = 0; i < n; i++) {
        const float a = __builtin_fabsf(x[i]);
        nan |= a != a;
        m = a > m ? a : m;
    }
    return nan ? __builtin_nanf("") : m;
}

/* ceil(log2(amax / 448)) exactly (moe_ep.quant exact_ceil_log2_ratio), amax > 0 finite. */
static inline int32_t fq_ceil_exp(float amax) {
    int e;
    const float m = __builtin_frexpf(amax, &e);
    return e - 9 + (m > 0.875f);
}

#ifdef MOE_EP_AVX512
/* The fake quantization's element loops on 16 lanes, lane for lane the scalar ones' fp32
 * operations (the tests compare both with the eager recipes bit for bit). Each returns how
 * many elements it did (whole vectors); the scalar loop does the rest. */

/* fq_amax of n elements, n a multiple of 16. */
static inline float fq_amax16(const float *x, int64_t n) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (int64_t i = 0; i < n; i += 16) {
        const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
        nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, a);
    }
    return nan ? __builtin_nanf("") : _mm512_reduce_max_ps(m);
}

/* 16 fp32 values v at out + j as fp32, or rounded to bf16 as f32_to_bf16 (the 16 lie in one
 * block, NaN in all lanes or none: f32x16_to_bf16's path for subnormals meets no NaN). */
static inline void fq_put16(void *out, int32_t out_bf16, int64_t j, __m512 v) {
    if (out_bf16) _mm256_storeu_si256((__m256i *)((uint16_t *)out + j), f32x16_to_bf16(v));
    else _mm512_storeu_ps((float *)out + j, v);
}

/* fq_e4m3_block's elements: x / s (by_div) or x * s, clamped to +-448, rounded to e4m3 as
 * fq_e4m3 (normals: RNE at 3 mantissa bits in the fp32 bits; below 2^-6 the fp32 add of
 * 2^14), the value times deq. A NaN element has no case of its own: it makes the block's
 * amax NaN, so deq is NaN and every output of the block NaN, as in the scalar loop. */
static inline __m512i fq_e4m3_round16(const float *x, int by_div, __m512 sv) {
    const __m512 xv = _mm512_loadu_ps(x), big = _mm512_set1_ps(0x1p14f);
    __m512 v = by_div ? _mm512_div_ps(xv, sv) : _mm512_mul_ps(xv, sv);
    /* max(c, v) and min(c, v) return v where v is NaN, as the scalar compares */
    v = _mm512_min_ps(_mm512_set1_ps(448.0f), _mm512_max_ps(_mm512_set1_ps(-448.0f), v));
    const __m512i u = _mm512_castps_si512(v);
    const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u));
    const __m512i a = _mm512_xor_si512(u, sign);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
    __m512i r = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7ffff)), lsb),
        _mm512_set1_epi32((int)0xfff00000u));
    const __m512 sub = _mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), big), big);
    r = _mm512_mask_mov_epi32(r, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)),
                              _mm512_castps_si512(sub));
    return _mm512_or_si512(r, sign);
}

static inline int64_t fq_e4m3_x16(const float *x, int64_t n, int by_div, float s, float deq,
                                  void *out, int32_t out_bf16, int64_t j0) {
    const __m512 sv = _mm512_set1_ps(s), dq = _mm512_set1_ps(deq);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        fq_put16(out, out_bf16, j0 + i,
                 _mm512_mul_ps(_mm512_castsi512_ps(fq_e4m3_round16(x + i, by_div, sv)), dq));
    return i;
}

/* fq_e4m3_x16's elements as their e4m3fn bytes (fq_e4m3's): from the rounded value's fp32
 * bits, a normal's exponent and 3 mantissa bits rebiased, a value below 2^-6 (a multiple
 * of 2^-9) times 2^9, NaN 0x7f; the sign in bit 7. */
static inline int64_t fq_e4m3_codes_x16(const float *x, int64_t n, int by_div, float s,
                                        uint8_t *codes) {
    const __m512 sv = _mm512_set1_ps(s);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512i r = fq_e4m3_round16(x + i, by_div, sv);
        const __m512i a = _mm512_and_si512(r, _mm512_set1_epi32(0x7fffffff));
        __m512i c = _mm512_sub_epi32(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(120 << 3));
        c = _mm512_mask_mov_epi32(
            c, _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(121 << 23)),
            _mm512_cvttps_epi32(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f))));
        c = _mm512_mask_mov_epi32(c, _mm512_cmpgt_epu32_mask(a, _mm512_set1_epi32(0x7f800000)),
                                  _mm512_set1_epi32(0x7f));
        c = _mm512_or_si512(c, _mm512_srli_epi32(_mm512_xor_si512(r, a), 24));
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(c));
    }
    return i;
}

/* fq_nvfp4_block's elements: y = x * acc * 2^-6, |y| rounded to e2m1's step in its band
 * by an fp32 add and subtract, times 64, at most 6 (NaN: 6), y's sign, times sf. */
static inline int64_t fq_nvfp4_x16(const float *x, int64_t n, float acc, float sf, void *out,
                                   int32_t out_bf16, int64_t j0) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 y = _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), _mm512_set1_ps(acc)),
                                       _mm512_set1_ps(0x1p-6f));
        const __m512i u = _mm512_castps_si512(y);
        const __m512i sign = _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u));
        const __m512i a = _mm512_xor_si512(u, sign);
        __m512i band = _mm512_and_si512(a, _mm512_set1_epi32(0x7f800000));
        band = _mm512_min_epu32(_mm512_max_epu32(band, _mm512_set1_epi32(121 << 23)),
                                _mm512_set1_epi32(123 << 23));
        const __m512 c = _mm512_castsi512_ps(_mm512_add_epi32(band, _mm512_set1_epi32(22 << 23)));
        __m512 q = _mm512_mul_ps(_mm512_sub_ps(_mm512_add_ps(_mm512_castsi512_ps(a), c), c),
                                 _mm512_set1_ps(64.0f));
        q = _mm512_min_ps(q, _mm512_set1_ps(6.0f)); /* q < 6 ? q : 6: NaN gives 6 */
        q = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(q), sign));
        fq_put16(out, out_bf16, j0 + i, _mm512_mul_ps(q, _mm512_set1_ps(sf)));
    }
    return i;
}
#endif

/* A block's amax (fq_amax), on 16 lanes where the build and the block size allow. */
static inline float fq_block_amax(const float *x, int64_t n) {
#ifdef MOE_EP_AVX512
    if (n % 16 == 0) return fq_amax16(x, n);
#endif
    return fq_amax(x, n);
}

/* An e4m3 format's element before the cast: x / div (by_div) or x * mult, clamped to
 * +-448 (fq_e4m3_block's scalar loop). */
static inline float fq_e4m3_scaled(float x, int by_div, float div, float mult) {
    const float v = by_div ? x / div : x * mult;
    return v < -448.0f ? -448.0f : v > 448.0f ? 448.0f : v;
}

/* out[j] = v, as fp32 or rounded to bf16. */
static inline void fq_put(void *out, int32_t out_bf16, int64_t j, float v) {
    if (out_bf16) ((uint16_t *)out)[j] = f32_to_bf16(v);
    else ((float *)out)[j] = v;
}

/* One nvfp4 block (quantize_nvfp4, then dequantize_nvfp4 without the global scale), its
 * amax given. */
static inline void fq_nvfp4_block(const float *x, int64_t n, float amax, float nc, int has_nc,
                                  void *out, int32_t out_bf16, int64_t j0) {
    float bs = amax * (float)(1.0 / 6.0);
    if (has_nc) bs = bs * nc;
    bs = bs > 448.0f ? 448.0f : bs;
    if (!__builtin_isfinite(amax)) bs = __builtin_nanf("");
    const float sf = e4m3_value[fq_e4m3(bs)];
    float acc = 1.0f / sf;
    if (has_nc) acc = acc * nc;
    acc = acc > 3.40282347e38f ? 3.40282347e38f : acc;
    if (sf == 0.0f) acc = 0.0f;
    int64_t i0 = 0;
#ifdef MOE_EP_AVX512
    i0 = fq_nvfp4_x16(x, n, acc, sf, out, out_bf16, j0);
#endif
    for (int64_t i = i0; i < n; i++) {
        const float y = x[i] * acc * 0x1p-6f; /* two roundings, as there */
        bits32 mag, c;
        mag.f = __builtin_fabsf(y);
        uint32_t band = mag.u & 0x7f800000u; /* e2m1's bands [1, 2), [2, 4), [4, 8), x 2^-6 */
        band = band < 121u << 23 ? 121u << 23 : band > 123u << 23 ? 123u << 23 : band;
        c.u = band + (22u << 23);
        float q = (mag.f + c.f - c.f) * 64.0f; /* rounded to the band's step, RNE */
        q = q <= 6.0f ? q : 6.0f;              /* past 6 (and NaN): code 7 */
        fq_put(out, out_bf16, j0 + i, (__builtin_signbit(y) ? -q : q) * sf);
    }
}

/* The scales of one block of the e4m3 formats, its amax given, as `kind` says: its
 * elements are x * *mult or x / *div (*by_div), the dequantization scale returned. */
static inline float fq_e4m3_scale(float amax, int32_t kind, float *mult_, float *div_,
                                  int *by_div_) {
    const float nan = __builtin_nanf("");
    const int finite = __builtin_isfinite(amax);
    float mult = 1.0f, div = 1.0f, deq;
    int by_div = 0;
    if (kind == FQ_MXFP8) {
        int32_t e = amax == 0.0f || !finite ? 0 : fq_ceil_exp(amax);
        e = e < -127 ? -127 : e > 127 ? 127 : e;
        const int32_t byte = amax == 0.0f ? 0 : e + 127;
        mult = finite ? e8m0_value((uint8_t)(127 - e)) : nan; /* 2^-e, as pow2_from_exponent */
        deq = finite ? e8m0_value((uint8_t)byte) : nan;
    } else if (kind == FQ_FP8_F32) {
        float s = amax / 448.0f;
        s = s < 0x1p-126f ? 0x1p-126f : s;
        s = amax > 0.0f ? s : 1.0f;
        div = deq = finite ? s : nan;
        by_div = 1;
    } else if (kind == FQ_FP8_UE8M0) {
        int32_t e = amax > 0.0f ? fq_ceil_exp(amax) : -127;
        e = e < -127 ? -127 : e > 127 ? 127 : e;
        div = deq = finite ? e8m0_value((uint8_t)(e + 127)) : nan;
        by_div = 1;
    } else { /* FQ_FP8_HYBRID */
        float s = amax * (float)(1.0 / 448.0);
        s = s < 1e-30f ? 1e-30f : s;
        deq = finite ? s : nan;
        mult = 1.0f / deq;
    }
    *mult_ = mult;
    *div_ = div;
    *by_div_ = by_div;
    return deq;
}

/* One block of the e4m3 formats, its amax given: scale as `kind` says, elements x * mult
 * or x / scale, clamped to +-448, cast, times the dequantization scale. */
static inline void fq_e4m3_block(const float *x, int64_t n, float amax, int32_t kind, void *out,
                                 int32_t out_bf16, int64_t j0) {
    float mult, div;
    int by_div;
    const float deq = fq_e4m3_scale(amax, kind, &mult, &div, &by_div);
    int64_t i0 = 0;
#ifdef MOE_EP_AVX512
    i0 = fq_e4m3_x16(x, n, by_div, by_div ? div : mult, deq, out, out_bf16, j0);
#endif
    for (int64_t i = i0; i < n; i++) {
        const uint8_t code = fq_e4m3(fq_e4m3_scaled(x[i], by_div, div, mult));
        fq_put(out, out_bf16, j0 + i, e4m3_value[code] * deq);
    }
}

/* The codes and scales of the e4m3 formats whose scale is an fp32 value (FQ_FP8_F32,
 * FQ_FP8_UE8M0, FQ_FP8_HYBRID): for rows [0, rows) of cols elements (cols % block == 0),
 * codes[r * ld_codes + i] the e4m3fn byte of x[r, i] and scales[r * ld_scales + b] block b's
 * dequantization scale, as moe_ep_fake_quant forms them (its output is code * scale).
 * Returns -1 (nothing written) for another kind. */
int32_t moe_ep_quant_e4m3(const float *x, int64_t ld_x, uint8_t *codes, int64_t ld_codes,
                          float *scales, int64_t ld_scales, int64_t rows, int64_t cols,
                          int32_t kind, int64_t block, int32_t threads) {
    if (kind != FQ_FP8_F32 && kind != FQ_FP8_UE8M0 && kind != FQ_FP8_HYBRID) return -1;
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cols; j += block) {
            const float *xb = x + r * ld_x + j;
            uint8_t *cb = codes + r * ld_codes + j;
            float mult, div;
            int by_div;
            scales[r * ld_scales + j / block] =
                fq_e4m3_scale(fq_block_amax(xb, block), kind, &mult, &div, &by_div);
            int64_t i0 = 0;
#ifdef MOE_EP_AVX512
            i0 = fq_e4m3_codes_x16(xb, block, by_div, by_div ? div : mult, cb);
#endif
            for (int64_t i = i0; i < block; i++)
                cb[i] = fq_e4m3(fq_e4m3_scaled(xb[i], by_div, div, mult));
        }
    }
    return 0;
}

/* out[r] = requantize(x[r]) for rows [0, rows) of cols elements (cols % block == 0); out
 * may be x (fp32, same stride): each block is read whole (its amax) before it is written,
 * element i read before out[i]. */
void moe_ep_fake_quant(const float *x, int64_t ld_x, void *out, int64_t ld_out, int32_t out_bf16,
                       int64_t rows, int64_t cols, int32_t kind, int64_t block, float norm_const,
                       int32_t threads) {
    (void)threads;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t j = 0; j < cols; j += block) {
            const float *xb = x + r * ld_x + j;
            const float amax = fq_block_amax(xb, block);
            if (kind == FQ_NVFP4)
                fq_nvfp4_block(xb, block, amax, norm_const, norm_const != 1.0f, out, out_bf16,
                               r * ld_out + j);
            else
                fq_e4m3_block(xb, block, amax, kind, out, out_bf16, r * ld_out + j);
        }
    }
}

static inline float eg_scale(const uint8_t *s_row, int32_t s_kind, int64_t block_index) {
    switch (s_kind) {
    case EG_S_F32: return ((const float *)s_row)[block_index];
    case EG_S_E8M0: return e8m0_value(s_row[block_index]);
    case EG_S_E4M3: return e4m3_value[s_row[block_index]];
    default: return 1.0f;
    }
}

static inline float eg_code(const uint8_t *w_row, int32_t w_kind, int64_t k) {
    switch (w_kind) {
    case EG_W_E4M3: return e4m3_value[w_row[k]];
    case EG_W_E2M1: return e2m1_value[(w_row[k >> 1] >> ((k & 1) * 4)) & 15u];
    default: return bf16_to_f32(((const uint16_t *)w_row)[k]);
    }
}

/* Bits per stored weight element. */
static inline int64_t eg_bits(int32_t w_kind) {
    return w_kind == EG_W_E2M1 ? 4 : w_kind == EG_W_E4M3 ? 8 : 16;
}

/* How far ahead of the weight element being read to prefetch, in bytes. An expert's rows
 * are contiguous, so this reaches rows (pages) ahead: the hardware prefetcher stops at
 * each 4 KiB page, one bf16 row of K = 2048 here. Measured (1 thread, m = 1 row per
 * expert): 5.4 GB/s without, 7.8 / 11.6 / 12.2 GB/s at 8 / 16 / 32 KiB. Into L2 (T1): 32
 * KiB in flight would fill L1 and evict the x block the later row tiles reuse (measured,
 * 1 thread, loaded box: 8 rows per expert 15.6 vs 17.9 ms, 64 rows 107 vs 136 ms). */
#define EG_PREFETCH_BYTES 32768

/* Lane of element j of a 16-chunk: even elements first, then odd. */
static inline int64_t eg_lane(int64_t j) { return (j >> 1) + ((j & 1) << 3); }

/* One 16-chunk of a weight row, elements [k, k + 16) clipped to k1, into dst in lane order:
 * code * scale (fp32, one rounding; no product without scales), zeros past k1. */
static void eg_decode_chunk_scalar(const uint8_t *w_row, int32_t w_kind, int64_t k, int64_t k1,
                                   float s, int32_t scaled, float *dst) {
    for (int64_t j = 0; j < EG_LANES; j++) {
        float v = 0.0f;
        if (k + j < k1) {
            v = eg_code(w_row, w_kind, k + j);
            v = scaled ? v * s : v;
        }
        dst[eg_lane(j)] = v;
    }
}

#ifdef MOE_EP_AVX2
/* e4m3fn bytes (one per 32-bit lane) -> fp32: the 7 magnitude bits placed under fp32's
 * exponent / mantissa fields give value * 2^-120 (subnormals included: an e4m3 subnormal is
 * an fp32 subnormal there, and the product by 2^120 is exact; needs MXCSR without DAZ, the
 * default), then the sign; 0x7f / 0xff become the quiet NaN of the table. */
static inline __m256 e4m3x8(__m256i b) {
    __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
    __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 20)),
                             _mm256_set1_ps(1.329227995784916e36f)); /* 2^120 */
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    f = _mm256_or_ps(f, _mm256_castsi256_ps(sign));
    __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f)));
    return _mm256_blendv_ps(f, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

/* e2m1 codes (one per 32-bit lane, 0..15) -> fp32 by an 8-entry table and the sign bit. */
static inline __m256 e2m1x8(__m256i c) {
    const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256 f = _mm256_permutevar8x32_ps(table, _mm256_and_si256(c, _mm256_set1_epi32(7)));
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(8)), 28);
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}

/* eg_decode_chunk_scalar for a whole chunk (k + 16 <= k1), the same values, in two
 * registers: lanes 0-7 (even elements) and 8-15 (odd). */
static inline __attribute__((always_inline)) void eg_decode_regs_avx2(
    const uint8_t *w_row, int32_t w_kind, int64_t k, float s, int32_t scaled, __m256 *even_out,
    __m256 *odd_out) {
    __m256 even, odd;
    if (w_kind == EG_W_E4M3) {
        __m256i d = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w_row + k)));
        even = e4m3x8(_mm256_and_si256(d, _mm256_set1_epi32(0xff)));
        odd = e4m3x8(_mm256_srli_epi32(d, 8));
    } else if (w_kind == EG_W_E2M1) {
        __m256i d = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w_row + k / 2)));
        even = e2m1x8(_mm256_and_si256(d, _mm256_set1_epi32(0xf)));
        odd = e2m1x8(_mm256_srli_epi32(d, 4));
    } else {
        __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w_row + k));
        even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    }
    if (scaled) {
        __m256 sv = _mm256_set1_ps(s);
        even = _mm256_mul_ps(even, sv);
        odd = _mm256_mul_ps(odd, sv);
    }
    *even_out = even;
    *odd_out = odd;
}

static inline void eg_decode_chunk_avx2(const uint8_t *w_row, int32_t w_kind, int64_t k,
                                        float s, int32_t scaled, float *dst) {
    __m256 even, odd;
    eg_decode_regs_avx2(w_row, w_kind, k, s, scaled, &even, &odd);
    _mm256_storeu_ps(dst, even);
    _mm256_storeu_ps(dst + 8, odd);
}

/* acc[m][n][:] (row stride ldacc) += the chunks of x rows m and weight rows n, lane by lane
 * with one fma each; mr x nr accumulator pairs stay in registers. Weight row n is w[n]:
 * bf16 stored elements when `bf16` (even lanes by a shift, odd by a mask: no buffer), else
 * fp32 already decoded in lane order. */
static inline __attribute__((always_inline)) void eg_tile_avx2(
    const int mr, const int nr, const int bf16, const float *x, int64_t ldx,
    const void *const *w, int64_t chunks, float *acc, int64_t ldacc, int64_t ahead) {
    const __m256i odd_mask = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[EG_MR][EG_NR][2];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++)
            for (int h = 0; h < 2; h++)
                a[m][n][h] = _mm256_loadu_ps(acc + m * ldacc + n * EG_LANES + h * 8);
    for (int64_t c = 0; c < chunks; c++) {
        if (bf16 && ahead && (c & 1) == 0) /* one 64-byte line per row every two chunks */
            for (int n = 0; n < nr; n++)
                _mm_prefetch((const char *)w[n] + c * 32 + ahead, _MM_HINT_T1);
        for (int h = 0; h < 2; h++) {
            __m256 wv[EG_NR];
            /* Each vector loaded once into a register (the empty asm stops the compiler from
             * folding the load into every fma that uses it: 1.3 loads per fma, not 0.8). */
            for (int n = 0; n < nr; n++) {
                if (bf16) {
                    const __m256i v =
                        _mm256_loadu_si256((const __m256i *)((const uint16_t *)w[n] + c * 16));
                    wv[n] = _mm256_castsi256_ps(h == 0 ? _mm256_slli_epi32(v, 16)
                                                       : _mm256_and_si256(v, odd_mask));
                } else {
                    wv[n] = _mm256_loadu_ps((const float *)w[n] + c * 16 + h * 8);
                }
                __asm__("" : "+x"(wv[n]));
            }
            for (int m = 0; m < mr; m++) {
                __m256 xv = _mm256_loadu_ps(x + m * ldx + c * 16 + h * 8);
                __asm__("" : "+x"(xv));
                for (int n = 0; n < nr; n++) a[m][n][h] = _mm256_fmadd_ps(xv, wv[n], a[m][n][h]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++)
            for (int h = 0; h < 2; h++)
                _mm256_storeu_ps(acc + m * ldacc + n * EG_LANES + h * 8, a[m][n][h]);
}
#endif

#if defined(MOE_EP_AVX2) && (defined(__GNUC__) || defined(__clang__))
/* The AVX-512F body: the same sum order in one zmm register per output (its 16 lanes are
 * the order's 16 lanes), so the same bits as the AVX2 body and the scalar twin with half
 * the instructions and, in 32 registers, a 4 x 4 tile (16 accumulators). Compiled by
 * target attribute on any AVX2 build and chosen at run time by cpuid, so the library
 * still builds and runs where the CPU lacks AVX-512. No vdpbf16ps here: it treats subnormal
 * inputs as zero and flushes its results, so it cannot give these bits for every input (the
 * bf16 dot bodies below sum in their own order). */
#define MOE_EP_AVX512_GEMM 1
#define EG_AVX512 __attribute__((target("avx512f,avx2,fma")))

/* 16 e4m3fn codes (one per 32-bit lane) -> their fp32 values, exact: the magnitude's bits
 * placed as an fp32 pattern times 2^120 (subnormal codes included), the sign, 0x7f / 0xff
 * -> quiet NaN. */
static inline __attribute__((always_inline)) EG_AVX512 __m512 e4m3x16_value(__m512i b) {
    const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
    __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)),
                             _mm512_set1_ps(1.329227995784916e36f)); /* 2^120 */
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    f = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign));
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
    return _mm512_mask_mov_ps(f, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
}

/* Whether this CPU (and OS) runs AVX-512F: libgcc's cpuid and xgetbv check. */
static int eg_avx512_supported(void) { return __builtin_cpu_supports("avx512f"); }

/* eg_tile_avx2 on zmm registers, mr <= EG_MR512 x nr <= EG_NR512. A bf16 16-chunk (8
 * dwords) is broadcast to both halves; lanes 0-7 shift each dword left by 16 (the even
 * element), lanes 8-15 keep its high half (the odd one): the lane order, in two ops. */
static inline __attribute__((always_inline)) EG_AVX512 void eg_tile_avx512(
    const int mr, const int nr, const int bf16, const float *x, int64_t ldx,
    const void *const *w, int64_t chunks, float *acc, int64_t ldacc, int64_t ahead) {
    const __m512i shift = _mm512_setr_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0,
                                            0, 0);
    const __m512i high = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a[EG_MR512][EG_NR512];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) a[m][n] = _mm512_loadu_ps(acc + m * ldacc + n * EG_LANES);
    for (int64_t c = 0; c < chunks; c++) {
        if (bf16 && ahead && (c & 1) == 0) /* one 64-byte line per row every two chunks */
            for (int n = 0; n < nr; n++)
                _mm_prefetch((const char *)w[n] + c * 32 + ahead, _MM_HINT_T1);
        __m512 wv[EG_NR512];
        for (int n = 0; n < nr; n++) {
            if (bf16) {
                const __m512i v = _mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)((const uint16_t *)w[n] + c * 16)));
                wv[n] = _mm512_castsi512_ps(_mm512_and_si512(_mm512_sllv_epi32(v, shift), high));
            } else {
                wv[n] = _mm512_loadu_ps((const float *)w[n] + c * 16);
            }
            __asm__("" : "+v"(wv[n])); /* loaded once, not folded into every fma */
        }
        for (int m = 0; m < mr; m++) {
            __m512 xv = _mm512_loadu_ps(x + m * ldx + c * 16);
            __asm__("" : "+v"(xv));
            for (int n = 0; n < nr; n++) a[m][n] = _mm512_fmadd_ps(xv, wv[n], a[m][n]);
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) _mm512_storeu_ps(acc + m * ldacc + n * EG_LANES, a[m][n]);
}

#define EG_T512(m, n, b) eg_tile_avx512(m, n, b, x, ldx, w, chunks, acc, ldacc, ahead)
#define EG_T512_N(m, b)                                                                       \
    (nr == 4 ? EG_T512(m, 4, b) : nr == 3 ? EG_T512(m, 3, b) : nr == 2 ? EG_T512(m, 2, b)     \
                                                                     : EG_T512(m, 1, b))
#define EG_T512_MN(b)                                                                         \
    (mr == 4 ? EG_T512_N(4, b) : mr == 3 ? EG_T512_N(3, b) : mr == 2 ? EG_T512_N(2, b)        \
                                                                     : EG_T512_N(1, b))

/* Every shape and weight kind of eg_tile_avx512, each its own register-tiled loop. */
static EG_AVX512 void eg_tile_avx512_any(int mr, int nr, int bf16, const float *x, int64_t ldx,
                                         const void *const *w, int64_t chunks, float *acc,
                                         int64_t ldacc, int64_t ahead) {
    if (bf16) EG_T512_MN(1);
    else EG_T512_MN(0);
}
#undef EG_T512_MN
#undef EG_T512_N
#undef EG_T512
#endif

/* The scalar twin of eg_tile_avx2 (fp32 weights in lane order, row n at w[n]): the same
 * fma per lane in the same order. */
static void eg_tile_scalar(int mr, int nr, const float *x, int64_t ldx, const void *const *w,
                           int64_t chunks, float *acc, int64_t ldacc) {
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) {
            float *a = acc + m * ldacc + n * EG_LANES;
            const float *wn = (const float *)w[n];
            for (int64_t c = 0; c < chunks; c++)
                for (int l = 0; l < EG_LANES; l++)
                    a[l] = __builtin_fmaf(x[m * ldx + c * 16 + l], wn[c * 16 + l], a[l]);
        }
}

#ifdef MOE_EP_AVX2
/* eg_tile_avx2 over decoded weights, summing one half of the lanes at a time: the even
 * elements' lanes 0-7 over every chunk, then the odd ones' 8-15 (each lane's fma chain
 * unchanged), so that mr x nr accumulators (up to 4 x 3) stay in registers and each loaded
 * vector feeds more fma's: mr + nr loads per mr x nr fma's, against 5 per 6 in 3 x 2. */
static inline __attribute__((always_inline)) void eg_tile_avx2_half(
    const int mr, const int nr, const float *x, int64_t ldx, const void *const *w,
    int64_t chunks, float *acc, int64_t ldacc) {
    for (int h = 0; h < 2; h++) {
        __m256 a[EG_HMR][EG_HNR];
        for (int m = 0; m < mr; m++)
            for (int n = 0; n < nr; n++)
                a[m][n] = _mm256_loadu_ps(acc + m * ldacc + n * EG_LANES + h * 8);
        for (int64_t c = 0; c < chunks; c++) {
            __m256 wv[EG_HNR];
            for (int n = 0; n < nr; n++) {
                wv[n] = _mm256_loadu_ps((const float *)w[n] + c * 16 + h * 8);
                __asm__("" : "+x"(wv[n])); /* loaded once (as in eg_tile_avx2) */
            }
            for (int m = 0; m < mr; m++) {
                __m256 xv = _mm256_loadu_ps(x + m * ldx + c * 16 + h * 8);
                __asm__("" : "+x"(xv));
                for (int n = 0; n < nr; n++) a[m][n] = _mm256_fmadd_ps(xv, wv[n], a[m][n]);
            }
        }
        for (int m = 0; m < mr; m++)
            for (int n = 0; n < nr; n++)
                _mm256_storeu_ps(acc + m * ldacc + n * EG_LANES + h * 8, a[m][n]);
    }
}

#define EG_TH(m, n) eg_tile_avx2_half(m, n, x, ldx, w, chunks, acc, ldacc)
#define EG_TH_MR(n)                                                                           \
    (mr == 4 ? EG_TH(4, n) : mr == 3 ? EG_TH(3, n) : mr == 2 ? EG_TH(2, n) : EG_TH(1, n))
/* eg_tile_avx2_half for mr <= EG_HMR rows and nr <= EG_HNR weight rows: each shape its own
 * loop. */
static void eg_tile_avx2_half_any(int mr, int nr, const float *x, int64_t ldx,
                                  const void *const *w, int64_t chunks, float *acc,
                                  int64_t ldacc) {
    nr == 3 ? EG_TH_MR(3) : nr == 2 ? EG_TH_MR(2) : EG_TH_MR(1);
}
#undef EG_TH_MR
#undef EG_TH
#endif

#ifdef MOE_EP_AVX2
#define EG_TILE_MR(mr, nr, bf16)                                                              \
    (mr == 3   ? eg_tile_avx2(3, nr, bf16, x, ldx, w, chunks, acc, ldacc, ahead)            \
     : mr == 2 ? eg_tile_avx2(2, nr, bf16, x, ldx, w, chunks, acc, ldacc, ahead)            \
               : eg_tile_avx2(1, nr, bf16, x, ldx, w, chunks, acc, ldacc, ahead))
#endif

/* eg_tile_avx512 (vector EG_BODY_AVX512), eg_tile_avx2 (EG_BODY_AVX2) or their scalar
 * twin (fp32 weights only), for mr <= eg_mr(vector) rows and nr <= eg_nr(vector) weight
 * rows: each shape and weight kind its own register-tiled loop. `ahead`: bf16 weights are
 * prefetched that many bytes past each line read (0: none). */
static void eg_tile(int mr, int nr, int bf16, const float *x, int64_t ldx, const void *const *w,
                    int64_t chunks, float *acc, int64_t ldacc, int32_t vector, int64_t ahead) {
#ifdef MOE_EP_AVX512_GEMM
    if (vector == EG_BODY_AVX512) {
        eg_tile_avx512_any(mr, nr, bf16, x, ldx, w, chunks, acc, ldacc, ahead);
        return;
    }
#endif
#ifdef MOE_EP_AVX2
    if (vector == EG_BODY_AVX2_HALF) { /* decoded weights only (eg_rows) */
        eg_tile_avx2_half_any(mr, nr, x, ldx, w, chunks, acc, ldacc);
        return;
    }
    if (vector) {
        if (bf16) nr == 2 ? EG_TILE_MR(mr, 2, 1) : EG_TILE_MR(mr, 1, 1);
        else nr == 2 ? EG_TILE_MR(mr, 2, 0) : EG_TILE_MR(mr, 1, 0);
        return;
    }
#endif
    (void)vector, (void)bf16, (void)ahead;
    eg_tile_scalar(mr, nr, x, ldx, w, chunks, acc, ldacc);
}

static inline float eg_lane_sum(const float *a) {
    float t[8], u[4];
    for (int j = 0; j < 8; j++) t[j] = a[j] + a[j + 8];
    for (int j = 0; j < 4; j++) u[j] = t[j] + t[j + 4];
    float v0 = u[0] + u[2], v1 = u[1] + u[3];
    return v0 + v1;
}

/* One row of x (bf16 or fp32) widened to fp32 in lane order, zero-padded to k16. */
static void eg_widen_row(const void *src, int32_t x_kind, int64_t k, int64_t k16, float *dst) {
    for (int64_t c = 0; c < k16; c += EG_LANES)
        for (int64_t j = 0; j < EG_LANES; j++) {
            int64_t kk = c + j;
            float v = 0.0f;
            if (kk < k)
                v = x_kind == EG_X_F32 ? ((const float *)src)[kk]
                                       : bf16_to_f32(((const uint16_t *)src)[kk]);
            dst[c + eg_lane(j)] = v;
        }
}

typedef struct {
    const float *xs;
    int64_t ldxs;
    const int64_t *q_start, *g_expert, *out_row0;
    const float *alpha;
    const uint8_t *w, *s;
    int64_t w_expert_bytes, w_row_bytes, s_expert_bytes, s_row_bytes, s_block;
    const int64_t *g_rows;    /* the row count that picks each group's body, or NULL */
    int32_t w_kind, s_kind, out_kind, vector, auto_dot, auto_kseq;
    void *out;
    int64_t ld_out, n, k;
    float *xt;                /* the k order's transposed x blocks (EG_BODY_KSEQ), or NULL */
    const uint16_t *x16;      /* the call's bf16 x rows (row(q) = x_rows[q] or q), ld_x apart */
    const int64_t *x_rows;
    int64_t ld_x;
    const int64_t *xt_start;  /* group g's blocks start at xt + xt_start[g] */
    uint16_t *xv;             /* the AMX bodies' packed x blocks, or NULL */
    int32_t x_kind;           /* EG_X_BF16 / EG_X_F32 / EG_X_E4M3: x16's elements */
    int32_t *inexact;         /* set when an fp32 x value is not exact in bf16 (AMX bodies) */
    uint16_t *dec;            /* per thread, an AMX item's decoded A tiles (codes) */
    const int64_t *xv_start;  /* group g's packed blocks: xv_start[g] on (EG_AMX_BLOCK each) */
    /* the block-scaled AMX order (e4m3 x codes; bs_block 0: not that order): the sum block
     * (elements), x's fp32 scales (x_block elements each, ld_xsc apart per x row), the
     * weights' fp32 scales (ws_block elements each; s / s_kind then say unscaled codes; NULL:
     * weights exact in bf16, scaled as they are decoded), and the packed blocks' x scales
     * (xsv: per 16-row block, per x block, 16 rows) */
    int64_t bs_block, x_block, ld_xsc, ws_expert_bytes, ws_row_bytes, ws_block;
    const float *xsc;
    const uint8_t *ws;
    float *xsv;
} eg_args;

typedef struct {
    const void *p;
    int64_t bytes;
} eg_span; /* bytes [p, p + bytes) */

/* Output element o (an index into a->out): sum v times alpha (where the call has alphas),
 * stored as fp32 or rounded to bf16. */
static inline void eg_put(const eg_args *a, int64_t o, float v, float alpha) {
    v = a->alpha ? v * alpha : v;
    if (a->out_kind == EG_OUT_F32) ((float *)a->out)[o] = v;
    else ((uint16_t *)a->out)[o] = f32_to_bf16(v);
}

/* ---------------------------------------------------------------------------------------
 * The bf16 dot-product bodies (EG_BODY_BF16DOT: AVX-512 BF16 `vdpbf16ps`; its scalar twin
 * EG_BODY_BF16DOT_SCALAR), for bf16 activations and bf16 weights only, in their own order:
 * 16 fp32 lanes per output, lane l taking the pair (32c + 2l, 32c + 2l + 1) of every
 * 32-chunk c in increasing c, K padded to a multiple of 32 with zeros, by the instruction's
 * arithmetic as measured on AMD Zen 5 (and as Intel's SDM states it): per pair
 *   a = ftz(fma(daz(x[2l + 1]), daz(w[2l + 1]), a)); a = ftz(fma(daz(x[2l]), daz(w[2l]), a))
 * (odd element first; each bf16 x bf16 product exact, one RNE rounding per add; daz / ftz:
 * an fp32 subnormal input or result becomes a zero of its sign), starting at +0; then the
 * fixed reduction of eg_lane_sum (plain fp32 adds), times alpha, rounded to bf16 or stored
 * as fp32 as above. The activations are copied as bf16 into the scratch (rows of
 * round_up(k, 32) + 32 elements, zero-padded) instead of widened. */
#define EG_DOT 32 /* bf16 elements per chunk (one zmm) */
#define EG_MRD 4  /* rows x weight rows of the register tile: 16 zmm accumulators */
#define EG_NRD 4

/* The row count that picks group g's body: g_rows[g] (a replica's logical expert's rows,
 * so every copy of an expert sums in one order), else the group's own rows. */
static inline int64_t eg_path_rows(const eg_args *a, int64_t g) {
    return a->g_rows ? a->g_rows[g] : a->q_start[g + 1] - a->q_start[g];
}

/* Whether a group of `rows` rows runs a dot body: asked for, and under auto more than
 * EG_AVX2_ROWS rows (smaller experts measured faster on the AVX2 body). */
static inline int eg_group_dot(const eg_args *a, int64_t rows) {
    return (a->vector == EG_BODY_BF16DOT || a->vector == EG_BODY_BF16DOT_SCALAR) &&
           !(a->auto_dot && rows <= EG_AVX2_ROWS);
}

/* fp32 subnormal -> zero of its sign (vdpbf16ps's DAZ on inputs and FTZ on outputs). */
static inline float eg_flush(float v) {
    bits32 b;
    b.f = v;
    if ((b.u & 0x7f800000u) == 0) b.u &= 0x80000000u;
    return b.f;
}

/* One output of the dot order, element by element (the twin and the definition). */
static float eg_dot_scalar(const uint16_t *x, const uint16_t *w, int64_t k) {
    float a[EG_LANES] = {0};
    for (int64_t c = 0; c < k; c += EG_DOT)
        for (int64_t l = 0; l < EG_LANES; l++) {
            const int64_t e = c + 2 * l, o = e + 1;
            const float xo = o < k ? eg_flush(bf16_to_f32(x[o])) : 0.0f;
            const float wo = o < k ? eg_flush(bf16_to_f32(w[o])) : 0.0f;
            const float xe = e < k ? eg_flush(bf16_to_f32(x[e])) : 0.0f;
            const float we = e < k ? eg_flush(bf16_to_f32(w[e])) : 0.0f;
            a[l] = eg_flush(__builtin_fmaf(xo, wo, a[l]));
            a[l] = eg_flush(__builtin_fmaf(xe, we, a[l]));
        }
    return eg_lane_sum(a);
}

#if defined(MOE_EP_AVX2) && (defined(__GNUC__) || defined(__clang__))
#define MOE_EP_BF16DOT_GEMM 1
#define EG_BF16DOT __attribute__((target("avx512bf16,avx512f,avx512bw,avx2,fma")))

static int eg_bf16dot_supported(void) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512bf16");
}

/* sums[m * EG_NRD + n] = the dot order's result for x row m (stride ldx, bf16, zero-padded
 * to whole chunks) and weight row w[n] (bf16 where stored: the last partial chunk by a
 * masked load), mr x nr accumulators in registers over the whole of K. */
static inline __attribute__((always_inline)) EG_BF16DOT void eg_dot_tile(
    const int mr, const int nr, const uint16_t *x, int64_t ldx, const uint16_t *const *w,
    int64_t k, float *sums, int64_t ahead) {
    __m512 a[EG_MRD][EG_NRD];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) a[m][n] = _mm512_setzero_ps();
    const int64_t whole = k / EG_DOT * EG_DOT;
    for (int64_t c = 0; c < whole; c += EG_DOT) {
        __m512i wv[EG_NRD];
        for (int n = 0; n < nr; n++) {
            if (ahead) _mm_prefetch((const char *)(w[n] + c) + ahead, _MM_HINT_T1);
            wv[n] = _mm512_loadu_si512((const void *)(w[n] + c));
            __asm__("" : "+v"(wv[n])); /* loaded once, not folded into every dot product */
        }
        for (int m = 0; m < mr; m++) {
            __m512i xv = _mm512_loadu_si512((const void *)(x + m * ldx + c));
            __asm__("" : "+v"(xv));
            for (int n = 0; n < nr; n++)
                a[m][n] = _mm512_dpbf16_ps(a[m][n], (__m512bh)xv, (__m512bh)wv[n]);
        }
    }
    if (whole < k) { /* the last partial chunk: weights by a masked load, x zero-padded */
        const __mmask32 keep = (__mmask32)((1ull << (k - whole)) - 1);
        for (int m = 0; m < mr; m++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(x + m * ldx + whole));
            for (int n = 0; n < nr; n++)
                a[m][n] = _mm512_dpbf16_ps(a[m][n], (__m512bh)xv,
                                           (__m512bh)_mm512_maskz_loadu_epi16(keep, w[n] + whole));
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) {
            float lanes[EG_LANES];
            _mm512_storeu_ps(lanes, a[m][n]);
            sums[m * EG_NRD + n] = eg_lane_sum(lanes);
        }
}

#define EG_DT(m, n) eg_dot_tile(m, n, x, ldx, w, k, sums, ahead)
#define EG_DT_N(m) (nr == 4 ? EG_DT(m, 4) : nr == 3 ? EG_DT(m, 3) : nr == 2 ? EG_DT(m, 2) : EG_DT(m, 1))
/* eg_dot_tile for every shape, each its own register-tiled loop. */
static EG_BF16DOT void eg_dot_tile_any(int mr, int nr, const uint16_t *x, int64_t ldx,
                                       const uint16_t *const *w, int64_t k, float *sums,
                                       int64_t ahead) {
    mr == 4 ? EG_DT_N(4) : mr == 3 ? EG_DT_N(3) : mr == 2 ? EG_DT_N(2) : EG_DT_N(1);
}
#undef EG_DT_N
#undef EG_DT
#endif

/* eg_rows for the dot bodies: rows [q0, q0 + rows) of group g times output columns
 * [j0, n1), per EG_NRD weight rows every EG_MRD x EG_NRD tile over the whole of K (the
 * weight rows, read from memory by the first row tile, stay in L1 / L2 for the others). */
static void eg_rows_dot(const eg_args *a, int64_t g, int64_t q0, int64_t rows, int64_t orow0,
                        int64_t j0, int64_t n1) {
    const uint8_t *we = a->w + a->g_expert[g] * a->w_expert_bytes;
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    const int64_t ldx = 2 * a->ldxs; /* bf16 elements in the fp32 scratch rows */
    const uint16_t *x = (const uint16_t *)(a->xs + q0 * a->ldxs);
    const int64_t ahead = (EG_PREFETCH_BYTES + a->w_row_bytes - 1) / a->w_row_bytes * a->w_row_bytes;
    (void)ahead; /* only the vector body prefetches */
    for (int64_t j = j0; j < n1; j += EG_NRD) {
        const int nr = n1 - j < EG_NRD ? (int)(n1 - j) : EG_NRD;
        const uint16_t *w_rows[EG_NRD];
        for (int n = 0; n < nr; n++) w_rows[n] = (const uint16_t *)(we + (j + n) * a->w_row_bytes);
        for (int64_t r = 0; r < rows; r += EG_MRD) {
            const int mr = rows - r < EG_MRD ? (int)(rows - r) : EG_MRD;
            float sums[EG_MRD * EG_NRD];
#ifdef MOE_EP_BF16DOT_GEMM
            if (a->vector == EG_BODY_BF16DOT)
                eg_dot_tile_any(mr, nr, x + r * ldx, ldx, w_rows, a->k, sums, r == 0 ? ahead : 0);
            else
#endif
                for (int m = 0; m < mr; m++)
                    for (int n = 0; n < nr; n++)
                        sums[m * EG_NRD + n] = eg_dot_scalar(x + (r + m) * ldx, w_rows[n], a->k);
            for (int m = 0; m < mr; m++)
                for (int n = 0; n < nr; n++)
                    eg_put(a, (orow0 + r + m) * a->ld_out + j + n, sums[m * EG_NRD + n], alpha);
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * The k-order bodies (EG_BODY_KSEQ: AVX2 + FMA; its scalar twin EG_BODY_KSEQ_SCALAR), for
 * bf16 activations and bf16 weights only, in their own order, the "k order": each output is
 * one fp32 fused multiply-add chain over k = 0, 1, ..., K - 1 in increasing k, starting at
 * +0 (acc = fmaf(x_k, w_k, acc); a bf16 x bf16 product is exact, so each step is one RNE
 * rounding of acc + x_k w_k), then times alpha and rounded to bf16 or stored as fp32 as
 * above. The AVX2 body puts 8 activation rows in the lanes of a register (the inner-product
 * form of the 16-lane order needs two accumulators per output; this one needs one per 8):
 * each group's rows are transposed into blocks of EG_KR rows ([K][EG_KR] fp32, the last
 * block's missing rows zero), each weight element broadcast to all lanes (a 32-bit load of
 * elements k - 1 and k, masked to its high half: exact widening, no shuffle), and a register
 * tile of 16 rows x EG_KNR weight rows (12 ymm accumulators; 8 x EG_KNR for a last block of
 * at most 8 rows) runs over K blocks of EG_KKC (a row block's x in L1 for every tile; the
 * accumulators go through the item's buffer between blocks, which changes no bit), or over
 * the whole of K when the item has one row block. Work items: (group, block of EG_ROWS rows,
 * tile of EG_KCOLS output columns); the item's weights stream from memory for its first row
 * block (software prefetch of the same rows, one K block or EG_KPF elements ahead) and stay
 * in L2 for the others. The sums go out through 8 x 8 register transposes. Tried and
 * slower: a 1 x 12 tile for 8-row blocks (12 weight rows 4 KiB apart share one L1 set: 2x
 * slower), the same with each K block of the weights first copied into a contiguous buffer
 * (0.78-0.90x), a 24 x 4 tile (17 live ymm: the compiler reloads x for every fma, 0.65x). */
#define EG_KR 16       /* rows per transposed block (two ymm of lanes) */
#define EG_KNR 6       /* weight rows of the register tile */
#define EG_KCOLS 48    /* output columns per work item (a multiple of EG_KNR) */
#define EG_KKC 256     /* K elements per block of the AVX2 k-order body */
#ifndef EG_KPF
#define EG_KPF 512     /* prefetch distance (elements) of a single row block's whole-K tiles */
#endif
/* EG_BODY_AUTO on CPUs without AVX-512F: bf16 groups of at least this many rows take the
 * k order (measured faster than the AVX2 fp32-order body from 12 rows, docs/layer.md). */
#define EG_KSEQ_ROWS 13

/* Whether group g's rows run a k-order body: asked for, or under auto rows enough. */
static inline int eg_group_kseq(const eg_args *a, int64_t rows) {
    return a->vector == EG_BODY_KSEQ || a->vector == EG_BODY_KSEQ_SCALAR ||
           (a->auto_kseq && rows >= EG_KSEQ_ROWS);
}

/* Element e of an fp32 scratch row in lane order (eg_widen_row). */
static inline float eg_lane_elem(const float *xs_row, int64_t e) {
    return xs_row[(e & ~(int64_t)(EG_LANES - 1)) + eg_lane(e & (EG_LANES - 1))];
}

/* One output of the k order from an fp32 scratch row in lane order and bf16 weights
 * w[e * stride] (1: a stored row; EG_PCOLS: a packed column, eg_item_k16). */
static float eg_kseq_scalar(const float *xs_row, const uint16_t *w, int64_t stride, int64_t k) {
    float acc = 0.0f;
    for (int64_t e = 0; e < k; e++)
        acc = __builtin_fmaf(eg_lane_elem(xs_row, e), bf16_to_f32(w[e * stride]), acc);
    return acc;
}

#ifdef MOE_EP_AVX2
/* acc[n * EG_KR + r] (r < 8 * RV, n < NR) carried on over elements [e0, e1) of the k order
 * for row r of the transposed block xt ([k][EG_KR]) and weight row w[n] (acc holds +0 before
 * element 0); with `ahead` the same rows' next EG_KKC elements are prefetched. */
#define EG_KSEQ_TILE(RV, NR)                                                                   \
    static void eg_kseq_tile_##RV##_##NR(const float *xt, const uint16_t *const *w, int64_t e0, \
                                         int64_t e1, float *acc, int64_t ahead) {              \
        __m256 a0[NR], a1[NR];                                                                 \
        const __m256 high = _mm256_castsi256_ps(_mm256_set1_epi32((int)0xffff0000u));          \
        _Pragma("GCC unroll 8") for (int n = 0; n < NR; n++) {                                 \
            a0[n] = _mm256_loadu_ps(acc + n * EG_KR);                                          \
            a1[n] = RV > 1 ? _mm256_loadu_ps(acc + n * EG_KR + 8) : a0[n];                     \
        }                                                                                      \
        if (e0 == 0) { /* element 0: no element before it to load the pair with */            \
            const __m256 x0 = _mm256_loadu_ps(xt), x1 = RV > 1 ? _mm256_loadu_ps(xt + 8) : x0; \
            _Pragma("GCC unroll 8") for (int n = 0; n < NR; n++) {                             \
                const __m256 b = _mm256_set1_ps(bf16_to_f32(w[n][0]));                         \
                a0[n] = _mm256_fmadd_ps(x0, b, a0[n]);                                         \
                if (RV > 1) a1[n] = _mm256_fmadd_ps(x1, b, a1[n]);                             \
            }                                                                                  \
            e0 = 1;                                                                            \
        }                                                                                      \
        for (int64_t c = e0; c < e1; c += 32) { /* 32 elements: one line of each weight row */ \
            if (ahead)                                                                         \
                _Pragma("GCC unroll 8") for (int n = 0; n < NR; n++)                           \
                    _mm_prefetch((const char *)(w[n] + c + ahead), _MM_HINT_T0);               \
            const int64_t c1 = c + 32 < e1 ? c + 32 : e1;                                      \
            for (int64_t e = c; e < c1; e++) {                                                 \
                const __m256 xe0 = _mm256_loadu_ps(xt + e * EG_KR);                            \
                const __m256 xe1 = RV > 1 ? _mm256_loadu_ps(xt + e * EG_KR + 8) : xe0;         \
                _Pragma("GCC unroll 8") for (int n = 0; n < NR; n++) {                         \
                    const __m256 b = _mm256_and_ps(                                            \
                        _mm256_broadcast_ss((const float *)(const void *)(w[n] + e - 1)), high); \
                    a0[n] = _mm256_fmadd_ps(xe0, b, a0[n]);                                    \
                    if (RV > 1) a1[n] = _mm256_fmadd_ps(xe1, b, a1[n]);                        \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int n = 0; n < NR; n++) {                                 \
            _mm256_storeu_ps(acc + n * EG_KR, a0[n]);                                          \
            if (RV > 1) _mm256_storeu_ps(acc + n * EG_KR + 8, a1[n]);                          \
        }                                                                                      \
    }
EG_KSEQ_TILE(2, 6) EG_KSEQ_TILE(2, 5) EG_KSEQ_TILE(2, 4) EG_KSEQ_TILE(2, 3) EG_KSEQ_TILE(2, 2)
EG_KSEQ_TILE(2, 1) EG_KSEQ_TILE(1, 6) EG_KSEQ_TILE(1, 5) EG_KSEQ_TILE(1, 4) EG_KSEQ_TILE(1, 3)
EG_KSEQ_TILE(1, 2) EG_KSEQ_TILE(1, 1)
#undef EG_KSEQ_TILE
typedef void (*eg_kseq_tile_fn)(const float *, const uint16_t *const *, int64_t, int64_t,
                                float *, int64_t);
static const eg_kseq_tile_fn eg_kseq_tiles[2][EG_KNR + 1] = {
    {NULL, eg_kseq_tile_1_1, eg_kseq_tile_1_2, eg_kseq_tile_1_3, eg_kseq_tile_1_4,
     eg_kseq_tile_1_5, eg_kseq_tile_1_6},
    {NULL, eg_kseq_tile_2_1, eg_kseq_tile_2_2, eg_kseq_tile_2_3, eg_kseq_tile_2_4,
     eg_kseq_tile_2_5, eg_kseq_tile_2_6}};

/* The 8 x 8 block of sums acc[c * EG_KR] (8 columns c, 8 lanes each) stored as 8 output rows
 * of 8 columns from out_row on (row m: lanes m of each column), times alpha, the first
 * `rows` of them. */
static void eg_kseq_store8x8(const eg_args *a, const float *acc, int64_t rows, int64_t out_row,
                             int64_t j, const float *alpha) {
    __m256 r[8], t[8];
    for (int c = 0; c < 8; c++) r[c] = _mm256_loadu_ps(acc + c * EG_KR);
    for (int c = 0; c < 8; c += 2) {
        t[c] = _mm256_unpacklo_ps(r[c], r[c + 1]);
        t[c + 1] = _mm256_unpackhi_ps(r[c], r[c + 1]);
    }
    for (int c = 0; c < 8; c += 4) {
        r[c] = _mm256_shuffle_ps(t[c], t[c + 2], 0x44);
        r[c + 1] = _mm256_shuffle_ps(t[c], t[c + 2], 0xee);
        r[c + 2] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0x44);
        r[c + 3] = _mm256_shuffle_ps(t[c + 1], t[c + 3], 0xee);
    }
    for (int m = 0; m < 4; m++) {
        t[m] = _mm256_permute2f128_ps(r[m], r[m + 4], 0x20);
        t[m + 4] = _mm256_permute2f128_ps(r[m], r[m + 4], 0x31);
    }
    for (int64_t m = 0; m < rows; m++) {
        const __m256 v = alpha ? _mm256_mul_ps(t[m], _mm256_set1_ps(*alpha)) : t[m];
        const int64_t o = (out_row + m) * a->ld_out + j;
        if (a->out_kind == EG_OUT_F32) _mm256_storeu_ps((float *)a->out + o, v);
        else _mm_storeu_si128((__m128i *)((uint16_t *)a->out + o), f32x8_to_bf16(v));
    }
}
#endif

/* Group g's rows i in [0, rows) transposed into its blocks (row i at lane i % EG_KR of block
 * i / EG_KR), widened from the call's bf16 rows (exact; such groups skip the fp32 scratch);
 * the last block's missing rows 0. */
static void eg_kseq_transpose(const eg_args *a, int64_t g, int64_t block) {
    const int64_t q0 = a->q_start[g] + block * EG_KR, k = a->k;
    const int64_t rows = a->q_start[g + 1] - q0 < EG_KR ? a->q_start[g + 1] - q0 : EG_KR;
    float *dst = a->xt + a->xt_start[g] + block * EG_KR * k;
    for (int64_t r = 0; r < EG_KR; r++) {
        if (r >= rows) {
            for (int64_t e = 0; e < k; e++) dst[e * EG_KR + r] = 0.0f;
            continue;
        }
        const int64_t q = q0 + r;
        const uint16_t *src = a->x16 + (a->x_rows ? a->x_rows[q] : q) * a->ld_x;
        for (int64_t e = 0; e < k; e++) dst[e * EG_KR + r] = bf16_to_f32(src[e]);
    }
}

/* One k-order work item: rows [block * EG_ROWS, +EG_ROWS) of group g times output columns
 * [tile * EG_KCOLS, +EG_KCOLS). */
static void eg_item_kseq(const eg_args *a, int64_t g, int64_t block, int64_t tile) {
    const int64_t i0 = block * EG_ROWS, n_rows = a->q_start[g + 1] - a->q_start[g];
    const int64_t rows = n_rows - i0 < EG_ROWS ? n_rows - i0 : EG_ROWS, k = a->k;
    const int64_t j0 = tile * EG_KCOLS, n1 = j0 + EG_KCOLS < a->n ? j0 + EG_KCOLS : a->n;
    const uint8_t *we = a->w + a->g_expert[g] * a->w_expert_bytes;
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    /* the item's sums: [row block][output column][EG_KR lanes]; a register tile of EG_KNR
     * weight rows holds EG_KNR consecutive columns */
    float acc[EG_ROWS / EG_KR][EG_KCOLS][EG_KR];
    const uint16_t *w_rows[EG_KCOLS];
    for (int64_t j = j0; j < n1; j++) w_rows[j - j0] = (const uint16_t *)(we + j * a->w_row_bytes);
#ifdef MOE_EP_AVX2
    if (a->vector != EG_BODY_KSEQ_SCALAR) {
        const int64_t n_tiles = (n1 - j0 + EG_KNR - 1) / EG_KNR;
        memset(acc, 0, sizeof acc);
        /* K blocks of EG_KKC: a row block's x (EG_KR x EG_KKC fp32) stays in L1 for every
         * tile, the slab's weights (EG_KCOLS x EG_KKC bf16) in L2 for every row block */
        const int64_t step = rows <= EG_KR ? k : EG_KKC;
        for (int64_t kc = 0; kc < k; kc += step) {
            const int64_t k1 = kc + step < k ? kc + step : k;
            for (int64_t r = 0; r < rows; r += EG_KR) {
                const float *xt = a->xt + a->xt_start[g] + (i0 + r) / EG_KR * EG_KR * k;
                for (int64_t t = 0; t < n_tiles; t++) {
                    const int64_t nr = n1 - j0 - t * EG_KNR < EG_KNR ? n1 - j0 - t * EG_KNR : EG_KNR;
                    eg_kseq_tiles[rows - r > 8][nr](xt, w_rows + t * EG_KNR, kc, k1,
                                                     acc[r / EG_KR][t * EG_KNR],
                                                     r > 0 ? 0 : step == k ? EG_KPF : EG_KKC);
                }
            }
        }
    } else
#endif
        for (int64_t m = 0; m < rows; m++) {
            const float *xs_row = a->xs + (a->q_start[g] + i0 + m) * a->ldxs;
            for (int64_t j = j0; j < n1; j++)
                acc[m / EG_KR][j - j0][m % EG_KR] = eg_kseq_scalar(xs_row, w_rows[j - j0], 1, k);
        }
    /* the sums out, in 8 x 8 blocks (rows m0.., columns jb..): the AVX2 body transposes a
     * whole block in registers, the twin and partial blocks go one element at a time */
    for (int64_t m0 = 0; m0 < rows; m0 += 8)
        for (int64_t jb = j0; jb < n1; jb += 8) {
            const int64_t mr = rows - m0 < 8 ? rows - m0 : 8, out_row = a->out_row0[g] + i0 + m0;
#ifdef MOE_EP_AVX2
            if (a->vector != EG_BODY_KSEQ_SCALAR && jb + 8 <= n1) {
                eg_kseq_store8x8(a, &acc[m0 / EG_KR][jb - j0][m0 % EG_KR], mr, out_row, jb,
                                 a->alpha ? &alpha : NULL);
                continue;
            }
#endif
            for (int64_t m = m0; m < m0 + mr; m++)
                for (int64_t j = jb; j < n1 && j < jb + 8; j++)
                    eg_put(a, (out_row + m - m0) * a->ld_out + j, acc[m / EG_KR][j - j0][m % EG_KR],
                           alpha);
        }
}

/* ---------------------------------------------------------------------------------------
 * The k order on packed weights (w_kind EG_W_BF16_K16 or EG_W_E4M3_K16; EG_BODY_KSEQ, its
 * twin EG_BODY_KSEQ_SCALAR, or EG_BODY_AUTO: the first where the CPU has AVX2): each
 * expert's weights in blocks of 16 output columns, w_row_bytes apart, per block its K
 * elements in increasing k, each the 16 columns' values (column 16b + j at position j; a
 * last block's missing columns zero): bf16 values, or e4m3fn codes (EG_W_E4M3_K16, NaN-free)
 * with fp32 scales per block of s_block elements of k, each the 16 columns' scales (s_row_bytes
 * apart per column block, |s| < 2^8, finite), the weight being code * scale, one fp32
 * product (the recipes' dequantize; the packer checks both conditions). The columns are
 * the lanes and x is broadcast: per element one load gives the block's 16 weights (bf16: the
 * even columns by a shift, the odd by a mask; codes: eg_decode_e4m3_fast_avx2's short decode,
 * its product by the scale folded with 2^120), and each x row's element, broadcast once,
 * feeds two fma's; tiles of up to EG_PMR rows x 16 columns (12 ymm accumulators) run over
 * the whole of K, or, with more rows than one tile, over K blocks of EG_PKC elements whose
 * weights stay in L1 for the later tiles (codes: blocks of EG_QKC, the first tile keeping
 * the decoded values in L1 for the others, which read them: measured on Zen 3, 32 experts
 * N = K = 2048, 1.06-1.22x faster at 8-24 rows than decoding in every tile). Every output is the k order's chain (x's elements
 * times the weights' in increasing k, one fma each, from +0), so the bits are those of the
 * k-order body on the unpacked weights (bf16 x); fp32 x (the quantized formats'
 * activations, on weights whose values are exact in bf16 or codes) takes the same chain,
 * one rounding per fma. Work items: (group, EG_ROWS rows, one block of 16 columns); a group
 * of one row takes two blocks per item, in one tile of four accumulator chains (one block's
 * two wait on the fma latency: measured on Zen 3, bf16, 32-64 experts N = K = 2048, 1.33x
 * faster; codes 1.1x; the same bits).
 * Measured on Zen 3 (AVX2, the weights from DRAM, 64 experts N = K = 2048): 1.6-1.8x faster
 * than the 16-lane body at 4-12 rows per expert (docs/layer.md). */
#define EG_PCOLS 16   /* output columns of one packed block (and of a work item) */
#define EG_PMR 6      /* rows of the packed tile */
#define EG_PKC 512    /* K elements per block when an item has several row tiles */
#ifndef EG_QKC
#define EG_QKC 256    /* the same for codes (their decoded values kept in L1: 16 KiB) */
#endif
#ifndef EG_PPF
#define EG_PPF 1024   /* bytes the first row tile prefetches ahead of its weight reads */
#endif

#ifdef MOE_EP_AVX2
/* The two scale registers of a packed e4m3 block's scale row sc (16 columns in order): the
 * even columns' and the odd ones', each times 2^120 (eg_decode_e4m3_fast_avx2's factor). */
static inline __attribute__((always_inline)) void eg_k16_scales(const float *sc, __m256 *ce,
                                                                __m256 *co) {
    const __m256 lo = _mm256_loadu_ps(sc), hi = _mm256_loadu_ps(sc + 8);
    const __m256 f = _mm256_set1_ps(1.329227995784916e36f); /* 2^120 */
    const __m256 e = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(2, 0, 2, 0));
    const __m256 o = _mm256_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 1, 3, 1));
    *ce = _mm256_mul_ps(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xd8)), f);
    *co = _mm256_mul_ps(_mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xd8)), f);
}

#define EG_K16_KEEP 100 /* codes, their decoded values also stored (lane order) at keep */
#define EG_K16_KEPT 101 /* the values EG_K16_KEEP stored: fp32 in lane order, from element e0 */
/* Element e's 16 weights of a packed block p (bytes; kind EG_W_BF16_K16, EG_W_E4M3_K16 or
 * the two above, a constant at each call): the even columns' in *we, the odd ones' in *wo. */
static inline __attribute__((always_inline)) void eg_k16_weights(int32_t kind, const uint8_t *p,
                                                                 int64_t e, __m256 ce, __m256 co,
                                                                 __m256 *we, __m256 *wo) {
    if (kind == EG_K16_KEPT) {
        *we = _mm256_loadu_ps((const float *)p + e * EG_PCOLS);
        *wo = _mm256_loadu_ps((const float *)p + e * EG_PCOLS + 8);
    } else if (kind == EG_W_BF16_K16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + e * EG_PCOLS * 2));
        *we = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        *wo = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xffff0000u)));
    } else {
        const __m256i d = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + e * EG_PCOLS)));
        const __m256i keep = _mm256_set1_epi32((int)0x87f00000u);
        const __m256i ev = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 24), 4), keep);
        const __m256i od = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 16), 4), keep);
        *we = _mm256_mul_ps(_mm256_castsi256_ps(ev), ce);
        *wo = _mm256_mul_ps(_mm256_castsi256_ps(od), co);
    }
}

/* acc[n * R + r][eg_lane(j)] (r < R rows of x, ldx apart, fp32 in lane order; column j of
 * the NB blocks p + n * ldp, weight kind KIND; codes: scale rows sc + n * ldsc, one per
 * sblock elements) carried on over elements [e0, e1) of the k order, e0 a multiple of 16.
 * NB = 2 (one row: two blocks' four accumulator chains hide the fma latency that one
 * block's two would wait on) keeps every output's chain as NB = 1 has it. */
#define EG_K16_TILE(R, NB, KIND, NAME)                                                         \
    static void NAME(const float *x, int64_t ldx, const uint8_t *p, int64_t ldp,              \
                     const float *sc, int64_t ldsc, int64_t sblock, int64_t e0, int64_t e1,    \
                     float *acc, int64_t ahead, float *keep) {                                 \
        const int64_t pe0 = KIND == EG_K16_KEPT ? e0 : 0; /* p's first element */              \
        __m256 ae[NB * R], ao[NB * R], ce[NB], co[NB], we[NB], wo[NB];                         \
        const int64_t esize = KIND == EG_W_BF16_K16 ? 2 * EG_PCOLS                             \
                              : KIND == EG_K16_KEPT ? 4 * EG_PCOLS : EG_PCOLS;                  \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB * R; r++) {                             \
            ae[r] = _mm256_loadu_ps(acc + r * EG_PCOLS);                                       \
            ao[r] = _mm256_loadu_ps(acc + r * EG_PCOLS + 8);                                   \
        }                                                                                      \
        const int scaled = KIND == EG_W_E4M3_K16 || KIND == EG_K16_KEEP;                        \
        int64_t e = e0, snext = e0, sb = scaled ? e0 / sblock - 1 : 0; /* codes: in use */    \
        (void)keep;                                                                            \
        (void)ldp;                                                                             \
        (void)ldsc;                                                                            \
        for (int n = 0; n < NB; n++) ce[n] = co[n] = _mm256_setzero_ps();                      \
        for (; e < e1; e++) { /* whole chunks 16 at a time, x's lane order unrolled */         \
            if (scaled && e == snext) {                                                        \
                sb++;                                                                          \
                for (int n = 0; n < NB; n++)                                                   \
                    eg_k16_scales(sc + n * ldsc + sb * EG_PCOLS, &ce[n], &co[n]);              \
                snext = e == e0 ? (e0 / sblock + 1) * sblock : snext + sblock;                 \
            }                                                                                  \
            if ((e & 15) == 0 && e + 16 <= e1) {                                               \
                _Pragma("GCC unroll 16") for (int j = 0; j < 16; j++) {                        \
                    for (int n = 0; n < NB; n++) {                                             \
                        if (ahead && (j & 1) == 0)                                             \
                            _mm_prefetch((const char *)(p + n * ldp + (e + j) * esize) + ahead, \
                                         _MM_HINT_T0);                                         \
                        eg_k16_weights(KIND, p + n * ldp, e + j - pe0, ce[n], co[n], &we[n],   \
                                       &wo[n]);                                                \
                    }                                                                          \
                    if (KIND == EG_K16_KEEP) {                                                 \
                        _mm256_storeu_ps(keep + (e + j - e0) * EG_PCOLS, we[0]);               \
                        _mm256_storeu_ps(keep + (e + j - e0) * EG_PCOLS + 8, wo[0]);           \
                    }                                                                          \
                    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                      \
                        const __m256 b = _mm256_broadcast_ss(x + r * ldx + e + eg_lane(j));    \
                        for (int n = 0; n < NB; n++) {                                         \
                            ae[n * R + r] = _mm256_fmadd_ps(b, we[n], ae[n * R + r]);          \
                            ao[n * R + r] = _mm256_fmadd_ps(b, wo[n], ao[n * R + r]);          \
                        }                                                                      \
                    }                                                                          \
                }                                                                              \
                e += 15;                                                                       \
                continue;                                                                      \
            }                                                                                  \
            for (int n = 0; n < NB; n++)                                                       \
                eg_k16_weights(KIND, p + n * ldp, e - pe0, ce[n], co[n], &we[n], &wo[n]);      \
            if (KIND == EG_K16_KEEP) {                                                         \
                _mm256_storeu_ps(keep + (e - e0) * EG_PCOLS, we[0]);                           \
                _mm256_storeu_ps(keep + (e - e0) * EG_PCOLS + 8, wo[0]);                       \
            }                                                                                  \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                              \
                const __m256 b = _mm256_broadcast_ss(x + r * ldx + (e & ~15) + eg_lane(e & 15)); \
                for (int n = 0; n < NB; n++) {                                                 \
                    ae[n * R + r] = _mm256_fmadd_ps(b, we[n], ae[n * R + r]);                  \
                    ao[n * R + r] = _mm256_fmadd_ps(b, wo[n], ao[n * R + r]);                  \
                }                                                                              \
            }                                                                                  \
        }                                                                                      \
        _Pragma("GCC unroll 8") for (int r = 0; r < NB * R; r++) {                             \
            _mm256_storeu_ps(acc + r * EG_PCOLS, ae[r]);                                       \
            _mm256_storeu_ps(acc + r * EG_PCOLS + 8, ao[r]);                                   \
        }                                                                                      \
    }
#define EG_K16_TILES(KIND, NAME)                                                               \
    EG_K16_TILE(1, 1, KIND, NAME##_1) EG_K16_TILE(2, 1, KIND, NAME##_2)                        \
    EG_K16_TILE(3, 1, KIND, NAME##_3) EG_K16_TILE(4, 1, KIND, NAME##_4)                        \
    EG_K16_TILE(5, 1, KIND, NAME##_5) EG_K16_TILE(6, 1, KIND, NAME##_6)
EG_K16_TILES(EG_W_BF16_K16, eg_k16_tile)
EG_K16_TILES(EG_W_E4M3_K16, eg_k16q_tile)
EG_K16_TILES(EG_K16_KEEP, eg_k16qk_tile)
EG_K16_TILES(EG_K16_KEPT, eg_k16f_tile)
EG_K16_TILE(1, 2, EG_W_BF16_K16, eg_k16_tile_pair)
EG_K16_TILE(1, 2, EG_W_E4M3_K16, eg_k16q_tile_pair)
#undef EG_K16_TILES
#undef EG_K16_TILE
typedef void (*eg_k16_tile_fn)(const float *, int64_t, const uint8_t *, int64_t, const float *,
                               int64_t, int64_t, int64_t, int64_t, float *, int64_t, float *);
#define EG_K16_ROW(name) {NULL, name##_1, name##_2, name##_3, name##_4, name##_5, name##_6}
/* by weight kind: bf16, codes, codes kept, the kept values */
static const eg_k16_tile_fn eg_k16_tiles[4][EG_PMR + 1] = {
    EG_K16_ROW(eg_k16_tile), EG_K16_ROW(eg_k16q_tile), EG_K16_ROW(eg_k16qk_tile),
    EG_K16_ROW(eg_k16f_tile)};
#undef EG_K16_ROW
/* one row times two blocks, by weight kind: bf16, codes */
static const eg_k16_tile_fn eg_k16_pairs[2] = {eg_k16_tile_pair, eg_k16q_tile_pair};
#endif

/* One output of the k order from an fp32 scratch row in lane order and packed e4m3 codes
 * c[e * EG_PCOLS] with their scales sc[(e / sblock) * EG_PCOLS] (one column of a block). */
static float eg_k16q_scalar(const float *xs_row, const uint8_t *c, const float *sc,
                            int64_t sblock, int64_t k) {
    float acc = 0.0f;
    for (int64_t e = 0; e < k; e++)
        acc = __builtin_fmaf(eg_lane_elem(xs_row, e),
                             e4m3_value[c[e * EG_PCOLS]] * sc[e / sblock * EG_PCOLS], acc);
    return acc;
}

/* One packed work item: rows [block * EG_ROWS, +EG_ROWS) of group g times the 16 columns of
 * packed block b, or, for a group of one row (eg_k16_items), packed blocks b and b + 1
 * (the second where there is one). */
static void eg_item_k16(const eg_args *a, int64_t g, int64_t block, int64_t b) {
    const int64_t i0 = block * EG_ROWS, n_rows = a->q_start[g + 1] - a->q_start[g];
    const int64_t rows = n_rows - i0 < EG_ROWS ? n_rows - i0 : EG_ROWS, k = a->k;
    const int64_t nblocks = (a->n + EG_PCOLS - 1) / EG_PCOLS;
    const int64_t nb = n_rows == 1 && b + 1 < nblocks ? 2 : 1; /* blocks of this item */
    const uint8_t *p = a->w + a->g_expert[g] * a->w_expert_bytes + b * a->w_row_bytes;
    const int codes = a->w_kind == EG_W_E4M3_K16;
    const float *sc = codes ? (const float *)(a->s + a->g_expert[g] * a->s_expert_bytes +
                                              b * a->s_row_bytes)
                            : NULL;
    const int64_t ldsc = a->s_row_bytes / (int64_t)sizeof(float);
    const float *x = a->xs + (a->q_start[g] + i0) * a->ldxs;
    float acc[EG_ROWS][EG_PCOLS]; /* column j of row m at acc[m][eg_lane(j)]; a pair: block
                                   * b + n in acc[n] */
#ifdef MOE_EP_AVX2
    if (a->vector != EG_BODY_KSEQ_SCALAR) {
        memset(acc, 0, sizeof(float) * (size_t)((rows > nb ? rows : nb) * EG_PCOLS));
        /* codes in several tiles: the first decodes each K block once, keeping the values
         * in L1 (kept) for the others */
        const int64_t tiles = (rows + EG_PMR - 1) / EG_PMR;
        const int64_t step = tiles == 1 ? k : codes ? EG_QKC : EG_PKC;
        float kept[EG_QKC * EG_PCOLS] __attribute__((aligned(64)));
        if (nb == 2)
            eg_k16_pairs[codes](x, a->ldxs, p, a->w_row_bytes, sc, ldsc, a->s_block, 0, k,
                                acc[0], EG_PPF, NULL);
        else
            for (int64_t kc = 0; kc < k; kc += step) {
                const int64_t k1 = kc + step < k ? kc + step : k;
                for (int64_t t = 0; t < tiles; t++) {
                    const int64_t r0 = rows * t / tiles, r1 = rows * (t + 1) / tiles;
                    const int kind = !codes ? 0 : tiles == 1 ? 1 : t == 0 ? 2 : 3;
                    eg_k16_tiles[kind][r1 - r0](x + r0 * a->ldxs, a->ldxs,
                                                kind == 3 ? (const uint8_t *)kept : p, 0, sc,
                                                0, a->s_block, kc, k1, acc[r0],
                                                t == 0 ? EG_PPF : 0, kept);
                }
            }
    } else
#endif
        for (int64_t n = 0; n < nb; n++) {
            const int64_t nc = a->n - (b + n) * EG_PCOLS < EG_PCOLS ? a->n - (b + n) * EG_PCOLS
                                                                   : EG_PCOLS;
            const uint8_t *pn = p + n * a->w_row_bytes;
            for (int64_t m = 0; m < rows; m++)
                for (int64_t j = 0; j < nc; j++)
                    acc[m + n][eg_lane(j)] =
                        codes ? eg_k16q_scalar(x + m * a->ldxs, pn + j, sc + n * ldsc + j,
                                               a->s_block, k)
                              : eg_kseq_scalar(x + m * a->ldxs, (const uint16_t *)pn + j,
                                               EG_PCOLS, k);
        }
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    for (int64_t n = 0; n < nb; n++) {
        const int64_t j0 = (b + n) * EG_PCOLS, nc = a->n - j0 < EG_PCOLS ? a->n - j0 : EG_PCOLS;
        for (int64_t m = 0; m < rows; m++)
            for (int64_t j = 0; j < nc; j++)
                eg_put(a, (a->out_row0[g] + i0 + m) * a->ld_out + j0 + j, acc[m + n][eg_lane(j)],
                       alpha);
    }
}

/* The packed items of a group of `rows` rows: one per EG_ROWS rows and block, but one per
 * two blocks for a single row (eg_item_k16). */
static inline int64_t eg_k16_items(int64_t rows, int64_t nblocks) {
    return rows == 1 ? (nblocks + 1) / 2 : (rows + EG_ROWS - 1) / EG_ROWS * nblocks;
}

/* Rows [0, cols) of dst (fp32, ld_dst apart, k elements each) = the packed e4m3 columns
 * [0, cols) (column 16b + j of block b: codes p + b * ld_p, element e at byte 16 e + j;
 * scales sc + b * ld_sc floats, block kb's at 16 kb + j): code * scale, one fp32 product
 * each (eg_item_k16's weights, the recipes' dequantize), for the `mm` blocks of experts
 * above the crossover (_mm_k16). */
void moe_ep_widen_k16(const uint8_t *p, int64_t ld_p, const float *sc, int64_t ld_sc,
                      int64_t s_block, int64_t cols, int64_t k, float *dst, int64_t ld_dst,
                      int32_t threads) {
    (void)threads;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && cols > 16)
    for (int64_t c = 0; c < cols; c++) {
        const uint8_t *col = p + c / EG_PCOLS * ld_p + c % EG_PCOLS;
        const float *s = sc + c / EG_PCOLS * ld_sc + c % EG_PCOLS;
        float *out = dst + c * ld_dst;
        for (int64_t kb = 0; kb * s_block < k; kb++) {
            const float scale = s[kb * EG_PCOLS];
            const int64_t e1 = (kb + 1) * s_block < k ? (kb + 1) * s_block : k;
            for (int64_t e = kb * s_block; e < e1; e++) out[e] = e4m3_value[col[e * EG_PCOLS]] * scale;
        }
    }
}

/* ---------------------------------------------------------------------------------------
 * The AMX bodies (EG_BODY_AMX: AMX-BF16 `tdpbf16ps`; its scalar twin EG_BODY_AMX_SCALAR),
 * for operands exact in bf16: bf16 or fp32 activations (an fp32 value past bf16's 8 bits is
 * refused: -4), and bf16 weights or codes whose dequantized values are (e4m3 with E8M0
 * scales, e2m1 with e4m3 or E8M0 scales: `code * scale` in fp32, the recipe's value, has at
 * most 6 significant bits; a subnormal one reads as zero, as the instruction reads a
 * subnormal input), in their own order, the "AMX order": K padded
 * to a multiple of 32 with zeros; per 32-chunk c in increasing c, two chains from +0 over
 * its 16 pairs p in increasing p,
 *   e = ftz(fma(daz(x[32c + 2p]), daz(w[32c + 2p]), e)),
 *   o = ftz(fma(daz(x[32c + 2p + 1]), daz(w[32c + 2p + 1]), o)),
 * then acc = ftz(acc + ftz(e + o)) (acc from +0; each bf16 x bf16 product exact, one RNE
 * rounding per step; daz / ftz as the dot bodies'); then times alpha, rounded to bf16 or
 * stored as fp32 as above. That is the instruction's arithmetic as measured on an Intel
 * Xeon with AMX (a C probe against emulations: this matched all 6.4M lanes of eight data
 * classes, random, wide exponents, cancellation, bf16 subnormals, tiny and huge products,
 * subnormal accumulators; one chain in k order, the two chains added to acc one after the
 * other, or products flushed before the adds each missed 0.35-2.2M of them).
 * bf16 weights are the A tiles where they are stored (16 weight rows x one 32-chunk, the
 * row stride apart; a last partial chunk or partial block of 16 rows through a zero-padded
 * buffer), prefetched EG_AMX_PF chunks ahead into L2. Codes are decoded first, per work item
 * into the thread's buffer (`dec`, all its whole chunks, row-major: each decoded row
 * written in order, as the A tiles' rows a padded row stride apart), each weight row read
 * in memory order and prefetched EG_AMX_DPF bytes ahead: unscaled e4m3 (fp8's block-scaled
 * order) 64 at a time by byte tables (eg_amx_e4m3_lut), other codes 32 at a time in 16-bit
 * lanes (e4m3 by adding the scale's exponent to the code's bf16 bits, e2m1 by looking the
 * codes up in a table of the 16 products per scale byte), element by element where that
 * cannot give the definition's bits (NaN codes, e8m0 products past bf16's normals, a K
 * tail). The activations are the B tiles: each group's rows packed once per call into
 * blocks of 16 rows, per chunk the 16 x 16 pairs in the tile's layout (`xv`), 1 KiB per
 * chunk, transposed in registers (eg_transpose16), as the C tiles' sums are on their way
 * out. Work items: (group, EG_AMX_ROWS
 * rows, EG_AMX_COLS output columns), run as 2 x 2 tiles (eg_item_amx), or for bf16 weights
 * and more than 32 rows as one block of weight rows against up to four row blocks
 * (eg_amx_sweeps). Each thread configures its tiles once per call and releases them after. */
#define EG_AMX_ROWS 256 /* rows per AMX work item (passes of 2 x 16 rows) */
#define EG_AMX_COLS 32 /* output columns per AMX work item (blocks of 16 weight rows) */
#ifndef EG_AMX_PF
#define EG_AMX_PF 4 /* bf16 weights' prefetch distance in 32-element chunks (16: 1.05x slower
                         * at 1-8 rows, 64 of 64 experts' weights from DRAM; 1.2-1.3x at 32-64
                         * rows; 1-4 level) */
#endif
#ifndef EG_AMX_DPF
#define EG_AMX_DPF 2048 /* bytes a decoded row's codes are prefetched ahead (into L1) */
#endif
#ifndef EG_AMX_ICH
#define EG_AMX_ICH 4 /* chunks decoded at a time in one pass of codes (eg_item_amx) */
#endif
#define EG_AMX_BLOCK(k32) ((k32) * 16) /* bf16 elements of one packed 16-row block */
#define EG_AMX_LDD(k32) ((k32) + 32) /* elements from one decoded weight row to the next: a line
                                        * of padding, so that a tile's rows do not share L1 sets */

/* bf16 bits of fp32 v, subnormals to a zero of their sign (daz), truncated: exact for the
 * AMX bodies' operands; *inexact set when the dropped bits are not all zero. */
static inline uint16_t eg_amx_bits(float v, int32_t *inexact) {
    bits32 b;
    b.f = eg_flush(v);
    if (b.u & 0xffffu) *inexact = 1;
    return (uint16_t)(b.u >> 16);
}

/* bf16 bits of e2m1 code c times scale byte s, the product as eg_amx_w_bits forms it:
 * eg_e2m1_scaled[0][s][c] for e8m0 scales (byte 127: unscaled), [1][s][c] for e4m3 ones. */
static uint16_t eg_e2m1_scaled[2][256][16] __attribute__((aligned(32)));

__attribute__((constructor(102))) static void fill_e2m1_scaled(void) {
    int32_t unused = 0;
    for (int s = 0; s < 256; s++)
        for (int c = 0; c < 16; c++) {
            eg_e2m1_scaled[0][s][c] = eg_amx_bits(e2m1_value[c] * e8m0_value((uint8_t)s), &unused);
            eg_e2m1_scaled[1][s][c] = eg_amx_bits(e2m1_value[c] * e4m3_value[s], &unused);
        }
}

/* Weight element i of a row (codes w_row, scales s_row) as bf16 bits: bf16 as stored, a
 * code times its scale (the fp32 product of eg_code and eg_scale) otherwise. */
static inline uint16_t eg_amx_w_bits(const eg_args *a, const uint8_t *w_row, const uint8_t *s_row,
                                     int64_t i) {
    if (a->w_kind == EG_W_BF16) return ((const uint16_t *)w_row)[i];
    int32_t unused = 0;
    const float s = a->s_kind != EG_S_NONE ? eg_scale(s_row, a->s_kind, i / a->s_block) : 1.0f;
    return eg_amx_bits(eg_code(w_row, a->w_kind, i) * s, &unused);
}

/* Element i of call row q of x as bf16 bits (an fp32 x checked exact). */
static inline uint16_t eg_amx_x_bits(const eg_args *a, int64_t q, int64_t i) {
    const int64_t row = a->x_rows ? a->x_rows[q] : q;
    if (a->x_kind == EG_X_BF16) return a->x16[row * a->ld_x + i];
    if (a->x_kind == EG_X_E4M3) { /* the code's value, exact in bf16 (NaN: a quiet one) */
        bits32 b;
        b.f = e4m3_value[((const uint8_t *)a->x16)[row * a->ld_x + i]];
        return (uint16_t)(b.u >> 16);
    }
    return eg_amx_bits(((const float *)a->x16)[row * a->ld_x + i], a->inexact);
}

/* The block-scaled AMX order's scale of call row q of x and weight row ws_row's scales,
 * sum block b: fp32(x scale * weight scale) (no weight scales, ws_row NULL: the x scale). */
static inline float eg_bs_scale(const eg_args *a, int64_t q, const float *ws_row, int64_t b) {
    const int64_t row = a->x_rows ? a->x_rows[q] : q;
    const float sx = a->xsc[row * a->ld_xsc + b * a->bs_block / a->x_block];
    return ws_row ? sx * ws_row[b * a->bs_block / a->ws_block] : sx;
}

/* One output of the AMX order, element by element (the twin and the definition): call row
 * q of x times weight row w_row (scales s_row); in the block-scaled order (a->bs_block;
 * ws_row: the row's fp32 scales, or NULL) each sum block's AMX-order sum from +0, p, then
 * acc = fma(p, eg_bs_scale, acc) in increasing blocks from +0. */
static float eg_amx_scalar(const eg_args *a, int64_t q, const uint8_t *w_row, const uint8_t *s_row,
                           const float *ws_row) {
    const int64_t k = a->k;
    float acc = 0.0f, bs = 0.0f;
    for (int64_t c = 0; c < k; c += EG_DOT) {
        float e = 0.0f, o = 0.0f;
        for (int64_t i = c; i < c + EG_DOT; i += 2) {
            const float xe = i < k ? bf16_to_f32(eg_amx_x_bits(a, q, i)) : 0.0f;
            const float we = i < k ? bf16_to_f32(eg_amx_w_bits(a, w_row, s_row, i)) : 0.0f;
            const float xo = i + 1 < k ? bf16_to_f32(eg_amx_x_bits(a, q, i + 1)) : 0.0f;
            const float wo = i + 1 < k ? bf16_to_f32(eg_amx_w_bits(a, w_row, s_row, i + 1)) : 0.0f;
            e = eg_flush(__builtin_fmaf(eg_flush(xe), eg_flush(we), e));
            o = eg_flush(__builtin_fmaf(eg_flush(xo), eg_flush(wo), o));
        }
        acc = eg_flush(acc + eg_flush(e + o));
        if (a->bs_block && (c + EG_DOT) % a->bs_block == 0) { /* the end of a sum block */
            bs = __builtin_fmaf(acc, eg_bs_scale(a, q, ws_row, c / a->bs_block), bs);
            acc = 0.0f;
        }
    }
    return a->bs_block ? bs : acc;
}

/* Writes the sums of 16 weight rows (from output column j, nr of them) x rows [m0, m0 +
 * mr) of the item: sums[r * 16 + m], column j + r, row m. */
static void eg_amx_store(const eg_args *a, const float *sums, int64_t out_row, int64_t mr,
                         int64_t j, int64_t nr, float alpha) {
    for (int64_t m = 0; m < mr; m++)
        for (int64_t r = 0; r < nr; r++)
            eg_put(a, (out_row + m) * a->ld_out + j + r, sums[r * 16 + m], alpha);
}

#if defined(MOE_EP_AVX2) && defined(__x86_64__) && defined(__linux__) &&                        \
    ((defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11) ||                           \
     (defined(__clang__) && __clang_major__ >= 12))
#define MOE_EP_AMX_GEMM 1
#include <cpuid.h>
#include <sys/syscall.h>
extern long syscall(long number, ...); /* glibc's; <unistd.h> declares it only past -std=c11 */
#define EG_AMX \
    __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512vbmi,avx2,fma")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} eg_tilecfg;

/* Whether this CPU has AMX-TILE, AMX-BF16 and AVX512-VBMI (every CPU with AMX so far) and
 * Linux lets this process use the tiles (asked once: arch_prctl(ARCH_REQ_XCOMP_PERM,
 * XFEATURE_XTILEDATA)). */
static int eg_amx_supported(void) {
    static int ok = -1; /* a race here asks twice, with the same answer */
    if (ok < 0) {
        unsigned eax, ebx, ecx, edx;
        const int cpu = __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) && (edx >> 22 & 1) &&
                        (edx >> 24 & 1) && (ecx >> 1 & 1);
        ok = cpu && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return ok;
}

/* Tiles 0-7 as 16 rows of 64 bytes (the C, A and B tiles of eg_item_amx). */
static EG_AMX void eg_amx_configure(void) {
    eg_tilecfg cfg __attribute__((aligned(64)));
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

static EG_AMX void eg_amx_release(void) { _tile_release(); }

/* Share `step` of `steps` of the spans' lines prefetched into L2 (the thread's next work
 * item's weights, a share per step of this one's loop). */
static inline __attribute__((always_inline)) void eg_prefetch_share(const eg_span next[2],
                                                                    int64_t step, int64_t steps) {
    for (int i = 0; i < 2; i++) {
        const int64_t lines = (next[i].bytes + 63) / 64, per = (lines + steps - 1) / steps;
        for (int64_t l = step * per; l < (step + 1) * per && l < lines; l++)
            _mm_prefetch((const char *)next[i].p + 64 * l, _MM_HINT_T1);
    }
}

/* Weight row w_row's (scales s_row) elements [32c, 32c + 32) as bf16 at dst, zeros past K:
 * whole chunks of e4m3 / e2m1 codes decoded 16 at a time (the fp32 value of
 * eg_decode_chunk_avx512, times the scale, daz, truncated), the rest element by element. */
static EG_AMX void eg_amx_decode(const eg_args *a, const uint8_t *w_row, const uint8_t *s_row,
                                 int64_t c, uint16_t *dst) {
    const int64_t i0 = c * EG_DOT;
    if (a->w_kind == EG_W_BF16 || i0 + EG_DOT > a->k) {
        for (int64_t i = 0; i < EG_DOT; i++)
            dst[i] = i0 + i < a->k ? eg_amx_w_bits(a, w_row, s_row, i0 + i) : 0;
        return;
    }
    for (int64_t i = i0; i < i0 + EG_DOT; i += EG_LANES) {
        __m512 f;
        if (a->w_kind == EG_W_E4M3) {
            f = e4m3x16_value(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w_row + i))));
        } else { /* e2m1: element 2m in byte m's low nibble */
            const __m128i pairs = _mm_loadl_epi64((const __m128i *)(w_row + i / 2));
            const __m512i b = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(pairs, pairs));
            const __m512i shift = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
            f = _mm512_permutexvar_ps(_mm512_srlv_epi32(b, shift), _mm512_loadu_ps(e2m1_value));
        }
        if (a->s_kind != EG_S_NONE)
            f = _mm512_mul_ps(f, _mm512_set1_ps(eg_scale(s_row, a->s_kind, i / a->s_block)));
        __m512i u = _mm512_castps_si512(f);
        const __mmask16 sub = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(0x7f800000));
        u = _mm512_mask_and_epi32(u, sub, u, _mm512_set1_epi32((int)0x80000000u));
        _mm256_storeu_si256((__m256i *)(dst + (i - i0)),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    }
}

/* bf16 bits of e4m3 magnitudes 1-7 (subnormal codes, m * 2^-9) less 0x3c00, mod 2^16. */
static const uint16_t eg_e4m3_sub_rel[32] = {0, 0xff00, 0xff80, 0xffc0, 0, 0x20, 0x40, 0x60};

/* e8m0 scale byte s -> 0x3c00 + (s - 127) << 7 (mod 2^16) in both halves: what
 * eg_amx_e4m3_fast adds to a normal code's shifted magnitude (a broadcast load, no shuffle). */
static uint32_t eg_e4m3_bias2[256];

__attribute__((constructor(103))) static void fill_e4m3_bias2(void) {
    for (int s = 0; s < 256; s++)
        eg_e4m3_bias2[s] = (uint32_t)(uint16_t)(0x3c00 + (s - 127) * 128) * 0x10001u;
}

/* eg_amx_decode of a whole chunk of e4m3 codes in 16-bit lanes, 32 at once: a normal
 * code's bf16 bits are its magnitude's shifted left by 4 plus 120 << 7 (the exponents'
 * bias difference), a subnormal (or zero) code's from a table; an e8m0 scale 2^(s - 127)
 * adds (s - 127) << 7 to the exponent of every nonzero value (bias2: eg_e4m3_bias2[s]).
 * Exact, so the same bits as eg_amx_decode, where every result stays a bf16 normal (scale
 * bytes 10-246: code exponents span -9..8) and no code is NaN; returns 0 with nothing
 * written otherwise. */
static inline __attribute__((always_inline)) EG_AMX int eg_amx_e4m3_fast(const uint8_t *codes,
                                                                       const uint32_t *bias2,
                                                                       uint16_t *dst) {
    const __m512i sx = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)codes));
    const __m512i mag = _mm512_and_si512(sx, _mm512_set1_epi16(0x7f));
    if (_mm512_cmpeq_epi16_mask(mag, _mm512_set1_epi16(0x7f))) return 0;
    const __m512i k = _mm512_set1_epi32((int)*bias2);
    /* subnormal bits plus add; magnitude 0 -> 0 */
    const __m512i sub = _mm512_maskz_add_epi16(0xfffffffeu, _mm512_loadu_si512(eg_e4m3_sub_rel), k);
    __m512i r = _mm512_add_epi16(_mm512_slli_epi16(mag, 4), k);
    r = _mm512_mask_permutexvar_epi16(r, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(8)), mag,
                                      sub);
    r = _mm512_ternarylogic_epi32(r, sx, _mm512_set1_epi16((short)0x8000),
                                  0xf8); /* r | (sx & 0x8000): the sign */
    _mm512_storeu_si512(dst, r);
    return 1;
}

/* Unscaled e4m3 codes' bf16 bits by magnitude (eg_amx_decode's: NaN 0x7fc0), their low
 * and high bytes, for eg_amx_e4m3_lut's byte lookups. */
static uint8_t eg_e4m3_lo[128] __attribute__((aligned(64))), eg_e4m3_hi[128]
    __attribute__((aligned(64)));

__attribute__((constructor(103))) static void fill_e4m3_bytes(void) {
    for (int m = 0; m < 128; m++) {
        bits32 v;
        v.f = e4m3_value[m];
        eg_e4m3_lo[m] = (uint8_t)(v.u >> 16);
        eg_e4m3_hi[m] = (uint8_t)(v.u >> 24);
    }
}

/* eg_amx_decode of two whole chunks of unscaled e4m3 codes (64; the first `halves` 32-code
 * chunks read and written: 1 or 2): the codes reordered so that a 128-bit lane holds 8 of
 * each half (one byte permute), each code's low and high bf16 bytes looked up by its
 * magnitude in 128-byte tables (two more), the sign put on the high byte, the bytes
 * interleaved into 16-bit lanes (unpacks within the lanes: code order). Half the vector
 * instructions of eg_amx_e4m3_fast per code and no exceptions to test: the same bits,
 * but a NaN code keeps its sign (eg_amx_decode's NaN has none). */
static inline __attribute__((always_inline)) EG_AMX void eg_amx_e4m3_lut(const uint8_t *codes,
                                                                       int halves,
                                                                       uint16_t *dst) {
    /* lane l: codes 8l..8l+7, then 32+8l..32+8l+7 */
    const __m512i order = _mm512_set_epi8(
        63, 62, 61, 60, 59, 58, 57, 56, 31, 30, 29, 28, 27, 26, 25, 24, 55, 54, 53, 52, 51, 50,
        49, 48, 23, 22, 21, 20, 19, 18, 17, 16, 47, 46, 45, 44, 43, 42, 41, 40, 15, 14, 13, 12,
        11, 10, 9, 8, 39, 38, 37, 36, 35, 34, 33, 32, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i b = _mm512_permutexvar_epi8(
        order, halves == 2 ? _mm512_loadu_si512(codes) : _mm512_maskz_loadu_epi8(0xffffffffu, codes));
    const __m512i lo = _mm512_permutex2var_epi8(_mm512_load_si512(eg_e4m3_lo), b,
                                                _mm512_load_si512(eg_e4m3_lo + 64));
    __m512i hi = _mm512_permutex2var_epi8(_mm512_load_si512(eg_e4m3_hi), b,
                                          _mm512_load_si512(eg_e4m3_hi + 64));
    hi = _mm512_ternarylogic_epi32(hi, b, _mm512_set1_epi8((char)0x80), 0xf8); /* hi | b & c */
    _mm512_storeu_si512(dst, _mm512_unpacklo_epi8(lo, hi));
    if (halves == 2) _mm512_storeu_si512(dst + EG_DOT, _mm512_unpackhi_epi8(lo, hi));
}

/* eg_amx_decode of a whole chunk of e2m1 codes in 16-bit lanes, 32 at once: each looked up
 * in the 16 products code x scale of its half's scale (t0: elements [0, 16), t1: [16, 32);
 * rows of eg_e2m1_scaled; one: t0 is t1, a block of 32 or more). The tables come in by
 * broadcast loads (and a blend where the halves differ), not a lane insert. */
static inline __attribute__((always_inline)) EG_AMX void eg_amx_e2m1_fast(const uint8_t *codes,
                                                                        const uint16_t *t0,
                                                                        const uint16_t *t1, int one,
                                                                        uint16_t *dst) {
    __m512i table = _mm512_broadcast_i64x4(_mm256_load_si256((const __m256i *)t0));
    if (!one)
        table = _mm512_mask_broadcast_i64x4(table, 0xf0, _mm256_load_si256((const __m256i *)t1));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
    /* element 2m: byte m's low nibble (word 2m), 2m + 1 its high one; +16 in the upper half */
    __m512i idx = _mm512_ternarylogic_epi32(b, _mm512_slli_epi32(b, 12),
                                            _mm512_set1_epi32(0x000f000f), 0xa8); /* (b | b << 12) & c */
    if (!one)
        idx = _mm512_or_si512(idx, _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0x00100010,
                                                     0x00100010, 0x00100010, 0x00100010,
                                                     0x00100010, 0x00100010, 0x00100010,
                                                     0x00100010));
    _mm512_storeu_si512(dst, _mm512_permutexvar_epi16(idx, table));
}

static const uint8_t eg_unscaled = 127; /* the scale byte of unscaled codes: 2^0 as e8m0 */

/* The scale byte of chunk c's half (elements [0, 16) or [16, 32)), block sb (0: one
 * scale byte for the row). */
static inline __attribute__((always_inline)) int64_t eg_amx_s_at(int64_t c, int64_t half,
                                                                 int64_t sb) {
    return sb == 0 ? 0 : sb == 16 ? 2 * c + half : sb == EG_DOT ? c : (c * EG_DOT + 16 * half) / sb;
}

/* Rows [0, nr) of e2m1 codes at w (ldw bytes apart; scales s, lds apart, block sb as
 * eg_amx_s_at), whole chunks [c0, c1), decoded by eg_amx_e2m1_fast with the products of
 * table t into buf (row r's chunk c at buf + r * ldd + (c - c0) * EG_DOT), each row's codes
 * prefetched pf bytes ahead (none: 0). */
static inline __attribute__((always_inline)) EG_AMX void eg_amx_e2m1_rows(
    const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds, int64_t sb, int64_t nr,
    int64_t c0, int64_t c1, const uint16_t (*t)[16], uint16_t *buf, int64_t ldd, int64_t pf) {
#define EG_E2M1_CHUNK(c)                                                                       \
    eg_amx_e2m1_fast(wr + (c) * (EG_DOT / 2), t[sr[eg_amx_s_at(c, 0, sb)]],                     \
                     t[sr[eg_amx_s_at(c, 1, sb)]], sb % EG_DOT == 0, dr + ((c) - c0) * EG_DOT)
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *wr = w + r * ldw, *sr = s + r * lds;
        uint16_t *dr = buf + r * ldd;
        int64_t c = c0;
        for (; c + 4 <= c1; c += 4) { /* a line of codes (four chunks) at a time: one
                                       * prefetch and one loop test per line */
            if (pf) _mm_prefetch((const char *)wr + c * (EG_DOT / 2) + pf, _MM_HINT_T0);
            EG_E2M1_CHUNK(c);
            EG_E2M1_CHUNK(c + 1);
            EG_E2M1_CHUNK(c + 2);
            EG_E2M1_CHUNK(c + 3);
        }
        for (; c < c1; c++) EG_E2M1_CHUNK(c);
    }
#undef EG_E2M1_CHUNK
}

/* Rows [0, nr) of e4m3 codes at w (ldw bytes apart; e8m0 scales s, lds apart, block sb a
 * multiple of EG_DOT, as eg_amx_s_at; unscaled codes go through eg_amx_e4m3_lut), whole
 * chunks [c0, c1), decoded by
 * eg_amx_e4m3_fast into buf as eg_amx_e2m1_rows; returns whether a chunk was left
 * undecoded (a NaN code, a scale byte outside 10-246). */
static inline __attribute__((always_inline)) EG_AMX int eg_amx_e4m3_rows(
    const uint8_t *w, int64_t ldw, const uint8_t *s, int64_t lds, int64_t sb, int64_t nr,
    int64_t c0, int64_t c1, uint16_t *buf, int64_t ldd, int64_t pf) {
    int slow = 0;
    for (int64_t r = 0; r < nr; r++) {
        const uint8_t *wr = w + r * ldw, *sr = s + r * lds;
        for (int64_t c = c0; c < c1; c++) {
            if (pf && (c & 1) == 0) /* a line holds two chunks */
                _mm_prefetch((const char *)wr + c * EG_DOT + pf, _MM_HINT_T0);
            const int32_t sc = sr[eg_amx_s_at(c, 0, sb)];
            if (sc < 10 || sc > 246 ||
                !eg_amx_e4m3_fast(wr + c * EG_DOT, eg_e4m3_bias2 + sc,
                                  buf + r * ldd + (c - c0) * EG_DOT))
                slow = 1;
        }
    }
    return slow;
}

/* Weight rows [j, j + nr) of the expert at we (scales se), whole chunks [c0, c1) of codes,
 * decoded into 16 rows at buf (row r ldd elements apart, its chunks in order: chunk c's A
 * tile at buf + (c - c0) * EG_DOT, stride ldd; zero rows past nr), each row's codes
 * prefetched pf bytes ahead (none: 0): row by row, each in memory order and written in
 * order, by the 16-bit-lane decodes where they apply, eg_amx_decode otherwise. */
static EG_AMX void eg_amx_decode_rows(const eg_args *a, const uint8_t *we, const uint8_t *se,
                                      int64_t j, int64_t nr, int64_t c0, int64_t c1,
                                      uint16_t *buf, int64_t ldd, int64_t pf) {
    const int64_t ldw = a->w_row_bytes, sb = a->s_block, lds = se ? a->s_row_bytes : 0;
    const uint8_t *w = we + j * ldw, *s = se ? se + j * lds : &eg_unscaled;
    const int64_t sbk = se ? sb : 0; /* eg_amx_s_at's block: 0 reads the one unscaled byte */
    if (a->w_kind == EG_W_E4M3 && a->s_kind == EG_S_NONE) { /* fp8's block-scaled order */
        for (int64_t r = 0; r < nr; r++) {
            const uint8_t *wr = w + r * ldw;
            uint16_t *dr = buf + r * ldd;
            for (int64_t c = c0; c < c1; c += 2) { /* a line of codes at a time */
                if (pf) _mm_prefetch((const char *)wr + c * EG_DOT + pf, _MM_HINT_T0);
                eg_amx_e4m3_lut(wr + c * EG_DOT, c + 1 < c1 ? 2 : 1, dr + (c - c0) * EG_DOT);
            }
        }
    } else if (a->w_kind == EG_W_E4M3 && a->s_kind == EG_S_E8M0 && sb % EG_DOT == 0) {
        /* one e8m0 scale per chunk; the chunks eg_amx_e4m3_fast does not cover after, so
         * that no call breaks the loop; mxfp8's block size as a constant (no branch per
         * chunk) */
        const int slow =
            sbk == EG_DOT ? eg_amx_e4m3_rows(w, ldw, s, lds, EG_DOT, nr, c0, c1, buf, ldd, pf)
                          : eg_amx_e4m3_rows(w, ldw, s, lds, sbk, nr, c0, c1, buf, ldd, pf);
        for (int64_t r = 0; slow && r < nr; r++) /* every chunk again, element by element */
            for (int64_t c = c0; c < c1; c++) {
                const int32_t sc = s[r * lds + eg_amx_s_at(c, 0, sbk)];
                uint16_t *dst = buf + r * ldd + (c - c0) * EG_DOT;
                if (sc < 10 || sc > 246 ||
                    !eg_amx_e4m3_fast(w + r * ldw + c * EG_DOT, eg_e4m3_bias2 + sc, dst))
                    eg_amx_decode(a, w + r * ldw, s + r * lds, c, dst);
            }
    } else if (a->w_kind == EG_W_E2M1 && a->s_kind != EG_S_F32) {
        const uint16_t(*t)[16] = eg_e2m1_scaled[a->s_kind == EG_S_E4M3];
        /* the formats' block sizes as constants (no division per chunk) */
        if (sbk == 16) eg_amx_e2m1_rows(w, ldw, s, lds, 16, nr, c0, c1, t, buf, ldd, pf);
        else if (sbk == EG_DOT)
            eg_amx_e2m1_rows(w, ldw, s, lds, EG_DOT, nr, c0, c1, t, buf, ldd, pf);
        else eg_amx_e2m1_rows(w, ldw, s, lds, sbk, nr, c0, c1, t, buf, ldd, pf);
    } else {
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = c0; c < c1; c++)
                eg_amx_decode(a, w + r * ldw, s + r * lds, c, buf + r * ldd + (c - c0) * EG_DOT);
    }
    for (int64_t r = nr; r < 16; r++)
        memset(buf + r * ldd, 0, sizeof(uint16_t) * (size_t)((c1 - c0) * EG_DOT));
}

/* An item's weight rows [j, j + nr0) and [j + 16, j + 16 + nr1) (nr1 may be 0), whole
 * chunks [c0, c1), by eg_amx_decode_rows into buf's two 16-row blocks (the second 16 * ldd
 * elements on). */
static inline __attribute__((always_inline)) EG_AMX void eg_amx_decode_item(
    const eg_args *a, const uint8_t *we, const uint8_t *se, int64_t j, int64_t nr0,
    int64_t nr1, int64_t c0, int64_t c1, uint16_t *buf, int64_t ldd, int64_t pf) {
    eg_amx_decode_rows(a, we, se, j, nr0, c0, c1, buf, ldd, pf);
    if (nr1 > 0) eg_amx_decode_rows(a, we, se, j + 16, nr1, c0, c1, buf + 16 * ldd, ldd, pf);
}

/* The A tile of weight rows [j, j + nr) of the expert at we (scales se), chunk c: bf16
 * weights where they are stored (their row stride apart), prefetching EG_AMX_PF chunks
 * ahead within the rows (not past their end: the next work item may be another thread's);
 * a partial block or chunk (and a code's K tail: eg_item_amx decodes its whole chunks with
 * eg_amx_decode_rows) decoded into buf (64 bytes apart, zeros past nr rows and past K).
 * Sets *stride. */
static EG_AMX const void *eg_amx_a(const eg_args *a, const uint8_t *we, const uint8_t *se,
                                   int64_t j, int64_t nr, int64_t c, uint16_t *buf,
                                   int64_t *stride) {
    const int64_t ldw = a->w_row_bytes, whole = a->k / EG_DOT;
    if (a->w_kind == EG_W_BF16 && c + EG_AMX_PF < whole)
        for (int64_t r = 0; r < nr; r++)
            _mm_prefetch((const char *)we + (j + r) * ldw + (c + EG_AMX_PF) * EG_DOT * 2,
                         _MM_HINT_T1);
    if (a->w_kind == EG_W_BF16 && nr == 16 && c < whole) {
        *stride = ldw;
        return we + j * ldw + c * EG_DOT * 2;
    }
    for (int64_t r = 0; r < 16; r++) {
        if (r < nr)
            eg_amx_decode(a, we + (j + r) * ldw, se ? se + (j + r) * a->s_row_bytes : NULL, c,
                          buf + r * EG_DOT);
        else
            memset(buf + r * EG_DOT, 0, sizeof(uint16_t) * EG_DOT);
    }
    *stride = 2 * EG_DOT;
    return buf;
}

/* The 16 x 16 32-bit matrix r (row i in r[i]) transposed in place: r[j] lane i = old r[i]
 * lane j (unpacks within 128-bit lanes, then lanes exchanged: 64 shuffles, no memory). */
static inline __attribute__((always_inline)) EG_AMX void eg_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* lane l of r[i + j]: column 4l + j of rows i..i + 3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i s0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
        const __m512i s1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xee);
        const __m512i s2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i s3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xee);
        t[j] = _mm512_shuffle_i32x4(s0, s2, 0x88); /* column j */
        t[4 + j] = _mm512_shuffle_i32x4(s0, s2, 0xdd);
        t[8 + j] = _mm512_shuffle_i32x4(s1, s3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(s1, s3, 0xdd);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Packs rows [16 block, +16) of group g (zeros past its last row) into the B tiles' layout:
 * per 32-chunk c, per pair p, per row t the pair (x[32c + 2p], x[32c + 2p + 1]) as bf16
 * (eg_amx_x_bits). Per whole chunk the 16 rows' 16 pairs (bf16 as stored; fp32 read as zero
 * where subnormal, its low halves checked zero, the high ones taken) transposed in
 * registers and stored as the tile's 16 lines; a K tail element by element into a zeroed
 * chunk. */
static EG_AMX void eg_amx_pack16(const eg_args *a, int64_t g, int64_t block) {
    const int64_t q0 = a->q_start[g] + block * 16, k = a->k, k32 = (k + EG_DOT - 1) / EG_DOT * EG_DOT;
    const int64_t rows = a->q_start[g + 1] - q0 < 16 ? a->q_start[g + 1] - q0 : 16;
    const int64_t whole = k / EG_DOT;
    uint32_t *dst = (uint32_t *)(a->xv + (a->xv_start[g] + block) * EG_AMX_BLOCK(k32));
    const __m512i high = _mm512_setr_epi32( /* words 2p + 1 of two fp32 vectors, in order */
        0x00030001, 0x00070005, 0x000b0009, 0x000f000d, 0x00130011, 0x00170015, 0x001b0019,
        0x001f001d, 0x00230021, 0x00270025, 0x002b0029, 0x002f002d, 0x00330031, 0x00370035,
        0x003b0039, 0x003f003d);
    const __m512i exp = _mm512_set1_epi32(0x7f800000), sign = _mm512_set1_epi32((int)0x80000000u);
    const char *src[16];
    for (int64_t t = 0; t < 16; t++) {
        const int64_t row = t < rows ? (a->x_rows ? a->x_rows[q0 + t] : q0 + t) : 0;
        src[t] = (const char *)a->x16 +
                 row * a->ld_x * (a->x_kind == EG_X_BF16 ? 2 : a->x_kind == EG_X_E4M3 ? 1 : 4);
    }
    if (a->bs_block) { /* the rows' x scales, per x block 16 rows (zeros past the last) */
        const int64_t nxb = k / a->x_block;
        float *xs = a->xsv + (a->xv_start[g] + block) * nxb * 16;
        for (int64_t b = 0; b < nxb; b++)
            for (int64_t t = 0; t < 16; t++)
                xs[b * 16 + t] = t < rows ? a->xsc[(a->x_rows ? a->x_rows[q0 + t] : q0 + t) *
                                                       a->ld_xsc + b]
                                          : 0.0f;
    }
    __mmask16 lost = 0;
    for (int64_t c = 0; c < whole; c++) {
        __m512i v[16];
        for (int64_t t = 0; t < 16; t++) {
            if (t >= rows) {
                v[t] = _mm512_setzero_si512();
            } else if (a->x_kind == EG_X_BF16) {
                v[t] = _mm512_loadu_si512(src[t] + c * EG_DOT * 2);
            } else if (a->x_kind == EG_X_E4M3) { /* the codes' values, exact in bf16 */
                const __m128i *b = (const __m128i *)(src[t] + c * EG_DOT);
                const __m512i lo = _mm512_castps_si512(
                    e4m3x16_value(_mm512_cvtepu8_epi32(_mm_loadu_si128(b))));
                const __m512i hi = _mm512_castps_si512(
                    e4m3x16_value(_mm512_cvtepu8_epi32(_mm_loadu_si128(b + 1))));
                v[t] = _mm512_permutex2var_epi16(lo, high, hi);
            } else {
                const float *f = (const float *)src[t] + c * EG_DOT;
                __m512i lo = _mm512_loadu_si512(f), hi = _mm512_loadu_si512(f + 16);
                lo = _mm512_mask_and_epi32(lo, _mm512_testn_epi32_mask(lo, exp), lo, sign);
                hi = _mm512_mask_and_epi32(hi, _mm512_testn_epi32_mask(hi, exp), hi, sign);
                lost |= _mm512_test_epi32_mask(lo, _mm512_set1_epi32(0xffff)) |
                        _mm512_test_epi32_mask(hi, _mm512_set1_epi32(0xffff));
                v[t] = _mm512_permutex2var_epi16(lo, high, hi);
            }
        }
        eg_transpose16(v);
        for (int64_t p = 0; p < 16; p++) _mm512_storeu_si512(dst + c * 16 * 16 + p * 16, v[p]);
    }
    if (whole * EG_DOT < k) { /* the K tail */
        memset(dst + whole * 16 * 16, 0, sizeof(uint32_t) * 16 * 16);
        for (int64_t t = 0; t < rows; t++)
            for (int64_t i = whole * EG_DOT; i < k; i++)
                ((uint16_t *)(dst + (i / EG_DOT * 16 + i % EG_DOT / 2) * 16 + t))[i & 1] =
                    eg_amx_x_bits(a, q0 + t, i);
    }
    if (lost) *a->inexact = 1;
}

/* eg_amx_store's work on 16 lanes (AMX CPUs have AVX-512): the tile sums transposed in
 * registers, so that output row m is lane r = sums[r * 16 + m] for r < nr, times alpha,
 * rounded to bf16 as f32_to_bf16 (RNE, NaN quietened) or stored as fp32, a masked store of
 * nr lanes. */
static EG_AMX void eg_amx_store16(const eg_args *a, const float *sums, int64_t out_row,
                                  int64_t mr, int64_t j, int64_t nr, float alpha) {
    const __mmask16 keep = (__mmask16)((1u << nr) - 1u);
    __m512i rows[16];
    for (int r = 0; r < 16; r++) rows[r] = _mm512_load_si512(sums + r * 16);
    eg_transpose16(rows);
    for (int64_t m = 0; m < mr; m++) {
        __m512 v = _mm512_castsi512_ps(rows[m]);
        if (a->alpha) v = _mm512_mul_ps(v, _mm512_set1_ps(alpha));
        const int64_t o = (out_row + m) * a->ld_out + j;
        if (a->out_kind == EG_OUT_F32) {
            _mm512_mask_storeu_ps((float *)a->out + o, keep, v);
            continue;
        }
        const __m512i u = _mm512_castps_si512(v);
        const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        __m512i h = _mm512_srli_epi32(
            _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
        const __mmask16 nan = _mm512_cmpgt_epu32_mask(
            _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
        h = _mm512_mask_mov_epi32(
            h, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
        _mm256_mask_storeu_epi16((uint16_t *)a->out + o, keep, _mm512_cvtepi32_epi16(h));
    }
}

/* _tile_stored / _tile_zero of C tile t (0-3; tile numbers are immediates). */
static inline __attribute__((always_inline)) EG_AMX void eg_amx_tile_store(int64_t t, float *sums) {
    switch (t) {
    case 0: _tile_stored(0, sums, 64); break;
    case 1: _tile_stored(1, sums, 64); break;
    case 2: _tile_stored(2, sums, 64); break;
    default: _tile_stored(3, sums, 64); break;
    }
}

static inline __attribute__((always_inline)) EG_AMX void eg_amx_tile_zero(int64_t t) {
    switch (t) {
    case 0: _tile_zero(0); break;
    case 1: _tile_zero(1); break;
    case 2: _tile_zero(2); break;
    default: _tile_zero(3); break;
    }
}

/* eg_item_amx's passes for bf16 weights and items of more than 32 rows: per group of up
 * to EG_AMX_SWEEP 16-row blocks, each block of 16 weight rows in turn (an A tile, tile 5) against all of
 * them (C tiles 0-3, B tiles 6 and 7 in turn) over the whole of K, so that each weight row
 * is streamed from memory once while the tiles work on it (the 2 x 2 passes read every
 * weight row once per 32 rows: the first pass from DRAM, the others from L2, and the
 * first pass did little besides waiting for memory). The same chunks in the same order
 * into each C tile, so the same bits as the 2 x 2 passes. */
#define EG_AMX_SWEEP 4 /* 16-row blocks per group (5, in C tiles 0-4, measured 1.15-1.25x slower
                          * at 80 and 160 rows, 3 level with 4) */
static EG_AMX void eg_amx_sweeps(const eg_args *a, int64_t g, int64_t i0, int64_t rows,
                                 int64_t j0, int64_t nr0, int64_t nr1, uint16_t *abuf,
                                 float *sums) {
    const int64_t k32 = (a->k + EG_DOT - 1) / EG_DOT * EG_DOT, chunks = k32 / EG_DOT;
    const int64_t tb_step = EG_AMX_BLOCK(k32), tsz = 16 * EG_DOT;
    const uint8_t *we = a->w + a->g_expert[g] * a->w_expert_bytes;
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    /* the item's 16-row blocks in as few groups as the C tiles allow, of sizes differing by
     * at most one (a last group of one block would read the weights again for one tile's
     * work): each group the blocks left over the groups left, rounded up */
    const int64_t blocks = (rows + 15) / 16;
    int64_t groups = (blocks + EG_AMX_SWEEP - 1) / EG_AMX_SWEEP;
    for (int64_t b = 0, nb; b < blocks; b += nb, groups--) {
        nb = (blocks - b + groups - 1) / groups;
        const int64_t b0 = 16 * b;
        const uint16_t *xv = a->xv + (a->xv_start[g] + (i0 + b0) / 16) * tb_step;
        for (int64_t wb = 0; wb < (nr1 > 0 ? 2 : 1); wb++) {
            const int64_t jw = j0 + 16 * wb, nrw = wb ? nr1 : nr0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t c = 0; c < chunks; c++) {
                int64_t sw;
                const void *aw = eg_amx_a(a, we, NULL, jw, nrw, c, abuf, &sw);
                const uint16_t *xc = xv + c * tsz;
                _tile_loadd(5, aw, sw);
                _tile_loadd(6, xc, 64);
                _tile_dpbf16ps(0, 5, 6);
                if (nb > 1) {
                    _tile_loadd(7, xc + tb_step, 64);
                    _tile_dpbf16ps(1, 5, 7);
                }
                if (nb > 2) {
                    _tile_loadd(6, xc + 2 * tb_step, 64);
                    _tile_dpbf16ps(2, 5, 6);
                }
                if (nb > 3) {
                    _tile_loadd(7, xc + 3 * tb_step, 64);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            const int64_t out_row = a->out_row0[g] + i0 + b0;
            for (int64_t t = 0; t < nb; t++) {
                eg_amx_tile_store(t, sums);
                const int64_t mr = rows - b0 - 16 * t < 16 ? rows - b0 - 16 * t : 16;
                eg_amx_store16(a, sums, out_row + 16 * t, mr, jw, nrw, alpha);
            }
        }
    }
}

/* The block-scaled order's step for one C tile (sums: weight row r's 16 row sums of sum
 * block b at sums + 16 r): acc[r] = fma(sums[r], x scales * weight row j + r's scale,
 * acc[r]) for r < nr (x scales: the packed block's 16 rows; no weight scales, wse NULL:
 * the x scales alone). */
static inline __attribute__((always_inline)) EG_AMX void eg_amx_bs_acc(
    const eg_args *a, const float *sums, float *acc, const uint8_t *wse, int64_t j, int64_t nr,
    const float *xs, int64_t b) {
    const __m512 sx = _mm512_loadu_ps(xs + b * a->bs_block / a->x_block * 16);
    const int64_t bw = wse ? b * a->bs_block / a->ws_block : 0;
    for (int64_t r = 0; r < nr; r++) {
        const float *sw = wse ? (const float *)(wse + (j + r) * a->ws_row_bytes) + bw : NULL;
        const __m512 sc = sw ? _mm512_mul_ps(sx, _mm512_set1_ps(*sw)) : sx;
        _mm512_store_ps(acc + 16 * r, _mm512_fmadd_ps(_mm512_load_ps(sums + 16 * r), sc,
                                                      _mm512_load_ps(acc + 16 * r)));
    }
}

/* One AMX work item: rows [block * EG_AMX_ROWS, +EG_AMX_ROWS) of group g times output
 * columns [tile * EG_AMX_COLS, +EG_AMX_COLS): per pair of 16-row blocks, the item's (up
 * to) two blocks of 16 weight rows x the two row blocks accumulate in tiles 0-3 (C[w][t]
 * in tile 2w + t; A tiles 4-5, B tiles 6-7) over the whole of K. */
static EG_AMX void eg_item_amx(const eg_args *a, int64_t g, int64_t block, int64_t tile,
                               uint16_t *dec, const eg_span next[2]) {
    const int64_t i0 = block * EG_AMX_ROWS, n_rows = a->q_start[g + 1] - a->q_start[g];
    const int64_t rows = n_rows - i0 < EG_AMX_ROWS ? n_rows - i0 : EG_AMX_ROWS;
    const int64_t k32 = (a->k + EG_DOT - 1) / EG_DOT * EG_DOT, chunks = k32 / EG_DOT;
    const int64_t j0 = tile * EG_AMX_COLS, n1 = j0 + EG_AMX_COLS < a->n ? j0 + EG_AMX_COLS : a->n;
    const int64_t nr0 = n1 - j0 < 16 ? n1 - j0 : 16, nr1 = n1 - j0 - nr0; /* weight rows */
    const uint8_t *we = a->w + a->g_expert[g] * a->w_expert_bytes;
    const uint8_t *se = a->s ? a->s + a->g_expert[g] * a->s_expert_bytes : NULL;
    const int64_t tb_step = EG_AMX_BLOCK(k32); /* elements from one 16-row block to the next */
    const int64_t tsz = 16 * EG_DOT;           /* elements of one A tile */
    const int64_t ldd = EG_AMX_LDD(k32), whole = a->k / EG_DOT;
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    uint16_t abuf[2][16 * EG_DOT] __attribute__((aligned(64)));
    float sums[16 * 16] __attribute__((aligned(64)));
    /* codes in one pass (at most 32 rows): every EG_AMX_ICH chunks of the item's weight
     * rows decoded just before their products, into L1 (fb, two sets in turn), their codes
     * read from L2, where the thread's previous item prefetched them (next); in more
     * passes: the item's A tiles decoded first, each weight row read once in memory order
     * (a stream the hardware prefetchers follow), into the thread's buffer dec (32 rows of
     * the whole chunks, EG_AMX_LDD apart, in L2), for all the passes; a K tail's partial
     * chunk through abuf as bf16's */
    const int codes = a->w_kind != EG_W_BF16, fused = a->w_kind == EG_W_E2M1 && rows <= 32;
    uint16_t fb[2][32 * EG_AMX_ICH * EG_DOT] __attribute__((aligned(64)));
    if (codes && !fused)
        eg_amx_decode_item(a, we, se, j0, nr0, nr1, 0, whole, dec, ldd, EG_AMX_DPF);
    if (rows > 32 && !codes) { /* bf16 weights in three or more 16-row blocks: eg_amx_sweeps
                                * (decoded codes come from L2 in every pass: the 2 x 2 passes,
                                * fewer tile loads per product, measured 2-9% faster) */
        eg_amx_sweeps(a, g, i0, rows, j0, nr0, nr1, abuf[0], sums);
        return;
    }
    /* the block-scaled order: each C tile's sums of a sum block scaled into acc (per tile,
     * 16 weight rows x 16 rows), the tile zeroed again */
    const int64_t cpb = a->bs_block / EG_DOT; /* chunks per sum block (0: not that order) */
    const uint8_t *wse = a->ws ? a->ws + a->g_expert[g] * a->ws_expert_bytes : NULL;
    float acc[4][16 * 16] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < rows; r0 += 32) {
        const int two = rows - r0 > 16; /* a second 16-row block */
        const uint16_t *xv = a->xv + (a->xv_start[g] + (i0 + r0) / 16) * EG_AMX_BLOCK(k32);
        const int64_t xs_step = cpb ? a->k / a->x_block * 16 : 0; /* one 16-row block's */
        const float *xs0 = cpb ? a->xsv + (a->xv_start[g] + (i0 + r0) / 16) * xs_step : NULL;
        const float *xs1 = cpb ? xs0 + xs_step : NULL;
        const int used[4] = {1, two, nr1 > 0, two && nr1 > 0}; /* the C tiles of this pass */
        if (cpb) memset(acc, 0, sizeof acc);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t c = 0; c < chunks; c++) {
            int64_t s0 = 2 * EG_DOT, s1 = 2 * EG_DOT;
            const uint16_t *d = dec + c * EG_DOT; /* the chunk's decoded A tiles, ld apart */
            int64_t ld = ldd;
            if (r0 == 0) eg_prefetch_share(next, c, chunks); /* in the first pass */
            if (fused && c < whole) {
                const int64_t c0 = c / EG_AMX_ICH * EG_AMX_ICH;
                const int64_t c1 = c0 + EG_AMX_ICH < whole ? c0 + EG_AMX_ICH : whole;
                uint16_t *f = fb[c / EG_AMX_ICH & 1];
                if (c == c0)
                    eg_amx_decode_item(a, we, se, j0, nr0, nr1, c0, c1, f, EG_AMX_ICH * EG_DOT, 0);
                d = f + (c - c0) * EG_DOT;
                ld = EG_AMX_ICH * EG_DOT;
            }
            if (codes && c < whole) s0 = s1 = 2 * ld;
            const void *a0 = codes && c < whole ? d
                                                : eg_amx_a(a, we, se, j0, nr0, c, abuf[0], &s0);
            const uint16_t *xc = xv + c * tsz;
            _tile_loadd(4, a0, s0);
            _tile_loadd(6, xc, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (two) {
                _tile_loadd(7, xc + tb_step, 64);
                _tile_dpbf16ps(1, 4, 7);
            }
            if (nr1 > 0) {
                const void *a1 = codes && c < whole
                                     ? d + 16 * ld
                                     : eg_amx_a(a, we, se, j0 + 16, nr1, c, abuf[1], &s1);
                _tile_loadd(5, a1, s1);
                _tile_dpbf16ps(2, 5, 6);
                if (two) _tile_dpbf16ps(3, 5, 7);
            }
            if (cpb && (c + 1) % cpb == 0) /* the end of sum block c / cpb */
                for (int64_t t = 0; t < 4; t++) {
                    if (!used[t]) continue;
                    eg_amx_tile_store(t, sums);
                    eg_amx_tile_zero(t);
                    eg_amx_bs_acc(a, sums, acc[t], wse, j0 + 16 * (t >> 1), t >> 1 ? nr1 : nr0,
                                  t & 1 ? xs1 : xs0, c / cpb);
                }
        }
        const int64_t out_row = a->out_row0[g] + i0 + r0;
        const int64_t mr0 = rows - r0 < 16 ? rows - r0 : 16, mr1 = rows - r0 - mr0;
        for (int64_t t = 0; t < 4; t++) { /* C[w][h] in tile 2w + h: rows 16h on, columns 16w on */
            if (!used[t]) continue;
            if (!cpb) eg_amx_tile_store(t, sums);
            eg_amx_store16(a, cpb ? acc[t] : sums, out_row + 16 * (t & 1),
                           t & 1 ? (mr1 < 16 ? mr1 : 16) : mr0, j0 + 16 * (t >> 1),
                           t >> 1 ? nr1 : nr0, alpha);
        }
    }
}
#endif

/* The AMX twin's work item, the same (group, rows, columns) split as eg_item_amx. */
static void eg_item_amx_scalar(const eg_args *a, int64_t g, int64_t block, int64_t tile) {
    const int64_t i0 = block * EG_AMX_ROWS, n_rows = a->q_start[g + 1] - a->q_start[g];
    const int64_t rows = n_rows - i0 < EG_AMX_ROWS ? n_rows - i0 : EG_AMX_ROWS;
    const int64_t j0 = tile * EG_AMX_COLS, n1 = j0 + EG_AMX_COLS < a->n ? j0 + EG_AMX_COLS : a->n;
    const uint8_t *we = a->w + a->g_expert[g] * a->w_expert_bytes;
    const uint8_t *se = a->s ? a->s + a->g_expert[g] * a->s_expert_bytes : NULL;
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    float sums[16 * 16];
    for (int64_t j = j0; j < n1; j += 16) {
        const int64_t nr = n1 - j < 16 ? n1 - j : 16;
        for (int64_t m0 = 0; m0 < rows; m0 += 16) {
            const int64_t mr = rows - m0 < 16 ? rows - m0 : 16;
            for (int64_t m = 0; m < mr; m++)
                for (int64_t r = 0; r < nr; r++)
                    sums[r * 16 + m] = eg_amx_scalar(
                        a, a->q_start[g] + i0 + m0 + m, we + (j + r) * a->w_row_bytes,
                        se ? se + (j + r) * a->s_row_bytes : NULL,
                        a->ws ? (const float *)(a->ws + a->g_expert[g] * a->ws_expert_bytes +
                                                (j + r) * a->ws_row_bytes)
                              : NULL);
            eg_amx_store(a, sums, a->out_row0[g] + i0 + m0, mr, j, nr, alpha);
        }
    }
}

#ifdef MOE_EP_AVX2
/* The weight/scale pairings with a specialised decode (each a compile-time constant of
 * EG_DECODE's inlined body), the generic loop for the rest. */
#define EG_DECODE_BY_KIND(a)                                                                   \
    do {                                                                                       \
        if ((a)->w_kind == EG_W_BF16) EG_DECODE(EG_W_BF16, EG_S_NONE);                         \
        else if ((a)->w_kind == EG_W_E4M3 && (a)->s_kind == EG_S_F32)                          \
            EG_DECODE(EG_W_E4M3, EG_S_F32);                                                    \
        else if ((a)->w_kind == EG_W_E4M3 && (a)->s_kind == EG_S_E8M0)                         \
            EG_DECODE(EG_W_E4M3, EG_S_E8M0);                                                   \
        else if ((a)->w_kind == EG_W_E2M1 && (a)->s_kind == EG_S_E4M3)                         \
            EG_DECODE(EG_W_E2M1, EG_S_E4M3);                                                   \
        else if ((a)->w_kind == EG_W_E2M1 && (a)->s_kind == EG_S_E8M0)                         \
            EG_DECODE(EG_W_E2M1, EG_S_E8M0);                                                   \
        else EG_DECODE((a)->w_kind, (a)->s_kind);                                              \
    } while (0)

/* eg_decode_row_*'s loop, over the chunk decoder `chunk`: one scale per scale block. */
#define EG_DECODE_ROW(chunk)                                                                   \
    do {                                                                                       \
        const int32_t scaled = s_kind != EG_S_NONE;                                            \
        const int64_t step = scaled ? s_block : k1 - kc;                                       \
        int64_t b = scaled ? kc / s_block : 0; /* the scale block: one division a call */     \
        for (int64_t kb = kc; kb < k1; kb += step, b++) {                                      \
            const float s = scaled ? eg_scale(s_row, s_kind, b) : 1.0f;                        \
            const int64_t kb1 = kb + step < k1 ? kb + step : k1;                               \
            for (int64_t kk = kb; kk < kb1; kk += EG_LANES)                                    \
                chunk(w_row, w_kind, kk, s, scaled, dst + (kk - kc));                          \
        }                                                                                      \
    } while (0)

/* Whether none of the n bytes (a multiple of 16) is an e4m3fn NaN (0x7f / 0xff). */
static inline int eg_e4m3_nan_free(const uint8_t *p, int64_t n) {
    const __m128i low7 = _mm_set1_epi8(0x7f);
    __m128i seen = _mm_setzero_si128();
    for (int64_t i = 0; i < n; i += 16) {
        const __m128i v = _mm_and_si128(_mm_loadu_si128((const __m128i *)(p + i)), low7);
        seen = _mm_or_si128(seen, _mm_cmpeq_epi8(v, low7));
    }
    return _mm_testz_si128(seen, seen);
}

/* eg_decode_chunk_avx2 for NaN-free e4m3 codes, times c = 2^120 * s (exact, finite: |s| <
 * 2^8): each byte moved to the top of its lane, an arithmetic shift by 4 and a mask leave
 * the sign in bit 31 and the 7 magnitude bits under fp32's exponent / mantissa (value *
 * 2^-120, subnormals included), and one product gives code * s with the one rounding of
 * the general path (code * 2^-120 * (2^120 * s) is the same real number). */
static inline __attribute__((always_inline)) void eg_decode_e4m3_fast_avx2(const uint8_t *w_row,
                                                                         int64_t k, __m256 c,
                                                                         float *dst) {
    const __m256i d = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(w_row + k)));
    const __m256i keep = _mm256_set1_epi32((int)0x87f00000u);
    const __m256i even = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 24), 4), keep);
    const __m256i odd = _mm256_and_si256(_mm256_srai_epi32(_mm256_slli_epi32(d, 16), 4), keep);
    _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_castsi256_ps(even), c));
    _mm256_storeu_ps(dst + 8, _mm256_mul_ps(_mm256_castsi256_ps(odd), c));
}

/* eg_decode_chunk_avx2 for NaN-free e4m3 codes: the short decode (half the operations) while
 * 2^120 * s is finite (|s| < 2^8), the general one from there (or for a NaN scale). */
static inline __attribute__((always_inline)) void eg_decode_chunk_e4m3_avx2(
    const uint8_t *w_row, int32_t w_kind, int64_t k, float s, int32_t scaled, float *dst) {
    if (__builtin_fabsf(s) < 256.0f)
        eg_decode_e4m3_fast_avx2(w_row, k, _mm256_set1_ps(s * 1.329227995784916e36f), dst);
    else
        eg_decode_chunk_avx2(w_row, w_kind, k, s, scaled, dst);
}

/* eg_decode_rows' vector body for one row: whole chunks [kc, k1) into dst, one scale per
 * s_block elements (kc a multiple of s_block or 16 when unscaled). w_kind and s_kind are
 * constants at each call, so each format compiles to its own loop. */
static inline __attribute__((always_inline)) void eg_decode_row_avx2(
    const int32_t w_kind, const int32_t s_kind, const uint8_t *w_row, const uint8_t *s_row,
    int64_t s_block, int64_t kc, int64_t k1, float *dst) {
    if (w_kind == EG_W_E4M3 && eg_e4m3_nan_free(w_row + kc, k1 - kc)) {
        EG_DECODE_ROW(eg_decode_chunk_e4m3_avx2);
        return;
    }
    EG_DECODE_ROW(eg_decode_chunk_avx2);
}

#ifdef MOE_EP_AVX512_GEMM
/* eg_decode_chunk_avx2 on one zmm: the same values (e4m3: the same operations on 16 lanes,
 * a mask instead of a blend for NaN; e2m1: one 16-entry table lookup, sign included). */
static inline __attribute__((always_inline)) EG_AVX512 void eg_decode_chunk_avx512(
    const uint8_t *w_row, int32_t w_kind, int64_t k, float s, int32_t scaled, float *dst) {
    __m512 f;
    if (w_kind == EG_W_E4M3) {
        const __m128i lanes = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        f = e4m3x16_value(_mm512_cvtepu8_epi32(
            _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(w_row + k)), lanes)));
    } else if (w_kind == EG_W_E2M1) {
        const __m512 table = _mm512_loadu_ps(e2m1_value);
        const __m128i pairs = _mm_loadl_epi64((const __m128i *)(w_row + k / 2));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(pairs, pairs));
        const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
        f = _mm512_permutexvar_ps(_mm512_srlv_epi32(b, shift), table); /* low 4 bits index */
    } else {
        const __m512i v = _mm512_broadcast_i64x4(
            _mm256_loadu_si256((const __m256i *)((const uint16_t *)w_row + k)));
        const __m512i shift = _mm512_setr_epi32(16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0,
                                                0, 0);
        f = _mm512_castsi512_ps(_mm512_and_si512(_mm512_sllv_epi32(v, shift),
                                                 _mm512_set1_epi32((int)0xffff0000u)));
    }
    _mm512_storeu_ps(dst, scaled ? _mm512_mul_ps(f, _mm512_set1_ps(s)) : f);
}

/* eg_decode_row_avx2 with the AVX-512F chunk decode. */
static inline __attribute__((always_inline)) EG_AVX512 void eg_decode_row_avx512(
    const int32_t w_kind, const int32_t s_kind, const uint8_t *w_row, const uint8_t *s_row,
    int64_t s_block, int64_t kc, int64_t k1, float *dst) {
    EG_DECODE_ROW(eg_decode_chunk_avx512);
}

static EG_AVX512 void eg_decode_row_vector512(const eg_args *a, const uint8_t *w_row,
                                              const uint8_t *s_row, int64_t kc, int64_t k1,
                                              float *dst) {
#define EG_DECODE(w, s) eg_decode_row_avx512(w, s, w_row, s_row, a->s_block, kc, k1, dst)
    EG_DECODE_BY_KIND(a);
#undef EG_DECODE
}
#endif

static void eg_decode_row_vector(const eg_args *a, const uint8_t *w_row, const uint8_t *s_row,
                                 int64_t kc, int64_t k1, float *dst) {
#ifdef MOE_EP_AVX512_GEMM
    if (a->vector == EG_BODY_AVX512) {
        eg_decode_row_vector512(a, w_row, s_row, kc, k1, dst);
        return;
    }
#endif
#define EG_DECODE(w, s) eg_decode_row_avx2(w, s, w_row, s_row, a->s_block, kc, k1, dst)
    EG_DECODE_BY_KIND(a);
#undef EG_DECODE
}
#endif

/* Decode elements [kc, k1) of weight rows [j, j + nb) into wbuf rows (stride EG_KC), in
 * lane order, zero-padded to whole chunks (kc a multiple of EG_KC, or the K tail). */
static void eg_decode_rows(const eg_args *a, const uint8_t *we, const uint8_t *se, int64_t j,
                           int64_t nb, int64_t kc, int64_t k1, float *wbuf) {
    const int32_t scaled = a->s_kind != EG_S_NONE;
    for (int64_t n = 0; n < nb; n++) {
        const uint8_t *w_row = we + (j + n) * a->w_row_bytes;
        const uint8_t *s_row = se ? se + (j + n) * a->s_row_bytes : NULL;
        int64_t kk = kc;
#ifdef MOE_EP_AVX2
        if (a->vector) {
            kk = kc + (k1 - kc) / EG_LANES * EG_LANES;
            eg_decode_row_vector(a, w_row, s_row, kc, kk, wbuf + n * EG_KC);
        }
#endif
        for (; kk < k1; kk += EG_LANES) {
            const float s = scaled ? eg_scale(s_row, a->s_kind, kk / a->s_block) : 1.0f;
            eg_decode_chunk_scalar(w_row, a->w_kind, kk, k1, s, scaled, wbuf + n * EG_KC + (kk - kc));
        }
    }
}

/* The prefetch distance: at least EG_PREFETCH_BYTES, in whole weight rows, so that it lands
 * on the same elements of a later row (the rows an item reads next). */
static inline int64_t eg_prefetch_ahead(int64_t row_bytes) {
    return (EG_PREFETCH_BYTES + row_bytes - 1) / row_bytes * row_bytes;
}

/* Ask for the bytes of elements [kc, k1) of the weight rows a prefetch distance (at least
 * EG_PREFETCH_BYTES, whole rows) past rows [j, j + nb): the same place in the rows this item
 * reads next, as they stream from DRAM once. Prefetches never fault, so running past the
 * expert's end is fine. */
static inline void eg_prefetch(const eg_args *a, const uint8_t *we, int64_t j, int64_t nb,
                               int64_t kc, int64_t k1, int64_t ahead) {
#ifdef MOE_EP_AVX2
    const int64_t row = a->w_row_bytes;
    const int64_t first = (kc * eg_bits(a->w_kind)) >> 3, end = (k1 * eg_bits(a->w_kind)) >> 3;
    for (int64_t n = 0; n < nb; n++)
        for (int64_t off = first; off < end; off += 64)
            _mm_prefetch((const char *)we + (j + n) * row + ahead + off, _MM_HINT_T1);
#else
    (void)a, (void)we, (void)j, (void)nb, (void)kc, (void)k1, (void)ahead;
#endif
}

/* acc[r] += `chunks` chunks of x rows [0, rows) times weight rows w[n] (n < nr), in
 * register tiles of eg_mr(body) rows: the weight chunks, read from memory by the first tile
 * (which prefetches bf16 ones `ahead` bytes on), stay in L1 for the later ones. */
static void eg_row_tiles(const eg_args *a, int64_t rows, int nr, int bf16, const float *x,
                         const void *const *w, int64_t chunks, float *acc, int64_t ldacc,
                         int64_t ahead) {
    const int64_t mr_max = eg_mr(a->vector);
    const int balanced = a->vector == EG_BODY_AVX2_HALF; /* 5 rows as 3 + 2: a one-row
                                                            * tile waits on its fma's */
    for (int64_t r = 0, mr; r < rows; r += mr) {
        const int64_t left = rows - r, tiles = (left + mr_max - 1) / mr_max;
        mr = balanced ? (left + tiles - 1) / tiles : left < mr_max ? left : mr_max;
        eg_tile((int)mr, nr, bf16, x + r * a->ldxs, a->ldxs, w, chunks, acc + r * ldacc, ldacc,
                a->vector, r == 0 ? ahead : 0);
    }
}

/* Outputs [orow0, orow0 + rows) x columns [j, j + nr) from their lane sums (acc rows ldacc
 * apart, EG_LANES per column): eg_lane_sum, times alpha where the call has alphas, then
 * stored as fp32 or rounded to bf16. */
static void eg_store_sums(const eg_args *a, const float *acc, int64_t ldacc, int64_t rows,
                          int nr, int64_t orow0, int64_t j, float alpha) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t orow = orow0 + r;
        for (int n = 0; n < nr; n++)
            eg_put(a, orow * a->ld_out + j + n, eg_lane_sum(acc + r * ldacc + n * EG_LANES), alpha);
    }
}

#ifdef MOE_EP_AVX512_GEMM
/* The AVX-512F body reads quantized weights where they are stored and decodes them in
 * registers (eg_rows_q512), in tiles of EG_QMR rows x 2 weight rows (4 x 4 for 4 rows or
 * fewer): measured 1 thread, 16 experts N = K = 2048, fp8 1.9x / 1.75x / 1.4x / 1.2x faster
 * at 1 / 8 / 16 / 24 rows than decoding into the L1 buffer first (whose store and reload
 * cost more than decoding each code once per 8 rows). */
#define EG_QMR 8

/* eg_decode_chunk_avx512's values for one chunk of codes at element k, in a register:
 * e4m3 by eg_decode_e4m3_fast_avx2's operations on 16 lanes while `fast` (c = 2^120 * s),
 * else as eg_decode_chunk_avx512, then a NaN code's lanes set to the table's quiet NaN (what
 * NaN * s gives there: the first operand's NaN); e2m1 by its 16-entry table. Times s (s = 1
 * without scales: the same bits as no product). */
static inline __attribute__((always_inline)) EG_AVX512 __m512 eg_q512_chunk(
    const int32_t w_kind, const uint8_t *w_row, int64_t k, int fast, __m512 c, __m512 s) {
    if (w_kind == EG_W_E4M3) {
        const __m128i lanes = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const __m512i b = _mm512_cvtepu8_epi32(
            _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(w_row + k)), lanes));
        const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
        const __mmask16 nan = _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7f));
        __m512 f;
        if (fast) {
            const __m512i v = _mm512_and_si512(_mm512_srai_epi32(_mm512_slli_epi32(b, 24), 4),
                                               _mm512_set1_epi32((int)0x87f00000u));
            f = _mm512_mul_ps(_mm512_castsi512_ps(v), c);
        } else {
            f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(mag, 20)),
                              _mm512_set1_ps(1.329227995784916e36f)); /* 2^120 */
            const __m512i sign =
                _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
            f = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sign)),
                              s);
        }
        return _mm512_mask_mov_ps(f, nan, _mm512_castsi512_ps(_mm512_set1_epi32(0x7fc00000)));
    }
    const __m512 table = _mm512_loadu_ps(e2m1_value);
    const __m128i pairs = _mm_loadl_epi64((const __m128i *)(w_row + k / 2));
    const __m512i b = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(pairs, pairs));
    const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    return _mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srlv_epi32(b, shift), table), s);
}

/* eg_tile_avx512 over `chunks` whole chunks from element 0 of quantized weight rows w[n]
 * (scale rows s[n], or NULL), decoded in registers per scale block: the same fma per lane
 * in the same order as decoding them into the L1 buffer first. Prefetches each code line
 * `ahead` bytes on. */
static inline __attribute__((always_inline)) EG_AVX512 void eg_qtile_avx512(
    const int mr, const int nr, const int32_t w_kind, const eg_args *a, const float *x,
    const uint8_t *const *w, const uint8_t *const *s, int64_t chunks, float *acc,
    int64_t ldacc, int64_t ahead) {
    __m512 acc_v[EG_QMR][EG_NR512];
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) acc_v[m][n] = _mm512_loadu_ps(acc + m * ldacc + n * EG_LANES);
    const int64_t bytes = w_kind == EG_W_E4M3 ? 16 : 8; /* code bytes per chunk */
    const int64_t per = s ? a->s_block / EG_LANES : chunks; /* chunks per scale */
    for (int64_t c0 = 0; c0 < chunks; c0 += per) {
        const int64_t c1 = c0 + per < chunks ? c0 + per : chunks;
        __m512 cv[EG_NR512], sv[EG_NR512];
        int fast = 1;
        for (int n = 0; n < nr; n++) {
            const float sc = s ? eg_scale(s[n], a->s_kind, c0 * EG_LANES / a->s_block) : 1.0f;
            fast &= __builtin_fabsf(sc) < 256.0f;
            sv[n] = _mm512_set1_ps(sc);
            cv[n] = _mm512_set1_ps(sc * 1.329227995784916e36f);
        }
        for (int64_t c = c0; c < c1; c++) {
            if (ahead && (c * bytes) % 64 == 0)
                for (int n = 0; n < nr; n++)
                    _mm_prefetch((const char *)w[n] + c * bytes + ahead, _MM_HINT_T1);
            __m512 wv[EG_NR512];
            for (int n = 0; n < nr; n++)
                wv[n] = eg_q512_chunk(w_kind, w[n], c * EG_LANES, fast, cv[n], sv[n]);
            for (int m = 0; m < mr; m++) {
                __m512 xv = _mm512_loadu_ps(x + m * a->ldxs + c * EG_LANES);
                __asm__("" : "+v"(xv));
                for (int n = 0; n < nr; n++) acc_v[m][n] = _mm512_fmadd_ps(xv, wv[n], acc_v[m][n]);
            }
        }
    }
    for (int m = 0; m < mr; m++)
        for (int n = 0; n < nr; n++) _mm512_storeu_ps(acc + m * ldacc + n * EG_LANES, acc_v[m][n]);
}

#define EG_QT(m, n, kind) eg_qtile_avx512(m, n, kind, a, x, w, s, chunks, acc, ldacc, ahead)
#define EG_QT_4(n, kind)                                                                      \
    (mr == 4 ? EG_QT(4, n, kind) : mr == 3 ? EG_QT(3, n, kind) : mr == 2 ? EG_QT(2, n, kind)  \
                                                                         : EG_QT(1, n, kind))
#define EG_QT_8(n, kind)                                                                      \
    (mr == 8 ? EG_QT(8, n, kind) : mr == 7 ? EG_QT(7, n, kind) : mr == 6 ? EG_QT(6, n, kind)  \
     : mr == 5 ? EG_QT(5, n, kind) : EG_QT_4(n, kind))
#define EG_QT_KIND(kind)                                                                      \
    (nr == 4 ? EG_QT_4(4, kind) : nr == 2 ? EG_QT_8(2, kind) : EG_QT_8(1, kind))
/* eg_qtile_avx512 for mr <= 4 rows x nr = 4 weight rows, mr <= EG_QMR x 2, or mr x 1: each
 * shape and code kind its own loop (at most 16 accumulators). */
static EG_AVX512 void eg_qtile_avx512_any(int mr, int nr, const eg_args *a, const float *x,
                                          const uint8_t *const *w, const uint8_t *const *s,
                                          int64_t chunks, float *acc, int64_t ldacc,
                                          int64_t ahead) {
    if (a->w_kind == EG_W_E4M3) EG_QT_KIND(EG_W_E4M3);
    else EG_QT_KIND(EG_W_E2M1);
}
#undef EG_QT_KIND
#undef EG_QT_8
#undef EG_QT_4
#undef EG_QT
#endif

#ifdef MOE_EP_AVX512_GEMM
/* eg_rows for quantized weights on the AVX-512F body: the whole chunks of
 * each weight row decoded in registers (eg_qtile_avx512), the K tail (a partial chunk)
 * through the L1 buffer after them as in eg_rows: the same fma chain per lane, the same
 * bits. */
static void eg_rows_q512(const eg_args *a, int64_t g, int64_t q0, int64_t rows, int64_t orow0,
                         int64_t j0, int64_t n1) {
    float wbuf[EG_NR_MAX * EG_KC];
    float acc[EG_SUB * EG_NR_MAX * EG_LANES];
    const int64_t ldacc = EG_NR_MAX * EG_LANES;
    const uint8_t *we = a->w + a->g_expert[g] * a->w_expert_bytes;
    const uint8_t *se = a->s ? a->s + a->g_expert[g] * a->s_expert_bytes : NULL;
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    const float *x = a->xs + q0 * a->ldxs;
    const int64_t chunks = a->k / EG_LANES, k_whole = chunks * EG_LANES;
    const void *wbuf_rows[EG_NR_MAX] = {wbuf, wbuf + EG_KC, wbuf + 2 * EG_KC, wbuf + 3 * EG_KC};
    const int64_t ahead = eg_prefetch_ahead(a->w_row_bytes);
    const int64_t mr_max = rows <= EG_MR512 ? EG_MR512 : EG_QMR;
    const int nr_max = rows <= EG_MR512 ? EG_NR512 : 2;
    for (int64_t j = j0; j < n1;) {
        const int nr = n1 - j >= nr_max ? nr_max : 1; /* the last few columns one by one */
        const uint8_t *w_rows[EG_NR512], *s_rows[EG_NR512];
        for (int n = 0; n < nr; n++) {
            w_rows[n] = we + (j + n) * a->w_row_bytes;
            s_rows[n] = se ? se + (j + n) * a->s_row_bytes : NULL;
        }
        memset(acc, 0, sizeof(float) * (size_t)(rows * ldacc));
        for (int64_t r = 0; r < rows && chunks > 0; r += mr_max) {
            const int mr = rows - r < mr_max ? (int)(rows - r) : (int)mr_max;
            eg_qtile_avx512_any(mr, nr, a, x + r * a->ldxs, w_rows, se ? s_rows : NULL, chunks,
                                acc + r * ldacc, ldacc, r == 0 ? ahead : 0);
        }
        if (k_whole < a->k) {
            eg_decode_rows(a, we, se, j, nr, k_whole, a->k, wbuf);
            eg_row_tiles(a, rows, nr, 0, x + k_whole, wbuf_rows, 1, acc, ldacc, 0);
        }
        eg_store_sums(a, acc, ldacc, rows, nr, orow0, j, alpha);
        j += nr;
    }
}
#endif

/* Rows [q0, q0 + rows) (rows <= EG_SUB) of group g, output row orow0 on, times output
 * columns [j0, n1): per EG_NR weight rows, per EG_KC block of K, every EG_MR x EG_NR
 * register tile of the rows over the block. bf16 weights (vector body) are read where they
 * are stored, the K tail (a partial chunk) and the other kinds decoded into an L1 buffer
 * first. The accumulators carry over from block to block, so the fma chain per lane is
 * unchanged. */
static void eg_rows(const eg_args *a, int64_t g, int64_t q0, int64_t rows, int64_t orow0,
                    int64_t j0, int64_t n1) {
    float wbuf[EG_NR_MAX * EG_KC];
    float acc[EG_SUB * EG_NR_MAX * EG_LANES];
    eg_args own;
    if (a->vector == EG_BODY_AUTO) { /* same bits either way: the faster body per row count */
        own = *a;
        own.vector = rows <= EG_AVX2_ROWS && a->w_kind == EG_W_BF16 ? EG_BODY_AVX2 : EG_BODY_AVX512;
        a = &own;
    }
#ifdef MOE_EP_AVX512_GEMM
    if (a->vector == EG_BODY_AVX512 && a->w_kind != EG_W_BF16) {
        eg_rows_q512(a, g, q0, rows, orow0, j0, n1);
        return;
    }
#endif
    /* Decoded (quantized) weights in half-lane tiles, the same bits; bf16 read where stored
     * keeps eg_tile_avx2 (half-lane tiles measured 1.05x slower in the layer at decode). */
    if (a->vector == EG_BODY_AVX2 && a->w_kind != EG_W_BF16 && rows >= EG_HALF_ROWS) {
        own = *a;
        own.vector = EG_BODY_AVX2_HALF;
        a = &own;
    }
    const int64_t ldacc = EG_NR_MAX * EG_LANES, nr_max = eg_nr(a->vector);
    const uint8_t *we = a->w + a->g_expert[g] * a->w_expert_bytes;
    const uint8_t *se = a->s ? a->s + a->g_expert[g] * a->s_expert_bytes : NULL;
    const float alpha = a->alpha ? a->alpha[g] : 1.0f;
    const float *x = a->xs + q0 * a->ldxs;
#ifdef MOE_EP_AVX2
    const int direct = a->vector && a->w_kind == EG_W_BF16; /* bf16 read where stored */
#else
    const int direct = 0;
#endif
    const int64_t k_whole = a->k / EG_LANES * EG_LANES; /* elements in whole chunks */
    const void *wbuf_rows[EG_NR_MAX] = {wbuf, wbuf + EG_KC, wbuf + 2 * EG_KC, wbuf + 3 * EG_KC};
    /* K in blocks whose weights stay in L1 for the later row tiles; with one row tile the
     * direct path streams whole rows (no accumulator round trips between blocks). */
    const int64_t step = direct && rows <= eg_mr(a->vector) ? a->k
                         : direct && a->vector == EG_BODY_AVX512 ? EG_KC512
                                                                  : EG_KC;
    const int64_t ahead = eg_prefetch_ahead(a->w_row_bytes);
    for (int64_t j = j0; j < n1; j += nr_max) {
        const int nr = n1 - j < nr_max ? (int)(n1 - j) : (int)nr_max;
        memset(acc, 0, sizeof(float) * (size_t)(rows * ldacc));
        for (int64_t kc = 0; kc < a->k; kc += step) {
            const int64_t k1 = kc + step < a->k ? kc + step : a->k;
            int64_t kd = kc; /* where the decoded part of this block starts */
            if (direct) {
                kd = k1 < k_whole ? k1 : k_whole > kc ? k_whole : kc;
                const void *w_rows[EG_NR_MAX];
                for (int n = 0; n < nr; n++) w_rows[n] = we + (j + n) * a->w_row_bytes + 2 * kc;
                if (kd > kc)
                    eg_row_tiles(a, rows, nr, 1, x + kc, w_rows, (kd - kc) / EG_LANES, acc,
                                 ldacc, ahead);
            }
            if (kd < k1) {
                if (!direct) eg_prefetch(a, we, j, nr, kd, k1, ahead);
                eg_decode_rows(a, we, se, j, nr, kd, k1, wbuf);
                eg_row_tiles(a, rows, nr, 0, x + kd, wbuf_rows,
                             (k1 - kd + EG_LANES - 1) / EG_LANES, acc, ldacc, 0);
            }
        }
        eg_store_sums(a, acc, ldacc, rows, nr, orow0, j, alpha);
    }
}

/* One work item: rows [q0, q0 + EG_ROWS) of group g times output columns [tile * EG_COLS,
 * ...), EG_SUB rows at a time (their x block stays in L1; the tile's weights, read from
 * DRAM for the first, stay in L2 for the others). */
static void eg_item(const eg_args *a, int64_t g, int64_t block, int64_t tile) {
    const int64_t q0 = a->q_start[g] + block * EG_ROWS;
    const int64_t rows = a->q_start[g + 1] - q0 < EG_ROWS ? a->q_start[g + 1] - q0 : EG_ROWS;
    const int64_t n1 = tile * EG_COLS + EG_COLS < a->n ? tile * EG_COLS + EG_COLS : a->n;
    const int dot = eg_group_dot(a, eg_path_rows(a, g));
    eg_args own;
    if (!dot && a->auto_dot) { /* a small expert under auto: AVX2 (eg_rows) */
        own = *a;
        own.vector = EG_BODY_AUTO;
        a = &own;
    }
    for (int64_t r = 0; r < rows; r += EG_SUB)
        (dot ? eg_rows_dot : eg_rows)(a, g, q0 + r, rows - r < EG_SUB ? rows - r : EG_SUB,
                a->out_row0[g] + block * EG_ROWS + r, tile * EG_COLS, n1);
}

/* The last g < groups with start[g] <= i (start ascending, start[0] <= i). */
static int64_t eg_group_of(const int64_t *start, int64_t groups, int64_t i) {
    int64_t lo = 0, hi = groups - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (start[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

#ifdef MOE_EP_AMX_GEMM
/* The codes and scales of AMX item it's weight rows (item_start as eg_group_of's). */
static void eg_amx_next(const eg_args *a, const int64_t *item_start, int64_t groups,
                        int64_t amx_tiles, int64_t it, eg_span out[2]) {
    const int64_t g = eg_group_of(item_start, groups, it);
    const int64_t j = (it - item_start[g]) % amx_tiles * EG_AMX_COLS;
    const int64_t nr = a->n - j < EG_AMX_COLS ? a->n - j : EG_AMX_COLS;
    out[0].p = a->w + a->g_expert[g] * a->w_expert_bytes + j * a->w_row_bytes;
    out[0].bytes = nr * a->w_row_bytes;
    if (a->s) {
        out[1].p = a->s + a->g_expert[g] * a->s_expert_bytes + j * a->s_row_bytes;
        out[1].bytes = nr * a->s_row_bytes;
    }
}
#endif

/* out[out_row0[g] + i, :n] = (x[row(q_start[g] + i), :k] @ w_e^T) [* alpha[g]] for every
 * group g (local expert e = g_expert[g]) and i < q_start[g + 1] - q_start[g], in the order
 * described above. row(q) = x_rows[q], or q when x_rows is NULL. w_e row j starts at byte
 * e * w_expert_bytes + j * w_row_bytes (bf16 elements, e4m3 bytes, or e2m1 pairs low nibble
 * first; EG_W_BF16_K16 / EG_W_E4M3_K16: block b of 16 packed columns there instead of row
 * j, eg_item_k16, bf16 or fp32 x, the codes' scales block b's s_row_bytes row, the k-order
 * bodies or auto only, else -3); its scale for
 * elements [b * s_block, (b + 1) * s_block) at s_row_bytes rows of s_kind values (s_block a
 * multiple of 16). alpha may be NULL. g_rows: per group, the row
 * count that picks its body under auto (NULL: its own). xs: fp32 scratch of
 * q_start[groups] * (round_up(k, 16) + 16) elements. vector: the body (EG_BODY_*: 0 the scalar
 * twin, 1 AVX2, 2 AVX-512F, 3 auto: for bf16 x and weights the AMX body where the CPU has
 * AMX, else the dot body where it has AVX-512 BF16 (EG_AUTO_BF16DOT) with AVX2 for groups of
 * <= EG_AVX2_ROWS path rows; else AVX-512F but AVX2 for bf16 blocks of <=
 * EG_AVX2_ROWS rows; without AVX-512F the AVX2 body, and the AVX2 k-order body for bf16 x
 * and weights in groups of >= EG_KSEQ_ROWS rows; 4 the AVX-512 BF16 dot body, 5 its scalar
 * twin, 6 the AVX2 k-order body, 7 its scalar twin, 8 the AMX body, 9 its scalar twin: bf16
 * x and weights only, their own orders). Returns 0, -1 when out of memory, -2 when this build
 * or CPU lacks the body asked for, -3 when a dot, AMX or k-order body is asked for other
 * kinds (nothing written in any of these): moe_ep_expert_gemm_v2 (below) does this.
 *
 * moe_ep_expert_gemm_v3: the same, with e4m3 x codes too (x_kind EG_X_E4M3, one byte per
 * element, ld_x bytes apart), in the block-scaled AMX order (the AMX bodies only): x_scale
 * holds each x row's fp32 scales, one per x_block elements, ld_x_scale apart (rows as
 * x's); e4m3 weights with fp32 scales (applied per sum block with x's: x_block and s_block
 * one dividing the other), or weights the AMX order takes (exact in bf16, scaled as they
 * are decoded: x's scales alone per x_block); x_block (and s_block) multiples of 32
 * dividing k; else -3. */
int32_t moe_ep_expert_gemm_v3(const void *x, int64_t ld_x, int32_t x_kind, const int64_t *x_rows,
                              const float *x_scale, int64_t ld_x_scale, int64_t x_block,
                              int64_t groups, const int64_t *q_start, const int64_t *g_expert,
                              const int64_t *out_row0, const int64_t *g_rows, const float *alpha,
                              const void *w, int64_t w_expert_bytes, int64_t w_row_bytes,
                              int32_t w_kind, const void *s, int64_t s_expert_bytes,
                              int64_t s_row_bytes, int32_t s_kind, int64_t s_block, void *out,
                              int64_t ld_out, int32_t out_kind, int64_t n, int64_t k, float *xs,
                              int32_t threads, int32_t vector) {
    const int32_t bodies = moe_ep_vector_bodies();
    const int bs = x_kind == EG_X_E4M3; /* the block-scaled AMX order */
    const int both = w_kind == EG_W_E4M3 && s_kind == EG_S_F32; /* scales on both sides */
    const int exact = w_kind == EG_W_BF16 ? s_kind == EG_S_NONE
                      : w_kind == EG_W_E4M3 ? s_kind == EG_S_E8M0 || s_kind == EG_S_NONE
                                            : s_kind != EG_S_F32; /* weights exact in bf16 */
    if (bs && (x_scale == NULL || x_block <= 0 || x_block % EG_DOT || k % x_block ||
               (vector != EG_BODY_AMX && vector != EG_BODY_AMX_SCALAR) || !(both || exact) ||
               (both && (s_block <= 0 || s_block % EG_DOT || k % s_block ||
                         (x_block % s_block && s_block % x_block)))))
        return -3;
    /* packed weights: the k order only (eg_item_k16), bf16 or fp32 x (bf16 values: no
     * scales; e4m3 codes: fp32 scales per s_block elements, a multiple of 16 dividing k);
     * auto: its AVX2 body where the CPU has AVX2, else the twin */
    const int packed16 = w_kind == EG_W_BF16_K16 || w_kind == EG_W_E4M3_K16;
    if (packed16) {
        if (x_kind == EG_X_E4M3 || bs) return -3;
        if (w_kind == EG_W_BF16_K16 ? s_kind != EG_S_NONE
                                    : s_kind != EG_S_F32 || s == NULL || s_block <= 0 ||
                                          s_block % EG_PCOLS || k % s_block)
            return -3;
        if (vector == EG_BODY_AUTO) vector = bodies & 1 ? EG_BODY_KSEQ : EG_BODY_KSEQ_SCALAR;
        else if (vector != EG_BODY_KSEQ && vector != EG_BODY_KSEQ_SCALAR) return -3;
    }
    const int bf16_only = (x_kind == EG_X_BF16 && w_kind == EG_W_BF16) || packed16;
    /* auto on bf16 with AMX: the AMX body for every group (1-2-row ones too: measured 1.15x
     * faster than the AVX2 body at 1 row per expert, weights from DRAM, 8 experts, K = 2048
     * / 1024, 2 threads) */
    const int auto_amx = vector == EG_BODY_AUTO && bf16_only && (bodies & 16);
    /* auto on bf16 with AVX-512 BF16 (no AMX): the dot body, but experts of <= EG_AVX2_ROWS
     * rows stay on the AVX2 body (eg_item), faster there */
    const int auto_dot =
        vector == EG_BODY_AUTO && EG_AUTO_BF16DOT && bf16_only && (bodies & 8) && !auto_amx;
    /* auto without AVX-512F: the AVX2 body, and the k order for bf16 groups of
     * >= EG_KSEQ_ROWS rows (eg_group_kseq) */
    const int auto_kseq = vector == EG_BODY_AUTO && !(bodies & 4) && (bodies & 1) && bf16_only;
    if (vector == EG_BODY_AUTO && !(bodies & 4)) vector = bodies & 1 ? EG_BODY_AVX2 : EG_BODY_SCALAR;
    vector = auto_dot ? EG_BODY_BF16DOT : auto_amx ? EG_BODY_AMX : vector;
    const int32_t need = vector == EG_BODY_BF16DOT ? 8
                         : vector == EG_BODY_AMX ? 16
                         : vector == EG_BODY_AVX2 || vector == EG_BODY_KSEQ ? 1
                         : vector == EG_BODY_AVX512 || vector == EG_BODY_AUTO ? 5 : 0;
    if (vector < 0 || vector > 9 || (bodies & need) != need) return -2;
    const int dot = vector == EG_BODY_BF16DOT || vector == EG_BODY_BF16DOT_SCALAR;
    const int amx_body = vector == EG_BODY_AMX || vector == EG_BODY_AMX_SCALAR;
    /* the AMX bodies: operands whose values are exact in bf16 (fp32 x checked as packed) */
    const int amx_kinds = bs || exact;
    if (amx_body ? !amx_kinds : (dot || vector >= EG_BODY_KSEQ) && !bf16_only) return -3;
    const int64_t k16 = (k + EG_LANES - 1) / EG_LANES * EG_LANES;
    const int64_t k32 = (k + EG_DOT - 1) / EG_DOT * EG_DOT;
    const int64_t tiles = (n + EG_COLS - 1) / EG_COLS, ktiles = (n + EG_KCOLS - 1) / EG_KCOLS;
    const int64_t ptiles = (n + EG_PCOLS - 1) / EG_PCOLS; /* packed blocks (packed16) */
    const int64_t amx_tiles = (n + EG_AMX_COLS - 1) / EG_AMX_COLS;
    int32_t inexact = 0; /* an fp32 x value not exact in bf16 (AMX bodies): -4 */
    /* per group: its first work item, its first transposed block (k order, AVX2), where its
     * transposed rows start in xt, and its first packed block (AMX) */
    int64_t *item_start = malloc(sizeof(int64_t) * (size_t)(4 * (groups + 1)));
    if (item_start == NULL) return -1;
    int64_t *blk_start = item_start + groups + 1, *xt_start = blk_start + groups + 1;
    int64_t *xv_start = xt_start + groups + 1;
    /* x rows one cache line longer than k16: rows 2^n bytes apart (K = 2048) would share L1
     * sets with each other and with the weight rows (4 KiB apart) and evict them. */
    const int64_t ldxs = k16 + EG_LANES; /* a dot group's row: 2 * ldxs bf16 elements */
    eg_args a = {.xs = xs, .ldxs = ldxs, .q_start = q_start, .g_expert = g_expert,
                 .out_row0 = out_row0, .alpha = alpha, .w = (const uint8_t *)w,
                 .s = (const uint8_t *)s, .w_expert_bytes = w_expert_bytes,
                 .w_row_bytes = w_row_bytes, .s_expert_bytes = s_expert_bytes,
                 .s_row_bytes = s_row_bytes, .s_block = s_block, .w_kind = w_kind,
                 .s_kind = s_kind, .out_kind = out_kind, .vector = vector,
                 .auto_dot = auto_dot, .auto_kseq = auto_kseq, .g_rows = g_rows, .out = out,
                 .ld_out = ld_out, .n = n, .k = k, .xt = NULL, .xt_start = xt_start,
                 .x16 = (const uint16_t *)x, .x_rows = x_rows, .ld_x = ld_x,
                 .xv = NULL, .xv_start = xv_start, .x_kind = x_kind, .inexact = &inexact};
    if (bs) {
        a.bs_block = x_block;
        a.x_block = x_block;
        a.xsc = x_scale;
        a.ld_xsc = ld_x_scale;
    }
    if (bs && both) { /* the weights' scales apply per sum block: the codes decode unscaled */
        a.bs_block = x_block < s_block ? x_block : s_block;
        a.ws = (const uint8_t *)s;
        a.ws_expert_bytes = s_expert_bytes;
        a.ws_row_bytes = s_row_bytes;
        a.ws_block = s_block;
        a.s = NULL;
        a.s_kind = EG_S_NONE;
    }
    /* the AVX2 k-order body on stored weights */
    const int transposed = (vector == EG_BODY_KSEQ || auto_kseq) && !packed16;
    const int packed = vector == EG_BODY_AMX;                   /* the AMX body */
    item_start[0] = blk_start[0] = xt_start[0] = xv_start[0] = 0;
    for (int64_t g = 0; g < groups; g++) {
        const int64_t rows = q_start[g + 1] - q_start[g];
        const int64_t path = eg_path_rows(&a, g);
        const int kseq = eg_group_kseq(&a, path);
        const int64_t blocks = kseq && transposed ? (rows + EG_KR - 1) / EG_KR : 0;
        item_start[g + 1] = item_start[g] + (amx_body ? (rows + EG_AMX_ROWS - 1) / EG_AMX_ROWS * amx_tiles
                                             : packed16 ? eg_k16_items(rows, ptiles)
                                                        : (rows + EG_ROWS - 1) / EG_ROWS *
                                                              (kseq ? ktiles : tiles));
        blk_start[g + 1] = blk_start[g] + blocks;
        xt_start[g + 1] = xt_start[g] + blocks * EG_KR * k;
        xv_start[g + 1] = xv_start[g] + (packed ? (rows + 15) / 16 : 0);
    }
    if (xt_start[groups] > 0) a.xt = malloc(sizeof(float) * (size_t)xt_start[groups]);
    if (xv_start[groups] > 0)
        a.xv = malloc(sizeof(uint16_t) * (size_t)(xv_start[groups] * EG_AMX_BLOCK(k32)));
    const int64_t xsv_size = bs ? xv_start[groups] * (k / x_block) * 16 : 0;
    if (xsv_size > 0) a.xsv = malloc(sizeof(float) * (size_t)xsv_size);
    /* per thread, an AMX item's decoded A tiles (codes only, eg_item_amx) */
    const int64_t dec_size = packed && w_kind != EG_W_BF16 ? 32 * EG_AMX_LDD(k32) : 0;
    if (dec_size > 0)
        a.dec = aligned_alloc(64, sizeof(uint16_t) * (size_t)(dec_size * (threads > 1 ? threads : 1)));
    if ((xt_start[groups] > 0 && a.xt == NULL) || (xv_start[groups] > 0 && a.xv == NULL) ||
        (dec_size > 0 && a.dec == NULL) || (xsv_size > 0 && a.xsv == NULL)) {
        free(a.xt);
        free(a.xv);
        free(a.xsv);
        free(a.dec);
        free(item_start);
        return -1;
    }
    const int64_t items = item_start[groups], total_rows = q_start[groups];
    const int64_t blocks = blk_start[groups], vblocks = xv_start[groups];
    const size_t x_elem = x_kind == EG_X_F32 ? 4 : x_kind == EG_X_E4M3 ? 1 : 2;
    (void)threads;
    (void)vblocks; /* packed (AMX builds only) */
    int64_t claimed = 0; /* items taken by a thread */
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t q = 0; q < total_rows; q++) {
            const int64_t row = x_rows ? x_rows[q] : q;
            const char *src = (const char *)x + row * ld_x * (int64_t)x_elem;
            const int64_t lo = eg_group_of(q_start, groups, q); /* the group holding row q */
            if (transposed && eg_group_kseq(&a, eg_path_rows(&a, lo))) continue; /* xt only */
            if (amx_body) continue; /* x16 (packed in xv) only */
            if (eg_group_dot(&a, eg_path_rows(&a, lo))) {
                uint16_t *dst = (uint16_t *)(xs + q * ldxs);
                memcpy(dst, src, sizeof(uint16_t) * (size_t)k);
                memset(dst + k, 0, sizeof(uint16_t) * (size_t)(k32 - k));
            } else {
                eg_widen_row(src, x_kind, k, k16, xs + q * ldxs);
            }
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t lo = eg_group_of(blk_start, groups, b); /* the group holding block b */
            eg_kseq_transpose(&a, lo, b - blk_start[lo]);
        }
#ifdef MOE_EP_AMX_GEMM /* blocks only where the AMX body runs */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < vblocks; b++) {
            const int64_t lo = eg_group_of(xv_start, groups, b); /* the group holding block b */
            eg_amx_pack16(&a, lo, b - xv_start[lo]);
        }
#endif
        /* the twin's fp32 x checked exact in bf16 before any output (the body's packing
         * above checks it) */
        if (amx_body && !packed && x_kind == EG_X_F32) {
#pragma omp for schedule(static)
            for (int64_t q = 0; q < total_rows; q++)
                for (int64_t i = 0; i < k; i++) (void)eg_amx_x_bits(&a, q, i);
        }
#ifdef MOE_EP_AMX_GEMM
        if (packed) eg_amx_configure();
#ifdef _OPENMP
        uint16_t *dec = a.dec ? a.dec + (int64_t)omp_get_thread_num() * dec_size : NULL;
#else
        uint16_t *dec = a.dec;
#endif
#endif
        /* the items in turn to whichever thread is free (as schedule(dynamic, 1)), each
         * thread claiming its next one when it starts one: an AMX item of codes prefetches
         * the next one's into L2 */
        for (int64_t it = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED), after; it < items;
             it = after) {
            after = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            if (inexact) continue;
            const int64_t lo = eg_group_of(item_start, groups, it); /* the group holding item it */
            const int64_t i = it - item_start[lo];
            if (amx_body) { /* every group of the call */
#ifdef MOE_EP_AMX_GEMM
                if (packed) {
                    eg_span next[2] = {{NULL, 0}, {NULL, 0}};
                    if (after < items && w_kind == EG_W_E2M1)
                        eg_amx_next(&a, item_start, groups, amx_tiles, after, next);
                    eg_item_amx(&a, lo, i / amx_tiles, i % amx_tiles, dec, next);
                } else
#endif
                    eg_item_amx_scalar(&a, lo, i / amx_tiles, i % amx_tiles);
            } else if (packed16) {
                const int one = q_start[lo + 1] - q_start[lo] == 1; /* a pair of blocks */
                eg_item_k16(&a, lo, one ? 0 : i / ptiles, one ? 2 * i : i % ptiles);
            } else if (eg_group_kseq(&a, eg_path_rows(&a, lo))) {
                eg_item_kseq(&a, lo, i / ktiles, i % ktiles);
            } else {
                eg_item(&a, lo, i / tiles, i % tiles);
            }
        }
#ifdef MOE_EP_AMX_GEMM
        if (packed) eg_amx_release();
#endif
    }
    free(a.xt);
    free(a.xv);
    free(a.xsv);
    free(a.dec);
    free(item_start);
    return inexact ? -4 : 0;
}

/* moe_ep_expert_gemm_v3 without x scales (bf16 or fp32 x; e4m3 x codes: -3). */
int32_t moe_ep_expert_gemm_v2(const void *x, int64_t ld_x, int32_t x_kind, const int64_t *x_rows,
                        int64_t groups, const int64_t *q_start, const int64_t *g_expert,
                        const int64_t *out_row0, const int64_t *g_rows, const float *alpha,
                        const void *w,
                        int64_t w_expert_bytes, int64_t w_row_bytes, int32_t w_kind,
                        const void *s, int64_t s_expert_bytes, int64_t s_row_bytes,
                        int32_t s_kind, int64_t s_block, void *out, int64_t ld_out,
                        int32_t out_kind, int64_t n, int64_t k, float *xs, int32_t threads,
                        int32_t vector) {
    if (x_kind == EG_X_E4M3) return -3; /* needs x scales: moe_ep_expert_gemm_v3 */
    return moe_ep_expert_gemm_v3(x, ld_x, x_kind, x_rows, NULL, 0, 0, groups, q_start, g_expert,
                                 out_row0, g_rows, alpha, w, w_expert_bytes, w_row_bytes, w_kind,
                                 s, s_expert_bytes, s_row_bytes, s_kind, s_block, out, ld_out,
                                 out_kind, n, k, xs, threads, vector);
}

/* Which vector bodies this build has and this CPU runs: bit 0 the AVX2 expert GEMM, bit 1
 * the AVX-512 epilogues, bit 2 the AVX-512F expert GEMM, bit 3 the AVX-512 BF16 one, bit 4
 * the AMX one (and Linux granted this process the tile state). */
int32_t moe_ep_vector_bodies(void) {
    int32_t bodies = 0;
#ifdef MOE_EP_AVX2
    bodies |= 1;
#endif
#ifdef MOE_EP_AVX512
    bodies |= 2;
#endif
#ifdef MOE_EP_AVX512_GEMM
    bodies |= eg_avx512_supported() ? 4 : 0;
#endif
#ifdef MOE_EP_BF16DOT_GEMM
    bodies |= eg_bf16dot_supported() ? 8 : 0;
#endif
#ifdef MOE_EP_AMX_GEMM
    bodies |= eg_amx_supported() ? 16 : 0;
#endif
    return bodies;
}
