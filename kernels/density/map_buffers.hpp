// Storage of the maps splat() writes for Python (the binding's empty_maps), kept for the next call
// when a map is freed: map_buffers.cpp says why.
#pragma once

#include <cstddef>

namespace kernels::density {

// Uninitialised storage for `bytes` bytes of map, 2 MiB aligned: the block of a freed map of exactly
// that size when one is idle, else fresh memory. Throws std::bad_alloc.
float* take_map_buffer(std::size_t bytes);

// Returns storage from take_map_buffer(bytes) when its map is freed; it is kept for the next map of
// that size (at most two blocks, 256 MiB in all; the oldest go back to the system first).
void give_back_map_buffer(float* ptr, std::size_t bytes) noexcept;

}  // namespace kernels::density
