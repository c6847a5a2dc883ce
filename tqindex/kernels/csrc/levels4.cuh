// Levels of 4-bit codes by prmt lookups, shared by the CUDA kernels: float16 levels (attention_decode.cu), int8
// levels (scan_tiles.cu).
#pragma once

#include <cstdint>

namespace tq4 {

struct Table {
  uint32_t lo0, lo1, hi0, hi1;  // low bytes of magnitudes 0-3, 4-7; high bytes of 0-3, 4-7 (f16, ascending)
  uint32_t shift16;              // 2^16 (lookup's notes)
};

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// The f16 levels of the eight 4-bit codes of w (code c in bits 4c..4c+3): low bytes of codes 0-3 in la, high bytes
// in ha, codes 4-7 in lb / hb. Direction codes: a code below 8 is negative with magnitude index 7 - c, else
// positive with c - 8. E2M1: bit 3 is the sign, bits 0-2 the magnitude index.
//
// The integer pipe (prmt, lop3, shf) is the attention kernel's busiest (Nsight Compute on an H100, tq4, batch 8 x
// 131k tokens: 74 % of its cycles), so the shifts and the sign masks go to the multiply pipe (imad.hi). ``seven``
// holds 7 in the nibbles of codes with bit 3 set (top * 7 / 8, exact: each nibble of top is 8 or 0). A direction
// code's magnitude index is then c ^ 7 ^ seven (low three bits), and the sign bytes are prmt picks by ``seven``
// itself (nibble 7: byte 7, nibble 0: byte 0) from {0x80 at byte 0, 0 at byte 7} (direction codes: negative below
// 8) or {0 at byte 0, 0x80 at byte 7} (E2M1: negative with bit 3 set). ``shift16`` is 2^16: the high half of m *
// 2^16 is m >> 16 (a parameter, so that the compiler does not turn it back into a shift). That kernel's batch 8 x
// 131k step took 537 us against 547 with the shifts and masks on the integer pipe.
template <bool E2M1>
__device__ __forceinline__ void lookup(uint32_t w, const Table& t, uint32_t& la, uint32_t& ha, uint32_t& lb,
                                       uint32_t& hb) {
  const uint32_t top = w & 0x88888888u;
  const uint32_t seven = __umulhi(top, 0xE0000000u), seven_hi = __umulhi(top, 0xE000u);  // the latter: seven >> 16
  const uint32_t m = E2M1 ? w & 0x77777777u : (w ^ seven ^ 0x77777777u) & 0x77777777u;  // magnitude indices
  const uint32_t m_hi = __umulhi(m, t.shift16);
  la = prmt(t.lo0, t.lo1, m);
  ha = prmt(t.hi0, t.hi1, m);
  lb = prmt(t.lo0, t.lo1, m_hi);
  hb = prmt(t.hi0, t.hi1, m_hi);
  constexpr uint32_t below = E2M1 ? 0u : 0x80u, above = E2M1 ? 0x80000000u : 0u;  // sign byte sources
  ha |= prmt(below, above, seven);
  hb |= prmt(below, above, seven_hi);
}

// The int8 levels of the eight 4-bit direction codes of w (code c in bits 4c..4c+3): codes 0-3 in the bytes of v0,
// 4-7 in v1. neg0 / neg1: the levels of codes 0-7 (negative), pos0 / pos1: of codes 8-15, four bytes per word. Two
// lookups of the code's low three bits, then a pick of either by its bit 3.
__device__ __forceinline__ void lookup_i8(uint32_t w, uint32_t neg0, uint32_t neg1, uint32_t pos0, uint32_t pos1,
                                          uint32_t& v0, uint32_t& v1) {
  const uint32_t s = w & 0x77777777u;
  const uint32_t a0 = prmt(neg0, neg1, s), b0 = prmt(pos0, pos1, s);
  const uint32_t a1 = prmt(neg0, neg1, s >> 16), b1 = prmt(pos0, pos1, s >> 16);
  const uint32_t pick = ((w >> 1) & 0x44444444u) | 0x32103210u;  // byte i of a (bit 3 clear) or of b (set)
  v0 = prmt(a0, b0, pick);
  v1 = prmt(a1, b1, pick >> 16);
}

}  // namespace tq4
