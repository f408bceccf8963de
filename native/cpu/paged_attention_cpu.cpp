// Paged attention on the CPU: varlen (prefill, decode and mixed batches), GQA-grouped,
// single-pass online softmax in fp32, split-KV with a log-sum-exp merge, OpenMP.
//
// Work item = (sequence, tile of up to kQueryTile query tokens, key range). A work item
// computes every query head for every query of its tile, so each cache block -- all KV
// heads of its tokens, contiguous in memory -- is streamed once per item, and each K/V row
// serves all the query heads of its GQA group. When there are too few items to keep
// every thread busy (small decode batches, long contexts), key ranges are split and the
// partial results merged with log-sum-exp.
//
// The arithmetic (kernel.cpp) is compiled twice, for AVX2+FMA and portable; the variant is
// chosen once at load time from the CPU's features, never by compile flags of the library.

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernel.h"

namespace {

using pa::Kernels;
using pa::Problem;
using pa::Scratch;
using pa::WorkItem;

thread_local std::string g_last_error;

int fail(const std::string& message) {
    g_last_error = message;
    return 1;
}

// The AVX2+FMA+F16C kernels where the CPU has them, else the portable ones; PA_CPU_ISA=portable
// in the environment when the library loads forces the portable ones (tests use it).
Kernels pick_kernels() {
    const char* forced = std::getenv("PA_CPU_ISA");
    if (forced != nullptr && std::string(forced) == "portable") return pa::pa_portable::kernels();
#if (defined(__x86_64__) || defined(_M_X64)) && !defined(PA_NO_AVX2)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return pa::pa_avx2::kernels();
#endif
    return pa::pa_portable::kernels();
}

const Kernels kKernels = pick_kernels();

// Multiply-adds (query x key x head_size, over all heads) one thread should have before a
// second joins. The layers of a decode step run back to back in one native call
// (pa_cpu_decoder_layers), so the worker that computed the last product is still spinning when
// the attention starts: a decode row at batch 1 is worth splitting from ~30 keys of context.
// (Measured on the default model, 9 heads of 64, AMD EPYC family 23, 2 threads, alternated in one
// process: a batch-1 decode step 1.04-1.07x faster at 40-250 tokens of context, 1.2x at 1000. The
// layer-by-layer loop, which calls this from Python for each layer (bf16 models, Gemma, ...), is
// not slower either: its batch-1 step at 200 tokens 13.4-13.9 ms against 13.9-14.8 with 1 << 20,
// the threshold from when the process had two OpenMP pools and a woken worker was a sleeping one.)
constexpr int64_t kMinWorkPerThread = 1 << 14;

int threads_for(const Problem& p) {
    int64_t work = 0;
    for (int seq = 0; seq < p.s->num_seqs; ++seq)
        work += static_cast<int64_t>(p.qsl[seq + 1] - p.qsl[seq]) *
                (p.window > 0 ? std::min(p.window, p.seq_lens[seq]) : p.seq_lens[seq]);
    work *= static_cast<int64_t>(p.s->num_heads) * p.s->head_size;
    return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(omp_get_max_threads(), work / kMinWorkPerThread)));
}

std::vector<WorkItem> plan(const Problem& p, int num_threads, int64_t* partial_floats) {
    const pa_shape& s = *p.s;
    std::vector<WorkItem> tiles;
    for (int seq = 0; seq < s.num_seqs; ++seq) {
        const int q_len = p.qsl[seq + 1] - p.qsl[seq];
        const int ctx = p.seq_lens[seq] - q_len;
        for (int q0 = 0; q0 < q_len; q0 += pa::kQueryTile) {
            // keys [first, seq_len): with a window, none before the tile's first query's window
            const int first = p.window > 0 ? std::max(0, ctx + q0 - p.window + 1) : 0;
            tiles.push_back({seq, q0, std::min(q_len, q0 + pa::kQueryTile), first, p.seq_lens[seq], 0, 1, 0});
        }
    }
    // Items wanted: none split on one thread; on more, one per thread when every tile is a decode
    // row (items of about the same cost: the split of a row is its key range cut evenly), else four
    // per thread, so that the dynamic schedule evens out a prefill's tiles of unequal key ranges.
    bool decode_rows = true;
    for (const WorkItem& t : tiles) decode_rows = decode_rows && t.q_end - t.q_begin == 1;
    const int64_t wanted = num_threads == 1 ? 1 : (decode_rows ? 1 : 4) * static_cast<int64_t>(num_threads);
    std::vector<WorkItem> items;
    *partial_floats = 0;
    for (const WorkItem& t : tiles) {
        const int keys = t.k_end - t.k_begin;
        int splits = 1;
        if (!p.fixed_order && static_cast<int64_t>(tiles.size()) < wanted && keys >= 2 * pa::kMinSplitKeys)
            splits = static_cast<int>(std::min<int64_t>((wanted + tiles.size() - 1) / tiles.size(), keys / pa::kMinSplitKeys));
        const int chunk = (keys + splits - 1) / splits;
        const int64_t part_size = static_cast<int64_t>(t.q_end - t.q_begin) * s.num_heads * (s.head_size + 2);
        for (int i = 0; i < splits; ++i) {
            WorkItem w = t;
            w.k_begin = t.k_begin + i * chunk;
            w.k_end = std::min(t.k_end, t.k_begin + (i + 1) * chunk);
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
    if (s->dtype != PA_FLOAT32 && s->dtype != PA_BFLOAT16)
        return fail("the CPU library takes float32 and bfloat16 rows only");
    if (s->kv_dtype < PA_FLOAT32 || s->kv_dtype > PA_INT8) return fail("unknown kv_dtype");
    if (s->num_kv_heads <= 0 || s->num_heads % s->num_kv_heads != 0) return fail("num_heads must be a multiple of num_kv_heads");
    if (s->head_size <= 0 || s->block_size <= 0) return fail("head_size and block_size must be positive");
    if (s->head_size > pa::kMaxHeadSize) return fail("head_size above 512 is not supported");
    return 0;
}

}  // namespace

int pa::report_error(const char* message) { return fail(message); }

extern "C" {

const char* pa_cpu_last_error(void) { return g_last_error.c_str(); }

const char* pa_cpu_isa(void) { return kKernels.name; }

int pa_cpu_abi_version(void) { return PA_ABI_VERSION; }

int pa_cpu_write_kv(const pa_shape* s, const void* key, const void* value, void* kv_cache, const int64_t* slot_mapping,
                    const float* kv_scales) {
    if (int rc = check_shape(s)) return rc;
    const int D = s->head_size, KV = s->num_kv_heads;
    const int64_t row = static_cast<int64_t>(KV) * D;  // one token's input, all KV heads
    const int64_t num_slots = static_cast<int64_t>(s->num_blocks) * s->block_size;
    const size_t elem = s->dtype == PA_FLOAT32 ? 4 : 2;
    const int64_t row_bytes = static_cast<int64_t>(pa::row_elements(s->kv_dtype, D)) * pa::element_bytes(s->kv_dtype);
    const int64_t cache_row = KV * row_bytes;  // one token's bytes in the cache
    char* k_cache = static_cast<char*>(kv_cache);
    char* v_cache = k_cache + num_slots * cache_row;
    const float inv_scales[2] = {kv_scales != nullptr ? 1.f / kv_scales[0] : 1.f,
                                 kv_scales != nullptr ? 1.f / kv_scales[1] : 1.f};
    int bad = 0;
#pragma omp parallel for schedule(static) reduction(| : bad) if (s->num_tokens > 64)
    for (int t = 0; t < s->num_tokens; ++t) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        if (slot >= num_slots) {
            bad = 1;
            continue;
        }
        for (int part = 0; part < 2; ++part) {
            const char* src = static_cast<const char*>(part == 0 ? key : value) + t * row * elem;
            char* dst = (part == 0 ? k_cache : v_cache) + slot * cache_row;
            if (s->kv_dtype == s->dtype) {  // the rows as they are
                std::memcpy(dst, src, row * elem);
                continue;
            }
            float values[pa::kMaxHeadSize];  // each KV head's row converted (kv_dtype.h)
            for (int h = 0; h < KV; ++h) {
                const char* head = src + h * D * elem;
                if (s->dtype == PA_FLOAT32) {
                    std::memcpy(values, head, D * sizeof(float));
                } else {
                    for (int i = 0; i < D; ++i) values[i] = pa_kv::bf16_to_float(reinterpret_cast<const uint16_t*>(head)[i]);
                }
                pa::store_kv_row(dst + h * row_bytes, values, D, s->kv_dtype, inv_scales[part]);
            }
        }
    }
    return bad ? fail("slot_mapping holds a slot outside the cache") : 0;
}

int pa_cpu_attention(const pa_shape* s, void* out, const void* query, const void* kv_cache, const float* kv_scales,
                     const int32_t* qsl, const int32_t* seq_lens, const int32_t* block_tables, float scale,
                     int32_t window, float softcap, int32_t fixed_order) {
    if (int rc = check_shape(s)) return rc;
    if (window < 0 || !(softcap >= 0.f)) return fail("window and softcap must be >= 0 (0: none)");
    const bool fp8 = s->kv_dtype == PA_FP8_E4M3 || s->kv_dtype == PA_FP8_E5M2;
    // (the kernel reads e4m3 as 1/256 of its values, a multiply saved per eight: the scales carry it)
    const float unit = s->kv_dtype == PA_FP8_E4M3 ? 256.f : 1.f;
    const float k_scale = (fp8 && kv_scales != nullptr ? kv_scales[0] : 1.f) * unit;
    const float v_scale = (fp8 && kv_scales != nullptr ? kv_scales[1] : 1.f) * unit;
    const int row = pa::row_elements(s->kv_dtype, s->head_size);
    Problem p{s, query, kv_cache, out, qsl, seq_lens, block_tables, scale * k_scale, v_scale, window, softcap,
              s->num_heads / s->num_kv_heads, row,
              static_cast<int64_t>(s->num_blocks) * s->block_size * s->num_kv_heads * row, fixed_order != 0};
    for (int seq = 0; seq < s->num_seqs; ++seq) {
        const int q_len = qsl[seq + 1] - qsl[seq];
        if (q_len < 0 || q_len > seq_lens[seq]) return fail("a sequence has more new tokens than its seq_len");
        if ((seq_lens[seq] + s->block_size - 1) / s->block_size > s->max_blocks_per_seq)
            return fail("a seq_len needs more blocks than block_tables has columns");
    }
    int64_t partial_floats = 0;
    const int wanted_threads = threads_for(p);
    const std::vector<WorkItem> items = plan(p, wanted_threads, &partial_floats);
    if (items.empty()) return 0;  // (no sequence has a new token)
    const int threads = static_cast<int>(std::min<int64_t>(wanted_threads, static_cast<int64_t>(items.size())));
    std::vector<float> partials(static_cast<size_t>(partial_floats));
    std::vector<size_t> firsts;  // the first split of each tile that was split
    for (size_t i = 0; i < items.size(); ++i)
        if (items[i].num_splits > 1 && items[i].split == 0) firsts.push_back(i);
    // Each thread's scratch is kept between calls (a decode step makes one call per layer, and
    // allocating and zeroing it each time cost more than a small attention); one thread runs
    // without a parallel region at all. The splits are merged in the same region, after the
    // barrier that ends the items' loop; the region's own end is the merge's barrier (nowait).
    auto run = [&] {
        static thread_local Scratch scratch;
        scratch.reserve(pa::kQueryTile * s->num_heads, s->head_size, s->block_size);
#pragma omp for schedule(dynamic, 1)  // (outside a parallel region: this thread runs every item)
        for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i)
            kKernels.run_item(p, items[i], scratch, partials.data());
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t i = 0; i < static_cast<int64_t>(firsts.size()); ++i)
            kKernels.merge_splits(p, &items[firsts[i]], partials.data());
    };
    if (threads == 1) {
        run();
    } else {
#pragma omp parallel num_threads(threads)
        run();
    }
    return 0;
}

}  // extern "C"
