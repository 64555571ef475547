// In-place bfloat16 <-> float32 (bf16_inplace.h). Work goes in blocks: a
// block's source is copied out first, then its destination written. Widening
// walks down from the end (a block's float32 destination lies at or above
// every bfloat16 source not yet read); narrowing walks up from the start (a
// block's bfloat16 destination lies below every float32 source not yet read).
#include "bf16_inplace.h"

#include <cstdint>
#include <cstring>

namespace aio {
namespace {

constexpr size_t kBlock = 256;

// One block of `count` values (kCount: known at compile time for whole
// blocks, so the compiler vectorizes the loop at -O2; 0 for the last one).
template <size_t kCount>
inline void widen_block(unsigned char* bytes, size_t begin, size_t n) {
  const size_t count = kCount ? kCount : n;
  uint16_t in[kBlock];
  uint32_t out[kBlock];
  std::memcpy(in, bytes + 2 * begin, 2 * count);
  for (size_t i = 0; i < count; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
  std::memcpy(bytes + 4 * begin, out, 4 * count);
}

template <size_t kCount>
inline void narrow_block(unsigned char* bytes, size_t begin, size_t n) {
  const size_t count = kCount ? kCount : n;
  uint32_t in[kBlock];
  uint16_t out[kBlock];
  std::memcpy(in, bytes + 4 * begin, 4 * count);
  for (size_t i = 0; i < count; ++i) out[i] = bf16_from_bits(in[i]);
  std::memcpy(bytes + 2 * begin, out, 2 * count);
}

}  // namespace

void bf16_widen_inplace(void* buf, size_t n) {
  auto* bytes = static_cast<unsigned char*>(buf);
  size_t end = n;
  for (; end >= kBlock; end -= kBlock) widen_block<kBlock>(bytes, end - kBlock, kBlock);
  if (end > 0) widen_block<0>(bytes, 0, end);
}

void bf16_narrow_inplace(void* buf, size_t n) {
  auto* bytes = static_cast<unsigned char*>(buf);
  size_t begin = 0;
  for (; n - begin >= kBlock; begin += kBlock) narrow_block<kBlock>(bytes, begin, kBlock);
  if (begin < n) narrow_block<0>(bytes, begin, n - begin);
}

}  // namespace aio
