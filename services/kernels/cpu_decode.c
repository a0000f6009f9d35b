/* Decode attention on the CPU over the paged KV cache: one query per row, every page of the row's block table or
 * only the selected ones, fp32 or FP8 (E4M3 with fp16 scales) pages dequantized as they are read.
 *
 * The same contract as cotserve.kernels.kv_fp8.decode_attention_ref (see cpu_native.py for the why): per row and KV
 * head, the keys are read once for every query head of the group, a page at a time, with an online softmax, so
 * nothing of the row's context is copied and tokens past the row's context length are never read.
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

static float e4m3_lut[256];

void cotserve_init(void) {
    for (int b = 0; b < 256; b++) {
        int e = (b >> 3) & 15, m = b & 7;
        float v = (e == 15 && m == 7) ? NAN : e == 0 ? ldexpf((float)m, -9) : ldexpf(8.0f + (float)m, e - 10);
        e4m3_lut[b] = (b & 0x80) ? -v : v;
    }
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

static inline float dot(const float *a, const float *b, int64_t n) {
    float part[8] = {0};
    int64_t d = 0;
    for (; d + 8 <= n; d += 8)
        for (int i = 0; i < 8; i++) part[i] += a[d + i] * b[d + i];
    float s = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
    for (; d < n; d++) s += a[d] * b[d];
    return s;
}

/* The row `slot`'s vector of KV head `h` as floats: a pointer into an f32 cache, or dequantized into `buf`. */
static inline const float *kv_row(const void *cache, const uint16_t *scales, int kind, int64_t slot, int64_t kv_heads,
                                  int64_t h, int64_t dim, float *buf) {
    int64_t at = (slot * kv_heads + h) * dim;
    if (kind == KV_F32) return (const float *)cache + at;
    const uint8_t *p = (const uint8_t *)cache + at;
    float s = half_bits_to_float(scales[slot * kv_heads + h]);
    for (int64_t d = 0; d < dim; d++) buf[d] = e4m3_lut[p[d]] * s;
    return buf;
}

/* One (row, KV head): every query head of its group over the row's pages. The caller checked every block id the
 * row's pages name (`row_in_bounds`). */
static void attend_one(const float *q, const void *kc, const void *vc, const uint16_t *ks, const uint16_t *vs, int kind,
                       const int64_t *table, int64_t ctx, const int64_t *pages, int64_t k, float *out, int64_t kv_heads,
                       int64_t h, int64_t group, int64_t dim, int64_t bs, float scale) {
    float acc[MAX_GROUP][MAX_DIM], scores[MAX_GROUP][MAX_BLOCK], m[MAX_GROUP], l[MAX_GROUP], buf[MAX_DIM];
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        memset(acc[g], 0, (size_t)dim * sizeof(float));
    }
    int64_t num_pages = (ctx + bs - 1) / bs, count = pages ? (k < num_pages ? k : num_pages) : num_pages;
    for (int64_t j = 0; j < count; j++) {
        int64_t page = pages ? pages[j] : j, block = table[page], first = page * bs;
        int64_t n = ctx - first < bs ? ctx - first : bs;
        if (n <= 0) continue;
        for (int64_t t = 0; t < n; t++) {
            const float *key = kv_row(kc, ks, kind, block * bs + t, kv_heads, h, dim, buf);
            for (int64_t g = 0; g < group; g++) scores[g][t] = dot(q + g * dim, key, dim) * scale;
        }
        for (int64_t g = 0; g < group; g++) {
            float top = m[g];
            for (int64_t t = 0; t < n; t++) top = scores[g][t] > top ? scores[g][t] : top;
            float c = expf(m[g] - top);
            l[g] *= c;
            for (int64_t d = 0; d < dim; d++) acc[g][d] *= c;
            m[g] = top;
            for (int64_t t = 0; t < n; t++) {
                scores[g][t] = expf(scores[g][t] - top);
                l[g] += scores[g][t];
            }
        }
        for (int64_t t = 0; t < n; t++) {
            const float *value = kv_row(vc, vs, kind, block * bs + t, kv_heads, h, dim, buf);
            for (int64_t g = 0; g < group; g++) {
                float p = scores[g][t];
                for (int64_t d = 0; d < dim; d++) acc[g][d] += p * value[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f; /* an empty context reads nothing: zeros */
        for (int64_t d = 0; d < dim; d++) out[g * dim + d] = acc[g][d] * inv;
    }
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
        for (int64_t h = 0; h < kv_heads; h++)
            attend_one(query + (b * heads + h * group) * dim, k_cache, v_cache, k_scale, v_scale, kind, tables + b * width,
                       ctx[b], pages ? pages + (b * kv_heads + h) * k : NULL, k, out + (b * heads + h * group) * dim,
                       kv_heads, h, group, dim, bs, scale);
    return 0;
}
