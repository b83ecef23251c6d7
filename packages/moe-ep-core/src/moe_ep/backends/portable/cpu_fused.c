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
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define MOE_EP_AVX512 1
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
static inline float exp_f32(float x) {
    float c = x < -86.0f ? -86.0f : x;
    c = c > 88.72283935546875f ? 88.72283935546875f : c;
    c = c == c ? c : 0.0f;
    float n = __builtin_fmaf(c, 1.44269504088896341f, 12582912.0f) - 12582912.0f;
    float r = __builtin_fmaf(n, -0.693145751953125f, c);
    r = __builtin_fmaf(n, -1.428606765330187045e-06f, r);
    float p = 1.9875691500e-4f;
    p = __builtin_fmaf(p, r, 1.3981999507e-3f);
    p = __builtin_fmaf(p, r, 8.3334519073e-3f);
    p = __builtin_fmaf(p, r, 4.1665795894e-2f);
    p = __builtin_fmaf(p, r, 1.6666665459e-1f);
    p = __builtin_fmaf(p, r, 5.0000001201e-1f);
    p = __builtin_fmaf(p, r * r, r) + 1.0f;
    bits32 scale;
    scale.i = ((int32_t)n + 126) << 23;
    float e = (p * scale.f) * 2.0f;
    e = x > 88.72283935546875f ? __builtin_inff() : e;
    return x == x ? e : x;
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
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), c);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
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
