/* The native kernels of the embedded engine's lean forward (float32, CPU): the decode
   attention, the fused element-wise steps of a dense layer, and the plain draw.

   Built at run time by ``native.py`` with the machine's compiler (``-O3 -march=native
   -fopenmp``). They run on the OpenMP threads torch uses, as many as torch's intra-op count
   (``threads``: the calling thread's OpenMP default may be the machine's core count). No libm
   call: the exponential is computed inline, so its loops vectorize without -ffast-math.

   The decode attention: one query token per row attends over the first ``lengths[r]``
   positions of its slot in the KV cache ``[slots, kv_heads, length, head_dim]``. The query
   heads that share a key/value head are computed together, so each key and value row is read
   once per row and kv head, and only the row's own positions are read (a batched attention
   reads every row up to the longest one, under a mask). */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v16 __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

#define MAX_GROUPS 16
#define MAX_CHUNKS 16 /* head_dim up to 256, in chunks of 16 floats */

/* exp(x) for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by Cephes' single-precision
   polynomial, 2^n through the exponent bits. Below -87 it returns e^-87 (about 1.6e-38, a
   weight of 0 next to the row's maximum, whose weight is 1). */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    /* round to nearest by the 1.5 * 2^23 trick (floorf keeps some compilers from vectorizing) */
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { int32_t i; float f; } two_n;
    two_n.i = ((int32_t)n + 127) << 23;
    return p * two_n.f;
}

static inline float hsum(v16 a) {
    v8 b = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 c = __builtin_shufflevector(b, b, 0, 1, 2, 3) + __builtin_shufflevector(b, b, 4, 5, 6, 7);
    return (c[0] + c[2]) + (c[1] + c[3]);
}

/* One (row, kv head): ``groups`` query heads over ``len`` positions of ``k``/``v``. The
   constant ``groups``/``chunks`` of the specialised callers let the compiler keep the queries
   and accumulators in registers. */
static inline __attribute__((always_inline)) void attend(
    const float *q, int64_t q_head, const float *k, const float *v, int64_t len, float *o,
    int64_t o_head, float scale, const int64_t groups, const int64_t chunks, float *s) {
    const int64_t d = 16 * chunks;
    v16 qv[MAX_GROUPS][MAX_CHUNKS], acc[MAX_GROUPS][MAX_CHUNKS];
    float top[MAX_GROUPS];
    for (int64_t h = 0; h < groups; h++) {
        for (int64_t c = 0; c < chunks; c++) {
            memcpy(&qv[h][c], q + h * q_head + 16 * c, sizeof(v16));
            qv[h][c] *= scale;
            acc[h][c] = (v16){0};
        }
        top[h] = -3.4e38f;
    }
    for (int64_t t = 0; t < len; t++) { /* scores, and each head's maximum */
        v16 kt[MAX_CHUNKS];
        memcpy(kt, k + t * d, sizeof(v16) * chunks);
        for (int64_t h = 0; h < groups; h++) {
            v16 a = qv[h][0] * kt[0];
            for (int64_t c = 1; c < chunks; c++) a += qv[h][c] * kt[c];
            const float x = hsum(a);
            s[h * len + t] = x;
            top[h] = x > top[h] ? x : top[h];
        }
    }
    float total[MAX_GROUPS];
    for (int64_t h = 0; h < groups; h++) { /* weights: exp(score - max), and their sum */
        float *sh = s + h * len;
        const float m = top[h];
        for (int64_t t = 0; t < len; t++) sh[t] = exp_nonpositive(sh[t] - m);
        v16 z = (v16){0};
        int64_t t = 0;
        for (; t + 16 <= len; t += 16) {
            v16 e;
            memcpy(&e, sh + t, sizeof(v16));
            z += e;
        }
        float rest = 0.0f;
        for (; t < len; t++) rest += sh[t];
        total[h] = hsum(z) + rest;
    }
    for (int64_t t = 0; t < len; t++) { /* the weighted values */
        v16 vt[MAX_CHUNKS];
        memcpy(vt, v + t * d, sizeof(v16) * chunks);
        for (int64_t h = 0; h < groups; h++) {
            const float p = s[h * len + t];
            for (int64_t c = 0; c < chunks; c++) acc[h][c] += p * vt[c];
        }
    }
    for (int64_t h = 0; h < groups; h++) {
        const float inv = 1.0f / total[h];
        for (int64_t c = 0; c < chunks; c++) {
            const v16 x = acc[h][c] * inv;
            memcpy(o + h * o_head + 16 * c, &x, sizeof(v16));
        }
    }
}

/* ``attend`` with constant ``groups`` and ``chunks`` for the common shapes (head_dim 64 or
   128, up to 8 query heads per kv head), with them read at run time otherwise. */
static void attend_any(const float *q, int64_t q_head, const float *k, const float *v,
                       int64_t len, float *o, int64_t o_head, float scale, int64_t groups,
                       int64_t chunks, float *s) {
#define CASE(G, C)                                                              \
    if (groups == G && chunks == C) {                                           \
        attend(q, q_head, k, v, len, o, o_head, scale, G, C, s);                \
        return;                                                                 \
    }
    CASE(1, 4) CASE(2, 4) CASE(3, 4) CASE(4, 4) CASE(5, 4) CASE(6, 4) CASE(7, 4) CASE(8, 4)
    CASE(1, 8) CASE(2, 8) CASE(3, 8) CASE(4, 8) CASE(5, 8) CASE(6, 8) CASE(7, 8) CASE(8, 8)
#undef CASE
    attend(q, q_head, k, v, len, o, o_head, scale, groups, chunks, s);
}

/* Returns 0, or -1 when the shape is outside what the kernel handles. */
int miles_decode_attention(
    const float *q, int64_t q_row, int64_t q_head, const float *kc, const float *vc,
    int64_t c_slot, int64_t c_head, const int64_t *slots, const int64_t *lengths, float *o,
    int64_t o_row, int64_t o_head, int64_t rows, int64_t heads, int64_t kv_heads,
    int64_t head_dim, float scale, int64_t threads) {
    if (kv_heads <= 0 || heads % kv_heads || head_dim % 16 || head_dim > 16 * MAX_CHUNKS)
        return -1;
    const int64_t groups = heads / kv_heads, chunks = head_dim / 16;
    if (groups > MAX_GROUPS) return -1;
#pragma omp parallel for schedule(dynamic, 1) collapse(2) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t g = 0; g < kv_heads; g++) {
            const int64_t len = lengths[r];
            const int64_t slot = slots ? slots[r] : r;
            const int64_t base = slot * c_slot + g * c_head;
            float small[4096];
            float *s = groups * len <= 4096 ? small : malloc(sizeof(float) * groups * len);
            attend_any(q + r * q_row + g * groups * q_head, q_head, kc + base, vc + base, len,
                       o + r * o_row + g * groups * o_head, o_head, scale, groups, chunks, s);
            if (s != small) free(s);
        }
    }
    return 0;
}

/* --- element-wise steps of a decoder layer ------------------------------------------------ */

/* Rows of at least this many elements in all are split over the OpenMP threads; a decode
   step's few rows run on the calling thread (a parallel region costs more than they do). */
#define PARALLEL_FROM 65536

/* ``h[r, :] += delta[r, :]`` (when ``delta``), then ``out[r, :] = w * (h[r, :] *
   rsqrt(mean(h[r, :]^2) + eps))``: a residual add and the RMS norm of the next step, over
   ``rows`` rows of ``n`` floats. ``h`` and ``out`` are row-major (row strides ``h_row``,
   ``out_row``); ``delta`` has any strides (a product's result in either layout). */
void miles_add_rms_norm(float *h, int64_t h_row, const float *delta, int64_t d_row,
                        int64_t d_col, const float *w, float eps, float *out, int64_t out_row,
                        int64_t rows, int64_t n, int64_t threads) {
#pragma omp parallel for if (rows * n >= PARALLEL_FROM) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        float *x = h + r * h_row;
        if (delta) {
            const float *d = delta + r * d_row;
            if (d_col == 1) {
                for (int64_t j = 0; j < n; j++) x[j] += d[j];
            } else {
                for (int64_t j = 0; j < n; j++) x[j] += d[j * d_col];
            }
        }
        v16 acc = (v16){0};
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            v16 a;
            memcpy(&a, x + j, sizeof(v16));
            acc += a * a;
        }
        float sq = hsum(acc);
        for (; j < n; j++) sq += x[j] * x[j];
        const float inv = 1.0f / __builtin_sqrtf(sq / (float)n + eps);
        float *o = out + r * out_row;
        for (j = 0; j < n; j++) o[j] = w[j] * (x[j] * inv);
    }
}

static void silu_mul_row(const float *restrict g, const float *restrict u, float *restrict o,
                         int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        const float x = g[j];
        /* sigmoid through exp(-|x|), so the exponential never overflows */
        const float e = exp_nonpositive(-__builtin_fabsf(x));
        const float s = (x < 0.0f ? e : 1.0f) / (1.0f + e);
        o[j] = x * s * u[j];
    }
}

/* ``out = silu(gate) * up`` over ``outer`` x ``inner`` elements, each operand's inner axis
   contiguous (``*_stride``: its outer stride). */
void miles_silu_mul(const float *gate, const float *up, int64_t in_stride, float *out,
                    int64_t out_stride, int64_t outer, int64_t inner, int64_t threads) {
#pragma omp parallel for if (outer * inner >= PARALLEL_FROM) num_threads(threads)
    for (int64_t i = 0; i < outer; i++)
        silu_mul_row(gate + i * in_stride, up + i * in_stride, out + i * out_stride, inner);
}

/* ``o = x * cos + roll(x, hd / 2) * sin`` over one head (``sin`` with its first half negated:
   the rotation of ``fast_forward._rotate``). */
static inline void rotate(const float *restrict x, const float *restrict c,
                          const float *restrict s, float *restrict o, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < half; j++) o[j] = x[j] * c[j] + x[j + half] * s[j];
    for (int64_t j = half; j < hd; j++) o[j] = x[j] * c[j] + x[j - half] * s[j];
}

/* ``rotate`` over a head whose elements lie ``xs`` apart (a product's transposed result). */
static inline void rotate_strided(const float *restrict x, int64_t xs, const float *restrict c,
                                  const float *restrict s, float *restrict o, int64_t hd) {
    const int64_t half = hd / 2;
    for (int64_t j = 0; j < half; j++) o[j] = x[j * xs] * c[j] + x[(j + half) * xs] * s[j];
    for (int64_t j = half; j < hd; j++) o[j] = x[j * xs] * c[j] + x[(j - half) * xs] * s[j];
}

/* The rotary embedding of a packed or decode forward's rows, and the store of their keys and
   values in the cache: row ``r`` of ``y`` (its elements at ``y[r * y_row + i * y_col]``: the
   q/k/v product's result in either layout) holds its ``heads`` query, ``kv_heads`` key and
   ``kv_heads`` value heads; the rotated queries go to ``q_out [rows, heads * hd]``, the
   rotated keys and the values to rows ``dst[r, g]`` of the caches viewed as ``[-1, hd]``.
   ``cos``/``sin``: ``[rows, hd]``. */
void miles_rope_store(const float *y, int64_t y_row, int64_t y_col, const float *cos,
                      const float *sin, float *q_out, float *kc, float *vc, const int64_t *dst,
                      int64_t rows, int64_t heads, int64_t kv_heads, int64_t hd,
                      int64_t threads) {
#pragma omp parallel for if (rows * (heads + 2 * kv_heads) * hd >= PARALLEL_FROM) \
    num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = y + r * y_row, *c = cos + r * hd, *s = sin + r * hd;
        if (y_col == 1) {
            for (int64_t h = 0; h < heads; h++)
                rotate(x + h * hd, c, s, q_out + (r * heads + h) * hd, hd);
            for (int64_t g = 0; g < kv_heads; g++) {
                const int64_t at = dst[r * kv_heads + g] * hd;
                rotate(x + (heads + g) * hd, c, s, kc + at, hd);
                memcpy(vc + at, x + (heads + kv_heads + g) * hd, sizeof(float) * hd);
            }
        } else {
            for (int64_t h = 0; h < heads; h++)
                rotate_strided(x + h * hd * y_col, y_col, c, s, q_out + (r * heads + h) * hd, hd);
            for (int64_t g = 0; g < kv_heads; g++) {
                const int64_t at = dst[r * kv_heads + g] * hd;
                rotate_strided(x + (heads + g) * hd * y_col, y_col, c, s, kc + at, hd);
                const float *xv = x + (heads + kv_heads + g) * hd * y_col;
                for (int64_t j = 0; j < hd; j++) vc[at + j] = xv[j * y_col];
            }
        }
    }
}

/* --- sampling ------------------------------------------------------------------------------ */

#define SAMPLE_BLOCK 1024

/* The raw distribution's draw for ``rows`` rows of logits over ``vocab`` tokens, where the
   logit of row ``r``, token ``j`` is at ``logits[r * rs + j * cs]``: a product's result in
   either layout (``cs == 1``: rows-first; ``rs == 1``: tokens-first, the rows of one token
   side by side). Per row: the maximum ``m``; the weights ``exp(l - m)`` summed per block of
   1024 tokens (float within a block, double across); the token where the running sum first
   passes ``u * total`` (the inverse CDF at ``uniforms[r]``), or the first maximum where
   ``greedy[r]``; its log-prob ``l - m - log(total)``. Blocks run in parallel; ``scratch``
   holds ``2 * blocks * rows`` floats. */
void miles_sample(const float *logits, int64_t rs, int64_t cs, int64_t vocab, int64_t rows,
                  const double *uniforms, const uint8_t *greedy, int64_t *tokens,
                  float *logprobs, float *scratch, int64_t threads) {
    const int64_t blocks = (vocab + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    float *block_max = scratch, *block_sum = scratch + blocks * rows;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) { /* each block's maximum, per row */
            const int64_t lo = b * SAMPLE_BLOCK;
            const int64_t hi = lo + SAMPLE_BLOCK < vocab ? lo + SAMPLE_BLOCK : vocab;
            float *bm = block_max + b * rows;
            if (rs == 1) {
                for (int64_t r = 0; r < rows; r++) bm[r] = logits[lo * cs + r];
                for (int64_t j = lo + 1; j < hi; j++) {
                    const float *x = logits + j * cs;
                    for (int64_t r = 0; r < rows; r++) bm[r] = x[r] > bm[r] ? x[r] : bm[r];
                }
            } else {
                for (int64_t r = 0; r < rows; r++) {
                    const float *x = logits + r * rs;
                    float m = x[lo * cs];
                    for (int64_t j = lo + 1; j < hi; j++) m = x[j * cs] > m ? x[j * cs] : m;
                    bm[r] = m;
                }
            }
        }
        /* every block's maximum is written before any thread reads them (the loop's barrier) */
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) { /* each block's sum of exp(l - m), per row */
            const int64_t lo = b * SAMPLE_BLOCK;
            const int64_t hi = lo + SAMPLE_BLOCK < vocab ? lo + SAMPLE_BLOCK : vocab;
            float m[256];
            float *bs = block_sum + b * rows;
            for (int64_t r0 = 0; r0 < rows; r0 += 256) {
                const int64_t n = rows - r0 < 256 ? rows - r0 : 256;
                for (int64_t r = 0; r < n; r++) {
                    float top = block_max[r0 + r];
                    for (int64_t c = 1; c < blocks; c++) {
                        const float x = block_max[c * rows + r0 + r];
                        top = x > top ? x : top;
                    }
                    m[r] = top;
                }
                if (rs == 1) {
                    float acc[256] = {0};
                    for (int64_t j = lo; j < hi; j++) {
                        const float *x = logits + j * cs + r0;
                        for (int64_t r = 0; r < n; r++) acc[r] += exp_nonpositive(x[r] - m[r]);
                    }
                    for (int64_t r = 0; r < n; r++) bs[r0 + r] = acc[r];
                } else {
                    for (int64_t r = 0; r < n; r++) {
                        const float *x = logits + (r0 + r) * rs;
                        float e[SAMPLE_BLOCK];
                        for (int64_t j = lo; j < hi; j++)
                            e[j - lo] = exp_nonpositive(x[j * cs] - m[r]);
                        v16 acc = (v16){0};
                        int64_t j = 0;
                        for (; j + 16 <= hi - lo; j += 16) {
                            v16 a;
                            memcpy(&a, e + j, sizeof(v16));
                            acc += a;
                        }
                        float s = hsum(acc);
                        for (; j < hi - lo; j++) s += e[j];
                        bs[r0 + r] = s;
                    }
                }
            }
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < rows; r++) { /* the token, and its log-prob */
            const float *x = logits + r * rs;
            float m = block_max[r];
            double total = 0.0;
            for (int64_t b = 0; b < blocks; b++) {
                const float bm = block_max[b * rows + r];
                m = bm > m ? bm : m;
                total += block_sum[b * rows + r];
            }
            int64_t tok = vocab - 1;
            if (greedy[r]) {
                for (int64_t j = 0; j < vocab; j++)
                    if (x[j * cs] == m) {
                        tok = j;
                        break;
                    }
            } else {
                const double target = uniforms[r] * total;
                double run = 0.0;
                int64_t b = 0;
                while (b < blocks - 1 && run + block_sum[b * rows + r] <= target)
                    run += block_sum[b * rows + r], b++;
                const int64_t lo = b * SAMPLE_BLOCK;
                const int64_t hi = lo + SAMPLE_BLOCK < vocab ? lo + SAMPLE_BLOCK : vocab;
                tok = hi - 1; /* where rounding leaves the target past the block's last weight */
                for (int64_t j = lo; j < hi; j++) {
                    run += exp_nonpositive(x[j * cs] - m);
                    if (run > target) {
                        tok = j;
                        break;
                    }
                }
            }
            logprobs[r] = (float)((double)(x[tok * cs] - m) - __builtin_log(total));
            tokens[r] = tok;
        }
    }
}
