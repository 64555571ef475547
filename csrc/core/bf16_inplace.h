// bfloat16 <-> float32 in one buffer, in place: the optimizer swapper keeps
// bf16 states on the drive and widens them in the fp32 buffer they are read
// into (aio/swap/lowp.py). The two layouts overlap, so the passes run in an
// order in which no value is overwritten before it is read.
#pragma once

#include <cstddef>
#include <cstdint>

namespace aio {

// The bfloat16 nearest (ties to even) to the float32 with bits u; a NaN stays
// a NaN (quiet, sign and top payload kept). Selects only: loops vectorize.
inline uint16_t bf16_from_bits(uint32_t u) {
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

// The n bfloat16 values in bytes [0, 2n) of buf become n float32 values in
// bytes [0, 4n) (exact: a bfloat16 is the top half of a float32).
void bf16_widen_inplace(void* buf, size_t n);

// The n float32 values in bytes [0, 4n) of buf become n bfloat16 values in
// bytes [0, 2n), rounded to nearest even as torch's tensor.to(torch.bfloat16)
// rounds; a NaN stays a NaN (its bits may differ from torch's 0xFFFF).
void bf16_narrow_inplace(void* buf, size_t n);

}  // namespace aio
