// ParallelFor over XLA's intra-op thread pool, shared by attention.cc and narrow.cc.
#ifndef FLAX_ATTENTION_PARALLEL_H_
#define FLAX_ATTENTION_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace flax_attention {

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
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

}  // namespace flax_attention

#endif  // FLAX_ATTENTION_PARALLEL_H_
