/* The CPU's C kernels: decode attention, KV writes, a decoder layer's small operations and its linear layers.
 *
 * Decode attention over the paged KV cache: one query per row, every page of the row's block table or only the
 * selected ones, fp32 or FP8 (E4M3 with fp16 scales) pages dequantized as they are read. The same contract as
 * cotserve.kernels.kv_fp8.decode_attention_ref (see cpu_native.py for the why): per (row, KV head) (`attend`), a page
 * at a time, the page's keys and values read once for every query head of the group, with an online softmax whose
 * exponentials are vectorised (`exp_approx`), so nothing of the row's context is copied and tokens past the row's
 * context length are never read.
 *
 * Layouts (all contiguous): query/out [batch, heads, dim] f32; caches [blocks, block_size, kv_heads, dim]; scales
 * [blocks, block_size, kv_heads] f16 bits; tables [batch, width] i64; ctx [batch] i64; pages [batch, kv_heads, k]
 * i64 indexes into the row's table (sorted; only the first ceil(ctx / block_size) columns count) or NULL.
 * Returns 0, -1 for shapes out of range, -2 - row for the first row that would read outside the table or the cache
 * (nothing is computed then: the caller raises rather than read memory that is not the cache).
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_DIM 512
#define MAX_GROUP 16
#define MAX_BLOCK 64

enum { KV_F32 = 0, KV_E4M3 = 1 };

static inline float f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

/* E4M3 bits placed in an f32's exponent and mantissa, then times 2^120 (the biases differ by 120): exact, subnormals
 * included, and it vectorises (a table's gathers did not); both NaN codes give NaN. */
static inline float e4m3_to_float(uint8_t b) {
    uint32_t mag = b & 0x7Fu;
    float v = f32_from_bits((mag << 20) | ((uint32_t)(b & 0x80u) << 24)) * 0x1p120f;
    return mag == 0x7Fu ? NAN : v;
}

/* e^x for float32 within 2 ulp (Cephes' polynomial after the range reduction x = n ln2 + r), in plain arithmetic so
 * that loops of it vectorise (libm's expf is a call per element: 5x slower in SwiGLU at batch 32). NaN gives NaN; above
 * ~88.4 +inf, below ~-87.3 about 1e-38 rather than a subnormal or zero. */
static inline float exp_approx(float x) {
    x = x > 88.3762626647949f ? 88.3762626647949f : x; /* written so that NaN falls through both */
    x = x < -87.3365478515625f ? -87.3365478515625f : x;
    float shifted = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: n = round(x / ln2) in the low bits */
    float n = shifted - 12582912.0f;
    float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    uint32_t e = (f32_bits(shifted) - f32_bits(12582912.0f) + 127u) << 23; /* 2^n, no float-to-int conversion */
    return p * f32_from_bits(e);
}

static inline float half_bits_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 0) {
        float f = ldexpf((float)m, -24);
        return sign ? -f : f;
    }
    bits = e == 31 ? sign | 0x7F800000u | (m << 13) : sign | ((e + 112) << 23) | (m << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define ALWAYS_INLINE inline __attribute__((always_inline))

/* 16 floats: a GCC vector type (plain C: an AVX-512 register where the CPU has them, halves or quarters elsewhere). */
typedef float v16 __attribute__((vector_size(64)));

static ALWAYS_INLINE v16 load16(const float *p) {
    v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static ALWAYS_INLINE void store16(float *p, v16 v) { memcpy(p, &v, sizeof v); }

static ALWAYS_INLINE float sum16(v16 v) {
    for (int i = 0; i < 8; i++) v[i] += v[i + 8];
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* 16 E4M3 codes as floats, `e4m3_to_float` 16 at a time: the codes widened, their bits placed, times 2^120 (with
 * AVX-512's intrinsics: GCC 12 widens a vector of bytes one element at a time). */
#if defined(__AVX512F__)
#include <immintrin.h>
static ALWAYS_INLINE v16 e4m3x16(const uint8_t *p) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
    __m512i bits = _mm512_or_si512(_mm512_slli_epi32(mag, 20),
                                   _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(0x7F)),
                                 _mm512_set1_epi32(0x7FC00000)); /* both NaN codes */
    return (v16)_mm512_mul_ps(_mm512_castsi512_ps(bits), _mm512_set1_ps(0x1p120f));
}

static ALWAYS_INLINE __m256 fold8(v16 v) { /* lanes i + (i + 8) */
    __m512 x = (__m512)v;
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
}

/* out[0..3] = the sums of a's, b's, c's and d's lanes, reduced together (three horizontal adds for the four, where
 * one at a time is a chain of shuffles and scalar adds per vector). */
static ALWAYS_INLINE void sum4(v16 a, v16 b, v16 c, v16 d, float *out) {
    __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(fold8(a), fold8(b)), _mm256_hadd_ps(fold8(c), fold8(d)));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1)));
}
#define HAVE_SUM4 1
#else
static ALWAYS_INLINE v16 e4m3x16(const uint8_t *p) {
    v16 f;
    for (int i = 0; i < 16; i++) f[i] = e4m3_to_float(p[i]);
    return f;
}
#endif

/* `n` rows of KV head `h` from slot `slot0` on (one page's tokens) as floats `stride` apart: a pointer into an f32
 * cache (stride kv_heads * dim), or dequantized into `buf` [n, dim] (stride dim). */
static ALWAYS_INLINE const float *page_rows(const void *cache, const uint16_t *scales, int kind, int64_t slot0, int64_t n,
                                            int64_t kv_heads, int64_t h, int64_t dim, float *buf, int64_t *stride) {
    if (kind == KV_F32) {
        *stride = kv_heads * dim;
        return (const float *)cache + (slot0 * kv_heads + h) * dim;
    }
    *stride = dim;
    for (int64_t t = 0; t < n; t++) {
        const uint8_t *p = (const uint8_t *)cache + ((slot0 + t) * kv_heads + h) * dim;
        float s = half_bits_to_float(scales[(slot0 + t) * kv_heads + h]), *o = buf + t * dim;
        for (int64_t d = 0; d < dim; d++) o[d] = e4m3_to_float(p[d]) * s;
    }
    return buf;
}

/* 16 elements of a key or value row from element d on: f32, or E4M3 codes decoded (`kind` is a constant wherever this
 * is inlined); and one element. */
static ALWAYS_INLINE v16 row16(const char *row, int64_t d, int kind) {
    return kind == KV_F32 ? load16((const float *)row + d) : e4m3x16((const uint8_t *)row + d);
}

static ALWAYS_INLINE float row1(const char *row, int64_t d, int kind) {
    return kind == KV_F32 ? ((const float *)row)[d] : e4m3_to_float(((const uint8_t *)row)[d]);
}

/* One page of one KV head for each query head of its group, in the online softmax: `q` [group, dim]; the page's `n`
 * keys and values, rows `stride` bytes apart, f32 or E4M3 codes (`kind`) read where they lie, with their per-token
 * scales `sstride` apart (NULL: none). Each token's scale multiplies its score (the key's) or its softmax weight (the
 * value's) once instead of each of its elements, so FP8 pages are never written out as floats: a quarter of the f32
 * pages' bytes read, nothing stored. The running max `m`, sum `l` and accumulator `acc` [group, dim] are rescaled to
 * the new max and the page's weighted values added; each query head's accumulator lives in a local array of `dim`
 * floats across the page's tokens (registers, where `dim` is a constant: see `attend`). Four tokens' dot products
 * are reduced to their scores together where AVX-512 is there (`sum4`). */
static ALWAYS_INLINE void page_head(const float *q, int64_t group, const char *keys, const char *values,
                                    const uint16_t *kscale, const uint16_t *vscale, int64_t stride, int64_t sstride,
                                    int64_t n, float *acc, float *m, float *l, int64_t dim, float scale, int kind) {
    float s[MAX_BLOCK], a[MAX_DIM];
    for (int64_t g = 0; g < group; g++) {
        const float *qg = q + g * dim;
        float top = m[g], sum = 0.0f;
        int64_t t = 0;
#ifdef HAVE_SUM4
        if (dim % 16 == 0)
            for (; t + 4 <= n; t += 4) {
                v16 acc4[4] = {{0}};
                for (int64_t d = 0; d < dim; d += 16) {
                    v16 qv = load16(qg + d);
                    for (int i = 0; i < 4; i++) acc4[i] += qv * row16(keys + (t + i) * stride, d, kind);
                }
                sum4(acc4[0], acc4[1], acc4[2], acc4[3], s + t);
            }
#endif
        for (; t < n; t++) {
            v16 part = {0};
            int64_t d = 0;
            for (; d + 16 <= dim; d += 16) part += load16(qg + d) * row16(keys + t * stride, d, kind);
            s[t] = sum16(part);
            for (; d < dim; d++) s[t] += qg[d] * row1(keys + t * stride, d, kind);
        }
        for (t = 0; t < n; t++) s[t] *= kscale ? half_bits_to_float(kscale[t * sstride]) * scale : scale;
        for (t = 0; t < n; t++) top = s[t] > top ? s[t] : top;
        for (t = 0; t < n; t++) s[t] = exp_approx(s[t] - top);
        for (t = 0; t < n; t++) sum += s[t];
        float c = exp_approx(m[g] - top); /* the first page: m is -inf, c ~1e-38 times l = 0 and acc = 0 */
        m[g] = top;
        l[g] = l[g] * c + sum;
        float *out = acc + g * dim;
        for (int64_t d = 0; d < dim; d++) a[d] = out[d] * c;
        for (t = 0; t < n; t++) {
            const char *v = values + t * stride;
            float p = vscale ? s[t] * half_bits_to_float(vscale[t * sstride]) : s[t];
            int64_t d = 0;
            for (; d + 16 <= dim; d += 16) store16(a + d, load16(a + d) + p * row16(v, d, kind));
            for (; d < dim; d++) a[d] += p * row1(v, d, kind);
        }
        for (int64_t d = 0; d < dim; d++) out[d] = a[d];
    }
}

/* One (row, KV head): every query head of its group over the row's pages, or over the `k` selected ones (`pages` not
 * NULL), a page at a time. `out` [group, dim] is the accumulator. The caller checked every block id the row's pages
 * name (`row_in_bounds`). */
static ALWAYS_INLINE void attend(const float *q, const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs,
                                 int kind, const int64_t *table, int64_t ctx, const int64_t *pages, int64_t k, float *out,
                                 int64_t kv_heads, int64_t h, int64_t group, int64_t dim, int64_t bs, float scale) {
    float m[MAX_GROUP], l[MAX_GROUP], kbuf[MAX_BLOCK * MAX_DIM], vbuf[MAX_BLOCK * MAX_DIM];
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
    }
    memset(out, 0, (size_t)(group * dim) * sizeof(float));
    int64_t num_pages = (ctx + bs - 1) / bs, count = pages ? (k < num_pages ? k : num_pages) : num_pages;
    for (int64_t j = 0; j < count; j++) {
        int64_t page = pages ? pages[j] : j, slot0 = table[page] * bs, n = ctx - page * bs < bs ? ctx - page * bs : bs;
        if (n <= 0) continue;
        if (kind == KV_E4M3 && group == 1) { /* read in place; a larger group would decode each code once per head */
            int64_t at = slot0 * kv_heads + h;
            page_head(q, 1, (const char *)kc + at * dim, (const char *)vc + at * dim, ks + at, vs + at, kv_heads * dim,
                      kv_heads, n, out, m, l, dim, scale, KV_E4M3);
            continue;
        }
        int64_t rows_apart; /* the keys' and the values' alike */
        const float *keys = page_rows(kc, ks, kind, slot0, n, kv_heads, h, dim, kbuf, &rows_apart);
        const float *values = page_rows(vc, vs, kind, slot0, n, kv_heads, h, dim, vbuf, &rows_apart);
        page_head(q, group, (const char *)keys, (const char *)values, NULL, NULL, rows_apart * (int64_t)sizeof(float), 0,
                  n, out, m, l, dim, scale, KV_F32);
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* an empty context reads nothing: zeros */
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] *= inv;
    }
}

/* `attend` for the common head sizes with `dim` a constant (its loops unrolled, each query head's accumulator in
 * registers over a page), and for any other. Per layer call at batch 32, demo shapes (contexts 64-128 tokens, pages
 * scattered through 4,096 blocks), one thread, against the token-at-a-time loop with libm's expf it replaces, two
 * interleaved runs: f32 pages 201-226 -> 134-138 us; FP8 pages 453-516 -> 354 us dequantized into a page buffer, 270-340
 * us read in place (`page_head` on the codes). Four tokens' dots reduced together (`sum4`, AVX-512), three interleaved pairs
 * of runs: f32 147-189 -> 127-136 us, FP8 317-404 -> 285-298 us. */
static void attend_64(const float *q, const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind,
                      const int64_t *table, int64_t ctx, const int64_t *pages, int64_t k, float *out, int64_t kv_heads,
                      int64_t h, int64_t group, int64_t bs, float scale) {
    attend(q, kc, vc, ks, vs, kind, table, ctx, pages, k, out, kv_heads, h, group, 64, bs, scale);
}

static void attend_128(const float *q, const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind,
                       const int64_t *table, int64_t ctx, const int64_t *pages, int64_t k, float *out, int64_t kv_heads,
                       int64_t h, int64_t group, int64_t bs, float scale) {
    attend(q, kc, vc, ks, vs, kind, table, ctx, pages, k, out, kv_heads, h, group, 128, bs, scale);
}

static void attend_any(const float *q, const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind,
                       const int64_t *table, int64_t ctx, const int64_t *pages, int64_t k, float *out, int64_t kv_heads,
                       int64_t h, int64_t group, int64_t dim, int64_t bs, float scale) {
    attend(q, kc, vc, ks, vs, kind, table, ctx, pages, k, out, kv_heads, h, group, dim, bs, scale);
}

/* Whether the row reads only what exists: its context within its table, every selected page within the table, and
 * every block id it reads within the cache. */
static int row_in_bounds(const int64_t *table, int64_t ctx, const int64_t *pages, int64_t k, int64_t kv_heads,
                         int64_t bs, int64_t width, int64_t num_blocks) {
    int64_t num_pages = (ctx + bs - 1) / bs;
    if (ctx < 0 || num_pages > width) return 0;
    for (int64_t j = 0; j < num_pages; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return 0;
    if (pages)
        for (int64_t i = 0; i < kv_heads * k; i++)
            if (pages[i] < 0 || pages[i] >= width) return 0;
    return 1;
}

int cotserve_decode_attention(const float *query, const void *k_cache, const void *v_cache, const uint16_t *k_scale,
                              const uint16_t *v_scale, int kind, const int64_t *tables, const int64_t *ctx,
                              const int64_t *pages, int64_t k, float *out, int64_t batch, int64_t heads,
                              int64_t kv_heads, int64_t dim, int64_t bs, int64_t width, int64_t num_blocks, float scale,
                              int threads) {
    int64_t group = heads / kv_heads;
    if (dim > MAX_DIM || group > MAX_GROUP || bs > MAX_BLOCK || group * kv_heads != heads) return -1;
    for (int64_t b = 0; b < batch; b++)
        if (!row_in_bounds(tables + b * width, ctx[b], pages ? pages + b * kv_heads * k : NULL, k, kv_heads, bs, width,
                           num_blocks))
            return -2 - (int)(b < 1000000 ? b : 1000000); /* -2 - row: the first row out of bounds */
#pragma omp parallel for collapse(2) num_threads(threads) if (threads > 1 && batch * kv_heads >= 2 * threads)
    for (int64_t b = 0; b < batch; b++)
        for (int64_t h = 0; h < kv_heads; h++) {
            const float *q = query + (b * heads + h * group) * dim;
            const int64_t *table = tables + b * width, *sel = pages ? pages + (b * kv_heads + h) * k : NULL;
            float *o = out + (b * heads + h * group) * dim;
            if (dim == 64)
                attend_64(q, k_cache, v_cache, k_scale, v_scale, kind, table, ctx[b], sel, k, o, kv_heads, h, group, bs, scale);
            else if (dim == 128)
                attend_128(q, k_cache, v_cache, k_scale, v_scale, kind, table, ctx[b], sel, k, o, kv_heads, h, group, bs,
                           scale);
            else
                attend_any(q, k_cache, v_cache, k_scale, v_scale, kind, table, ctx[b], sel, k, o, kv_heads, h, group, dim,
                           bs, scale);
        }
    return 0;
}

/* ---- KV writes: new keys and values into their slots (write_kv_ref's contract) -----------------------------------
 *
 * key/value [tokens, kv_heads, dim] f32; caches [blocks, block_size, kv_heads, dim] E4M3 or f32; scales [blocks,
 * block_size, kv_heads] f16 (E4M3 only); slots [tokens] i64; fresh [tokens] bool or NULL; k_min/k_max [blocks,
 * kv_heads, dim] f32 or NULL (no page bounds kept). FP8, per token and head: scale = max|x| / 448 (1 for an all-zero
 * vector), at least f16's smallest normal, rounded to f16; payload = x / scale clamped to +-448, rounded to nearest
 * even E4M3 (as torch's float8_e4m3fn cast). f32: a copy. Bounds: pages whose first slot this write fills are emptied
 * first, then every key is folded in as attention will read it (payload times scale for FP8). */

#define E4M3_MAX 448.0f
#define F16_TINY 6.103515625e-05f /* 2^-14, float16's smallest normal */

/* Round-to-nearest-even float -> E4M3 (finite, |x| <= 448 here: the caller clamps). */
static inline uint8_t e4m3_from_float(float x) {
    uint32_t bits = f32_bits(x), sign = bits & 0x80000000u, mag = bits ^ sign;
    uint8_t out;
    if (mag < (121u << 23)) { /* below 2^-6, E4M3's smallest normal: steps of 2^-9, rounded by the FPU */
        float shifted = f32_from_bits(mag) + f32_from_bits(141u << 23); /* + 2^14, whose ulp is 2^-9 */
        out = (uint8_t)(f32_bits(shifted) - (141u << 23));
    } else { /* re-bias the exponent (127 -> 7) and round away the low 20 mantissa bits, ties to even */
        uint32_t odd = (mag >> 20) & 1u;
        mag += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
        out = (uint8_t)(mag >> 20);
    }
    return out | (uint8_t)(sign >> 24);
}

/* f32 -> f16 bits, round to nearest even, for the normal positive range the scales live in (>= 2^-14, < 65520). */
static inline uint16_t half_bits_from_float(float x) {
    uint32_t bits = f32_bits(x), odd = (bits >> 13) & 1u;
    bits += 0xFFFu + odd;
    return (uint16_t)(((bits >> 13) - ((uint32_t)(127 - 15) << 10)) & 0x7FFFu);
}

static void quantize_row(const float *x, int64_t dim, uint8_t *payload, uint16_t *scale_out, float *dequant) {
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; d++) {
        float a = fabsf(x[d]);
        amax = a > amax ? a : amax;
    }
    float s = amax > 0.0f ? amax / E4M3_MAX : 1.0f;
    s = s < F16_TINY ? F16_TINY : s;
    uint16_t h = s >= 65520.0f ? 0x7C00 : half_bits_from_float(s); /* past float16's range: inf, as torch rounds */
    float stored = half_bits_to_float(h);
    *scale_out = h;
    for (int64_t d = 0; d < dim; d++) {
        float q = x[d] / stored;
        q = q > E4M3_MAX ? E4M3_MAX : q < -E4M3_MAX ? -E4M3_MAX : q;
        payload[d] = e4m3_from_float(q);
        if (dequant) dequant[d] = e4m3_to_float(payload[d]) * stored;
    }
}

/* One token's slot for every KV head: FP8 (quantized, `dequant` gets the keys as attention will read them) or f32
 * (copied). */
static void write_token(int kind, const float *key, const float *value, void *k_cache, void *v_cache, uint16_t *k_scale,
                        uint16_t *v_scale, int64_t slot, int64_t h, int64_t kv_heads, int64_t dim, float *dequant,
                        const float **key_read) {
    int64_t dst = (slot * kv_heads + h) * dim;
    if (kind == KV_F32) {
        memcpy((float *)k_cache + dst, key, (size_t)dim * sizeof(float));
        memcpy((float *)v_cache + dst, value, (size_t)dim * sizeof(float));
        *key_read = key;
        return;
    }
    quantize_row(key, dim, (uint8_t *)k_cache + dst, k_scale + slot * kv_heads + h, dequant);
    quantize_row(value, dim, (uint8_t *)v_cache + dst, v_scale + slot * kv_heads + h, NULL);
    *key_read = dequant;
}

/* New keys and values into their slots, f32 or FP8 pages (`kind`; scales NULL for f32). Returns 0, -1 for shapes out of
 * range, or -2 - token for the first token whose slot is outside the cache (nothing is written then). */
int cotserve_write_kv(int kind, const float *key, const float *value, void *k_cache, void *v_cache, uint16_t *k_scale,
                      uint16_t *v_scale, const int64_t *slots, const uint8_t *fresh, float *k_min, float *k_max,
                      int64_t tokens, int64_t kv_heads, int64_t dim, int64_t bs, int64_t num_blocks) {
    if (dim > MAX_DIM) return -1;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] < 0 || slots[t] >= num_blocks * bs) return -2 - (int)(t < 1000000 ? t : 1000000);
    int64_t width = kv_heads * dim;
    if (k_min && fresh)
        for (int64_t t = 0; t < tokens; t++)
            if (fresh[t])
                for (int64_t i = 0; i < width; i++) {
                    k_min[slots[t] / bs * width + i] = INFINITY;
                    k_max[slots[t] / bs * width + i] = -INFINITY;
                }
    float dequant[MAX_DIM];
    for (int64_t t = 0; t < tokens; t++) {
        int64_t slot = slots[t], page = slot / bs;
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t src = (t * kv_heads + h) * dim;
            const float *read;
            write_token(kind, key + src, value + src, k_cache, v_cache, k_scale, v_scale, slot, h, kv_heads, dim,
                        dequant, &read);
            if (!k_min) continue;
            float *lo = k_min + page * width + h * dim, *hi = k_max + page * width + h * dim;
            for (int64_t d = 0; d < dim; d++) {
                lo[d] = read[d] < lo[d] ? read[d] : lo[d];
                hi[d] = read[d] > hi[d] ? read[d] : hi[d];
            }
        }
    }
    return 0;
}

/* ---- The decode step's small operations between its matrix multiplies ------------------------------------------
 *
 * The model's references (cotserve.kernels.layer_ops) are a handful of torch operations each, every one a pass over
 * the batch and a dispatch; on the demo model a decode step ran about 160 of them. Here each is one pass. RoPE and
 * SiLU-times-up round as torch does (no fused multiply-adds: products are rounded before they are summed, as torch's
 * separate operations do); RMSNorm's sum of squares may associate differently (within an ulp of the mean), and SiLU's
 * exponential is `exp_approx` (torch's is its own vectorised one: 99% of results bit for bit, the rest within 2 ulp). */

#if defined(__GNUC__) && !defined(__clang__)
#define NO_CONTRACT __attribute__((optimize("fp-contract=off")))
#define NO_CONTRACT_HERE
#else
#define NO_CONTRACT
#define NO_CONTRACT_HERE _Pragma("STDC FP_CONTRACT OFF")
#endif

/* out = x * rsqrt(mean(x^2) + eps) * weight, rows of `hidden`; with `residual`, first residual += x in place and the
 * sum is normalized (the pre-norm residual stream). */
void cotserve_rms_norm(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t hidden,
                       float eps, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * hidden >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *in = x + r * hidden;
        if (residual) {
            float *res = residual + r * hidden;
            for (int64_t i = 0; i < hidden; i++) res[i] = in[i] + res[i];
            in = res;
        }
        float part[16] = {0};
        int64_t i = 0;
        for (; i + 16 <= hidden; i += 16)
            for (int j = 0; j < 16; j++) part[j] += in[i + j] * in[i + j];
        float sum = 0.0f;
        for (int j = 0; j < 16; j++) sum += part[j];
        for (; i < hidden; i++) sum += in[i] * in[i];
        float inv = 1.0f / sqrtf(sum / (float)hidden + eps);
        float *o = out + r * hidden;
        for (i = 0; i < hidden; i++) o[i] = weight[i] * (in[i] * inv);
    }
}

/* qkv [tokens, (heads + 2 kv_heads) * dim] -> q [tokens, heads, dim], k and v [tokens, kv_heads, dim], contiguous,
 * with rotate-half RoPE on q and k: x * cos + rotate_half(x) * sin, cos/sin [tokens, dim]. */
NO_CONTRACT void cotserve_rope_split(const float *qkv, const float *cos, const float *sin, float *q, float *k, float *v,
                                     int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim) {
    NO_CONTRACT_HERE
    int64_t half = dim / 2, width = (heads + 2 * kv_heads) * dim;
    for (int64_t t = 0; t < tokens; t++) {
        const float *row = qkv + t * width, *c = cos + t * dim, *s = sin + t * dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const float *x = row + h * dim;
            float *o = h < heads ? q + (t * heads + h) * dim : k + (t * kv_heads + h - heads) * dim;
            for (int64_t d = 0; d < half; d++) {
                float a = x[d] * c[d], b = -x[d + half] * s[d];
                o[d] = a + b;
            }
            for (int64_t d = half; d < dim; d++) {
                float a = x[d] * c[d], b = x[d - half] * s[d];
                o[d] = a + b;
            }
        }
        memcpy(v + t * kv_heads * dim, row + (heads + kv_heads) * dim, (size_t)(kv_heads * dim) * sizeof(float));
    }
}

/* gate_up [rows, 2 * inter] (gate, then up) -> out [rows, inter] = silu(gate) * up, silu(x) = x / (1 + exp(-x)). */
void cotserve_silu_mul(const float *gate_up, float *out, int64_t rows, int64_t inter, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows * inter >= (1 << 16))
    for (int64_t r = 0; r < rows; r++) {
        const float *g = gate_up + r * 2 * inter, *u = g + inter;
        float *o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
}

/* ---- Linear layers: y = x @ W^T + b, W stored transposed ([in, out] contiguous) ----------------------------------
 *
 * MKL's sgemm packs the weight matrix into its panel format on every call; at a decode step's few rows that copy is
 * about a third of each multiply (perf on the demo model at batch 32: mkl_blas_def_sgemm_scopy_right16_bdz 12.7% of
 * the engine's time beside the kernel's 17.8%). Stored transposed, a weight's rows ARE panels: for each input feature
 * k, the next 16 output columns are 16 adjacent floats. A tile of 6 rows x 64 columns keeps its 24 accumulators in
 * vector registers over the whole of k: per k, 4 vector loads of the weight, 6 broadcasts of x and 24 fused
 * multiply-adds. The weight row 8 ahead is prefetched: rows lie a whole output row apart, a stride the CPU's own
 * prefetcher does not follow across pages (the demo model's 17 multiplies at batch 32 with the caches flushed first,
 * as a step finds them after the attention's reads: 1.97-2.04 -> 1.84-1.90 ms; hot 1.42-1.98 -> 1.31-1.35 ms). The
 * weights packed into contiguous 64-column panels read faster still from memory (1.50-1.71 ms flushed) but would be
 * a second copy of every weight: not done. Written with GCC vector types (16 floats), so it is plain C: AVX-512 where
 * the CPU has it, halves or quarters elsewhere. Each output is summed over k in order, one fused multiply-add at a
 * time (MKL blocks k: the two differ in the last bits). Threads split the columns (and the rows, for narrow outputs). */

#define TILE_ROWS 6
#define TILE_VECS 4

/* y [R, 16 C] (row stride ldy) = x [R, K] (row stride ldx) @ wt [K, 16 C] (row stride ldw) + bias. */
static ALWAYS_INLINE void linear_tile(const float *x, int64_t ldx, const float *wt, int64_t ldw, const float *bias,
                                      float *y, int64_t ldy, int64_t K, const int R, const int C) {
    v16 acc[TILE_ROWS][TILE_VECS];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) acc[r][c] = bias ? load16(bias + 16 * c) : (v16){0};
    for (int64_t k = 0; k < K; k++) {
        const float *ahead = wt + (k + 8 < K ? k + 8 : k) * ldw; /* the weight row 8 ahead: rows lie ldw floats apart */
        for (int c = 0; c < C; c++) __builtin_prefetch(ahead + 16 * c, 0, 3);
        v16 w[TILE_VECS];
        for (int c = 0; c < C; c++) w[c] = load16(wt + k * ldw + 16 * c);
        for (int r = 0; r < R; r++) {
            float s = x[r * ldx + k]; /* a splat written out: `(v16){0} + s` would add a zero for every element */
            v16 a = {s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
            for (int c = 0; c < C; c++) acc[r][c] += a * w[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) store16(y + r * ldy + 16 * c, acc[r][c]);
}

typedef void (*linear_tile_fn)(const float *, int64_t, const float *, int64_t, const float *, float *, int64_t, int64_t);

#define LINEAR_TILE(R, C)                                                                                              \
    static void linear_tile_##R##_##C(const float *x, int64_t ldx, const float *wt, int64_t ldw, const float *bias,    \
                                      float *y, int64_t ldy, int64_t K) {                                              \
        linear_tile(x, ldx, wt, ldw, bias, y, ldy, K, R, C);                                                           \
    }
#define LINEAR_TILES(C) LINEAR_TILE(6, C) LINEAR_TILE(4, C) LINEAR_TILE(2, C) LINEAR_TILE(1, C)
LINEAR_TILES(1)
LINEAR_TILES(2)
LINEAR_TILES(3)
LINEAR_TILES(4)

static const linear_tile_fn LINEAR_TILE_FNS[4][TILE_VECS] = {
    {linear_tile_6_1, linear_tile_6_2, linear_tile_6_3, linear_tile_6_4},
    {linear_tile_4_1, linear_tile_4_2, linear_tile_4_3, linear_tile_4_4},
    {linear_tile_2_1, linear_tile_2_2, linear_tile_2_3, linear_tile_2_4},
    {linear_tile_1_1, linear_tile_1_2, linear_tile_1_3, linear_tile_1_4},
};
static const int LINEAR_TILE_ROWS[4] = {6, 4, 2, 1};

/* y [M, N] = x [M, K] @ wt [K, N] + bias [N] (NULL: none); all contiguous. Columns past the last multiple of 16 are
 * summed one at a time, in the same order. Threads take (columns, rows) blocks: whole spans of 64 columns where there
 * are enough of them, else the rows split too (a 192-wide output is 3 spans). */
void cotserve_linear(const float *x, const float *wt, const float *bias, float *y, int64_t M, int64_t N, int64_t K,
                     int threads) {
    const int64_t span = 16 * TILE_VECS, spans = (N + span - 1) / span;
    int64_t chunk = spans >= 4 * threads ? M : (M + 6 * threads - 1) / (6 * threads) * 6;
    chunk = chunk < 1 ? 1 : chunk;
    const int64_t chunks = (M + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) num_threads(threads) if (threads > 1 && spans * chunks >= 2 && M * N * K >= (1 << 18))
    for (int64_t j = 0; j < spans; j++)
        for (int64_t c = 0; c < chunks; c++) {
            int64_t n0 = j * span, width = N - n0 < span ? N - n0 : span, vecs = width / 16;
            int64_t m0 = c * chunk, m1 = M - m0 < chunk ? M : m0 + chunk, m = m0;
            if (vecs)
                for (int i = 0; i < 4; i++)
                    for (; m + LINEAR_TILE_ROWS[i] <= m1; m += LINEAR_TILE_ROWS[i])
                        LINEAR_TILE_FNS[i][vecs - 1](x + m * K, K, wt + n0, N, bias ? bias + n0 : NULL, y + m * N + n0,
                                                     N, K);
            for (int64_t n = n0 + 16 * vecs; n < n0 + width; n++)
                for (m = m0; m < m1; m++) {
                    float s = bias ? bias[n] : 0.0f;
                    for (int64_t k = 0; k < K; k++) s += x[m * K + k] * wt[k * N + n];
                    y[m * N + n] = s;
                }
        }
}

/* ---- A step's decoder layers in one call ----------------------------------------------------------------------------
 *
 * The operations above, called one layer after another from here rather than from Python: on a small model a decode
 * step's time went a third to the Python around them (the modules' calls, a tensor allocated per result, ctypes'
 * argument conversion, ten calls a layer). Each operation is the function above with the arguments the per-operation
 * path gives it, in the same order, so the results are the per-operation path's bit for bit.
 *
 * `layers` [num_layers, LAYER_FIELDS] holds each layer's addresses (weights stored transposed, as `cotserve_linear`
 * takes them; a bias 0 for none) and its cache's kind; `x` [n, hidden] is the embedded tokens and becomes the residual
 * stream; `out` [n, hidden] the final norm's output; `work` room for the intermediate results (n rows of 2 hidden +
 * 2 (heads + 2 kv_heads) dim + heads dim + 3 inter floats: cpu_native.DecodeLayers). Every row is one token: row r's
 * key and value go to slots[r] and it attends over its table's pages up to ctx[r] (all of them: no page selection),
 * after every row's write, so a prompt chunk's token given its own position + 1 as ctx attends causally over the
 * chunk and what precedes it. num_layers >= 1. Returns 0, or -1 with `err` = {the operation: 0 the write, 1 attention; its return code} when a
 * write or a row's read would leave the cache: the first layer's write checks every slot before it writes any (every
 * layer uses the same slots and tables), so an out-of-range slot writes nothing; a row out of its table fails the
 * first layer's attention, after its write, as on the per-operation path. */
enum {
    L_IN_NORM, L_QKV_W, L_QKV_B, L_O_W, L_O_B, L_POST_NORM, L_GU_W, L_GU_B, L_DOWN_W, L_DOWN_B,
    L_K, L_V, L_K_SCALE, L_V_SCALE, L_K_MIN, L_K_MAX, L_KIND, LAYER_FIELDS
};

int64_t cotserve_decode_layer_fields(void) { return LAYER_FIELDS; }

int cotserve_decode_layers(const int64_t *layers, int64_t num_layers, const float *final_norm, float *x,
                           const float *cos, const float *sin, const int64_t *slots, const uint8_t *fresh,
                           const int64_t *tables, const int64_t *ctx, float *work, float *out, int64_t *err, int64_t n,
                           int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim, int64_t inter, int64_t bs,
                           int64_t width, int64_t num_blocks, float eps, float scale, int threads) {
    const int64_t qkv_width = (heads + 2 * kv_heads) * dim;
    float *h = work, *qkv = h + n * hidden, *q = qkv + n * qkv_width, *k = q + n * heads * dim;
    float *v = k + n * kv_heads * dim, *att = v + n * kv_heads * dim, *gate_up = att + n * heads * dim;
    float *act = gate_up + n * 2 * inter, *y = act + n * inter; /* y: a block's output, added into x by the next norm */
#define FIELD(T, f) ((T)(intptr_t)L[f])
    for (int64_t i = 0; i < num_layers; i++) {
        const int64_t *L = layers + i * LAYER_FIELDS;
        int kind = (int)L[L_KIND];
        void *kc = FIELD(void *, L_K), *vc = FIELD(void *, L_V);
        uint16_t *ks = FIELD(uint16_t *, L_K_SCALE), *vs = FIELD(uint16_t *, L_V_SCALE);
        float *k_min = FIELD(float *, L_K_MIN), *k_max = FIELD(float *, L_K_MAX);
        cotserve_rms_norm(i ? y : x, i ? x : NULL, FIELD(const float *, L_IN_NORM), h, n, hidden, eps, threads);
        cotserve_linear(h, FIELD(const float *, L_QKV_W), FIELD(const float *, L_QKV_B), qkv, n, qkv_width, hidden,
                        threads);
        cotserve_rope_split(qkv, cos, sin, q, k, v, n, heads, kv_heads, dim);
        int rc = cotserve_write_kv(kind, k, v, kc, vc, ks, vs, slots, k_min ? fresh : NULL, k_min, k_max, n, kv_heads,
                                   dim, bs, num_blocks);
        if (rc != 0) {
            err[0] = 0, err[1] = rc;
            return -1;
        }
        rc = cotserve_decode_attention(q, kc, vc, ks, vs, kind, tables, ctx, NULL, 0, att, n, heads, kv_heads, dim, bs,
                                       width, num_blocks, scale, threads);
        if (rc != 0) {
            err[0] = 1, err[1] = rc;
            return -1;
        }
        cotserve_linear(att, FIELD(const float *, L_O_W), FIELD(const float *, L_O_B), y, n, hidden, heads * dim,
                        threads);
        cotserve_rms_norm(y, x, FIELD(const float *, L_POST_NORM), h, n, hidden, eps, threads);
        cotserve_linear(h, FIELD(const float *, L_GU_W), FIELD(const float *, L_GU_B), gate_up, n, 2 * inter, hidden,
                        threads);
        cotserve_silu_mul(gate_up, act, n, inter, threads);
        cotserve_linear(act, FIELD(const float *, L_DOWN_W), FIELD(const float *, L_DOWN_B), y, n, hidden, inter,
                        threads);
    }
#undef FIELD
    cotserve_rms_norm(y, x, final_norm, out, n, hidden, eps, threads);
    return 0;
}
