// cuda_on_cpu.cpp: the launcher of cuda_on_cpu.h (see its comment for the model), compiled once
// and linked into every kernel's executable: the fibers and their barriers, the param buffers
// against guard pages, the fault handler, and main()'s work (`run`).
#include <csignal>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include <unistd.h>
#include <vector>

#include "cuda_on_cpu.h"

uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

// save the callee-saved registers on this stack, store its pointer in *from, switch to `to`
extern "C" void qatc_cpu_switch(void** from, void* to);
#if defined(__x86_64__)
__asm__(
    ".text\n"
    ".globl qatc_cpu_switch\n"
    ".type qatc_cpu_switch,@function\n"
    "qatc_cpu_switch:\n"
    "    pushq %rbp\n"
    "    pushq %rbx\n"
    "    pushq %r12\n"
    "    pushq %r13\n"
    "    pushq %r14\n"
    "    pushq %r15\n"
    "    movq %rsp, (%rdi)\n"
    "    movq %rsi, %rsp\n"
    "    popq %r15\n"
    "    popq %r14\n"
    "    popq %r13\n"
    "    popq %r12\n"
    "    popq %rbx\n"
    "    popq %rbp\n"
    "    ret\n"
    ".size qatc_cpu_switch,.-qatc_cpu_switch\n");
#elif defined(__aarch64__)
__asm__(
    ".text\n"
    ".globl qatc_cpu_switch\n"
    ".type qatc_cpu_switch,%function\n"
    "qatc_cpu_switch:\n"
    "    sub sp, sp, #176\n"
    "    stp x19, x20, [sp, #0]\n"
    "    stp x21, x22, [sp, #16]\n"
    "    stp x23, x24, [sp, #32]\n"
    "    stp x25, x26, [sp, #48]\n"
    "    stp x27, x28, [sp, #64]\n"
    "    stp x29, x30, [sp, #80]\n"
    "    stp d8, d9, [sp, #96]\n"
    "    stp d10, d11, [sp, #112]\n"
    "    stp d12, d13, [sp, #128]\n"
    "    stp d14, d15, [sp, #144]\n"
    "    mov x9, sp\n"
    "    str x9, [x0]\n"
    "    mov sp, x1\n"
    "    ldp x19, x20, [sp, #0]\n"
    "    ldp x21, x22, [sp, #16]\n"
    "    ldp x23, x24, [sp, #32]\n"
    "    ldp x25, x26, [sp, #48]\n"
    "    ldp x27, x28, [sp, #64]\n"
    "    ldp x29, x30, [sp, #80]\n"
    "    ldp d8, d9, [sp, #96]\n"
    "    ldp d10, d11, [sp, #112]\n"
    "    ldp d12, d13, [sp, #128]\n"
    "    ldp d14, d15, [sp, #144]\n"
    "    add sp, sp, #176\n"
    "    ret\n"
    ".size qatc_cpu_switch,.-qatc_cpu_switch\n");
#else
#error "cuda_on_cpu.h: no fiber switch for this architecture (x86_64 and aarch64 only)"
#endif

namespace qatc_cpu {

void fail(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::fflush(stdout);
    std::fprintf(stderr, "cuda_on_cpu: ");
    std::vfprintf(stderr, fmt, ap);
    std::fprintf(stderr, " (block (%u, %u, %u), thread (%u, %u, %u))\n", blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, threadIdx.y,
                 threadIdx.z);
    va_end(ap);
    std::fflush(stderr);
    std::_Exit(code);
}

namespace {

struct Fiber {
    void* sp;
    State state;
    unsigned char parity;  // which of the warp's two exchange buffers the next shuffle uses
    unsigned mma_seq;      // how many mma.sync this thread has issued in this block
};

// One lane's operands of one mma.sync, as it handed them in.
struct MmaSlot {
    unsigned seq;   // the lane's mma count at it (0: none yet in this block)
    unsigned type;  // MmaType
    unsigned a[4], b[2];
    float c[4];
};

// A warp's mma.sync rendezvous: two sets of slots, alternating by the count's parity (as the
// shuffles' exchange buffers: a lane ahead cannot overwrite operands a slower one has not read),
// and the product D of each, computed once by the first lane to read it.
struct MmaWarp {
    MmaSlot lane[2][32];
    float d[2][16][8];
    unsigned d_seq[2];
};

struct Sched {
    bool fibers = false;  // this launch runs its threads as fibers
    unsigned n = 0;       // threads per block
    std::vector<Fiber> f;
    std::vector<char*> stack_top;
    void* sched_sp = nullptr;
    unsigned cur = 0;
    void (*body)(void**) = nullptr;
    void** ptrs = nullptr;
    std::vector<uint64_t> exch;  // [warp][2][32]
    std::vector<MmaWarp> mma;    // [warp]
    unsigned long long mma_ops = 0;  // warp-wide mma.sync emulated, both runs
};
Sched S;

void set_thread(unsigned i) {
    threadIdx.x = i % blockDim.x;
    threadIdx.y = i / blockDim.x % blockDim.y;
    threadIdx.z = i / (blockDim.x * blockDim.y);
}

[[noreturn]] void fiber_entry() {
    S.body(S.ptrs);
    Fiber& me = S.f[S.cur];
    me.state = DONE;
    qatc_cpu_switch(&me.sp, S.sched_sp);
    __builtin_unreachable();
}

// A fresh frame at the top of fiber i's stack whose "return" enters fiber_entry.
void init_fiber(unsigned i) {
    void** sp = (void**)((uintptr_t)S.stack_top[i] & ~(uintptr_t)15);
#if defined(__x86_64__)
    *--sp = nullptr;                    // fiber_entry's own return address: never used
    *--sp = (void*)&fiber_entry;        // popped by `ret`: a 16-byte aligned slot
    for (int r = 0; r < 6; ++r) *--sp = nullptr;  // rbp rbx r12-r15
#else
    sp -= 22;  // 176 bytes: x19-x28, x29, x30 (the return address), d8-d15
    std::memset(sp, 0, 176);
    sp[11] = (void*)&fiber_entry;
#endif
    S.f[i].sp = sp;
    S.f[i].state = READY;
    S.f[i].parity = 0;
    S.f[i].mma_seq = 0;
}

// Stacks for `n` fibers, each with a guard page below it.
void make_stacks(unsigned n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), size = 256 << 10;
    char* base = (char*)mmap(nullptr, n * (size + page), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) fail(2, "no memory for %u fiber stacks", n);
    S.f.assign(n, Fiber{});
    S.stack_top.resize(n);
    for (unsigned i = 0; i < n; ++i) {
        char* lo = base + i * (size + page);
        mprotect(lo, page, PROT_NONE);
        S.stack_top[i] = lo + page + size;
    }
    S.exch.assign(((n + 31) / 32) * 64, 0);
    S.mma.assign((n + 31) / 32, MmaWarp{});
}

const char* state_name(State s) {
    switch (s) {
        case READY: return "ready";
        case AT_BLOCK: return "__syncthreads";
        case AT_WARP: return "a warp barrier or shuffle";
        default: return "returned";
    }
}

// Runs the current block (blockIdx set) to completion, threads in ascending or descending order.
// Warps in turn, each as far as it can go (its warp barriers released as soon as all its live
// lanes reach one) before the next starts: the schedule that lets one warp run furthest ahead of
// the others, so a read of what another warp writes with no block barrier between them sees the
// old value in one order or the other.
void run_block(bool reverse) {
    const unsigned n = S.n, warps = (n + 31) / 32;
    if (!S.fibers) {
        for (unsigned k = 0; k < n; ++k) {
            set_thread(reverse ? n - 1 - k : k);
            S.body(S.ptrs);
        }
        return;
    }
    for (unsigned i = 0; i < n; ++i) init_fiber(i);
    // no operands of the previous block's mma.sync can pass for this block's
    for (MmaWarp& w : S.mma) w = MmaWarp{};
    for (;;) {
        for (unsigned kw = 0; kw < warps; ++kw) {
            const unsigned w = reverse ? warps - 1 - kw : kw, lo = w * 32, hi = lo + 32 < n ? lo + 32 : n;
            for (;;) {
                for (unsigned k = lo; k < hi; ++k) {
                    const unsigned i = reverse ? hi - 1 - (k - lo) : k;
                    if (S.f[i].state != READY) continue;
                    S.cur = i;
                    set_thread(i);
                    qatc_cpu_switch(&S.sched_sp, S.f[i].sp);
                }
                bool live = false, all = true;
                for (unsigned i = lo; i < hi; ++i) {
                    if (S.f[i].state == DONE) continue;
                    live = true;
                    all &= S.f[i].state == AT_WARP;
                }
                if (!live || !all) break;
                for (unsigned i = lo; i < hi; ++i)
                    if (S.f[i].state == AT_WARP) S.f[i].state = READY;
            }
        }
        // every warp is done or waits at the block barrier (or is stuck)
        bool done = true, all = true;
        for (unsigned i = 0; i < n; ++i) {
            done &= S.f[i].state == DONE;
            all &= S.f[i].state == DONE || S.f[i].state == AT_BLOCK;
        }
        if (done) return;
        if (all) {
            for (unsigned i = 0; i < n; ++i)
                if (S.f[i].state == AT_BLOCK) S.f[i].state = READY;
            continue;
        }
        // deadlock: say where each warp's threads wait
        for (unsigned i = 0; i < n; ++i) {
            if (i % 32 == 0 || S.f[i].state != S.f[i - 1].state)
                std::fprintf(stderr, "  thread %u (warp %u): %s\n", i, i / 32, state_name(S.f[i].state));
        }
        threadIdx = uint3{0, 0, 0};
        fail(3, "deadlock: the block's threads wait at different barriers");
    }
}

struct Buf {
    unsigned char* p;
    size_t n;
    bool written;
};
std::vector<Buf> bufs;

// The bytes between a buffer's end and the guard page (0-3 of them) hold this: a write there is
// caught when the launch ends (a read there is not).
constexpr unsigned char CANARY = 0xa5;

// `n` bytes starting 4-byte aligned (enough for every scalar a kernel reads and for `store_i4`'s
// words; cudaMalloc gives 256, which no generated kernel relies on) and ending 0-3 bytes before a
// PROT_NONE page, with another PROT_NONE page below the page they start in.
unsigned char* guarded(size_t n) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE), data = (n + 4 + page - 1) / page * page, span = data + 2 * page;
    char* base = (char*)mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) fail(2, "no memory for a buffer of %zu bytes", n);
    mprotect(base, page, PROT_NONE);
    char* end = base + page + data;
    mprotect(end, page, PROT_NONE);
    unsigned char* start = (unsigned char*)((uintptr_t)(end - n) & ~(uintptr_t)3);
    std::memset(start + n, CANARY, (size_t)((unsigned char*)end - (start + n)));
    return start;
}

// Every buffer's bytes past its end are still the canary.
void check_canaries() {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    for (size_t s = 0; s < bufs.size(); ++s) {
        const unsigned char* end = bufs[s].p + bufs[s].n;
        for (const unsigned char* q = end; (uintptr_t)q % page != 0; ++q) {
            if (*q != CANARY) {
                threadIdx = uint3{0, 0, 0};
                blockIdx = uint3{0, 0, 0};
                fail(7, "a write %zu bytes past the end of buffer %zu (%zu bytes)", (size_t)(q - end), s, bufs[s].n);
            }
        }
    }
}

void on_fault(int sig, siginfo_t* info, void*) {
    const uintptr_t a = (uintptr_t)info->si_addr;
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    char msg[256] = "not near a param buffer (a fiber's stack overflowed, or a wild pointer)";
    for (size_t s = 0; s < bufs.size(); ++s) {
        const uintptr_t lo = (uintptr_t)bufs[s].p, hi = lo + bufs[s].n;
        if (a >= hi && a < hi + page + 16)
            std::snprintf(msg, sizeof msg, "%zu bytes past the end of buffer %zu (%zu bytes)", (size_t)(a - hi), s, bufs[s].n);
        else if (a < lo && a + 2 * page >= lo)
            std::snprintf(msg, sizeof msg, "%zu bytes before the start of buffer %zu (%zu bytes)", (size_t)(lo - a), s, bufs[s].n);
    }
    fail(7, "signal %d: an access at %p, %s", sig, info->si_addr, msg);
}

void install_fault_handler() {
    static char alt[1 << 16];
    stack_t ss{};
    ss.ss_sp = alt;
    ss.ss_size = sizeof alt;
    sigaltstack(&ss, nullptr);
    struct sigaction sa {};
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
}

std::vector<unsigned> numbers(const char* s) {
    std::vector<unsigned> out;
    while (*s) {
        char* end;
        out.push_back((unsigned)std::strtoul(s, &end, 10));
        if (end == s) fail(2, "bad number list: %s", s);
        s = *end == ',' ? end + 1 : end;
    }
    return out;
}

void run_grid(bool reverse) {
    const unsigned nb = gridDim.x * gridDim.y * gridDim.z;
    for (unsigned k = 0; k < nb; ++k) {
        const unsigned b = reverse ? nb - 1 - k : k;
        blockIdx = uint3{b % gridDim.x, b / gridDim.x % gridDim.y, b / (gridDim.x * gridDim.y)};
        run_block(reverse);
    }
}

}  // namespace

// The calling thread waits at a barrier of kind `s`.
void wait(State s) {
    if (!S.fibers) fail(6, "a barrier or warp shuffle in a kernel run without fibers (the harness's scan of its source missed it)");
    Fiber& me = S.f[S.cur];
    me.state = s;
    __asm__ __volatile__("" ::: "memory");
    qatc_cpu_switch(&me.sp, S.sched_sp);
    __asm__ __volatile__("" ::: "memory");
}

unsigned lane_id() { return S.cur % 32; }

uint64_t exchange(uint64_t bits, unsigned src) {
    const unsigned me = S.cur, lane = me % 32, warp = me / 32;
    uint64_t* buf = &S.exch[(warp * 2 + S.f[me].parity) * 32];
    buf[lane] = bits;
    wait(AT_WARP);
    S.f[me].parity ^= 1;
    return buf[src % 32];
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 ----
//
// The fragment layouts, written from NVIDIA's PTX ISA, section 9.7.14.5.8 (9.7.15.5.8 in later
// releases) "Matrix Fragments for mma.m16n8k16 with floating point type"
// (https://docs.nvidia.com/cuda/parallel-thread-execution/#warp-level-matrix-fragment-mma-16816-float),
// not from the header that uses them, so that running the header here checks it. With
// groupID = %laneid >> 2 and threadID_in_group = %laneid % 4:
//   A (16 x 16, .f16/.bf16): elements a0..a7, two to each of the four .f16x2 registers, low half
//     first (register r holds a(2r), a(2r+1));
//     row = groupID for ai where 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise;
//     col = threadID_in_group * 2 + (i & 1) for i < 4, threadID_in_group * 2 + (i & 1) + 8 for i >= 4.
//   B (16 x 8, .f16/.bf16): elements b0..b3, two to each of the two registers, low half first;
//     row = threadID_in_group * 2 + (i & 1) for i < 2, threadID_in_group * 2 + (i & 1) + 8 for i >= 2;
//     col = groupID.
//   C, D (16 x 8, .f32): elements c0..c3, one register each;
//     row = groupID for i < 2, groupID + 8 for i >= 2; col = threadID_in_group * 2 + (i & 1).
// D = A B + C. Each product of two 16-bit values is exact in fp32; the 16 are added to C in
// order of k, in fp32 (the tensor core's own order and internal precision are not specified: the
// test's tolerance covers a different fixed order).

namespace {

void a_at(unsigned lane, unsigned i, unsigned& row, unsigned& col) {
    const unsigned group = lane >> 2, tig = lane % 4;
    row = (i < 2 || (4 <= i && i < 6)) ? group : group + 8;
    col = tig * 2 + (i & 1) + (i >= 4 ? 8 : 0);
}

void b_at(unsigned lane, unsigned i, unsigned& row, unsigned& col) {
    const unsigned group = lane >> 2, tig = lane % 4;
    row = tig * 2 + (i & 1) + (i >= 2 ? 8 : 0);
    col = group;
}

void c_at(unsigned lane, unsigned i, unsigned& row, unsigned& col) {
    const unsigned group = lane >> 2, tig = lane % 4;
    row = i < 2 ? group : group + 8;
    col = tig * 2 + (i & 1);
}

// Element i of a fragment whose registers hold two 16-bit values each, low half first, widened
// exactly.
float element16(MmaType type, const unsigned* regs, unsigned i) {
    const unsigned short bits = (unsigned short)(regs[i / 2] >> (16 * (i & 1)));
    return type == MMA_BF16 ? std::bit_cast<float>((unsigned)bits << 16) : (float)std::bit_cast<_Float16>(bits);
}

// The layouts above give each element of A, B and C to exactly one (lane, element): checked once,
// so that a slip in them is not mistaken for a bug in the kernel.
void check_layouts() {
    unsigned char a[16][16] = {}, b[16][8] = {}, c[16][8] = {};
    for (unsigned lane = 0; lane < 32; ++lane) {
        unsigned r, k;
        for (unsigned i = 0; i < 8; ++i) a_at(lane, i, r, k), ++a[r][k];
        for (unsigned i = 0; i < 4; ++i) b_at(lane, i, r, k), ++b[r][k];
        for (unsigned i = 0; i < 4; ++i) c_at(lane, i, r, k), ++c[r][k];
    }
    for (unsigned r = 0; r < 16; ++r) {
        for (unsigned k = 0; k < 16; ++k)
            if (a[r][k] != 1) fail(8, "the shim's mma fragment layout of A covers (%u, %u) %u times", r, k, a[r][k]);
        for (unsigned n = 0; n < 8; ++n)
            if (b[r][n] != 1 || c[r][n] != 1) fail(8, "the shim's mma fragment layout of B or C covers (%u, %u) twice or never", r, n);
    }
}

// D = A B + C from the 32 lanes' slots.
void mma_product(MmaType type, const MmaSlot* slots, float d[16][8]) {
    float a[16][16], b[16][8];
    for (unsigned lane = 0; lane < 32; ++lane) {
        unsigned r, k;
        for (unsigned i = 0; i < 8; ++i) a_at(lane, i, r, k), a[r][k] = element16(type, slots[lane].a, i);
        for (unsigned i = 0; i < 4; ++i) b_at(lane, i, r, k), b[r][k] = element16(type, slots[lane].b, i);
        for (unsigned i = 0; i < 4; ++i) c_at(lane, i, r, k), d[r][k] = slots[lane].c[i];
    }
    for (unsigned m = 0; m < 16; ++m)
        for (unsigned n = 0; n < 8; ++n) {
            float acc = d[m][n];
            for (unsigned k = 0; k < 16; ++k) acc += a[m][k] * b[k][n];
            d[m][n] = acc;
        }
}

}  // namespace

void mma_m16n8k16(MmaType type, float c[4], const unsigned a[4], const unsigned b[2]) {
    static const bool layouts = (check_layouts(), true);
    (void)layouts;
    const unsigned me = S.cur, lane = me % 32, warp = me / 32;
    Fiber& f = S.f[me];
    const unsigned seq = ++f.mma_seq, p = seq & 1;
    MmaWarp& w = S.mma[warp];
    MmaSlot& mine = w.lane[p][lane];
    mine.seq = seq;
    mine.type = type;
    std::memcpy(mine.a, a, sizeof mine.a);
    std::memcpy(mine.b, b, sizeof mine.b);
    std::memcpy(mine.c, c, sizeof mine.c);
    // released once every live lane of the warp waits at a warp barrier: this mma, if the warp
    // is converged. (Lanes are matched by their mma count, not the instruction's address: a lane
    // that reaches its count-th mma by another path is taken as converged.)
    wait(AT_WARP);
    const unsigned lanes = S.n - warp * 32 < 32 ? S.n - warp * 32 : 32;
    if (lanes < 32) fail(8, "mma.sync.aligned in a warp of %u threads: all 32 lanes must execute it", lanes);
    for (unsigned l = 0; l < 32; ++l) {
        const MmaSlot& o = w.lane[p][l];
        if (o.seq != seq) {
            const bool gone = S.f[warp * 32 + l].state == DONE;
            fail(8, "mma.sync.aligned (this thread's mma number %u) without lane %u of the warp, which %s: .aligned needs all 32 lanes "
                    "at the same mma",
                 seq, l, gone ? "has returned" : "is elsewhere (another barrier, shuffle or mma: the warp diverged)");
        }
        if (o.type != type) fail(8, "mma.sync.aligned: lane %u multiplies %s, this thread %s", l, o.type == MMA_BF16 ? "bf16" : "f16",
                                 type == MMA_BF16 ? "bf16" : "f16");
    }
    if (w.d_seq[p] != seq) {
        mma_product(type, w.lane[p], w.d[p]);
        w.d_seq[p] = seq;
        ++S.mma_ops;
    }
    for (unsigned i = 0; i < 4; ++i) {
        unsigned r, k;
        c_at(lane, i, r, k);
        c[i] = w.d[p][r][k];
    }
}

// argv: DIR SLOTS GRID BLOCK MODE. DIR/in{s}.bin are the buffers' bytes (s a slot); SLOTS gives
// each param's slot ("0,1,0": params 0 and 2 are one buffer); GRID "x,y,z", BLOCK "x,y,z"; MODE
// "fibers" or "direct". Writes DIR/out{s}.bin for each slot a non-const param points at.
int run(int argc, char** argv, size_t np, const bool* written, void (*body)(void**)) {
    if (argc != 6) fail(2, "usage: %s DIR SLOTS GRID BLOCK fibers|direct", argv[0]);
    const std::vector<unsigned> slot = numbers(argv[2]), grid = numbers(argv[3]), block = numbers(argv[4]);
    if (slot.size() != np || grid.size() != 3 || block.size() != 3) fail(2, "%zu params, %zu slots given", np, slot.size());
    unsigned nslots = 0;
    for (unsigned s : slot) nslots = s + 1 > nslots ? s + 1 : nslots;
    bufs.assign(nslots, Buf{nullptr, 0, false});
    std::vector<std::vector<unsigned char>> initial(nslots);
    for (unsigned s = 0; s < nslots; ++s) {
        char path[4096];
        std::snprintf(path, sizeof path, "%s/in%u.bin", argv[1], s);
        FILE* f = std::fopen(path, "rb");
        if (!f) fail(2, "cannot open %s", path);
        std::fseek(f, 0, SEEK_END);
        const long n = std::ftell(f);
        std::fseek(f, 0, SEEK_SET);
        initial[s].resize((size_t)n);
        if (n > 0 && std::fread(initial[s].data(), 1, (size_t)n, f) != (size_t)n) fail(2, "cannot read %s", path);
        std::fclose(f);
        bufs[s] = Buf{guarded((size_t)n), (size_t)n, false};
    }
    for (size_t i = 0; i < np; ++i) bufs[slot[i]].written |= written[i];
    std::vector<void*> ptrs(np + 1);
    for (size_t i = 0; i < np; ++i) ptrs[i] = bufs[slot[i]].p;
    gridDim = dim3{grid[0], grid[1], grid[2]};
    blockDim = dim3{block[0], block[1], block[2]};
    S.n = block[0] * block[1] * block[2];
    S.fibers = std::strcmp(argv[5], "fibers") == 0;
    if (S.fibers) make_stacks(S.n);
    S.body = body;
    S.ptrs = ptrs.data();
    install_fault_handler();

    std::vector<std::vector<unsigned char>> first(nslots);
    for (int pass = 0; pass < 2; ++pass) {
        for (unsigned s = 0; s < nslots; ++s)
            if (bufs[s].n) std::memcpy(bufs[s].p, initial[s].data(), bufs[s].n);
        run_grid(pass == 1);
        check_canaries();
        for (unsigned s = 0; s < nslots; ++s) {
            if (!bufs[s].written) continue;
            if (pass == 0) {
                first[s].assign(bufs[s].p, bufs[s].p + bufs[s].n);
                continue;
            }
            for (size_t b = 0; b < bufs[s].n; ++b) {
                if (first[s][b] != bufs[s].p[b]) {
                    std::fprintf(stderr,
                                 "cuda_on_cpu: the result depends on the order the threads run in (a race: threads that "
                                 "communicate without a barrier): buffer %u byte %zu is 0x%02x with threads and blocks in "
                                 "ascending order, 0x%02x in descending order\n",
                                 s, b, first[s][b], bufs[s].p[b]);
                    return 4;
                }
            }
        }
    }
    // the harness reads this to know the tensor-core path ran (not an sm_80-less fallback)
    if (S.mma_ops) std::fprintf(stderr, "cuda_on_cpu: %llu warp-wide mma.sync emulated (both runs)\n", S.mma_ops);
    for (unsigned s = 0; s < nslots; ++s) {
        if (!bufs[s].written) continue;
        char path[4096];
        std::snprintf(path, sizeof path, "%s/out%u.bin", argv[1], s);
        FILE* f = std::fopen(path, "wb");
        if (!f || (bufs[s].n && std::fwrite(first[s].data(), 1, bufs[s].n, f) != bufs[s].n)) fail(2, "cannot write %s", path);
        std::fclose(f);
    }
    return 0;
}

}  // namespace qatc_cpu
