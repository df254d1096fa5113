// ParallelFor over XLA's intra-op thread pool, shared by attention.cc and narrow.cc.
#ifndef FLAX_ATTENTION_PARALLEL_H_
#define FLAX_ATTENTION_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace flax_attention {

// How long ParallelFor's caller spins for the helpers' last items before it sleeps: a sleep on
// the condition variable and its wake-up took 13 us a call on the 2-core Zen 4 VM, as long as
// a 256 x 256 bfloat16 product takes in all (3.4 us a call with the spin; GPT-2 small's layer
// products at one row: 8.2 -> 7.2 ms a pass in bfloat16, 4.3 -> 3.6 in int8). An item takes
// at most a few hundred microseconds, so the spin rarely runs out; when it does (a helper that
// has not started on a busy machine), the caller sleeps as before.
constexpr int64_t kSpinUs = 200;

inline void Pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// body(item) for item in [0, n): items taken in turn by the calling thread and up to
// num_threads - 1 of the pool's threads; returns when all are done.
template <typename Body>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, const Body& body) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  const Body* fn = &body;  // used only while the caller waits below
  auto work = [state, fn, n] {
    for (int64_t item; (item = state->next.fetch_add(1)) < n;) {
      (*fn)(item);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work(); });
  work();
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(kSpinUs);
  for (int64_t spin = 1; state->done.load() != n; ++spin) {
    Pause();
    if (spin % 64 == 0 && std::chrono::steady_clock::now() > until) break;
  }
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace flax_attention

#endif  // FLAX_ATTENTION_PARALLEL_H_
