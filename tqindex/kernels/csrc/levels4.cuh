// Levels of 4-bit codes by prmt lookups, shared by the CUDA kernels: float16 levels (attention_decode.cu), int8
// levels (scan_tiles.cu).
#pragma once

#include <cstdint>

namespace tq4 {

struct Table {
  uint32_t lo0, lo1, hi0, hi1;  // low bytes of magnitudes 0-3, 4-7; high bytes of 0-3, 4-7 (f16, ascending)
};

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(s));
  return d;
}

// The f16 levels of the eight 4-bit codes of w (code c in bits 4c..4c+3): low bytes of codes 0-3 in la, high bytes
// in ha, codes 4-7 in lb / hb. Direction codes: a code below 8 is negative with magnitude index 7 - c, else
// positive with c - 8. E2M1: bit 3 is the sign, bits 0-2 the magnitude index.
template <bool E2M1>
__device__ __forceinline__ void lookup(uint32_t w, const Table& t, uint32_t& la, uint32_t& ha, uint32_t& lb,
                                       uint32_t& hb) {
  uint32_t neg, m;
  if constexpr (E2M1) {
    neg = w & 0x88888888u;
    m = w & 0x77777777u;
  } else {
    neg = ~w & 0x88888888u;
    m = (w & 0x77777777u) ^ (neg - (neg >> 3));  // magnitude indices, one per nibble
  }
  la = prmt(t.lo0, t.lo1, m);
  ha = prmt(t.hi0, t.hi1, m);
  lb = prmt(t.lo0, t.lo1, m >> 16);
  hb = prmt(t.hi0, t.hi1, m >> 16);
  const uint32_t s = neg >> 1;  // selector 4 (byte 0x80) where negative, 0 (byte 0) elsewhere
  ha |= prmt(0u, 0x80808080u, s);
  hb |= prmt(0u, 0x80808080u, s >> 16);
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
