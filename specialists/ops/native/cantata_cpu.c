/* Cantata's CPU kernels for weight-only quantized decoding (AVX-512 F/BW/VNNI; built and loaded by
 * specialists/ops/native.py, which checks the CPU first).
 *
 * Products: int8 weights with one fp32 scale per output row, times activations quantized per row to
 * int16 (one fp32 scale per row, |q| <= 8191), accumulated exactly in int32 (vpdpwssd), scaled once
 * in fp32; or a GGUF's own Q4_1 / Q8_0 blocks times activations rounded to int8 per block of 32
 * (vpdpbusd, see "GGML block weights" below); or fp32 weights. Every row of a call is computed by the same instructions in the same order whatever the
 * number of rows or threads: a row's result depends on nothing else in the call (what speculation's
 * exactness needs: a verify row equals the decode of its position, bit for bit).
 *
 * llama_forward runs a whole Llama stack for T rows in one call (RMSNorm, q/k/v, RoPE, the paged
 * KV write, attention of each row over its own sequence's keys [0, position], the output product
 * with the residual, RMSNorm, gate/up, SiLU, down with the residual, the final norm), with no Python
 * between the layers. Fixed-order reductions only (no -ffast-math): masked tails, no alignment peel.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#define QMAX 8191.0f

static inline __mmask16 tail_mask(int n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* exp for x <= 88 (below -87.3 it flushes to 0): 2^n * p(r), r = x - n ln2, degree-7 Taylor (~1 ulp) */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
    x = _mm512_min_ps(x, _mm512_set1_ps(88.3f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* one row of K floats -> int16 (|q| <= 8191) and its scale (0 for an all-zero row) */
static float quant_row(const float* x, int K, int16_t* q) {
    __m512 amax = _mm512_setzero_ps();
    for (int k = 0; k < K; k += 16)
        amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail_mask(K - k), x + k)));
    float a = _mm512_reduce_max_ps(amax);
    if (!(a > 0.f)) { memset(q, 0, (size_t)K * sizeof(int16_t)); return 0.f; }
    __m512 inv = _mm512_set1_ps(QMAX / a);
    for (int k = 0; k < K; k += 16) {
        __mmask16 m = tail_mask(K - k);
        __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), inv));
        _mm256_mask_storeu_epi16(q + k, m, _mm512_cvtsepi32_epi16(i));
    }
    return a / QMAX;
}

/* The lanes' total: each int32 lane sums K / 16 products of |x| <= 8191, |w| <= 127 (no overflow for
 * K <= 32768); the total of all K fits int32 for K <= 2064 (then summed in int32), else int64. */
static inline int64_t lanes_total(__m512i acc, int K) {
    if (K <= 2064) return _mm512_reduce_add_epi32(acc);
    return _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(acc)))
         + _mm512_reduce_add_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(acc, 1)));
}

#define WLOAD(w, k) _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)((w) + (k))))

/* sum_k x[k] * w[k] for one row of x, exact */
static inline int64_t dot1(const int16_t* x, const int8_t* w, int K) {
    __m512i acc = _mm512_setzero_si512();
    int k = 0;
    for (; k + 32 <= K; k += 32) acc = _mm512_dpwssd_epi32(acc, _mm512_loadu_si512(x + k), WLOAD(w, k));
    int64_t s = lanes_total(acc, K);
    for (; k < K; k++) s += (int64_t)x[k] * (int64_t)w[k];
    return s;
}

/* the same for four rows of x (K apart) against one weight row, each widened once: equal to four dot1 */
static inline void dot4(const int16_t* x, const int8_t* w, int K, int64_t* s) {
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    const int16_t *x1 = x + K, *x2 = x + 2 * (size_t)K, *x3 = x + 3 * (size_t)K;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        __m512i wv = WLOAD(w, k);
        a0 = _mm512_dpwssd_epi32(a0, _mm512_loadu_si512(x + k), wv);
        a1 = _mm512_dpwssd_epi32(a1, _mm512_loadu_si512(x1 + k), wv);
        a2 = _mm512_dpwssd_epi32(a2, _mm512_loadu_si512(x2 + k), wv);
        a3 = _mm512_dpwssd_epi32(a3, _mm512_loadu_si512(x3 + k), wv);
    }
    s[0] = lanes_total(a0, K); s[1] = lanes_total(a1, K); s[2] = lanes_total(a2, K); s[3] = lanes_total(a3, K);
    for (; k < K; k++) {
        s[0] += (int64_t)x[k] * w[k]; s[1] += (int64_t)x1[k] * w[k];
        s[2] += (int64_t)x2[k] * w[k]; s[3] += (int64_t)x3[k] * w[k];
    }
}

/* fp32 weights: sum_k x[m, k] w[k] for M4 <= 4 rows of x (K apart) sharing each weight load, one
 * fixed-order sum per row (16 lanes, masked tail, the lanes' tree) */
static inline __attribute__((always_inline)) void fdot4(const float* x, int M4, const float* w, int K, float* s) {
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int k = 0; k < K; k += 16) {
        __mmask16 m = tail_mask(K - k);
        __m512 wv = _mm512_maskz_loadu_ps(m, w + k);
        for (int j = 0; j < M4; j++) a[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + (size_t)j * K + k), wv, a[j]);
    }
    for (int j = 0; j < M4; j++) s[j] = _mm512_reduce_add_ps(a[j]);
}

/* A product over M rows: int8 weights W [N, K] with scales ws against rows rounded to int16 (xq, xs),
 * or (ws NULL) fp32 weights against fp32 rows xf. */
typedef struct {
    const int16_t* xq;
    const float *xs, *xf, *ws, *bias, *res;
    const void* W;
    float* out;
    int M, K, N, ldo, nt;
} gemm_t;

/* rows m0..m0+mm-1 (mm <= 4) times weight row n, before bias and residual. int8: the exact integer
 * sum, converted to fp32 once, then times the two scales. Every row takes the same instructions in
 * any call: its result does not depend on the other rows. */
static inline void gemm_block(const gemm_t* g, int n, int m0, int mm, float* v) {
    size_t K = (size_t)g->K;
    if (!g->ws) {
        const float* wr = (const float*)g->W + (size_t)n * K;
        if (mm == 4) fdot4(g->xf + m0 * K, 4, wr, g->K, v);
        else for (int j = 0; j < mm; j++) fdot4(g->xf + (m0 + j) * K, 1, wr, g->K, v + j);
        return;
    }
    const int8_t* wr = (const int8_t*)g->W + (size_t)n * K;
    int64_t acc[4];
    if (mm == 4) dot4(g->xq + m0 * K, wr, g->K, acc);
    else for (int j = 0; j < mm; j++) acc[j] = dot1(g->xq + (m0 + j) * K, wr, g->K);
    for (int j = 0; j < mm; j++) v[j] = (float)acc[j] * g->xs[m0 + j] * g->ws[n];
}

/* out[m, n] = the product (+ bias[n]) (+ res[m, n]); rows of out are ldo apart (res too). Each thread
 * takes a contiguous range of output columns; rows go in tiles of MTILE, so a prefill's activations
 * stay in L2 while its weight rows stream past them (one pass over the weights per tile). */
#define MTILE 64
static void gemm(const gemm_t* g) {
    #pragma omp parallel num_threads(g->nt)
    {
        int nthr = omp_get_num_threads(), tid = omp_get_thread_num();
        int lo = (int)((int64_t)g->N * tid / nthr), hi = (int)((int64_t)g->N * (tid + 1) / nthr);
        float v[4];
        for (int t0 = 0; t0 < g->M; t0 += MTILE) {
            int t1 = g->M - t0 < MTILE ? g->M : t0 + MTILE;
            for (int n = lo; n < hi; n++)
                for (int m0 = t0; m0 < t1; m0 += 4) {
                    int mm = t1 - m0 < 4 ? t1 - m0 : 4;
                    gemm_block(g, n, m0, mm, v);
                    for (int j = 0; j < mm; j++) {
                        size_t at = (size_t)(m0 + j) * g->ldo + n;
                        float x = v[j];
                        if (g->bias) x += g->bias[n];
                        if (g->res) x += g->res[at];
                        g->out[at] = x;
                    }
                }
        }
    }
}

static void qgemm(const int16_t* xq, const float* xs, int M, int K, const int8_t* W, const float* ws,
                  const float* bias, int N, float* out, int ldo, const float* res, int nt) {
    gemm_t g = {xq, xs, NULL, ws, bias, res, W, out, M, K, N, ldo, nt};
    gemm(&g);
}

static void fgemm(const float* x, int M, int K, const float* W, const float* bias, int N, float* out, int ldo,
                  const float* res, int nt) {
    gemm_t g = {NULL, NULL, x, NULL, bias, res, W, out, M, K, N, ldo, nt};
    gemm(&g);
}

/* x [M, K] fp32 -> int16 rows and scales, then qgemm (the entry point for single products) */
int cantata_qlinear(const float* x, int M, int K, const int8_t* W, const float* ws, const float* bias, int N,
                    float* out, const float* res, int16_t* xq, float* xs, int nt) {
    for (int m = 0; m < M; m++) xs[m] = quant_row(x + (size_t)m * K, K, xq + (size_t)m * K);
    qgemm(xq, xs, M, K, W, ws, bias, N, out, N, res, nt);
    return 0;
}

/* ---- GGML block weights (`quantization="q4"`: the imported GGUF's own 4-bit values). A product's
 * weight is packed by specialists/ggml_blocks.py in groups of 16 output rows; per group and per block
 * of 32 inputs: Q4_1 (type 1): 4 x 64 bytes of nibbles (lane r of vector j: byte i low nibble = row r's
 * input 8j + i, high nibble = input 8j + 4 + i), then the 16 rows' d and m (fp16): value d q + m.
 * Q8_0 (type 2): 8 x 64 bytes of int8 (lane r of vector j: row r's inputs 4j..4j+3), the rows' d
 * (fp16) and c = -128 d sum(q) (fp32, exact). Activations are rounded per block of 32 to int8 (scale
 * amax / 127, as llama.cpp's Q8_1), then vpdpbusd sums a block exactly in int32 and the block's
 * result joins an fp32 sum in block order: Q4_1 d sa sum(q a) + m sa sum(a); Q8_0 (activations
 * offset to unsigned, a + 128) d sa sum(q (a + 128)) + c sa. Row-invariant like the int8 products. ---- */

#define QB 32
enum { BT_Q4_1 = 1, BT_Q8_0 = 2 };

static inline size_t block_bytes(int type) { return type == BT_Q4_1 ? 320 : 608; }

/* one row of K floats -> int8 per block of 32 (unsigned a + 128 for Q8_0), the blocks' scales sa and
 * the second term's factor sb (Q4_1: sa sum(a); Q8_0: sa) */
static void quant_blocks_row(const float* x, int K, int type, int8_t* q, float* sa, float* sb) {
    for (int b = 0; b < K / QB; b++) {
        const float* xb = x + (size_t)b * QB;
        __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
        float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
        float s = a > 0.f ? a / 127.0f : 0.f;
        __m512 inv = _mm512_set1_ps(a > 0.f ? 127.0f / a : 0.f);
        __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
        int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
        if (type == BT_Q8_0) {
            i0 = _mm512_add_epi32(i0, _mm512_set1_epi32(128));
            i1 = _mm512_add_epi32(i1, _mm512_set1_epi32(128));
            _mm_storeu_si128((__m128i*)(q + (size_t)b * QB), _mm512_cvtusepi32_epi8(i0));
            _mm_storeu_si128((__m128i*)(q + (size_t)b * QB + 16), _mm512_cvtusepi32_epi8(i1));
        } else {
            _mm_storeu_si128((__m128i*)(q + (size_t)b * QB), _mm512_cvtsepi32_epi8(i0));
            _mm_storeu_si128((__m128i*)(q + (size_t)b * QB + 16), _mm512_cvtsepi32_epi8(i1));
        }
        sa[b] = s;
        sb[b] = type == BT_Q8_0 ? s : s * (float)sum;
    }
}

typedef struct {
    const int8_t* xq;
    const float *sa, *sb, *bias, *res;
    const uint8_t* W;
    float* out;
    int M, K, N, ldo, nt, type;
} bgemm_t;

#define BCAST(p) _mm512_set1_epi32(*(const int32_t*)(p))

/* 16 output rows (group g) for MM <= 4 activation rows m0.. -> acc[r] (lane = output row) */
static inline __attribute__((always_inline)) void bgroup(const bgemm_t* g, int grp, int m0, const int MM, __m512* acc) {
    int nb = g->K / QB;
    size_t bb = block_bytes(g->type), K = (size_t)g->K;
    const uint8_t* wg = g->W + (size_t)grp * nb * bb;
    for (int r = 0; r < MM; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int b = 0; b < nb; b++) {
        const uint8_t* blk = wg + (size_t)b * bb;
        __m512i id[4] = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512()};
        __m512 dv, mv;
        if (g->type == BT_Q4_1) {
            for (int j = 0; j < 4; j++) {
                __m512i v = _mm512_loadu_si512(blk + 64 * j);
                __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int r = 0; r < MM; r++) {
                    const int8_t* xa = g->xq + (size_t)(m0 + r) * K + (size_t)b * QB + 8 * j;
                    id[r] = _mm512_dpbusd_epi32(id[r], lo, BCAST(xa));
                    id[r] = _mm512_dpbusd_epi32(id[r], hi, BCAST(xa + 4));
                }
            }
            dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 256)));
            mv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 288)));
        } else {
            for (int j = 0; j < 8; j++) {
                __m512i v = _mm512_loadu_si512(blk + 64 * j);
                for (int r = 0; r < MM; r++)
                    id[r] = _mm512_dpbusd_epi32(id[r], BCAST(g->xq + (size_t)(m0 + r) * K + (size_t)b * QB + 4 * j), v);
            }
            dv = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(blk + 512)));
            mv = _mm512_loadu_ps(blk + 544);
        }
        for (int r = 0; r < MM; r++) {
            size_t at = (size_t)(m0 + r) * nb + b;
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(id[r]), _mm512_mul_ps(dv, _mm512_set1_ps(g->sa[at])), acc[r]);
            acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(g->sb[at]), acc[r]);
        }
    }
}

static void bgemm(const bgemm_t* g) {
    int groups = (g->N + 15) / 16;
    #pragma omp parallel num_threads(g->nt)
    {
        int nthr = omp_get_num_threads(), tid = omp_get_thread_num();
        int lo = (int)((int64_t)groups * tid / nthr), hi = (int)((int64_t)groups * (tid + 1) / nthr);
        __m512 acc[4];
        for (int t0 = 0; t0 < g->M; t0 += MTILE) {
            int t1 = g->M - t0 < MTILE ? g->M : t0 + MTILE;
            for (int grp = lo; grp < hi; grp++)
                for (int m0 = t0; m0 < t1; m0 += 4) {
                    int mm = t1 - m0 < 4 ? t1 - m0 : 4;
                    if (mm == 4) bgroup(g, grp, m0, 4, acc);
                    else for (int j = 0; j < mm; j++) bgroup(g, grp, m0 + j, 1, acc + j);
                    int n0 = grp * 16;
                    __mmask16 k = tail_mask(g->N - n0);
                    __m512 bias = g->bias ? _mm512_maskz_loadu_ps(k, g->bias + n0) : _mm512_setzero_ps();
                    for (int j = 0; j < mm; j++) {
                        float* o = g->out + (size_t)(m0 + j) * g->ldo + n0;
                        __m512 x = _mm512_add_ps(acc[j], bias);
                        if (g->res) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(k, g->res + (size_t)(m0 + j) * g->ldo + n0));
                        _mm512_mask_storeu_ps(o, k, x);
                    }
                }
        }
    }
}

/* x [M, K] fp32 rounded per block (scratch xq [M, K], sa / sb [M, K / 32]), times packed W -> out */
static void blinear(const float* x, int M, int K, int type, const uint8_t* W, const float* bias, int N, float* out,
                    int ldo, const float* res, int8_t* xq, float* sa, float* sb, int nt) {
    int nb = K / QB;
    for (int m = 0; m < M; m++)
        quant_blocks_row(x + (size_t)m * K, K, type, xq + (size_t)m * K, sa + (size_t)m * nb, sb + (size_t)m * nb);
    bgemm_t g = {xq, sa, sb, bias, res, W, out, M, K, N, ldo, nt, type};
    bgemm(&g);
}

/* the entry point for single products (the lm_head): K a multiple of 32 */
int cantata_blinear(const float* x, int M, int K, int type, const uint8_t* W, const float* bias, int N, float* out,
                    int8_t* xq, float* sa, float* sb, int nt) {
    if (K % QB || (type != BT_Q4_1 && type != BT_Q8_0)) return -1;
    blinear(x, M, K, type, W, bias, N, out, N, NULL, xq, sa, sb, nt);
    return 0;
}

static void rms_norm_row(const float* x, const float* w, int d, float eps, float* y) {
    __m512 ss = _mm512_setzero_ps();
    for (int k = 0; k < d; k += 16) {
        __m512 v = _mm512_maskz_loadu_ps(tail_mask(d - k), x + k);
        ss = _mm512_fmadd_ps(v, v, ss);
    }
    __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)d + eps));
    for (int k = 0; k < d; k += 16) {
        __mmask16 m = tail_mask(d - k);
        __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + k), r);
        _mm512_mask_storeu_ps(y + k, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + k)));
    }
}

static inline __attribute__((always_inline)) float dot_f32(const float* a, const float* b, int n) {
    __m512 acc = _mm512_setzero_ps();
    for (int k = 0; k < n; k += 16) {
        __mmask16 m = tail_mask(n - k);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + k), _mm512_maskz_loadu_ps(m, b + k), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

/* rotate-half RoPE on the first R channels of a head vector, in place */
static void rope_head(float* x, const float* c, const float* s, int R) {
    int h = R / 2;
    for (int i = 0; i < h; i++) {
        float a = x[i], b = x[i + h];
        x[i] = a * c[i] - b * s[i];
        x[i + h] = b * c[i + h] + a * s[i + h];
    }
}

/* A key source: n keys of a sequence in the paged pool (through its block table), then nt keys of a
 * dense tail (the drafter's chained entries), rows `stride` apart, a head `off` into each row. */
typedef struct {
    const float *kc, *vc, *tk, *tv;
    const int64_t* table;
    int bs, n, nt;
    size_t stride, off;
} keys_t;

/* the sums of 16 vectors (a[u]: key u's per-lane products) in key order, each added up exactly as
 * _mm512_reduce_add_ps adds one vector (GCC's order: lanes i and i+8, then i and i+4 of those, then
 * 0+2 and 1+3, then the two): the bits dot_f32 gives each key, 16 keys at a time in ~45 vector ops
 * instead of 16 horizontal reductions */
static inline __attribute__((always_inline)) __m512 reduce16(const __m512* a) {
    __m512 s1[8], s2[4], s3[2];
    for (int p = 0; p < 8; p++)  /* keys 2p, 2p+1: [T3 of 2p | T3 of 2p+1] */
        s1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE), _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44));
    for (int p = 0; p < 4; p++)  /* keys 4p..4p+3: T6 of each, one 128-bit lane a key */
        s2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0xDD), _mm512_shuffle_f32x4(s1[2 * p], s1[2 * p + 1], 0x88));
    for (int p = 0; p < 2; p++)  /* lane k: T8 of key 8p+k, then of key 8p+4+k */
        s3[p] = _mm512_add_ps(_mm512_shuffle_ps(s2[2 * p], s2[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_ps(s2[2 * p], s2[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(s3[0], s3[1], _MM_SHUFFLE(3, 1, 3, 1)));  /* element 4k+e: key k+4e */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), r);
}

/* q [D] (D a multiple of 16, at most 128) against 16 keys `stride` apart from k: the 16 dot products
 * in key order, each the bits dot_f32 gives (its lanes' sums, then reduce16) */
static inline __attribute__((always_inline)) __m512 dots16(const float* q, const float* k, size_t stride, const int D) {
    __m512 acc[16];
    for (int u = 0; u < 16; u++) {
        const float* kr = k + (size_t)u * stride;
        __m512 t = _mm512_setzero_ps();
        for (int c = 0; c < D; c += 16) t = _mm512_fmadd_ps(_mm512_loadu_ps(q + c), _mm512_loadu_ps(kr + c), t);
        acc[u] = t;
    }
    return reduce16(acc);
}

#define GMAX 8  /* query heads a KV head serves in attend_gd (more: one head at a time) */
#define QMAX 32  /* queries attend_gd takes at once: rows of a sequence x the query heads of a KV head */

/* one query row and head over its keys: softmax(q k^T * scale) v -> o [D]. The pool's keys are
 * walked block by block of the table (no division per key), their scores 16 at a time where the
 * block holds 16 more slots (reduce16: the same bits as one key at a time); D is a constant where
 * inlined from attend() (64, 128), so the head's accumulators stay in registers. */
static inline __attribute__((always_inline)) void attend_d(const float* q, const keys_t* s, const int D, float scale,
                                                           float* sc, float* o) {
    const float *kc = s->kc, *vc = s->vc;
    const int64_t* table = s->table;
    int bs = s->bs, n = s->n, ntot = s->n + s->nt;
    size_t stride = s->stride, off = s->off;
    float mx = -INFINITY;
    __m512 vscale = _mm512_set1_ps(scale), vmax = _mm512_set1_ps(-INFINITY);
    for (int j = 0, blk = 0; j < n; blk++) {
        const float* kb = kc + (size_t)table[blk] * bs * stride + off;
        int e = n - j < bs ? n - j : bs, r = 0;
        if (D % 16 == 0 && D <= 128) {
            for (; r < e && r + 16 <= bs; r += 16) {  /* slots past e in the block are read, their scores dropped */
                __mmask16 m = tail_mask(e - r);
                __m512 v = _mm512_mul_ps(dots16(q, kb + (size_t)r * stride, stride, D), vscale);
                _mm512_mask_storeu_ps(sc + j + r, m, v);
                vmax = _mm512_mask_max_ps(vmax, m, vmax, v);
            }
        }
        for (; r < e; r++) {
            float v = dot_f32(q, kb + r * stride, D) * scale;
            sc[j + r] = v;
            if (v > mx) mx = v;
        }
        j += e;
    }
    float vm = _mm512_reduce_max_ps(vmax);
    if (vm > mx) mx = vm;
    for (int j = 0; j < s->nt; j++) {
        float v = dot_f32(q, s->tk + j * stride + off, D) * scale;
        sc[n + j] = v;
        if (v > mx) mx = v;
    }
    n = ntot;
    __m512 sum = _mm512_setzero_ps(), vmx = _mm512_set1_ps(mx);
    for (int j = 0; j < n; j += 16) {
        __mmask16 m = tail_mask(n - j);
        __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sc + j), vmx)));
        _mm512_mask_storeu_ps(sc + j, m, e);
        sum = _mm512_add_ps(sum, e);
    }
    __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    n = s->n;
    for (int d0 = 0; d0 < D; d0 += 128) {  /* up to 8 accumulators at a time */
        __m512 acc[8];
        int nc = (D - d0 + 15) / 16 < 8 ? (D - d0 + 15) / 16 : 8;
        for (int c = 0; c < nc; c++) acc[c] = _mm512_setzero_ps();
        for (int j = 0, blk = 0; j < n; blk++) {
            const float* vb = vc + (size_t)table[blk] * bs * stride + off + d0;
            int e = n - j < bs ? n - j : bs;
            for (int r = 0; r < e; r++, j++) {
                __m512 p = _mm512_set1_ps(sc[j]);
                for (int c = 0; c < nc; c++)
                    acc[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(tail_mask(D - d0 - 16 * c), vb + r * stride + 16 * c), acc[c]);
            }
        }
        for (int j = 0; j < s->nt; j++) {
            __m512 p = _mm512_set1_ps(sc[n + j]);
            const float* vb = s->tv + j * stride + off + d0;
            for (int c = 0; c < nc; c++)
                acc[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(tail_mask(D - d0 - 16 * c), vb + 16 * c), acc[c]);
        }
        for (int c = 0; c < nc; c++)
            _mm512_mask_storeu_ps(o + d0 + 16 * c, tail_mask(D - d0 - 16 * c), _mm512_mul_ps(acc[c], inv));
    }
}

/* Q queries over one KV head of one sequence (the query heads that share it, of one row or of several
 * rows of the sequence): qs[i] a query [D], os[i] its output, nq[i] <= s->n the pool keys it sees
 * (with a tail, s->nt > 0, every nq[i] is s->n and each sees the whole tail); sc: Q rows scs apart.
 * Each query is computed exactly as attend_d computes it alone (the same operations in the same
 * order; a pool key past a query's end adds p = 0 to its sums, which leaves them as they are), and
 * each key and value is read from memory once for all of them (the other queries read it from L1). */
static inline __attribute__((always_inline)) void attend_gd(const float* const* qs, const int* nq, float* const* os,
                                                            const keys_t* s, const int D, int Q, float scale,
                                                            float* sc, size_t scs) {
    const float *kc = s->kc, *vc = s->vc;
    const int64_t* table = s->table;
    int bs = s->bs, n = s->n;
    size_t stride = s->stride, off = s->off;
    float mx[QMAX];
    __m512 vmax[QMAX], vscale = _mm512_set1_ps(scale);
    for (int g = 0; g < Q; g++) { mx[g] = -INFINITY; vmax[g] = _mm512_set1_ps(-INFINITY); }
    for (int j = 0, blk = 0; j < n; blk++) {
        const float* kb = kc + (size_t)table[blk] * bs * stride + off;
        int e = n - j < bs ? n - j : bs, r = 0;
        if (D % 16 == 0 && D <= 128) {
            for (; r < e && r + 16 <= bs; r += 16) {
                for (int g = 0; g < Q; g++) {
                    int valid = nq[g] - j - r < e - r ? nq[g] - j - r : e - r;
                    if (valid <= 0) continue;
                    __mmask16 m = tail_mask(valid);
                    __m512 v = _mm512_mul_ps(dots16(qs[g], kb + (size_t)r * stride, stride, D), vscale);
                    _mm512_mask_storeu_ps(sc + g * scs + j + r, m, v);
                    vmax[g] = _mm512_mask_max_ps(vmax[g], m, vmax[g], v);
                }
            }
        }
        for (; r < e; r++)
            for (int g = 0; g < Q; g++) {
                if (j + r >= nq[g]) continue;
                float v = dot_f32(qs[g], kb + r * stride, D) * scale;
                sc[g * scs + j + r] = v;
                if (v > mx[g]) mx[g] = v;
            }
        j += e;
    }
    for (int t = 0; t < s->nt; t++)
        for (int g = 0; g < Q; g++) {
            float v = dot_f32(qs[g], s->tk + t * stride + off, D) * scale;
            sc[g * scs + n + t] = v;
            if (v > mx[g]) mx[g] = v;
        }
    __m512 inv[QMAX];
    for (int g = 0; g < Q; g++) {
        float vm = _mm512_reduce_max_ps(vmax[g]);
        float* sg = sc + g * scs;
        int ntot = nq[g] + s->nt;
        __m512 sum = _mm512_setzero_ps(), vmx = _mm512_set1_ps(vm > mx[g] ? vm : mx[g]);
        for (int j = 0; j < ntot; j += 16) {
            __mmask16 m = tail_mask(ntot - j);
            __m512 ex = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + j), vmx)));
            _mm512_mask_storeu_ps(sg + j, m, ex);
            sum = _mm512_add_ps(sum, ex);
        }
        inv[g] = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
        for (int j = nq[g]; j < n; j++) sg[j] = 0.0f;  /* keys past its end: p = 0 (no tail here: nq[g] == n with one) */
    }
    const int C = D / 16 < 8 ? D / 16 : 8, GC = 24 / C < GMAX ? 24 / C : GMAX;  /* accumulators within the registers */
    for (int g0 = 0; g0 < Q; g0 += GC) {
        int gn = Q - g0 < GC ? Q - g0 : GC;
        for (int d0 = 0; d0 < D; d0 += 16 * C) {
            __m512 acc[24];
            for (int a = 0; a < gn * C; a++) acc[a] = _mm512_setzero_ps();
            for (int j = 0, blk = 0; j < n; blk++) {
                const float* vb = vc + (size_t)table[blk] * bs * stride + off + d0;
                int e = n - j < bs ? n - j : bs;
                for (int r = 0; r < e; r++, j++)
                    for (int g = 0; g < gn; g++) {
                        __m512 p = _mm512_set1_ps(sc[(g0 + g) * scs + j]);
                        for (int c = 0; c < C; c++)
                            acc[g * C + c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vb + r * stride + 16 * c), acc[g * C + c]);
                    }
            }
            for (int t = 0; t < s->nt; t++) {
                const float* vb = s->tv + t * stride + off + d0;
                for (int g = 0; g < gn; g++) {
                    __m512 p = _mm512_set1_ps(sc[(g0 + g) * scs + n + t]);
                    for (int c = 0; c < C; c++)
                        acc[g * C + c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(vb + 16 * c), acc[g * C + c]);
                }
            }
            for (int g = 0; g < gn; g++)
                for (int c = 0; c < C; c++)
                    _mm512_storeu_ps(os[g0 + g] + d0 + 16 * c, _mm512_mul_ps(acc[g * C + c], inv[g0 + g]));
        }
    }
}

static void attend(const float* q, const keys_t* s, int D, float scale, float* sc, float* o) {
    if (D == 64) attend_d(q, s, 64, scale, sc, o);
    else if (D == 128) attend_d(q, s, 128, scale, sc, o);
    else attend_d(q, s, D, scale, sc, o);
}

/* silu(gate) * up for one row of gu = [gate | up] (each I wide) */
static void swiglu_row(const float* gu, int I, float* y) {
    for (int k = 0; k < I; k += 16) {
        __mmask16 m = tail_mask(I - k);
        __m512 g = _mm512_maskz_loadu_ps(m, gu + k), u = _mm512_maskz_loadu_ps(m, gu + I + k);
        __m512 sig = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
        _mm512_mask_storeu_ps(y + k, m, _mm512_mul_ps(_mm512_mul_ps(g, sig), u));
    }
}

enum { P_IN_NORM, P_POST_NORM, P_QKV_W, P_QKV_S, P_QKV_B, P_O_W, P_O_S, P_O_B, P_GU_W, P_GU_S, P_GU_B,
       P_DN_W, P_DN_S, P_DN_B, P_KC, P_VC, P_COUNT };

typedef struct {
    int T, d, L, Hq, Hkv, D, R, I, bs, tw, nt;
    float eps, scale;
} dims_t;

/* the attention of every (row, head) of a layer; qkv rows hold q | k | v, rotated. Row t sees the
 * pool's keys [0, npool[t]) of its sequence and, with a tail, tail rows [0, ntail) of its own
 * (tail + t * tcap rows). */
static void attention_layer(const dims_t* z, const float* qkv, const float* kc, const float* vc, const int64_t* npool,
                            const int64_t* rowseq, const int64_t* tables, const float* tk, const float* tv, int ntail,
                            int tcap, float* att, int maxctx) {
    int W = (z->Hq + 2 * z->Hkv) * z->D, grp = z->Hq / z->Hkv;
    size_t stride = (size_t)z->Hkv * z->D, scs = (size_t)(maxctx + ntail + 16);
    if (grp > 1 && grp <= GMAX && z->D % 16 == 0 && z->D <= 128) {  /* a KV head's query heads together */
        /* runs of consecutive rows of one sequence (a verify's, a prefill's; one row with a tail: its own),
           up to QMAX queries an item; few items: each KV head's heads in two parts, so the threads share */
        int rmax = ntail ? 1 : QMAX / grp, nruns = 0;
        int* run0 = (int*)malloc(sizeof(int) * (size_t)(z->T + 1));
        for (int t = 0; t < z->T; nruns++) {
            int t1 = t + 1;
            while (t1 < z->T && t1 - t < rmax && rowseq[t1] == rowseq[t]) t1++;
            run0[nruns] = t;
            t = t1;
        }
        run0[nruns] = z->T;
        int parts = nruns * z->Hkv < 2 * z->nt ? 2 : 1, gs = (grp + parts - 1) / parts;
        #pragma omp parallel num_threads(z->nt)
        {
            float* sc = (float*)malloc(sizeof(float) * scs * (size_t)QMAX);
            const float* qs[QMAX];
            float* os[QMAX];
            int nq[QMAX];
            #pragma omp for schedule(static)
            for (int item = 0; item < nruns * z->Hkv * parts; item++) {
                int run = item / (z->Hkv * parts), kh = item / parts % z->Hkv, h0 = kh * grp + item % parts * gs;
                int g = (kh + 1) * grp - h0 < gs ? (kh + 1) * grp - h0 : gs, t0 = run0[run], Q = 0, nmax = 0;
                for (int t = t0; t < run0[run + 1]; t++)
                    for (int h = h0; h < h0 + g; h++, Q++) {
                        qs[Q] = qkv + (size_t)t * W + (size_t)h * z->D;
                        os[Q] = att + ((size_t)t * z->Hq + h) * z->D;
                        nq[Q] = (int)npool[t];
                        if (nq[Q] > nmax) nmax = nq[Q];
                    }
                keys_t s = {kc, vc, tk ? tk + (size_t)t0 * tcap * stride : NULL, tv ? tv + (size_t)t0 * tcap * stride : NULL,
                            tables + (size_t)rowseq[t0] * z->tw, z->bs, nmax, ntail, stride, (size_t)kh * z->D};
                if (z->D == 64) attend_gd(qs, nq, os, &s, 64, Q, z->scale, sc, scs);
                else if (z->D == 128) attend_gd(qs, nq, os, &s, 128, Q, z->scale, sc, scs);
                else attend_gd(qs, nq, os, &s, z->D, Q, z->scale, sc, scs);
            }
            free(sc);
        }
        free(run0);
        return;
    }
    #pragma omp parallel num_threads(z->nt)
    {
        float* sc = (float*)malloc(sizeof(float) * scs);
        #pragma omp for schedule(static)
        for (int item = 0; item < z->T * z->Hq; item++) {
            int t = item / z->Hq, h = item % z->Hq;
            keys_t s = {kc, vc, tk ? tk + (size_t)t * tcap * stride : NULL, tv ? tv + (size_t)t * tcap * stride : NULL,
                        tables + (size_t)rowseq[t] * z->tw, z->bs, (int)npool[t], ntail, stride, (size_t)(h / grp) * z->D};
            attend(qkv + (size_t)t * W + (size_t)h * z->D, &s, z->D, z->scale, sc, att + ((size_t)t * z->Hq + h) * z->D);
        }
        free(sc);
    }
}

/* RoPE on q and k heads of every row, k and v into the pool at the rows' slots */
static void rope_write(const dims_t* z, float* qkv, const float* cosv, const float* sinv, const int64_t* slot,
                       float* kc, float* vc) {
    int W = (z->Hq + 2 * z->Hkv) * z->D;
    size_t kvw = (size_t)z->Hkv * z->D;
    for (int t = 0; t < z->T; t++) {
        float* row = qkv + (size_t)t * W;
        for (int h = 0; h < z->Hq + z->Hkv; h++) rope_head(row + (size_t)h * z->D, cosv + (size_t)t * z->R, sinv + (size_t)t * z->R, z->R);
        memcpy(kc + (size_t)slot[t] * kvw, row + (size_t)z->Hq * z->D, kvw * sizeof(float));
        memcpy(vc + (size_t)slot[t] * kvw, row + (size_t)(z->Hq + z->Hkv) * z->D, kvw * sizeof(float));
    }
}

static void quant_rows(const float* x, int T, int K, int16_t* xq, float* xs) {
    for (int t = 0; t < T; t++) xs[t] = quant_row(x + (size_t)t * K, K, xq + (size_t)t * K);
}

/* Scratch of a step's products: int16 rows (int8 weights) or int8 block rows (GGML blocks). */
typedef struct {
    int16_t* xq;
    float* xs;
    int8_t* bq;
    float *sa, *sb;
} scratch_t;

enum { MODE_INT8, MODE_FP32, MODE_BLOCKS };

/* One product of the stack over fp32 rows x [T, K] -> out [T, N] (+ res): fp32 weights as they are,
 * int8 weights with the rows rounded to int16 first, or GGML blocks (the block type where int8 keeps
 * its scales) with the rows rounded per block. p + iw: weight, scale (block type), bias pointers. */
static void product(int mode, const float* x, int T, int K, const int64_t* p, int iw, int N, float* out,
                    const float* res, scratch_t* s, int nt) {
    const float* bias = (const float*)(intptr_t)p[iw + 2];
    if (mode == MODE_FP32) {
        fgemm(x, T, K, (const float*)(intptr_t)p[iw], bias, N, out, N, res, nt);
    } else if (mode == MODE_BLOCKS) {
        blinear(x, T, K, (int)p[iw + 1], (const uint8_t*)(intptr_t)p[iw], bias, N, out, N, res, s->bq, s->sa, s->sb, nt);
    } else {
        quant_rows(x, T, K, s->xq, s->xs);
        qgemm(s->xq, s->xs, T, K, (const int8_t*)(intptr_t)p[iw], (const float*)(intptr_t)p[iw + 1], bias, N, out, N, res, nt);
    }
}

/* The whole stack: h [T, d] (the embeddings) is the residual stream, updated in place; out [T, d]
 * gets the final-normed hidden states. layers: L rows of P_COUNT pointers (see the enum). */
int cantata_llama_forward(const int32_t* ints, const float* floats, float* h, float* out, const float* final_norm,
                          const int64_t* pos, const int64_t* slot, const int64_t* rowseq, const int64_t* tables,
                          const float* cosv, const float* sinv, const int64_t* layers) {
    dims_t z = {ints[0], ints[1], ints[2], ints[3], ints[4], ints[5], ints[6], ints[7], ints[8], ints[9], ints[10],
                floats[0], floats[1]};
    int T = z.T, d = z.d, qw = (z.Hq + 2 * z.Hkv) * z.D, ad = z.Hq * z.D, mode = ints[11];
    int wide = d > ad ? d : ad;
    if (z.I > wide) wide = z.I;
    int maxctx = 0;
    for (int t = 0; t < T; t++) if (pos[t] + 1 > maxctx) maxctx = (int)pos[t] + 1;
    float* x = (float*)malloc(sizeof(float) * (size_t)T * d);
    float* qkv = (float*)malloc(sizeof(float) * (size_t)T * qw);
    float* att = (float*)malloc(sizeof(float) * (size_t)T * ad);
    float* gu = (float*)malloc(sizeof(float) * (size_t)T * 2 * z.I);
    float* act = (float*)malloc(sizeof(float) * (size_t)T * z.I);
    scratch_t s = {(int16_t*)malloc(sizeof(int16_t) * (size_t)T * wide), (float*)malloc(sizeof(float) * (size_t)T),
                   (int8_t*)malloc((size_t)T * wide), (float*)malloc(sizeof(float) * ((size_t)T * wide / QB + 1)),
                   (float*)malloc(sizeof(float) * ((size_t)T * wide / QB + 1))};
    int64_t* npool = (int64_t*)malloc(sizeof(int64_t) * (size_t)T);
    if (!x || !qkv || !att || !gu || !act || !s.xq || !s.xs || !s.bq || !s.sa || !s.sb || !npool) return -1;
    for (int t = 0; t < T; t++) npool[t] = pos[t] + 1;  /* a row sees its sequence's keys [0, position] */
    for (int l = 0; l < z.L; l++) {
        const int64_t* p = layers + (size_t)l * P_COUNT;
        #define PTR(type, i) ((type*)(intptr_t)p[i])
        for (int t = 0; t < T; t++) rms_norm_row(h + (size_t)t * d, PTR(const float, P_IN_NORM), d, z.eps, x + (size_t)t * d);
        product(mode, x, T, d, p, P_QKV_W, qw, qkv, NULL, &s, z.nt);
        rope_write(&z, qkv, cosv, sinv, slot, PTR(float, P_KC), PTR(float, P_VC));
        attention_layer(&z, qkv, PTR(float, P_KC), PTR(float, P_VC), npool, rowseq, tables, NULL, NULL, 0, 0, att, maxctx);
        product(mode, att, T, ad, p, P_O_W, d, h, h, &s, z.nt);
        for (int t = 0; t < T; t++) rms_norm_row(h + (size_t)t * d, PTR(const float, P_POST_NORM), d, z.eps, x + (size_t)t * d);
        product(mode, x, T, d, p, P_GU_W, 2 * z.I, gu, NULL, &s, z.nt);
        for (int t = 0; t < T; t++) swiglu_row(gu + (size_t)t * 2 * z.I, z.I, act + (size_t)t * z.I);
        product(mode, act, T, z.I, p, P_DN_W, d, h, h, &s, z.nt);
        #undef PTR
    }
    for (int t = 0; t < T; t++) rms_norm_row(h + (size_t)t * d, final_norm, d, z.eps, out + (size_t)t * d);
    free(x); free(qkv); free(att); free(gu); free(act); free(s.xq); free(s.xs); free(s.bq); free(s.sa); free(s.sb);
    free(npool);
    return 0;
}

/* ---- The MTP drafter's CPU path (specialists/drafter.py): its one layer with every RMSNorm's gain
 * folded into the next product (times sqrt(d)), so a norm is x / |x|; RoPE over the whole head from
 * the drafter's signed table (cos, then sin with rotate-half's sign folded in). Its products only
 * propose (verification decides), so nothing here has to equal the torch path. ---- */

enum { M_HID_W, M_HID_S, M_QKV_W, M_QKV_S, M_O_W, M_O_S, M_GU_W, M_GU_S, M_DN_W, M_DN_S, M_HEAD_W, M_HEAD_S,
       M_TOKPROJ, M_VOCAB, M_KC, M_VC, M_COUNT };

static void unit_quant(const float* x, int T, int d, float* y, int16_t* xq, float* xs) {
    for (int t = 0; t < T; t++) {
        const float* r = x + (size_t)t * d;
        __m512 ss = _mm512_setzero_ps();
        for (int k = 0; k < d; k += 16) {
            __m512 v = _mm512_maskz_loadu_ps(tail_mask(d - k), r + k);
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 inv = _mm512_set1_ps(1.0f / (sqrtf(_mm512_reduce_add_ps(ss)) + 1e-12f));
        for (int k = 0; k < d; k += 16) {
            __mmask16 m = tail_mask(d - k);
            _mm512_mask_storeu_ps(y + (size_t)t * d + k, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + k), inv));
        }
        xs[t] = quant_row(y + (size_t)t * d, d, xq + (size_t)t * d);
    }
}

/* x * cos + roll(x, D / 2) * signed_sin on q and k heads of one row; cs: [2, D] (cos | signed sin) */
static void signed_rope_row(float* row, int heads, int D, const float* cs) {
    float tmp[1024];
    int h = D / 2;
    for (int hd = 0; hd < heads; hd++) {
        float* x = row + (size_t)hd * D;
        memcpy(tmp, x, sizeof(float) * (size_t)D);
        for (int i = 0; i < D; i++) x[i] = tmp[i] * cs[i] + tmp[(i + h) % D] * cs[D + i];
    }
}

typedef struct {
    dims_t z;
    const int64_t* p;  /* M_COUNT pointers */
    float *x, *y, *qkv, *att, *gu, *act, *logits;
    int16_t* xq;
    float* xs;
    int N, V;
} mtp_t;

#define MP(type, i) ((type*)(intptr_t)m->p[i])

/* x [T, d] = W_h unit(prev) + token_proj[tok] */
static void mtp_fuse(mtp_t* m, const float* prev, const int64_t* tok) {
    int T = m->z.T, d = m->z.d;
    unit_quant(prev, T, d, m->y, m->xq, m->xs);
    qgemm(m->xq, m->xs, T, d, MP(const int8_t, M_HID_W), MP(const float, M_HID_S), NULL, d, m->x, d, NULL, m->z.nt);
    const float* tp = MP(const float, M_TOKPROJ);
    for (int t = 0; t < T; t++) {
        int64_t id = tok[t] < 0 ? 0 : tok[t];
        if (id >= m->V) id = m->V - 1;
        for (int k = 0; k < d; k++) m->x[(size_t)t * d + k] += tp[(size_t)id * d + k];
    }
}

/* q/k/v of unit(x), rotated with rope rows cs[t] ([2, D] each, `csstride` floats apart) */
static void mtp_qkv(mtp_t* m, const float* cs, size_t csstride) {
    int T = m->z.T, d = m->z.d, W = (m->z.Hq + 2 * m->z.Hkv) * m->z.D;
    unit_quant(m->x, T, d, m->y, m->xq, m->xs);
    qgemm(m->xq, m->xs, T, d, MP(const int8_t, M_QKV_W), MP(const float, M_QKV_S), NULL, W, m->qkv, W, NULL, m->z.nt);
    for (int t = 0; t < T; t++) signed_rope_row(m->qkv + (size_t)t * W, m->z.Hq + m->z.Hkv, m->z.D, cs + (size_t)t * csstride);
}

/* out = x + o(att); out += down(silu(gate) * up) of unit(out) */
static void mtp_finish(mtp_t* m, float* out) {
    dims_t* z = &m->z;
    int T = z->T, d = z->d, ad = z->Hq * z->D;
    quant_rows(m->att, T, ad, m->xq, m->xs);
    qgemm(m->xq, m->xs, T, ad, MP(const int8_t, M_O_W), MP(const float, M_O_S), NULL, d, out, d, m->x, z->nt);
    unit_quant(out, T, d, m->y, m->xq, m->xs);
    qgemm(m->xq, m->xs, T, d, MP(const int8_t, M_GU_W), MP(const float, M_GU_S), NULL, 2 * z->I, m->gu, 2 * z->I, NULL, z->nt);
    for (int t = 0; t < T; t++) swiglu_row(m->gu + (size_t)t * 2 * z->I, z->I, m->act + (size_t)t * z->I);
    quant_rows(m->act, T, z->I, m->xq, m->xs);
    qgemm(m->xq, m->xs, T, z->I, MP(const int8_t, M_DN_W), MP(const float, M_DN_S), NULL, d, out, d, out, z->nt);
}

/* Each row's greedy draft, argmax of head(unit(out)) mapped through the vocabulary (full-vocabulary
   ids, every dstride-th entry of dst). With words (a grammar's bitmask per row over the full
   vocabulary, W int32 words a row: token i allowed when bit i % 32 of word i / 32 is set) the draft is
   the best allowed token, and free gets the unmasked one; a row that allows no token of the draft
   vocabulary drafts the unmasked one (the grammar refuses it on the host). */
static void mtp_argmax(mtp_t* m, const float* out, int64_t* dst, size_t dstride, const int32_t* words, int W,
                       int64_t* free_dst) {
    int T = m->z.T, d = m->z.d, N = m->N;
    unit_quant(out, T, d, m->y, m->xq, m->xs);
    qgemm(m->xq, m->xs, T, d, MP(const int8_t, M_HEAD_W), MP(const float, M_HEAD_S), NULL, N, m->logits, N, NULL, m->z.nt);
    const int64_t* vocab = MP(const int64_t, M_VOCAB);
    for (int t = 0; t < T; t++) {
        const float* l = m->logits + (size_t)t * N;
        int best = 0;
        for (int i = 1; i < N; i++) if (l[i] > l[best]) best = i;
        int pick = best;
        if (words) {
            const int32_t* w = words + (size_t)t * W;
            int allowed = -1;
            for (int i = 0; i < N; i++) {
                int64_t id = vocab ? vocab[i] : i;
                if ((id >> 5) < W && (((uint32_t)w[id >> 5] >> (id & 31)) & 1u)) {
                    if (allowed < 0 || l[i] > l[allowed]) allowed = i;
                }
            }
            if (allowed >= 0) pick = allowed;
            free_dst[(size_t)t * dstride] = vocab ? vocab[best] : best;
        }
        dst[(size_t)t * dstride] = vocab ? vocab[pick] : pick;
    }
}

static int mtp_alloc(mtp_t* m, const int32_t* ints, const float* floats, const int64_t* p) {
    dims_t z = {ints[0], ints[1], 1, ints[2], ints[3], ints[4], ints[4], ints[5], ints[6], ints[7], ints[8],
                0.f, floats[0]};
    m->z = z;
    m->p = p;
    m->N = ints[9];
    m->V = ints[10];
    int T = z.T, d = z.d, W = (z.Hq + 2 * z.Hkv) * z.D, ad = z.Hq * z.D;
    int wide = d > ad ? d : ad;
    if (z.I > wide) wide = z.I;
    m->x = (float*)malloc(sizeof(float) * (size_t)T * d);
    m->y = (float*)malloc(sizeof(float) * (size_t)T * d);
    m->qkv = (float*)malloc(sizeof(float) * (size_t)T * W);
    m->att = (float*)malloc(sizeof(float) * (size_t)T * ad);
    m->gu = (float*)malloc(sizeof(float) * (size_t)T * 2 * z.I);
    m->act = (float*)malloc(sizeof(float) * (size_t)T * z.I);
    m->logits = (float*)malloc(sizeof(float) * (size_t)T * m->N);
    m->xq = (int16_t*)malloc(sizeof(int16_t) * (size_t)T * wide);
    m->xs = (float*)malloc(sizeof(float) * (size_t)T);
    return (m->x && m->y && m->qkv && m->att && m->gu && m->act && m->logits && m->xq && m->xs && z.D <= 1024) ? 0 : -1;
}

static void mtp_free(mtp_t* m) {
    free(m->x); free(m->y); free(m->qkv); free(m->att); free(m->gu); free(m->act); free(m->logits); free(m->xq); free(m->xs);
}

/* ints: T, d, Hq, Hkv, D, I, bs, tw, nt, N (head rows), V (token_proj rows); floats: attention scale.
 * The drafter's rebuild: entries for T tokens (hidden [T, d], the token after each), each written to
 * the pool at slot[t] and attending over its sequence's entries [0, pos[t]] -> out [T, d]. cs: the
 * rope rows of the tokens (positions + 1), [T, 2, D]. */
int cantata_mtp_rebuild(const int32_t* ints, const float* floats, const float* hidden, const int64_t* next_tokens,
                        float* out, const float* cs, const int64_t* pos, const int64_t* slot, const int64_t* rowseq,
                        const int64_t* tables, const int64_t* p) {
    mtp_t mm, *m = &mm;
    if (mtp_alloc(m, ints, floats, p)) { mtp_free(m); return -1; }
    int T = m->z.T, D = m->z.D, W = (m->z.Hq + 2 * m->z.Hkv) * D;
    size_t kvw = (size_t)m->z.Hkv * D;
    int64_t* npool = (int64_t*)malloc(sizeof(int64_t) * (size_t)T);
    int maxctx = 0;
    for (int t = 0; t < T; t++) { npool[t] = pos[t] + 1; if (npool[t] > maxctx) maxctx = (int)npool[t]; }
    mtp_fuse(m, hidden, next_tokens);
    mtp_qkv(m, cs, 2 * (size_t)D);
    float *kc = MP(float, M_KC), *vc = MP(float, M_VC);
    for (int t = 0; t < T; t++) {
        memcpy(kc + (size_t)slot[t] * kvw, m->qkv + (size_t)t * W + (size_t)m->z.Hq * D, kvw * sizeof(float));
        memcpy(vc + (size_t)slot[t] * kvw, m->qkv + (size_t)t * W + (size_t)(m->z.Hq + m->z.Hkv) * D, kvw * sizeof(float));
    }
    attention_layer(&m->z, m->qkv, kc, vc, npool, rowseq, tables, NULL, NULL, 0, 0, m->att, maxctx);
    mtp_finish(m, out);
    free(npool);
    mtp_free(m);
    return 0;
}

/* The drafter's greedy chain for T = B rows: from prev [B, d] (each sequence's last entry output) and
 * committed [B] (its C_b entries in the pool through its table), K drafts each -> drafts [B, K]. The
 * chained entry of depth j >= 2 (index C_b + j - 2, rope position C_b + j - 1) lives in a dense tail;
 * rope: the signed table [P, 2, D]. */
/* The greedy chain. Under a grammar (depth != NULL): before each draft j the host's depth(j) reads the
   drafts so far and writes draft j's bitmasks into words; a nonzero return stops the chain (-3). */
typedef int (*depth_fn)(int);

int cantata_mtp_chain(const int32_t* ints, const float* floats, const float* prev, const int64_t* committed,
                      const int64_t* tables, const float* rope, int P, int K, int64_t* drafts, const int64_t* p,
                      const int32_t* words, int words_w, int64_t* free_drafts, depth_fn depth) {
    mtp_t mm, *m = &mm;
    if (mtp_alloc(m, ints, floats, p)) { mtp_free(m); return -1; }
    int B = m->z.T, d = m->z.d, D = m->z.D, W = (m->z.Hq + 2 * m->z.Hkv) * D;
    size_t kvw = (size_t)m->z.Hkv * D;
    float* cur = (float*)malloc(sizeof(float) * (size_t)B * d);
    float* nxt = (float*)malloc(sizeof(float) * (size_t)B * d);
    float* tk = (float*)malloc(sizeof(float) * (size_t)B * K * kvw);
    float* tv = (float*)malloc(sizeof(float) * (size_t)B * K * kvw);
    float* cs = (float*)malloc(sizeof(float) * (size_t)B * 2 * D);
    int64_t* rowseq = (int64_t*)malloc(sizeof(int64_t) * (size_t)B);
    int64_t* tok = (int64_t*)malloc(sizeof(int64_t) * (size_t)B);
    int rc = (cur && nxt && tk && tv && cs && rowseq && tok) ? 0 : -1;
    int maxctx = 0;
    for (int b = 0; b < B && !rc; b++) {
        rowseq[b] = b;
        if (committed[b] > maxctx) maxctx = (int)committed[b];
        if (committed[b] + K > P) rc = -2;  /* the caller grows the table first */
    }
    if (!rc) {
        memcpy(cur, prev, sizeof(float) * (size_t)B * d);
        if (depth && depth(0)) rc = -3;
        else mtp_argmax(m, cur, drafts, (size_t)K, depth ? words : NULL, words_w, free_drafts);
        for (int j = 2; j <= K && !rc; j++) {
            for (int b = 0; b < B; b++) {
                tok[b] = drafts[(size_t)b * K + j - 2];
                memcpy(cs + (size_t)b * 2 * D, rope + (size_t)(committed[b] + j - 1) * 2 * D, sizeof(float) * 2 * (size_t)D);
            }
            mtp_fuse(m, cur, tok);
            mtp_qkv(m, cs, 2 * (size_t)D);
            for (int b = 0; b < B; b++) {
                float* row = m->qkv + (size_t)b * W;
                memcpy(tk + ((size_t)b * K + j - 2) * kvw, row + (size_t)m->z.Hq * D, kvw * sizeof(float));
                memcpy(tv + ((size_t)b * K + j - 2) * kvw, row + (size_t)(m->z.Hq + m->z.Hkv) * D, kvw * sizeof(float));
            }
            attention_layer(&m->z, m->qkv, MP(const float, M_KC), MP(const float, M_VC), committed, rowseq, tables, tk, tv,
                            j - 1, K, m->att, maxctx);
            mtp_finish(m, nxt);
            float* sw = cur; cur = nxt; nxt = sw;
            if (depth && depth(j - 1)) { rc = -3; break; }
            mtp_argmax(m, cur, drafts + j - 1, (size_t)K, depth ? words : NULL, words_w, depth ? free_drafts + j - 1 : NULL);
        }
    }
    free(cur); free(nxt); free(tk); free(tv); free(cs); free(rowseq); free(tok);
    mtp_free(m);
    return rc;
}
#undef MP
