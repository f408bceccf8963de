// Paged attention on the CPU: varlen (prefill, decode and mixed batches), GQA-grouped,
// single-pass online softmax in fp32, split-KV with a log-sum-exp merge, OpenMP.
//
// Work item = (sequence, KV head, tile of up to kQueryTile query tokens, key range). A work
// item computes every query head of the KV head's GQA group for every query of its tile,
// so each K/V row it needs is loaded (and converted to fp32) once per item. Keys are taken
// a cache block at a time: scores for the block, one rescale of the running sums, then
// the weighted V accumulation (the flash-attention recurrence).
//
// Vector kernels (dot, axpy, scale) have an AVX2+FMA version and a portable one; the
// choice is made once at load time from the CPU's features, never at compile time.

#include "paged_attention.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define PA_X86 1
#endif

namespace {

thread_local std::string g_last_error;

int fail(const std::string& message) {
    g_last_error = message;
    return 1;
}

constexpr int kQueryTile = 16;        // query tokens per work item (prefill)
constexpr int kMinSplitKeys = 256;    // never split a key range shorter than this
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- vector kernels ----

float dot_portable(const float* a, const float* b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}
void axpy_portable(float* y, float a, const float* x, int n) {
    for (int i = 0; i < n; ++i) y[i] += a * x[i];
}
void scale_portable(float* y, float a, int n) {
    for (int i = 0; i < n; ++i) y[i] *= a;
}

#ifdef PA_X86
__attribute__((target("avx2,fma"))) float dot_avx2(const float* a, const float* b, int n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    __m256 acc = _mm256_add_ps(acc0, acc1);
    __m128 lo = _mm256_castps256_ps128(acc), hi = _mm256_extractf128_ps(acc, 1);
    __m128 s = _mm_add_ps(lo, hi);
    s = _mm_hadd_ps(s, s);
    s = _mm_hadd_ps(s, s);
    float total = _mm_cvtss_f32(s);
    for (; i < n; ++i) total += a[i] * b[i];
    return total;
}
__attribute__((target("avx2,fma"))) void axpy_avx2(float* y, float a, const float* x, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] += a * x[i];
}
__attribute__((target("avx2,fma"))) void scale_avx2(float* y, float a, int n) {
    __m256 va = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; ++i) y[i] *= a;
}
#endif

struct Isa {
    float (*dot)(const float*, const float*, int);
    void (*axpy)(float*, float, const float*, int);
    void (*scale)(float*, float, int);
    const char* name;
};

Isa pick_isa() {
#ifdef PA_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return {dot_avx2, axpy_avx2, scale_avx2, "avx2+fma"};
#endif
    return {dot_portable, axpy_portable, scale_portable, "portable"};
}

const Isa kIsa = pick_isa();

// ---- dtype conversion ----

inline float bf16_to_float(uint16_t v) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
}
inline uint16_t float_to_bf16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);  // NaN stays NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);  // round to nearest even
    return static_cast<uint16_t>(bits >> 16);
}

void load_row(float* dst, const void* base, int64_t offset, int n, int dtype) {
    if (dtype == PA_FLOAT32) {
        std::memcpy(dst, static_cast<const float*>(base) + offset, n * sizeof(float));
    } else {
        const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
        for (int i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
    }
}

void store_row(void* base, int64_t offset, const float* src, int n, int dtype) {
    if (dtype == PA_FLOAT32) {
        std::memcpy(static_cast<float*>(base) + offset, src, n * sizeof(float));
    } else {
        uint16_t* dst = static_cast<uint16_t*>(base) + offset;
        for (int i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
    }
}

// ---- attention ----

struct WorkItem {
    int seq, kv_head, q_begin, q_end;  // query rows are relative to the sequence's first new token
    int k_begin, k_end;                // key positions
    int split, num_splits;
    int64_t partial;                   // offset of this item's partial results (split items only)
};

struct Problem {
    const pa_shape* s;
    const void* query;
    const void* kv_cache;
    void* out;
    const int32_t* qsl;
    const int32_t* seq_lens;
    const int32_t* block_tables;
    float scale;
    int group;
    int64_t kv_half;  // elements in one of K or V: num_blocks * block_size * num_kv_heads * head_size
};

// Per-thread scratch: the running softmax state of every (query, head) row of an item and
// one block of K and V converted to fp32.
struct Scratch {
    std::vector<float> q, acc, m, l, k, v, scores;
    void reserve(int rows, int head_size, int block_size) {
        q.resize(static_cast<size_t>(rows) * head_size);
        acc.resize(static_cast<size_t>(rows) * head_size);
        m.resize(rows);
        l.resize(rows);
        k.resize(static_cast<size_t>(block_size) * head_size);
        v.resize(static_cast<size_t>(block_size) * head_size);
        scores.resize(block_size);
    }
};

// Runs one work item; leaves (m, l, acc) per row in the scratch.
void run_item(const Problem& p, const WorkItem& w, Scratch& sc) {
    const pa_shape& s = *p.s;
    const int D = s.head_size, BS = s.block_size, G = p.group;
    const int q_len = p.qsl[w.seq + 1] - p.qsl[w.seq];
    const int ctx = p.seq_lens[w.seq] - q_len;  // tokens cached before the first new one
    const int rows = (w.q_end - w.q_begin) * G;
    for (int qi = w.q_begin; qi < w.q_end; ++qi) {
        for (int g = 0; g < G; ++g) {
            int64_t token = p.qsl[w.seq] + qi;
            int64_t off = (token * s.num_heads + static_cast<int64_t>(w.kv_head) * G + g) * D;
            load_row(&sc.q[static_cast<size_t>((qi - w.q_begin) * G + g) * D], p.query, off, D, s.dtype);
        }
    }
    std::fill(sc.acc.begin(), sc.acc.begin() + static_cast<size_t>(rows) * D, 0.f);
    std::fill(sc.m.begin(), sc.m.begin() + rows, kNegInf);
    std::fill(sc.l.begin(), sc.l.begin() + rows, 0.f);
    // The last query of the tile sees keys up to ctx + q_end - 1.
    const int k_end = std::min(w.k_end, ctx + w.q_end);
    const int32_t* table = p.block_tables + static_cast<int64_t>(w.seq) * s.max_blocks_per_seq;
    for (int k0 = w.k_begin; k0 < k_end;) {
        const int block = table[k0 / BS];
        const int first = k0 % BS;
        const int count = std::min(BS - first, k_end - k0);
        for (int j = 0; j < count; ++j) {
            int64_t off = ((static_cast<int64_t>(block) * BS + first + j) * s.num_kv_heads + w.kv_head) * D;
            load_row(&sc.k[static_cast<size_t>(j) * D], p.kv_cache, off, D, s.dtype);
            load_row(&sc.v[static_cast<size_t>(j) * D], p.kv_cache, p.kv_half + off, D, s.dtype);
        }
        for (int qi = w.q_begin; qi < w.q_end; ++qi) {
            const int visible = std::min(count, ctx + qi + 1 - k0);  // causal limit within this block
            if (visible <= 0) continue;
            for (int g = 0; g < G; ++g) {
                const int r = (qi - w.q_begin) * G + g;
                const float* q = &sc.q[static_cast<size_t>(r) * D];
                float block_max = kNegInf;
                for (int j = 0; j < visible; ++j) {
                    sc.scores[j] = kIsa.dot(q, &sc.k[static_cast<size_t>(j) * D], D) * p.scale;
                    block_max = std::max(block_max, sc.scores[j]);
                }
                const float m_new = std::max(sc.m[r], block_max);
                float* acc = &sc.acc[static_cast<size_t>(r) * D];
                const float correction = std::exp(sc.m[r] - m_new);  // 0 when m was -inf
                if (correction != 1.f) kIsa.scale(acc, correction, D);
                float sum = 0.f;
                for (int j = 0; j < visible; ++j) {
                    const float e = std::exp(sc.scores[j] - m_new);
                    sum += e;
                    kIsa.axpy(acc, e, &sc.v[static_cast<size_t>(j) * D], D);
                }
                sc.l[r] = sc.l[r] * correction + sum;
                sc.m[r] = m_new;
            }
        }
        k0 += count;
    }
}

void store_item(const Problem& p, const WorkItem& w, Scratch& sc, float* partials) {
    const int D = p.s->head_size, G = p.group;
    for (int qi = w.q_begin; qi < w.q_end; ++qi) {
        for (int g = 0; g < G; ++g) {
            const int r = (qi - w.q_begin) * G + g;
            float* acc = &sc.acc[static_cast<size_t>(r) * D];
            if (w.num_splits > 1) {  // keep (m, l, acc) for the merge
                float* dst = partials + w.partial + static_cast<int64_t>(r) * (D + 2);
                dst[0] = sc.m[r];
                dst[1] = sc.l[r];
                std::memcpy(dst + 2, acc, D * sizeof(float));
                continue;
            }
            if (sc.l[r] > 0.f) kIsa.scale(acc, 1.f / sc.l[r], D);
            int64_t token = p.qsl[w.seq] + qi;
            store_row(p.out, (token * p.s->num_heads + static_cast<int64_t>(w.kv_head) * G + g) * D, acc, D, p.s->dtype);
        }
    }
}

// Combine the split partials of one (sequence, KV head) decode item group with log-sum-exp.
void merge_splits(const Problem& p, const std::vector<WorkItem>& items, size_t first, float* partials) {
    const WorkItem& w0 = items[first];
    const int D = p.s->head_size, G = p.group;
    std::vector<float> out(D);
    for (int qi = w0.q_begin; qi < w0.q_end; ++qi) {
        for (int g = 0; g < G; ++g) {
            const int r = (qi - w0.q_begin) * G + g;
            float m = kNegInf;
            for (int i = 0; i < w0.num_splits; ++i) m = std::max(m, partials[items[first + i].partial + static_cast<int64_t>(r) * (D + 2)]);
            std::fill(out.begin(), out.end(), 0.f);
            float l = 0.f;
            for (int i = 0; i < w0.num_splits; ++i) {
                const float* part = partials + items[first + i].partial + static_cast<int64_t>(r) * (D + 2);
                if (part[1] == 0.f) continue;
                const float weight = std::exp(part[0] - m);
                l += part[1] * weight;
                kIsa.axpy(out.data(), weight, part + 2, D);
            }
            if (l > 0.f) kIsa.scale(out.data(), 1.f / l, D);
            int64_t token = p.qsl[w0.seq] + qi;
            store_row(p.out, (token * p.s->num_heads + static_cast<int64_t>(w0.kv_head) * G + g) * D, out.data(), D, p.s->dtype);
        }
    }
}

// Work items: query tiles of every (sequence, KV head); when there are too few items to
// keep every thread busy, long key ranges are split (split-KV).
std::vector<WorkItem> plan(const Problem& p, int num_threads, int64_t* partial_floats) {
    const pa_shape& s = *p.s;
    std::vector<WorkItem> tiles;
    for (int seq = 0; seq < s.num_seqs; ++seq) {
        const int q_len = p.qsl[seq + 1] - p.qsl[seq];
        for (int h = 0; h < s.num_kv_heads; ++h)
            for (int q0 = 0; q0 < q_len; q0 += kQueryTile)
                tiles.push_back({seq, h, q0, std::min(q_len, q0 + kQueryTile), 0, p.seq_lens[seq], 0, 1, 0});
    }
    const int64_t wanted = 2LL * num_threads;
    std::vector<WorkItem> items;
    *partial_floats = 0;
    for (const WorkItem& t : tiles) {
        const int keys = t.k_end;
        int splits = 1;
        if (static_cast<int64_t>(tiles.size()) < wanted && keys >= 2 * kMinSplitKeys)
            splits = static_cast<int>(std::min<int64_t>((wanted + tiles.size() - 1) / tiles.size(), keys / kMinSplitKeys));
        const int chunk = (keys + splits - 1) / splits;
        const int64_t part_size = static_cast<int64_t>(t.q_end - t.q_begin) * p.group * (s.head_size + 2);
        for (int i = 0; i < splits; ++i) {
            WorkItem w = t;
            w.k_begin = i * chunk;
            w.k_end = std::min(keys, (i + 1) * chunk);
            w.split = i;
            w.num_splits = splits;
            if (splits > 1) {
                w.partial = *partial_floats;
                *partial_floats += part_size;
            }
            items.push_back(w);
        }
    }
    return items;
}

int check_shape(const pa_shape* s) {
    if (s == nullptr) return fail("shape is null");
    if (s->dtype != PA_FLOAT32 && s->dtype != PA_BFLOAT16) return fail("the CPU library supports float32 and bfloat16 only");
    if (s->num_kv_heads <= 0 || s->num_heads % s->num_kv_heads != 0) return fail("num_heads must be a multiple of num_kv_heads");
    if (s->head_size <= 0 || s->block_size <= 0) return fail("head_size and block_size must be positive");
    return 0;
}

}  // namespace

extern "C" {

const char* pa_cpu_last_error(void) { return g_last_error.c_str(); }

const char* pa_cpu_isa(void) { return kIsa.name; }

int pa_cpu_write_kv(const pa_shape* s, const void* key, const void* value, void* kv_cache, const int64_t* slot_mapping) {
    if (int rc = check_shape(s)) return rc;
    const int64_t row = static_cast<int64_t>(s->num_kv_heads) * s->head_size;
    const int64_t num_slots = static_cast<int64_t>(s->num_blocks) * s->block_size;
    const size_t elem = s->dtype == PA_FLOAT32 ? 4 : 2;
    char* k_cache = static_cast<char*>(kv_cache);
    char* v_cache = k_cache + num_slots * row * elem;
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad)
    for (int t = 0; t < s->num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) { bad = 1; continue; }
        std::memcpy(k_cache + slot * row * elem, static_cast<const char*>(key) + t * row * elem, row * elem);
        std::memcpy(v_cache + slot * row * elem, static_cast<const char*>(value) + t * row * elem, row * elem);
    }
    return bad ? fail("slot_mapping holds a slot outside the cache") : 0;
}

int pa_cpu_attention(const pa_shape* s, void* out, const void* query, const void* kv_cache, const int32_t* qsl,
                     const int32_t* seq_lens, const int32_t* block_tables, float scale) {
    if (int rc = check_shape(s)) return rc;
    Problem p{s, query, kv_cache, out, qsl, seq_lens, block_tables, scale, s->num_heads / s->num_kv_heads,
              static_cast<int64_t>(s->num_blocks) * s->block_size * s->num_kv_heads * s->head_size};
    for (int seq = 0; seq < s->num_seqs; ++seq) {
        const int q_len = qsl[seq + 1] - qsl[seq];
        if (q_len < 0 || q_len > seq_lens[seq]) return fail("a sequence has more new tokens than its seq_len");
        if ((seq_lens[seq] + s->block_size - 1) / s->block_size > s->max_blocks_per_seq)
            return fail("a seq_len needs more blocks than block_tables has columns");
    }
    const int num_threads = omp_get_max_threads();
    int64_t partial_floats = 0;
    const std::vector<WorkItem> items = plan(p, num_threads, &partial_floats);
    std::vector<float> partials(static_cast<size_t>(partial_floats));
    const int rows = kQueryTile * p.group;
#pragma omp parallel
    {
        Scratch scratch;
        scratch.reserve(rows, s->head_size, s->block_size);
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
            run_item(p, items[i], scratch);
            store_item(p, items[i], scratch, partials.data());
        }
    }
    if (partial_floats > 0) {
        std::vector<size_t> firsts;
        for (size_t i = 0; i < items.size(); ++i)
            if (items[i].num_splits > 1 && items[i].split == 0) firsts.push_back(i);
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t i = 0; i < static_cast<int64_t>(firsts.size()); ++i) merge_splits(p, items, firsts[i], partials.data());
    }
    return 0;
}

}  // extern "C"
