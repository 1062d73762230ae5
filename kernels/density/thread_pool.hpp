// The parallel loop every kernel of scatter.hpp runs its tasks in: on torch's intra-op OpenMP threads
// where this module shares torch's OpenMP runtime (TorchTeam in thread_pool.cpp), else, and for a
// while after a team member came late, on a pool of std::threads that the caller never waits to
// arrive (HelperPool). Which worker runs a task never changes a result: tasks write disjoint outputs.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace kernels::density::detail {

// One task of a parallel loop: body(context, task, worker).
using TaskBody = void (*)(void* context, int64_t task, int worker);

// body(context, task, worker) for task in [0, n_tasks) over 2..n_threads workers (worker <
// n_threads), the caller among them; returns when every task has finished, rethrowing the first
// exception a task threw (the other tasks still run).
void run_tasks(int64_t n_tasks, int n_threads, TaskBody body, void* context);

// fn(task, worker) for task in [0, n_tasks) over up to n_threads workers; worker < n_threads. One
// worker (or one task): on the calling thread, in task order.
template <class F>
void parallel_for(int64_t n_tasks, int n_threads, F&& fn) {
    n_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(n_threads, n_tasks)));
    if (n_threads <= 1) {
        for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
        return;
    }
    using Fn = std::remove_reference_t<F>;
    run_tasks(
        n_tasks, n_threads, [](void* c, int64_t t, int w) { (*static_cast<Fn*>(c))(t, w); },
        const_cast<void*>(static_cast<const void*>(&fn)));
}

}  // namespace kernels::density::detail
