#include "map_buffers.hpp"

#include <algorithm>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace {

// Storage of the maps splat() writes for Python, kept for the next call when a map is freed.
//
// A fresh map of tens of MB is a fresh mmap each call (glibc maps every block over 32 MB), and
// its first touch costs a page fault per page: 3WIP's zeroing takes 6.6 ms fresh against 0.4 ms
// in memory touched before. A freed map's block goes to a short idle list instead of back to the
// system, and the next map of the same size takes it. A map in use is never handed out twice.
class MapBuffers {
   public:
    static constexpr size_t kIdle = 2;                      // blocks kept after their maps are freed
    static constexpr size_t kIdleBytes = size_t(1) << 28;  // at most 256 MiB kept; larger blocks go back
    static constexpr size_t kAlign = size_t(1) << 21;      // huge-page aligned (splat() asks for THP)

    static float* take(size_t bytes) {
        {
            std::lock_guard<std::mutex> lock(mu());
            auto& idle = list();
            for (size_t i = 0; i < idle.size(); ++i)
                if (idle[i].bytes == bytes) {
                    float* p = idle[i].ptr;
                    idle.erase(idle.begin() + static_cast<std::ptrdiff_t>(i));
                    return p;
                }
        }
        const size_t rounded = (std::max<size_t>(bytes, 1) + kAlign - 1) / kAlign * kAlign;
        void* p = std::aligned_alloc(kAlign, rounded);
        if (!p) throw std::bad_alloc();
        return static_cast<float*>(p);
    }

    static void give_back(float* ptr, size_t bytes) noexcept {
        if (bytes > kIdleBytes) {
            std::free(ptr);
            return;
        }
        std::lock_guard<std::mutex> lock(mu());
        auto& idle = list();
        size_t kept = bytes;
        for (const Block& b : idle) kept += b.bytes;
        while (!idle.empty() && (idle.size() == kIdle || kept > kIdleBytes)) {  // the oldest go back
            kept -= idle.front().bytes;
            std::free(idle.front().ptr);
            idle.erase(idle.begin());
        }
        idle.push_back({ptr, bytes});
    }

   private:
    struct Block {
        float* ptr;
        size_t bytes;
    };
    // never destroyed: a map may be freed during interpreter shutdown, after static destructors
    static std::mutex& mu() {
        static std::mutex* m = new std::mutex;
        return *m;
    }
    static std::vector<Block>& list() {
        static std::vector<Block>* l = new std::vector<Block>;
        return *l;
    }
};

}  // namespace

namespace kernels::density {

float* take_map_buffer(std::size_t bytes) { return MapBuffers::take(bytes); }

void give_back_map_buffer(float* ptr, std::size_t bytes) noexcept { MapBuffers::give_back(ptr, bytes); }

}  // namespace kernels::density
