// The CUDA emulator's scheduler and warp primitives (see cuda_emulator.h).
#include "cuda_emulator.h"

#include <ucontext.h>

#include <cstdio>
#include <cstdlib>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define KVSERVE_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVSERVE_EMU_ASAN 1
#endif
#endif
#ifdef KVSERVE_EMU_ASAN
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom,
                                               size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old,
                                                size_t* size_old);
#endif

namespace kvserve::emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;

struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
  bool fill;
};

struct Thread {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  uint3 index;
  int linear = 0;
  bool done = false;
  const char* waiting_at = "start";
  std::vector<Copy> open;                 // cp.async since the last commit
  std::deque<std::vector<Copy>> groups;   // committed, oldest first
  void* fake_stack = nullptr;             // ASan's, while switched out
};

struct Warp {
  int arrived = 0;
  uint64_t generation = 0;
  const char* op = nullptr;
  unsigned char in[32][kSlotBytes];
  unsigned char out[32][kSlotBytes];
};

struct Block {
  dim3 grid, dim;
  uint3 index;
  std::vector<Thread> threads;
  std::vector<Warp> warps;
  int barrier_arrived = 0;
  uint64_t barrier_generation = 0;
  unsigned char* shared = nullptr;
  size_t shared_bytes = 0;
  const std::function<void()>* body = nullptr;
  ucontext_t scheduler;
  Thread* current = nullptr;
  uint64_t events = 0;  // arrivals and completions: progress
  const void* scheduler_stack = nullptr;
  size_t scheduler_stack_size = 0;
};

Block* g_block = nullptr;
CopyTiming g_copy_timing = CopyTiming::kLate;
Schedule g_schedule = Schedule::kInterleaved;
BlockOrder g_block_order = BlockOrder::kForward;

Block& block() {
  if (g_block == nullptr) fail("a device function ran outside an emulated launch");
  return *g_block;
}

Thread& current() { return *block().current; }

void finish_switch_into_thread(Thread& t) {
#ifdef KVSERVE_EMU_ASAN
  Block& b = block();
  __sanitizer_finish_switch_fiber(t.fake_stack, &b.scheduler_stack, &b.scheduler_stack_size);
#else
  (void)t;
#endif
}

/// Back to the scheduler; returns when the scheduler resumes this thread.
void yield(const char* where) {
  Thread& t = current();
  Block& b = block();
  t.waiting_at = where;
#ifdef KVSERVE_EMU_ASAN
  __sanitizer_start_switch_fiber(t.done ? nullptr : &t.fake_stack, b.scheduler_stack,
                                 b.scheduler_stack_size);
#endif
  swapcontext(&t.context, &b.scheduler);
  finish_switch_into_thread(t);
}

void run_copies(std::vector<Copy>& copies) {
  for (const Copy& c : copies) {
    if (c.fill) {
      std::memcpy(c.dst, c.src, c.bytes);
    } else {
      std::memset(c.dst, 0, c.bytes);
    }
  }
  copies.clear();
}

void thread_entry() {
  Thread& t = current();
  finish_switch_into_thread(t);
  (*block().body)();
  // Copies left in flight land before the block ends.
  for (auto& group : t.groups) run_copies(group);
  run_copies(t.open);
  t.groups.clear();
  t.done = true;
  ++block().events;
  yield("exit");
  fail("an exited thread was resumed");
}

bool in_shared(const void* ptr, size_t bytes) {
  const Block& b = block();
  const auto* p = static_cast<const unsigned char*>(ptr);
  return b.shared != nullptr && p >= b.shared && p + bytes <= b.shared + b.shared_bytes;
}

void check_shared_row(const void* ptr, const char* op) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0 || !in_shared(ptr, 16)) {
    std::string what = std::string(op) + ": a row address outside dynamic shared memory or not "
                       "16-byte aligned";
    fail(what.c_str());
  }
}

template <typename T>
float half_to_float(uint16_t bits) {
  T value;
  std::memcpy(&value, &bits, 2);
  return cuda::to_float(value);
}

}  // namespace

void set_copy_timing(CopyTiming timing) { g_copy_timing = timing; }
void set_schedule(Schedule schedule) { g_schedule = schedule; }
void set_block_order(BlockOrder order) { g_block_order = order; }

void fail(const char* what) {
  std::fprintf(stderr, "cuda emulator: %s\n", what);
  if (g_block != nullptr) {
    const Block& b = *g_block;
    std::fprintf(stderr, "  block (%u, %u, %u)\n", b.index.x, b.index.y, b.index.z);
    for (const Thread& t : b.threads) {
      std::fprintf(stderr, "  thread %d: %s\n", t.linear, t.done ? "exited" : t.waiting_at);
    }
  }
  std::abort();
}

const uint3& thread_index() { return current().index; }
const uint3& block_index() { return block().index; }
const dim3& block_dim() { return block().dim; }
const dim3& grid_dim() { return block().grid; }

void sync_threads() {
  Block& b = block();
  const uint64_t generation = b.barrier_generation;
  ++b.barrier_arrived;
  ++b.events;
  while (b.barrier_generation == generation) {
    int alive = 0;
    for (const Thread& t : b.threads) alive += t.done ? 0 : 1;
    if (b.barrier_arrived >= alive) {
      b.barrier_arrived = 0;
      ++b.barrier_generation;
      ++b.events;
      break;
    }
    yield("__syncthreads");
  }
}

void warp_collective_raw(const char* name, const void* in, size_t in_bytes, void* out,
                         size_t out_bytes,
                         const std::function<void(const unsigned char (*)[kSlotBytes],
                                                  unsigned char (*)[kSlotBytes])>& op) {
  Block& b = block();
  Thread& t = current();
  Warp& w = b.warps[t.linear / 32];
  const int lane = t.linear % 32;
  if (w.arrived == 0) {
    w.op = name;
  } else if (std::strcmp(w.op, name) != 0) {
    const std::string what = std::string("lanes of one warp at different primitives: ") + w.op +
                             " and " + name;
    fail(what.c_str());
  }
  std::memcpy(w.in[lane], in, in_bytes);
  const uint64_t generation = w.generation;
  ++w.arrived;
  ++b.events;
  while (w.generation == generation) {
    if (w.arrived == 32) {
      op(w.in, w.out);
      w.arrived = 0;
      ++w.generation;
      ++b.events;
      break;
    }
    yield(name);
  }
  std::memcpy(out, w.out[lane], out_bytes);
}

namespace {

void resume(Block& b, Thread& t, char* stack) {
  b.current = &t;
#ifdef KVSERVE_EMU_ASAN
  void* fake = nullptr;
  __sanitizer_start_switch_fiber(&fake, stack, kStackBytes);
#else
  (void)stack;
#endif
  swapcontext(&b.scheduler, &t.context);
#ifdef KVSERVE_EMU_ASAN
  __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
  b.current = nullptr;
}

// Runs the block's threads to their end in the order g_schedule asks for.
void run_block(Block& b, const std::vector<std::unique_ptr<char[]>>& stacks) {
  const int threads = static_cast<int>(b.threads.size()), warps = threads / 32;
  const auto finished = [&] {
    for (const Thread& t : b.threads) {
      if (!t.done) return false;
    }
    return true;
  };
  while (!finished()) {
    const uint64_t events = b.events;
    if (g_schedule == Schedule::kInterleaved) {
      for (Thread& t : b.threads) {
        if (!t.done) resume(b, t, stacks[t.linear].get());
      }
    } else {
      // Each warp in turn, as far as it goes (to a block barrier or its end).
      for (int k = 0; k < warps; ++k) {
        const int w = g_schedule == Schedule::kWarpsAhead ? k : warps - 1 - k;
        for (uint64_t before = ~uint64_t{0}; before != b.events;) {
          before = b.events;
          for (int l = 0; l < 32; ++l) {
            Thread& t = b.threads[32 * w + l];
            if (!t.done) resume(b, t, stacks[t.linear].get());
          }
        }
      }
    }
    if (!finished() && b.events == events) fail("deadlock");
  }
}

}  // namespace

void launch_blocks(dim3 grid, dim3 dim, size_t shared_bytes, const std::function<void()>& body) {
  const int threads = static_cast<int>(dim.x * dim.y * dim.z);
  if (threads % 32 != 0) fail("blocks of whole warps only");
  static std::vector<std::unique_ptr<char[]>> stacks;
  while (static_cast<int>(stacks.size()) < threads) {
    stacks.emplace_back(new char[kStackBytes]);
  }
  std::unique_ptr<unsigned char[]> shared(new unsigned char[shared_bytes + 16]);  // 16-aligned
  const unsigned blocks = grid.x * grid.y * grid.z;
  for (unsigned i = 0; i < blocks; ++i) {
    const unsigned linear = g_block_order == BlockOrder::kForward ? i : blocks - 1 - i;
    Block b;
    b.grid = grid;
    b.dim = dim;
    b.index = make_uint3(linear % grid.x, (linear / grid.x) % grid.y, linear / (grid.x * grid.y));
    b.shared = shared_bytes > 0 ? shared.get() : nullptr;
    b.shared_bytes = shared_bytes;
    std::memset(shared.get(), 0xFF, shared_bytes + 16);
    b.body = &body;
    b.threads.resize(threads);
    b.warps.resize(threads / 32);
    g_block = &b;
    for (int t = 0; t < threads; ++t) {
      Thread& thread = b.threads[t];
      thread.linear = t;
      thread.index = make_uint3(t % dim.x, (t / dim.x) % dim.y, t / (dim.x * dim.y));
      getcontext(&thread.context);
      thread.context.uc_stack.ss_sp = stacks[t].get();
      thread.context.uc_stack.ss_size = kStackBytes;
      thread.context.uc_link = nullptr;
      makecontext(&thread.context, thread_entry, 0);
    }
    run_block(b, stacks);
    g_block = nullptr;
  }
}

// Warp primitives of cuda_mma.cuh.

template <typename T>
void mma_m16n8k16_impl(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  struct In {
    uint32_t a[4], b[2];
    float c[4];
  };
  struct Out {
    float d[4];
  };
  In in{};
  std::memcpy(in.a, a, sizeof(in.a));
  std::memcpy(in.b, b, sizeof(in.b));
  std::memcpy(in.c, c, sizeof(in.c));
  const Out out = warp_collective<In, Out>("mma_m16n8k16", in, [](const In* ins, Out* outs) {
    float A[16][16], B[16][8], C[16][8];
    const auto low = [](uint32_t r) { return half_to_float<T>(static_cast<uint16_t>(r)); };
    const auto high = [](uint32_t r) { return half_to_float<T>(static_cast<uint16_t>(r >> 16)); };
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, k = 2 * (l % 4);
      const In& x = ins[l];
      A[g][k] = low(x.a[0]), A[g][k + 1] = high(x.a[0]);
      A[g + 8][k] = low(x.a[1]), A[g + 8][k + 1] = high(x.a[1]);
      A[g][k + 8] = low(x.a[2]), A[g][k + 9] = high(x.a[2]);
      A[g + 8][k + 8] = low(x.a[3]), A[g + 8][k + 9] = high(x.a[3]);
      B[k][g] = low(x.b[0]), B[k + 1][g] = high(x.b[0]);
      B[k + 8][g] = low(x.b[1]), B[k + 9][g] = high(x.b[1]);
      C[g][k] = x.c[0], C[g][k + 1] = x.c[1], C[g + 8][k] = x.c[2], C[g + 8][k + 1] = x.c[3];
    }
    for (int m = 0; m < 16; ++m) {
      for (int n = 0; n < 8; ++n) {
        float sum = C[m][n];
        for (int k = 0; k < 16; ++k) sum += A[m][k] * B[k][n];
        C[m][n] = sum;
      }
    }
    for (int l = 0; l < 32; ++l) {
      const int g = l / 4, k = 2 * (l % 4);
      outs[l] = Out{{C[g][k], C[g][k + 1], C[g + 8][k], C[g + 8][k + 1]}};
    }
  });
  std::memcpy(c, out.d, sizeof(out.d));
}

template <bool TRANSPOSE>
void ldmatrix_x4_impl(uint32_t (&r)[4], const void* shared_row) {
  check_shared_row(shared_row, "ldmatrix");
  struct In {
    const void* row;
  };
  struct Out {
    uint32_t r[4];
  };
  const Out out = warp_collective<In, Out>(
      TRANSPOSE ? "ldmatrix.trans" : "ldmatrix", In{shared_row}, [](const In* ins, Out* outs) {
        uint16_t tiles[4][8][8];
        for (int i = 0; i < 4; ++i) {
          for (int row = 0; row < 8; ++row) std::memcpy(tiles[i][row], ins[8 * i + row].row, 16);
        }
        for (int l = 0; l < 32; ++l) {
          const int g = l / 4, k = 2 * (l % 4);
          for (int i = 0; i < 4; ++i) {
            const uint16_t lo = TRANSPOSE ? tiles[i][k][g] : tiles[i][g][k];
            const uint16_t hi = TRANSPOSE ? tiles[i][k + 1][g] : tiles[i][g][k + 1];
            outs[l].r[i] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
          }
        }
      });
  std::memcpy(r, out.r, sizeof(out.r));
}

}  // namespace kvserve::emu

namespace kvserve::cuda {

template <>
void mma_m16n8k16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  emu::mma_m16n8k16_impl<__nv_bfloat16>(c, a, b);
}
template <>
void mma_m16n8k16<__half>(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  emu::mma_m16n8k16_impl<__half>(c, a, b);
}
template <>
void ldmatrix_x4<false>(uint32_t (&r)[4], const void* shared_row) {
  emu::ldmatrix_x4_impl<false>(r, shared_row);
}
template <>
void ldmatrix_x4<true>(uint32_t (&r)[4], const void* shared_row) {
  emu::ldmatrix_x4_impl<true>(r, shared_row);
}

static void cp_async(void* shared_dst, const void* global_src, size_t bytes, bool fill) {
  if (reinterpret_cast<uintptr_t>(global_src) % bytes != 0 ||
      reinterpret_cast<uintptr_t>(shared_dst) % bytes != 0 ||
      !emu::in_shared(shared_dst, bytes)) {
    emu::fail("cp.async: addresses must be aligned to the size, the destination in shared memory");
  }
  std::vector<emu::Copy> copy = {{shared_dst, global_src, bytes, fill}};
  if (emu::g_copy_timing == emu::CopyTiming::kEarly) {
    emu::run_copies(copy);
  } else {
    emu::current().open.push_back(copy[0]);
  }
}

void cp_async_16(void* shared_dst, const void* global_src, bool fill) {
  cp_async(shared_dst, global_src, 16, fill);
}

void cp_async_8(void* shared_dst, const void* global_src, bool fill) {
  cp_async(shared_dst, global_src, 8, fill);
}

void cp_async_4(void* shared_dst, const void* global_src, bool fill) {
  cp_async(shared_dst, global_src, 4, fill);
}

void cp_async_commit() {
  emu::Thread& t = emu::current();
  t.groups.push_back(std::move(t.open));
  t.open.clear();
}

template <int PENDING>
void cp_async_wait() {
  emu::Thread& t = emu::current();
  while (static_cast<int>(t.groups.size()) > PENDING) {
    emu::run_copies(t.groups.front());
    t.groups.pop_front();
  }
}
template void cp_async_wait<0>();
template void cp_async_wait<1>();
template void cp_async_wait<2>();

void* dynamic_shared_memory() { return emu::block().shared; }

}  // namespace kvserve::cuda

// The fast exponential the CUDA headers declare for host code without defining it (on the GPU an
// ex2.approx; here the exact one, within the kernels' tolerances).
extern "C" float __expf(float x) { return std::exp(x); }
