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

uint16_t round_bf16(uint32_t u) {
  if ((u & 0x7FFFFFFFu) > 0x7F800000u)
    return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace

void bf16_widen_inplace(void* buf, size_t n) {
  auto* bytes = static_cast<unsigned char*>(buf);
  uint16_t in[kBlock];
  uint32_t out[kBlock];
  for (size_t end = n; end > 0;) {
    const size_t begin = end > kBlock ? end - kBlock : 0;
    const size_t count = end - begin;
    std::memcpy(in, bytes + 2 * begin, 2 * count);
    for (size_t i = 0; i < count; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(bytes + 4 * begin, out, 4 * count);
    end = begin;
  }
}

void bf16_narrow_inplace(void* buf, size_t n) {
  auto* bytes = static_cast<unsigned char*>(buf);
  uint32_t in[kBlock];
  uint16_t out[kBlock];
  for (size_t begin = 0; begin < n; begin += kBlock) {
    const size_t count = n - begin < kBlock ? n - begin : kBlock;
    std::memcpy(in, bytes + 4 * begin, 4 * count);
    for (size_t i = 0; i < count; ++i) out[i] = round_bf16(in[i]);
    std::memcpy(bytes + 2 * begin, out, 2 * count);
  }
}

}  // namespace aio
