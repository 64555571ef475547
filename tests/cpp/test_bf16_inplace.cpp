// bf16_inplace: widening and narrowing in one buffer, against a separate
// buffer converted element by element, at sizes around the block (the
// sanitizer build catches any access past the 4n bytes).
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "bf16_inplace.h"
#include "check.h"

namespace {

uint16_t reference_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

void round_trip(size_t n) {
  std::mt19937 rng(static_cast<unsigned>(n));
  std::vector<float> values(n);
  for (auto& v : values) {
    uint32_t bits = rng();
    std::memcpy(&v, &bits, 4);  // every bit pattern: NaNs, subnormals, infinities
  }
  std::vector<unsigned char> buf(4 * n);
  std::memcpy(buf.data(), values.data(), 4 * n);
  aio::bf16_narrow_inplace(buf.data(), n);
  bool narrow_ok = true, widen_ok = true;
  for (size_t i = 0; i < n; ++i) {
    uint16_t got;
    std::memcpy(&got, buf.data() + 2 * i, 2);
    narrow_ok = narrow_ok && got == reference_bf16(values[i]);
  }
  CHECK(narrow_ok);
  aio::bf16_widen_inplace(buf.data(), n);
  for (size_t i = 0; i < n; ++i) {
    uint32_t got;
    std::memcpy(&got, buf.data() + 4 * i, 4);
    widen_ok = widen_ok && got == static_cast<uint32_t>(reference_bf16(values[i])) << 16;
  }
  CHECK(widen_ok);
}

}  // namespace

TEST(bf16_inplace_round_trips_every_bit_pattern) {
  for (size_t n : {1u, 2u, 3u, 255u, 256u, 257u, 511u, 512u, 513u, 100003u}) round_trip(n);
}

TEST(bf16_inplace_zero_elements_touch_nothing) {
  unsigned char b[4] = {1, 2, 3, 4};
  aio::bf16_widen_inplace(b, 0);
  aio::bf16_narrow_inplace(b, 0);
  CHECK(b[0] == 1 && b[3] == 4);
}
