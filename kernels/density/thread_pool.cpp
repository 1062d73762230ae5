// The thread pool and torch's OpenMP team (thread_pool.hpp), and the scatter.hpp functions that say
// which one runs: set_shared_openmp, shared_openmp, openmp_library.
#include "thread_pool.hpp"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "scatter.hpp"

#ifndef KERNELS_NO_OPENMP
#include <omp.h>
#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>  // dladdr: which OpenMP runtime this module calls
#endif
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>  // pthread_atfork
#endif

namespace {

using kernels::density::detail::TaskBody;

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// A loop whose caller, done with its own tasks, waited for a helper's task longer than
// kLateWaitNs and longer than a tenth of its own working time had a helper on a core that
// another process keeps busy (quiet, the decreasing slabs leave a tail of a few % of the work).
// The calls of the next kHoldoffNs then run on the caller alone: a second thread on a busy core
// adds at most half a core, and one that the scheduler sets aside while it holds a task makes the
// call slower than one thread (3WIP's forward took 1.4-1.5x its 1-thread time in such runs). The
// first call after the hold-off tries the threads again. Results are the same either way: any
// assignment of tasks to workers gives the same outputs.
// One late loop starts a hold-off while the machine counts as busy: from the start, and until
// kQuietLoops loops in a row have come on time. After that, on a machine that has shown itself
// quiet, it takes a second late loop within kPairNs of the first: a single one is as likely a
// moment's preemption of the helper (a VM's neighbour, a daemon) as a busy core, and 2 s of one
// thread would follow it, while a busy core makes nearly every call's long loop late. (The short
// loops between them, such as the atoms' preparation, may well come on time: only the time between
// late loops counts, not whether others came between.)
struct SerialHoldoff {
    static constexpr int64_t kLateWaitNs = 1'000'000;
    static constexpr int64_t kHoldoffNs = 2'000'000'000;
    static constexpr int64_t kPairNs = 1'000'000'000;
    static constexpr int kQuietLoops = 4;

    static bool active() { return now_ns() < until_.load(std::memory_order_relaxed); }

    static void after_loop(int64_t caller_work_ns, int64_t caller_wait_ns, int64_t end_ns) {
        if (caller_wait_ns > kLateWaitNs && 10 * caller_wait_ns > caller_work_ns) {
            on_time_.store(0, std::memory_order_relaxed);
            const int64_t previous = last_late_.exchange(end_ns, std::memory_order_relaxed);
            if (!quiet_.load(std::memory_order_relaxed) || end_ns - previous < kPairNs) {
                until_.store(end_ns + kHoldoffNs, std::memory_order_relaxed);
                quiet_.store(false, std::memory_order_relaxed);
            }
        } else if (on_time_.fetch_add(1, std::memory_order_relaxed) + 1 >= kQuietLoops) {
            quiet_.store(true, std::memory_order_relaxed);
        }
    }

    static inline std::atomic<int64_t> until_{0};
    static inline std::atomic<int64_t> last_late_{INT64_MIN / 2};  // end of the last late loop
    static inline std::atomic<int> on_time_{0};                    // loops on time in a row
    static inline std::atomic<bool> quiet_{false};
};

// Tasks [0, n_tasks) taken by the workers of one parallel loop from one atomic counter; the first
// exception a task throws is kept for the caller to rethrow, and the loop goes on with the others.
struct TaskQueue {
    int64_t n_tasks = 0;
    std::atomic<int64_t> next{0}, done{0};
    std::mutex error_mu;
    std::exception_ptr error;

    template <class F>
    void work(F& fn, int worker) {
        for (int64_t t = next.fetch_add(1); t < n_tasks; t = next.fetch_add(1)) {
            try {
                fn(t, worker);
            } catch (...) {
                std::lock_guard<std::mutex> lock(error_mu);
                if (!error) error = std::current_exception();
            }
            done.fetch_add(1, std::memory_order_release);
        }
    }
};

// A parallel loop that never waits for a thread to arrive, only for tasks that have started.
//
// fn(task, worker) for task in [0, n_tasks): the caller (worker 0) and up to n_threads − 1
// helper threads take tasks from one atomic counter. An OpenMP region (or a fork-join of
// std::threads) ends only when every thread of its team has arrived: on a machine where another
// process keeps a core busy, a helper woken on that core may get it only after milliseconds,
// and the caller would wait for it even when it has done all the work itself. Here a helper that
// comes late finds no task left and goes back to sleep; the caller returns as soon as every
// task taken has finished. Helpers live for the process (started on first use, never joined).
// Calls from several host threads at once: one runs with the helpers, the others on their own
// thread (their results are the same: any assignment of tasks to workers is).
class HelperPool {
   public:
    static HelperPool& get() {
        static HelperPool* pool = new HelperPool;  // never destroyed: helpers may outlive static destructors
        return *pool;
    }

    template <class F>
    void run(int64_t n_tasks, int n_threads, F& fn) {
        std::unique_lock<std::mutex> busy(call_, std::try_to_lock);
        if (!busy.owns_lock() || n_threads <= 1) {
            for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
            return;
        }
        auto job = std::make_shared<Job>();
        job->tasks.n_tasks = n_tasks;
        job->n_workers = n_threads;
        job->body = [&fn](int64_t t, int w) { fn(t, w); };
        start_helpers(n_threads - 1);
        {
            std::lock_guard<std::mutex> lock(mu_);
            job_ = job;
            ++generation_;
        }
        const int64_t start = now_ns();
        cv_.notify_all();
        job->work(0);
        const int64_t caller_done = now_ns();
        // tasks still running on helpers: spin briefly, then yield the core
        for (int spins = 0; job->tasks.done.load(std::memory_order_acquire) < n_tasks; ++spins)
            if (spins > 2000) std::this_thread::yield();
        const int64_t end = now_ns();
        SerialHoldoff::after_loop(caller_done - start, end - caller_done, end);
        {
            std::lock_guard<std::mutex> lock(mu_);
            job_.reset();  // a helper that has not looked yet finds nothing
        }
        if (job->tasks.error) std::rethrow_exception(job->tasks.error);
    }

   private:
    struct Job {
        TaskQueue tasks;
        int n_workers = 1;
        std::function<void(int64_t, int)> body;
        std::atomic<int> next_worker{1};

        void work(int worker) { tasks.work(body, worker); }
    };

    void start_helpers(int n) {
        while (static_cast<int>(n_helpers_) < n) {
            std::thread(&HelperPool::helper, this).detach();
            ++n_helpers_;
        }
    }

    void helper() {
        uint64_t seen = 0;
        for (;;) {
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lock(mu_);
                cv_.wait(lock, [&] { return generation_ != seen; });
                seen = generation_;
                job = job_;
            }
            if (!job) continue;
            // worker ids 1..n_workers−1, each at most once per job (they index per-worker scratch)
            const int id = job->next_worker.fetch_add(1);
            if (id < job->n_workers) job->work(id);
        }
    }

    std::mutex call_;  // one job at a time
    std::mutex mu_;
    std::condition_variable cv_;
    std::shared_ptr<Job> job_;
    uint64_t generation_ = 0;
    size_t n_helpers_ = 0;
};

// The same loop on the calling thread's OpenMP team, used when this module's OpenMP runtime is
// the one torch's CPU ops run on (set_shared_openmp, checked from Python). The team's workers are
// then torch's intra-op threads, which spin for a few ms after each multi-threaded torch op: a
// call that follows the caller's torch ops (every backward, and a forward inside a refinement loop)
// finds them awake on the other cores, where a pool helper would share a core with one of them and
// run at half speed. A region still ends only when every member has arrived. When a member had not
// arrived by the time the caller ran out of tasks and the caller then waited more than
// kLateWaitNs for it (its core busy with another process), calls within kHoldoffNs take the pool,
// which never waits for a thread to arrive.
class TorchTeam {
   public:
    static constexpr int64_t kLateWaitNs = 200'000;
    static constexpr int64_t kHoldoffNs = 2'000'000'000;

    // A child forked after the team ran has none of its threads, and libgomp would wait for them
    // at the child's first region: the child takes the pool.
    static void set_shared(bool shared) {
#if defined(__unix__) || defined(__APPLE__)
        static std::once_flag at_fork;
        std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, [] { shared_.store(false); }); });
#endif
        shared_.store(shared, std::memory_order_relaxed);
    }
    static bool shared() { return shared_.load(std::memory_order_relaxed); }

    // Runs the loop and returns true, or returns false (nothing run) where the pool should.
    template <class F>
    static bool run(int64_t n_tasks, int n_threads, F& fn) {
#ifndef KERNELS_NO_OPENMP
        if (!shared() || omp_in_parallel()) return false;
        if (now_ns() < avoid_until_.load(std::memory_order_relaxed)) return false;
        TaskQueue tasks;
        tasks.n_tasks = n_tasks;
        std::atomic<int> arrived{0};
        const int64_t start = now_ns();
        int64_t caller_done = 0;
        bool missing = false;
#pragma omp parallel num_threads(n_threads)
        {
            arrived.fetch_add(1, std::memory_order_relaxed);
            const int worker = omp_get_thread_num();
            tasks.work(fn, worker);
            if (worker == 0) {
                missing = arrived.load(std::memory_order_relaxed) < omp_get_num_threads();
                caller_done = now_ns();
            }
        }
        const int64_t end = now_ns();
        if (missing && end - caller_done > kLateWaitNs)
            avoid_until_.store(end + kHoldoffNs, std::memory_order_relaxed);
        else
            SerialHoldoff::after_loop(caller_done - start, end - caller_done, end);  // a member slow on its task
        if (tasks.error) std::rethrow_exception(tasks.error);
        return true;
#else
        (void)n_tasks, (void)n_threads, (void)fn;
        return false;
#endif
    }

   private:
    static inline std::atomic<bool> shared_{false};
    static inline std::atomic<int64_t> avoid_until_{0};
};

}  // namespace

namespace kernels::density {

void detail::run_tasks(int64_t n_tasks, int n_threads, TaskBody body, void* context) {
    auto fn = [body, context](int64_t t, int w) { body(context, t, w); };
    if (SerialHoldoff::active()) {
        for (int64_t t = 0; t < n_tasks; ++t) fn(t, 0);
        return;
    }
    if (TorchTeam::run(n_tasks, n_threads, fn)) return;
    HelperPool::get().run(n_tasks, n_threads, fn);
}

const char* openmp_library() {
#if !defined(KERNELS_NO_OPENMP) && (defined(__unix__) || defined(__APPLE__))
    Dl_info where;
    if (dladdr(reinterpret_cast<void*>(&omp_get_max_threads), &where) && where.dli_fname) return where.dli_fname;
#endif
    return "";
}

void set_shared_openmp(bool shared) {
#ifndef KERNELS_NO_OPENMP
    TorchTeam::set_shared(shared);
#else
    (void)shared;
#endif
}

bool shared_openmp() { return TorchTeam::shared(); }

}  // namespace kernels::density
