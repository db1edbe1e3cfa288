// ssm_scan's body; compiled once per CPU capability (see kernels/cpu_dispatch.h). Each
// (sequence, head) runs its tokens in order (the recurrent form), the pairs in parallel, a row of
// the state a vector of states at a time; a Mamba head (A per state entry) is one channel, its
// decay a vector over the state.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/cpu_kernels.h"
#include "kernels/cpu_vec.h"

namespace kvserve::cpu {
inline namespace CPU_CAPABILITY {
namespace {

inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

template <typename T, typename S, bool kPerState>
void scan(const SsmScanArgs& a) {
  const int64_t heads = a.heads, P = a.head_dim, N = a.state_size;
  const int64_t per_group = heads / a.groups;
  const auto* x = static_cast<const T*>(a.x);
  const auto* dt = static_cast<const T*>(a.dt);
  const auto* B = static_cast<const T*>(a.B);
  const auto* C = static_cast<const T*>(a.C);
  auto* out = static_cast<T*>(a.out);
  auto* pool = static_cast<S*>(a.state);
  at::parallel_for(0, a.num_seqs * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> h(P * N), b(N), c(N), decays(kPerState ? N : 0);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / heads, head = i % heads, g = head / per_group;
      S* state = pool + (static_cast<int64_t>(a.slots[s]) * heads + head) * P * N;
      for (int64_t k = 0; k < P * N; ++k) {
        h[k] = a.has_initial_state[s] ? static_cast<float>(state[k]) : 0.0f;
      }
      const float A = kPerState ? 0.0f : a.A[head];
      const float* A_row = a.A + head * N;  // kPerState
      const float D = a.D ? a.D[head] : 0.0f;
      const float bias = a.dt_bias ? a.dt_bias[head] : 0.0f;
      for (int64_t t = a.cu_seqlens[s]; t < a.cu_seqlens[s + 1]; ++t) {
        float d = static_cast<float>(dt[t * a.dt_stride + head]) + bias;
        if (a.dt_softplus) d = softplus(d);
        d = std::min(std::max(d, a.dt_min), a.dt_max);
        const float decay = kPerState ? 0.0f : std::exp(d * A);
        if constexpr (kPerState) {
          int64_t n = 0;
          for (; n + Vec::size() <= N; n += Vec::size()) {
            (Vec(d) * Vec::loadu(A_row + n)).exp().store(decays.data() + n);
          }
          for (; n < N; ++n) decays[n] = std::exp(d * A_row[n]);
        }
        const T* bt = B + t * a.B_stride + g * N;
        const T* ct = C + t * a.C_stride + g * N;
        for (int64_t n = 0; n < N; ++n) {
          b[n] = d * static_cast<float>(bt[n]);
          c[n] = static_cast<float>(ct[n]);
        }
        const T* xt = x + t * a.x_stride + head * P;
        T* yt = out + t * a.out_stride + head * P;
        for (int64_t p = 0; p < P; ++p) {
          const float xp = static_cast<float>(xt[p]);
          float* row = h.data() + p * N;
          // The row's update and its dot with C, a vector of states at a time.
          const Vec xv(xp), decay_v(decay);
          Vec yv(0.0f);
          int64_t n = 0;
          for (; n + Vec::size() <= N; n += Vec::size()) {
            const Vec rate = kPerState ? Vec::loadu(decays.data() + n) : decay_v;
            const Vec r = at::vec::fmadd(rate, Vec::loadu(row + n), xv * Vec::loadu(b.data() + n));
            r.store(row + n);
            yv = at::vec::fmadd(r, Vec::loadu(c.data() + n), yv);
          }
          float y = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, yv);
          for (; n < N; ++n) {
            row[n] = (kPerState ? decays[n] : decay) * row[n] + xp * b[n];
            y += row[n] * c[n];
          }
          yt[p] = static_cast<T>(y + D * xp);
        }
      }
      for (int64_t k = 0; k < P * N; ++k) state[k] = static_cast<S>(h[k]);
    }
  });
}

void ssm_scan_impl(c10::ScalarType dtype, const SsmScanArgs& args) {
  KVSERVE_DISPATCH_FLOATING(dtype, [&] {
    if (args.fp32_state) {
      args.A_per_state ? scan<scalar_t, float, true>(args) : scan<scalar_t, float, false>(args);
    } else {
      args.A_per_state ? scan<scalar_t, scalar_t, true>(args)
                       : scan<scalar_t, scalar_t, false>(args);
    }
  });
}

}  // namespace

KVSERVE_REGISTER_CPU_KERNEL(ssm_scan_stub, &ssm_scan_impl);

}  // namespace CPU_CAPABILITY
}  // namespace kvserve::cpu
