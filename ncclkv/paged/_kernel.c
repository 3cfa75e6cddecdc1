/* Paged KV gather/scatter on the CPU: one call moves a token span of one layer's parts (K
 * and V, or an MLA latent) between a paged cache and the contiguous wire tensor.
 *
 * Why native: torch's copy kernels pay per indexed row, and the vLLM CPU layouts cut a
 * slice into rows of head_size elements (256 B in bf16); they ran at 0.1-0.45x memcpy.
 * Here each row is one memcpy, and CPU_KT keys ([head_size, block_size] per block and
 * head) are transposed tile by tile while the tile sits in L1. Head-major layouts move K
 * and V of one (block, head) one after the other: in the vLLM CPU layouts they are adjacent,
 * so the cache is read (or written) front to back.
 *
 * The Python side (_native.py) checks every argument; this file trusts them. Sizes and
 * strides are in bytes except head_size (elements); block ids are int64. The GIL is
 * released for the copy, so several threads may gather at once, and one call may cut its
 * slice at block boundaries over up to set_threads() threads (move_slice).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>


enum { MAX_PARTS = 2 };

static int have_avx2 = 0;  /* set once at import: whether this CPU runs AVX2 */

typedef struct {
    char *cache;            /* the part's element (block 0, token 0, first head, dim 0) */
    Py_ssize_t s_block, s_token, s_head, s_dim;  /* the part's strides, bytes */
    char *wire;             /* the part's contiguous [num_tokens, num_heads, head_size] wire */
} Part;

/* What both entries are given first (SLICE_ARGS arguments): the slice's geometry and where its tokens sit. */
typedef struct {
    int gather;             /* 1: cache -> wire, 0: wire -> cache */
    Py_ssize_t elem;        /* element size, bytes */
    Py_ssize_t head_size;   /* elements per head */
    Py_ssize_t num_heads;   /* heads in the slice (the wire's dim 1) */
    const int64_t *block_ids;
    Py_ssize_t block_size;
    Py_ssize_t token_start; /* request-relative position of the wire's first token */
    Py_ssize_t num_tokens;
} Slice;

typedef struct {
    Slice s;
    int num_parts;
    Part parts[MAX_PARTS];
} Job;

static inline void move(int gather, char *cache, char *wire, size_t bytes) {
    if (gather)
        memcpy(wire, cache, bytes);
    else
        memcpy(cache, wire, bytes);
}

/* dst[j * dst_stride + i] = src[i * src_stride + j] for an n x n block of T, n = 16 / sizeof(T):
 * one SSE2 transpose of rows loaded unaligned (16 B each). */
#if defined(__SSE2__)
#include <emmintrin.h>

static inline void transpose8x8_u16(const uint16_t *src, Py_ssize_t src_stride, uint16_t *dst, Py_ssize_t dst_stride) {
    __m128i r[8], a[8], b[8];
    for (int i = 0; i < 8; i++)
        r[i] = _mm_loadu_si128((const __m128i *)(src + i * src_stride));
    for (int i = 0; i < 4; i++) {
        a[2 * i] = _mm_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
    }
    b[0] = _mm_unpacklo_epi32(a[0], a[2]);
    b[1] = _mm_unpackhi_epi32(a[0], a[2]);
    b[2] = _mm_unpacklo_epi32(a[1], a[3]);
    b[3] = _mm_unpackhi_epi32(a[1], a[3]);
    b[4] = _mm_unpacklo_epi32(a[4], a[6]);
    b[5] = _mm_unpackhi_epi32(a[4], a[6]);
    b[6] = _mm_unpacklo_epi32(a[5], a[7]);
    b[7] = _mm_unpackhi_epi32(a[5], a[7]);
    for (int i = 0; i < 4; i++) {  /* column 2i from (b[i], b[i + 4]) low halves, 2i + 1 from the high */
        _mm_storeu_si128((__m128i *)(dst + (2 * i) * dst_stride), _mm_unpacklo_epi64(b[i], b[i + 4]));
        _mm_storeu_si128((__m128i *)(dst + (2 * i + 1) * dst_stride), _mm_unpackhi_epi64(b[i], b[i + 4]));
    }
}

static inline void transpose4x4_u32(const uint32_t *src, Py_ssize_t src_stride, uint32_t *dst, Py_ssize_t dst_stride) {
    __m128i r0 = _mm_loadu_si128((const __m128i *)(src));
    __m128i r1 = _mm_loadu_si128((const __m128i *)(src + src_stride));
    __m128i r2 = _mm_loadu_si128((const __m128i *)(src + 2 * src_stride));
    __m128i r3 = _mm_loadu_si128((const __m128i *)(src + 3 * src_stride));
    __m128i a0 = _mm_unpacklo_epi32(r0, r1), a1 = _mm_unpackhi_epi32(r0, r1);
    __m128i a2 = _mm_unpacklo_epi32(r2, r3), a3 = _mm_unpackhi_epi32(r2, r3);
    _mm_storeu_si128((__m128i *)(dst), _mm_unpacklo_epi64(a0, a2));
    _mm_storeu_si128((__m128i *)(dst + dst_stride), _mm_unpackhi_epi64(a0, a2));
    _mm_storeu_si128((__m128i *)(dst + 2 * dst_stride), _mm_unpacklo_epi64(a1, a3));
    _mm_storeu_si128((__m128i *)(dst + 3 * dst_stride), _mm_unpackhi_epi64(a1, a3));
}
#define HAVE_SIMD_TRANSPOSE 1

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* 16x16 of uint16 with AVX2: the SSE2 scheme in each 128-bit lane for rows 0-7 and 8-15,
 * then the lanes exchanged. Half the instructions per byte of two 8x8 passes. */
__attribute__((target("avx2"))) static void transpose16x16_u16(const uint16_t *src, Py_ssize_t src_stride,
                                                              uint16_t *dst, Py_ssize_t dst_stride) {
    __m256i out[2][8];
    for (int half = 0; half < 2; half++) {
        __m256i r[8], a[8], b[8];
        for (int i = 0; i < 8; i++)
            r[i] = _mm256_loadu_si256((const __m256i *)(src + (8 * half + i) * src_stride));
        for (int i = 0; i < 4; i++) {
            a[2 * i] = _mm256_unpacklo_epi16(r[2 * i], r[2 * i + 1]);
            a[2 * i + 1] = _mm256_unpackhi_epi16(r[2 * i], r[2 * i + 1]);
        }
        b[0] = _mm256_unpacklo_epi32(a[0], a[2]);
        b[1] = _mm256_unpackhi_epi32(a[0], a[2]);
        b[2] = _mm256_unpacklo_epi32(a[1], a[3]);
        b[3] = _mm256_unpackhi_epi32(a[1], a[3]);
        b[4] = _mm256_unpacklo_epi32(a[4], a[6]);
        b[5] = _mm256_unpackhi_epi32(a[4], a[6]);
        b[6] = _mm256_unpacklo_epi32(a[5], a[7]);
        b[7] = _mm256_unpackhi_epi32(a[5], a[7]);
        for (int i = 0; i < 4; i++) {  /* lane 0: column 2i (2i + 1) of these rows; lane 1: column 2i + 8 (2i + 9) */
            out[half][2 * i] = _mm256_unpacklo_epi64(b[i], b[i + 4]);
            out[half][2 * i + 1] = _mm256_unpackhi_epi64(b[i], b[i + 4]);
        }
    }
    for (int k = 0; k < 8; k++) {
        _mm256_storeu_si256((__m256i *)(dst + k * dst_stride), _mm256_permute2x128_si256(out[0][k], out[1][k], 0x20));
        _mm256_storeu_si256((__m256i *)(dst + (k + 8) * dst_stride),
                            _mm256_permute2x128_si256(out[0][k], out[1][k], 0x31));
    }
}

__attribute__((target("avx2"))) static void transpose_u16_avx2(const uint16_t *s, Py_ssize_t src_stride, uint16_t *d,
                                                              Py_ssize_t dst_stride, Py_ssize_t rows, Py_ssize_t cols) {
    for (Py_ssize_t i0 = 0; i0 < rows; i0 += 16)
        for (Py_ssize_t j0 = 0; j0 < cols; j0 += 16)
            transpose16x16_u16(s + i0 * src_stride + j0, src_stride, d + j0 * dst_stride + i0, dst_stride);
}
#define HAVE_AVX2_TRANSPOSE 1
#endif
#else
#define HAVE_SIMD_TRANSPOSE 0
#endif

/* dst[j * dst_stride + i] = src[i * src_stride + j] for i < rows, j < cols (strides in elements):
 * SIMD blocks where they fit, element by element at the ragged edges. */
#define TRANSPOSE_LOOPS(T, N, BLOCK)                                                          \
    do {                                                                                      \
        const T *s = (const T *)src;                                                          \
        T *d = (T *)dst;                                                                      \
        const Py_ssize_t rows_blocked = N > 1 ? rows - rows % N : 0;                          \
        const Py_ssize_t cols_blocked = N > 1 ? cols - cols % N : 0;                          \
        /* Source rows outer: each is read front to back (measured faster than destination-major). */ \
        for (Py_ssize_t i0 = 0; i0 < rows_blocked; i0 += N)                                   \
            for (Py_ssize_t j0 = 0; j0 < cols_blocked; j0 += N)                               \
                BLOCK(s + i0 * src_stride + j0, src_stride, d + j0 * dst_stride + i0, dst_stride); \
        for (Py_ssize_t j = 0; j < cols; j++)                                                 \
            for (Py_ssize_t i = j < cols_blocked ? rows_blocked : 0; i < rows; i++)           \
                d[j * dst_stride + i] = s[i * src_stride + j];                                \
    } while (0)

#define NO_BLOCK(s, ss, d, ds) ((void)0)

static void transpose(const char *src, Py_ssize_t src_stride, char *dst, Py_ssize_t dst_stride, Py_ssize_t rows,
                      Py_ssize_t cols, Py_ssize_t elem) {
    /* The typed loops read elements as uint16/32/64 words: only where both ends are aligned to one (a CPU_AMX
     * cache or wire at an odd element offset moves element pairs from 2-byte-aligned addresses). */
    if (((uintptr_t)src | (uintptr_t)dst) % (uintptr_t)elem)
        goto bytes;
#ifdef HAVE_AVX2_TRANSPOSE
    if (elem == 2 && have_avx2 && rows % 16 == 0 && cols % 16 == 0) {
        transpose_u16_avx2((const uint16_t *)src, src_stride, (uint16_t *)dst, dst_stride, rows, cols);
        return;
    }
#endif
    switch (elem) {
#if HAVE_SIMD_TRANSPOSE
    case 2: TRANSPOSE_LOOPS(uint16_t, 8, transpose8x8_u16); return;
    case 4: TRANSPOSE_LOOPS(uint32_t, 4, transpose4x4_u32); return;
#else
    case 2: TRANSPOSE_LOOPS(uint16_t, 1, NO_BLOCK); return;
    case 4: TRANSPOSE_LOOPS(uint32_t, 1, NO_BLOCK); return;
#endif
    case 1: TRANSPOSE_LOOPS(uint8_t, 1, NO_BLOCK); return;
    case 8: TRANSPOSE_LOOPS(uint64_t, 1, NO_BLOCK); return;
    default:
        break;
    }
bytes:
    for (Py_ssize_t i = 0; i < rows; i++)
        for (Py_ssize_t j = 0; j < cols; j++)
            memcpy(dst + (j * dst_stride + i) * elem, src + (i * src_stride + j) * elem, (size_t)elem);
}

/* A transposed tile of one head: wire[t, d] (row stride w_row bytes) <-> cache[d * s_dim + t * elem]. */
static void move_tile(int gather, char *cache, char *wire, Py_ssize_t tokens, Py_ssize_t dim, Py_ssize_t s_dim,
                      Py_ssize_t w_row, Py_ssize_t elem) {
    if (gather)  /* cache rows are dims, columns tokens */
        transpose(cache, s_dim / elem, wire, w_row / elem, dim, tokens, elem);
    else
        transpose(wire, w_row / elem, cache, s_dim / elem, tokens, dim, elem);
}

/* Ask for a range's cache lines into L2 (for writing when !for_read). */
static inline void prefetch_range(const char *start, Py_ssize_t bytes, int for_read) {
    for (Py_ssize_t at = 0; at < bytes; at += 64) {
        if (for_read)
            __builtin_prefetch(start + at, 0, 2);
        else
            __builtin_prefetch(start + at, 1, 2);
    }
}

/* One head of `tokens` tokens of one part: rows, a transposed tile, or elements. */
static void move_head(const Job *job, const Part *part, char *cache, char *wire, Py_ssize_t tokens) {
    const Py_ssize_t elem = job->s.elem, dim = job->s.head_size;
    const Py_ssize_t row = dim * elem, token_row = job->s.num_heads * row;
    if (part->s_dim == elem) {                   /* head-major (CPU, FLASH_HND): a row per token */
        for (Py_ssize_t t = 0; t < tokens; t++)
            move(job->s.gather, cache + t * part->s_token, wire + t * token_row, (size_t)row);
    } else if (part->s_token == elem) {          /* token-minor keys (CPU_KT) */
        move_tile(job->s.gather, cache, wire, tokens, dim, part->s_dim, token_row, elem);
    } else {                                     /* any other strides: element by element */
        for (Py_ssize_t t = 0; t < tokens; t++)
            for (Py_ssize_t d = 0; d < dim; d++)
                move(job->s.gather, cache + t * part->s_token + d * part->s_dim, wire + t * token_row + d * elem,
                     (size_t)elem);
    }
}

/* Wire tokens [done, done + tokens), which sit in block `block_id` from `offset` on. */
static void move_segment(const Job *job, int64_t block_id, Py_ssize_t offset, Py_ssize_t done, Py_ssize_t tokens) {
    const Py_ssize_t elem = job->s.elem, heads = job->s.num_heads;
    const Py_ssize_t row = job->s.head_size * elem, token_row = heads * row;
    char *cache[MAX_PARTS], *wire[MAX_PARTS];
    int head_wise[MAX_PARTS], any_head_wise = 0;
    for (int p = 0; p < job->num_parts; p++) {
        const Part *part = &job->parts[p];
        cache[p] = part->cache + block_id * part->s_block + offset * part->s_token;
        wire[p] = part->wire + done * token_row;
        head_wise[p] = !(part->s_dim == elem && part->s_head == row);
        any_head_wise |= head_wise[p];
        if (head_wise[p])
            continue;
        /* The slice's heads are adjacent per token (NHD layouts, MLA): a run per token, or one run. */
        if (part->s_token == token_row)
            move(job->s.gather, cache[p], wire[p], (size_t)(tokens * token_row));
        else
            for (Py_ssize_t t = 0; t < tokens; t++)
                move(job->s.gather, cache[p] + t * part->s_token, wire[p] + t * token_row, (size_t)token_row);
    }
    if (!any_head_wise)
        return;
    for (Py_ssize_t h = 0; h < heads; h++) {
        for (int p = 0; p < job->num_parts; p++) {
            const Part *part = &job->parts[p];
            if (!head_wise[p])
                continue;
            if (part->s_token == elem && part->s_dim != elem && h + 1 < heads)
                /* A transpose's loads queue behind its shuffles, so misses would come one tile at a
                 * time; asking for the next head's tile now overlaps them (7 -> 10-11 GB/s here). */
                prefetch_range(cache[p] + (h + 1) * part->s_head, (job->s.head_size - 1) * part->s_dim + tokens * elem,
                               job->s.gather);
            move_head(job, part, cache[p] + h * part->s_head, wire[p] + h * row, tokens);
        }
    }
}

/* Cut wire tokens [begin, end), request positions from token_start on, at block boundaries:
 * segment(job, block id, offset in the block, wire tokens done before, tokens) for each piece. */
typedef void (*Segment)(const void *job, int64_t block_id, Py_ssize_t offset, Py_ssize_t done, Py_ssize_t tokens);

static void for_each_block(const Slice *slice, Segment segment, const void *job, Py_ssize_t begin, Py_ssize_t end) {
    const Py_ssize_t block_size = slice->block_size;
    Py_ssize_t done = begin;
    while (done < end) {
        const Py_ssize_t pos = slice->token_start + done;
        const Py_ssize_t offset = pos % block_size;
        Py_ssize_t tokens = block_size - offset;
        if (tokens > end - done)
            tokens = end - done;
        segment(job, slice->block_ids[pos / block_size], offset, done, tokens);
        done += tokens;
    }
}

/* Threads one call may use (set_threads; 1: the caller's alone). A thread is given at least
 * MIN_THREAD_BYTES: below that, handing it work costs about what it saves. */
enum { MAX_THREADS = 16, MIN_THREAD_BYTES = 256 * 1024 };
static int copy_threads = 1;

typedef struct {
    const Slice *slice;
    Segment segment;
    const void *job;
    Py_ssize_t begin, end;
} Range;

static void run_range(const Range *range) {
    for_each_block(range->slice, range->segment, range->job, range->begin, range->end);
}

/* A pool of workers kept between calls: starting a thread per call cost 50-100 us here, as much as a
 * 1 MiB copy. One call at a time uses the pool (pool_lock, taken without waiting); a call that finds it
 * taken, or gets no worker, moves its ranges on its own thread. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    Range range;
    int busy;  /* a range was handed over and is not done yet */
} Worker;

static Worker workers[MAX_THREADS];
static int num_workers = 0;
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;

static void *work_loop(void *arg) {
    Worker *worker = (Worker *)arg;
#if defined(__linux__)
    pthread_setname_np(pthread_self(), "ncclkv-copy");  /* what top, py-spy and /proc call it */
#endif
    pthread_mutex_lock(&worker->lock);
    for (;;) {
        while (!worker->busy)
            pthread_cond_wait(&worker->cond, &worker->lock);
        pthread_mutex_unlock(&worker->lock);
        run_range(&worker->range);
        pthread_mutex_lock(&worker->lock);
        worker->busy = 0;
        pthread_cond_broadcast(&worker->cond);
    }
    return NULL;
}

/* With pool_lock held: at least `wanted` workers if they can be started; how many there are. */
static int grow_pool(int wanted) {
    while (num_workers < wanted) {
        Worker *worker = &workers[num_workers];
        pthread_mutex_init(&worker->lock, NULL);
        pthread_cond_init(&worker->cond, NULL);
        worker->busy = 0;
        /* Started with every signal blocked but the faults: signals go to the process's own threads, not to
         * a copy, while a fault in a copy (a bad pointer) still reaches faulthandler: blocked, it would kill
         * the process without a word. */
        sigset_t all, before;
        sigfillset(&all);
        const int faults[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS};
        for (size_t f = 0; f < sizeof faults / sizeof faults[0]; f++)
            sigdelset(&all, faults[f]);
        pthread_sigmask(SIG_SETMASK, &all, &before);
        pthread_t id;
        const int failed = pthread_create(&id, NULL, work_loop, worker);
        pthread_sigmask(SIG_SETMASK, &before, NULL);
        if (failed)
            break;
        pthread_detach(id);
        num_workers++;
    }
    return num_workers < wanted ? num_workers : wanted;
}

/* A forked child has none of the parent's workers, and a lock a parent thread held stays held. */
static void forget_pool_after_fork(void) {
    num_workers = 0;
    pthread_mutex_init(&pool_lock, NULL);
}

/* The whole slice (`parts` wire parts of its tokens and heads) on up to `threads` threads, the caller's one
 * of them: wire token ranges cut at block boundaries, so no two threads write the same block row or wire row. */
static void move_slice(const Slice *slice, Segment segment, const void *job, int parts, int threads) {
    const Py_ssize_t total = slice->num_tokens, start = slice->token_start, block_size = slice->block_size;
    const Py_ssize_t bytes = total * slice->num_heads * slice->head_size * slice->elem * parts;
    const Py_ssize_t first_block = start / block_size;
    const Py_ssize_t blocks = total ? (start + total - 1) / block_size - first_block + 1 : 0;
    if (threads > bytes / MIN_THREAD_BYTES)
        threads = (int)(bytes / MIN_THREAD_BYTES);
    if (threads > blocks)  /* a thread gets one block at least */
        threads = (int)blocks;
    if (threads < 2 || pthread_mutex_trylock(&pool_lock) != 0) {
        for_each_block(slice, segment, job, 0, total);
        return;
    }
    threads = 1 + grow_pool(threads - 1);
    Range ranges[MAX_THREADS + 1];
    Py_ssize_t begin = 0;
    for (int i = 0; i < threads; i++) {
        Py_ssize_t end = total;
        if (i + 1 < threads) {  /* an even share of the blocks, in wire tokens; the first block may be partial */
            end = (first_block + blocks * (i + 1) / threads) * block_size - start;
            if (end < begin)
                end = begin;
        }
        ranges[i] = (Range){slice, segment, job, begin, end};
        begin = end;
    }
    for (int i = 1; i < threads; i++) {
        Worker *worker = &workers[i - 1];
        pthread_mutex_lock(&worker->lock);
        worker->range = ranges[i];
        worker->busy = 1;
        pthread_cond_broadcast(&worker->cond);
        pthread_mutex_unlock(&worker->lock);
    }
    run_range(&ranges[0]);
    for (int i = 1; i < threads; i++) {
        Worker *worker = &workers[i - 1];
        pthread_mutex_lock(&worker->lock);
        while (worker->busy)
            pthread_cond_wait(&worker->cond, &worker->lock);
        pthread_mutex_unlock(&worker->lock);
    }
    pthread_mutex_unlock(&pool_lock);
}

static void job_segment(const void *job, int64_t block_id, Py_ssize_t offset, Py_ssize_t done, Py_ssize_t tokens) {
    move_segment((const Job *)job, block_id, offset, done, tokens);
}

enum { SLICE_ARGS = 8 };

/* Every argument of entry `name` as an int into v, the slice from the first SLICE_ARGS, its geometry checked:
 * head_size and block_size at least `multiple` and multiples of it. 0 with a Python error set. */
static int read_slice(const char *name, PyObject *const *args, Py_ssize_t nargs, Py_ssize_t multiple,
                      Py_ssize_t *v, Slice *slice) {
    for (Py_ssize_t i = 0; i < nargs; i++) {
        v[i] = PyLong_AsSsize_t(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s: argument %zd must be an int", name, i);
            return 0;
        }
    }
    *slice = (Slice){
        .gather = v[0] != 0, .elem = v[1], .head_size = v[2], .num_heads = v[3],
        .block_ids = (const int64_t *)(uintptr_t)v[4], .block_size = v[5], .token_start = v[6], .num_tokens = v[7],
    };
    if (slice->elem < 1 || slice->head_size < multiple || slice->head_size % multiple || slice->num_heads < 0 ||
        slice->block_size < multiple || slice->block_size % multiple || slice->token_start < 0 ||
        slice->num_tokens < 0) {
        PyObject *what = PyUnicode_FromFormat(
            "%s: bad geometry elem=%zd head_size=%zd num_heads=%zd block_size=%zd token_start=%zd num_tokens=%zd",
            name, slice->elem, slice->head_size, slice->num_heads, slice->block_size, slice->token_start,
            slice->num_tokens);
        if (what == NULL)
            return 0;
        if (multiple > 1)
            PyErr_Format(PyExc_ValueError, "%U (head_size and block_size must be multiples of %zd)", what, multiple);
        else
            PyErr_SetObject(PyExc_ValueError, what);
        Py_DECREF(what);
        return 0;
    }
    return 1;
}

enum { PART_ARGS = 6 };

static PyObject *copy_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t v[SLICE_ARGS + MAX_PARTS * PART_ARGS];
    (void)self;
    const Py_ssize_t num_parts = (nargs - SLICE_ARGS) / PART_ARGS;
    if (nargs < SLICE_ARGS + PART_ARGS || (nargs - SLICE_ARGS) % PART_ARGS || num_parts > MAX_PARTS) {
        PyErr_Format(PyExc_TypeError, "copy_parts takes %d arguments and %d per part (1 or %d parts), got %zd",
                     (int)SLICE_ARGS, (int)PART_ARGS, (int)MAX_PARTS, nargs);
        return NULL;
    }
    Job job = {.num_parts = (int)num_parts};
    if (!read_slice("copy_parts", args, nargs, 1, v, &job.s))
        return NULL;
    for (Py_ssize_t p = 0; p < num_parts; p++) {
        const Py_ssize_t *a = v + SLICE_ARGS + p * PART_ARGS;
        job.parts[p] = (Part){
            .cache = (char *)(uintptr_t)a[0], .s_block = a[1], .s_token = a[2], .s_head = a[3], .s_dim = a[4],
            .wire = (char *)(uintptr_t)a[5],
        };
    }
    const int threads = copy_threads;  /* read with the GIL held: set_threads writes it under the GIL */
    Py_BEGIN_ALLOW_THREADS
    move_slice(&job.s, job_segment, &job, (int)num_parts, threads);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* CPU_AMX: per (block, head), K is [bs/16][D/2][16][2] and V is [D/16][bs/2][16][2] (elements).
 * A K tile of 16 tokens is a transposed [D/2][16] matrix of element pairs; a V chunk of
 * 16 dims of a token pair is a [16][2] matrix whose columns are the two tokens. */
enum { AMX_ROWS = 16, AMX_PAIR = 2 };

typedef struct {
    Slice s;
    char *keys, *values;          /* block 0's K and V halves of the slice's first head */
    Py_ssize_t s_block, s_head;   /* bytes */
    char *wire_keys, *wire_values;
} AmxJob;

#if HAVE_SIMD_TRANSPOSE
/* The 16 dims of both tokens of a pair, 2-byte elements: chunk [16 dims][2 tokens] <-> w0[16], w1[16]. */
static inline void amx_value_pair_u16(int gather, uint16_t *chunk, uint16_t *w0, uint16_t *w1) {
    for (int half = 0; half < 2; half++) {  /* dims 8 * half .. 8 * half + 7 */
        __m128i *c = (__m128i *)(chunk + 16 * half);
        if (gather) {  /* [d t0, d t1, ...] -> [t0 d, d+1 | t1 d, d+1] per 4 dims, then the halves joined */
            __m128i x0 = _mm_loadu_si128(c), x1 = _mm_loadu_si128(c + 1);
            x0 = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(x0, 0xD8), 0xD8), 0xD8);
            x1 = _mm_shuffle_epi32(_mm_shufflehi_epi16(_mm_shufflelo_epi16(x1, 0xD8), 0xD8), 0xD8);
            _mm_storeu_si128((__m128i *)(w0 + 8 * half), _mm_unpacklo_epi64(x0, x1));
            _mm_storeu_si128((__m128i *)(w1 + 8 * half), _mm_unpackhi_epi64(x0, x1));
        } else {
            __m128i a = _mm_loadu_si128((const __m128i *)(w0 + 8 * half));
            __m128i b = _mm_loadu_si128((const __m128i *)(w1 + 8 * half));
            _mm_storeu_si128(c, _mm_unpacklo_epi16(a, b));
            _mm_storeu_si128(c + 1, _mm_unpackhi_epi16(a, b));
        }
    }
}
#endif

static void amx_segment(const void *amx_job, int64_t block_id, Py_ssize_t offset, Py_ssize_t done, Py_ssize_t tokens) {
    const AmxJob *job = (const AmxJob *)amx_job;
    const Py_ssize_t elem = job->s.elem, dim = job->s.head_size, pair = AMX_PAIR * elem;
    const Py_ssize_t token_row = job->s.num_heads * dim * elem;  /* wire bytes per token */
    const Py_ssize_t k_tile = dim * AMX_ROWS * elem;           /* bytes per 16-token key tile */
    const Py_ssize_t v_group = job->s.block_size * AMX_ROWS * elem;  /* bytes per 16-dim value group */
    for (Py_ssize_t h = 0; h < job->s.num_heads; h++) {
        char *keys = job->keys + block_id * job->s_block + h * job->s_head;
        char *values = job->values + block_id * job->s_block + h * job->s_head;
        char *wire_keys = job->wire_keys + done * token_row + h * dim * elem;
        char *wire_values = job->wire_values + done * token_row + h * dim * elem;
        for (Py_ssize_t t = offset; t < offset + tokens;) {  /* keys: one transpose per tile (or part of one) */
            const Py_ssize_t row = t % AMX_ROWS, run = AMX_ROWS - row < offset + tokens - t ? AMX_ROWS - row
                                                                                           : offset + tokens - t;
            char *tile = keys + (t / AMX_ROWS) * k_tile + row * pair;
            move_tile(job->s.gather, tile, wire_keys + (t - offset) * token_row, run, dim / AMX_PAIR, AMX_ROWS * pair,
                      token_row, pair);
            t += run;
        }
        for (Py_ssize_t t = offset; t < offset + tokens;) {  /* values: 16 dims at a time, every other element */
            char *chunk = values + ((t / AMX_PAIR) * AMX_ROWS * AMX_PAIR + t % AMX_PAIR) * elem;
            char *wired = wire_values + (t - offset) * token_row;
#if HAVE_SIMD_TRANSPOSE
            if (elem == 2 && t % AMX_PAIR == 0 && t + 1 < offset + tokens) {  /* both tokens of the pair at once */
                for (Py_ssize_t group = 0; group < dim / AMX_ROWS; group++)
                    amx_value_pair_u16(job->s.gather, (uint16_t *)(chunk + group * v_group),
                                       (uint16_t *)(wired + group * AMX_ROWS * elem),
                                       (uint16_t *)(wired + token_row + group * AMX_ROWS * elem));
                t += AMX_PAIR;
                continue;
            }
#endif
            for (Py_ssize_t group = 0; group < dim / AMX_ROWS; group++)
                move_tile(job->s.gather, chunk + group * v_group, wired + group * AMX_ROWS * elem, 1, AMX_ROWS, pair,
                          token_row, elem);
            t++;
        }
    }
}

static PyObject *copy_amx(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    enum { NARGS = SLICE_ARGS + 6 };
    Py_ssize_t v[NARGS];
    (void)self;
    if (nargs != NARGS) {
        PyErr_Format(PyExc_TypeError, "copy_amx takes %d arguments, got %zd", (int)NARGS, nargs);
        return NULL;
    }
    AmxJob job;
    if (!read_slice("copy_amx", args, nargs, AMX_ROWS, v, &job.s))
        return NULL;
    job.keys = (char *)(uintptr_t)v[SLICE_ARGS];
    job.values = (char *)(uintptr_t)v[SLICE_ARGS + 1];
    job.s_block = v[SLICE_ARGS + 2];
    job.s_head = v[SLICE_ARGS + 3];
    job.wire_keys = (char *)(uintptr_t)v[SLICE_ARGS + 4];
    job.wire_values = (char *)(uintptr_t)v[SLICE_ARGS + 5];
    const int threads = copy_threads;
    Py_BEGIN_ALLOW_THREADS
    move_slice(&job.s, amx_segment, &job, 2, threads);  /* K and V */
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *isa(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return PyUnicode_FromString(have_avx2 ? "avx2" : HAVE_SIMD_TRANSPOSE ? "sse2" : "scalar");
}

static PyObject *set_threads(PyObject *self, PyObject *arg) {
    (void)self;
    const long threads = PyLong_AsLong(arg);
    if (threads == -1 && PyErr_Occurred())
        return NULL;
    if (threads < 1 || threads > MAX_THREADS) {
        PyErr_Format(PyExc_ValueError, "set_threads: threads must be 1..%d, got %ld", (int)MAX_THREADS, threads);
        return NULL;
    }
    const int before = copy_threads;
    copy_threads = (int)threads;
    return PyLong_FromLong(before);
}

static PyObject *pool_workers(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    pthread_mutex_lock(&pool_lock);  /* a copy in flight may be growing it */
    const int workers = num_workers;
    pthread_mutex_unlock(&pool_lock);
    return PyLong_FromLong(workers);
}

static PyMethodDef methods[] = {
    {"pool_workers", pool_workers, METH_NOARGS,
     "pool_workers() -> the worker threads started so far in this process (threaded copies hand them ranges)."},
    {"set_threads", set_threads, METH_O,
     "set_threads(n) -> the previous n: threads one copy_parts / copy_amx call may use (1..16; a thread gets at least "
     "256 KiB of the slice)."},
    {"isa", isa, METH_NOARGS, "isa() -> 'avx2', 'sse2' or 'scalar': what the CPU_KT key transposes run on here."},
    {"copy_parts", (PyCFunction)(void (*)(void))copy_parts, METH_FASTCALL,
     "copy_parts(gather, elem, head_size, num_heads, block_ids_ptr, block_size, token_start, num_tokens, "
     "*[cache_ptr, s_block, s_token, s_head, s_dim, wire_ptr] per part): move a token span of one layer."},
    {"copy_amx", (PyCFunction)(void (*)(void))copy_amx, METH_FASTCALL,
     "copy_amx(gather, elem, head_size, num_heads, block_ids_ptr, block_size, token_start, num_tokens, keys_ptr, "
     "values_ptr, s_block, s_head, wire_keys_ptr, wire_values_ptr): move a token span of one CPU_AMX layer."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_kernel",
    .m_doc = "Native CPU gather/scatter for paged KV caches.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__kernel(void) {
#if defined(HAVE_AVX2_TRANSPOSE)
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2");
#endif
    if (pthread_atfork(NULL, NULL, forget_pool_after_fork) != 0) {
        PyErr_SetString(PyExc_OSError, "_kernel: pthread_atfork failed");
        return NULL;
    }
    return PyModule_Create(&module);
}
