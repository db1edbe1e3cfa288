#pragma once
// A host emulator of the CUDA execution model, for testing kernel bodies (*_kernel.cuh) on a
// machine without a GPU: every thread of a block is a coroutine on one OS thread, run until it
// reaches a point that needs other threads (__syncthreads, a warp shuffle, ldmatrix, mma), which
// completes when all of them have arrived; the threads take turns step by step, or each warp
// runs as far as it can before the next (set_schedule). The warp-wide primitives follow PTX's
// definitions: mma.m16n8k16 computes in fp32 from the fragments' bf16 / fp16 entries, ldmatrix
// checks that its rows are 16-byte aligned and inside the block's shared memory, and cp.async
// copies land at the latest allowed moment (cp_async_wait) or at once (set_copy_timing), the
// two extremes of the hardware's freedom, so a read that misses its wait or its barrier, or a
// copy into a stage that other warps still read, changes what the kernel computes. Dynamic
// shared memory starts as 0xFF bytes (NaN), so reading what nothing wrote shows. A deadlock (a
// barrier some thread never reaches, lanes of a warp at different primitives) aborts with where
// each thread waits. Include this before any kernel body.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <functional>

#define KVSERVE_CUDA_EMULATOR 1
#include "kernels/cuda_mma.cuh"

namespace kvserve::emu {

const uint3& thread_index();
const uint3& block_index();
const dim3& block_dim();
const dim3& grid_dim();
void sync_threads();
[[noreturn]] void fail(const char* what);

/// When cp.async copies land: as late as the program allows (at the issuing thread's
/// cp_async_wait, so a read that misses its wait or barrier sees stale bytes), or at once (so a
/// copy into a buffer that other warps still read, missing a barrier, overwrites it under them).
enum class CopyTiming { kLate, kEarly };
void set_copy_timing(CopyTiming timing);

/// The order the threads of a block run in: one step each in turn (the warps move together), or
/// each warp as far as it goes before the next, lowest first or highest first (one warp runs
/// ahead of the others, so a missing barrier between warps shows).
enum class Schedule { kInterleaved, kWarpsAhead, kWarpsAheadReversed };
void set_schedule(Schedule schedule);

/// The order the blocks of a grid run in (one after another): by index, or from the last (so a
/// kernel whose blocks meet through global memory, the last to arrive finishing the work, is
/// seen with each block in that role).
enum class BlockOrder { kForward, kReversed };
void set_block_order(BlockOrder order);

/// Bytes a warp primitive's lane may pass in or out.
constexpr size_t kSlotBytes = 64;

/// Runs `op(inputs, outputs)` once every lane of the calling thread's warp has called this with
/// the same `name`; inputs[l] / outputs[l] are lane l's (raw bytes of In / Out).
void warp_collective_raw(const char* name, const void* in, size_t in_bytes, void* out,
                         size_t out_bytes,
                         const std::function<void(const unsigned char (*)[kSlotBytes],
                                                  unsigned char (*)[kSlotBytes])>& op);

template <typename In, typename Out, typename Op>
Out warp_collective(const char* name, const In& in, Op op) {
  static_assert(sizeof(In) <= kSlotBytes && sizeof(Out) <= kSlotBytes, "slot too small");
  Out out{};
  using Slots = unsigned char (*)[kSlotBytes];
  warp_collective_raw(name, &in, sizeof(In), &out, sizeof(Out),
                      [&](const unsigned char (*ins)[kSlotBytes], Slots outs) {
                        In lanes_in[32];
                        Out lanes_out[32];
                        for (int l = 0; l < 32; ++l) std::memcpy(&lanes_in[l], ins[l], sizeof(In));
                        op(lanes_in, lanes_out);
                        for (int l = 0; l < 32; ++l) {
                          std::memcpy(outs[l], &lanes_out[l], sizeof(Out));
                        }
                      });
  return out;
}

/// Runs body() as each thread of `grid` blocks of `block` threads, one block after another, with
/// `shared_bytes` of dynamic shared memory each.
void launch_blocks(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body);

template <typename T>
struct Same {
  using type = T;
};

/// kernel<<<grid, block, shared_bytes>>>(args...), emulated.
template <typename... Params>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
            typename Same<Params>::type... args) {
  launch_blocks(grid, block, shared_bytes, [&] { kernel(args...); });
}

}  // namespace kvserve::emu

#define threadIdx (::kvserve::emu::thread_index())
#define blockIdx (::kvserve::emu::block_index())
#define blockDim (::kvserve::emu::block_dim())
#define gridDim (::kvserve::emu::grid_dim())
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#define __syncthreads() ::kvserve::emu::sync_threads()

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  if (mask != 0xffffffffu || width != 32) ::kvserve::emu::fail("__shfl_xor_sync: full warps only");
  return ::kvserve::emu::warp_collective<T, T>(
      "__shfl_xor_sync", value, [lane_mask](const T* in, T* out) {
        for (int l = 0; l < 32; ++l) out[l] = in[(l ^ lane_mask) & 31];
      });
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int source, int width = 32) {
  if (mask != 0xffffffffu || width != 32) ::kvserve::emu::fail("__shfl_sync: full warps only");
  struct In {
    T value;
    int source;
  };
  return ::kvserve::emu::warp_collective<In, T>(
      "__shfl_sync", In{value, source}, [](const In* in, T* out) {
        for (int l = 0; l < 32; ++l) out[l] = in[in[l].source & 31].value;
      });
}

inline int __all_sync(unsigned mask, int predicate) {
  if (mask != 0xffffffffu) ::kvserve::emu::fail("__all_sync: full warps only");
  return ::kvserve::emu::warp_collective<int, int>("__all_sync", predicate,
                                                   [](const int* in, int* out) {
                                                     int all = 1;
                                                     for (int l = 0; l < 32; ++l) all &= in[l] != 0;
                                                     for (int l = 0; l < 32; ++l) out[l] = all;
                                                   });
}

// Blocks run one after another and threads take turns on one OS thread: every read-modify-write
// is atomic, and a fence has nothing to order.
inline int atomicAdd(int* address, int value) {
  const int old = *address;
  *address = old + value;
  return old;
}

inline void __threadfence() {}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// Byte j of the result is byte (selector's nibble j & 7) of the 8 bytes y:x (x the low four).
inline unsigned int __byte_perm(unsigned int x, unsigned int y, unsigned int selector) {
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  unsigned int result = 0;
  for (int j = 0; j < 4; ++j) {
    const unsigned int source = (selector >> (4 * j)) & 7u;
    result |= static_cast<unsigned int>((bytes >> (8 * source)) & 0xffu) << (8 * j);
  }
  return result;
}

inline float __uint_as_float(unsigned int x) {
  float f;
  std::memcpy(&f, &x, sizeof(f));
  return f;
}

inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<uint64_t>(a) * b) >> 32);
}

using std::max;
using std::min;
