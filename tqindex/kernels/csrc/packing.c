/* Bit packing of codes (the fast path of packing.pack): each row of d codes of `bits` bits becomes a
 * little-endian bit stream, code j at bits [bits·j, bits·j + bits), ceil(d·bits / 8) bytes.
 *
 * Called through ctypes (tqindex/native.py).
 */
#include <stdint.h>
#include <string.h>

/* One row: d codes (only the low `bits` bits of each are kept, bits in 1..8) -> ceil(d·bits/8) bytes at o. */
void tq_pack_row(const uint8_t *c, int64_t d, int64_t bits, uint8_t *o) {
    int64_t groups = d / 8;
    uint64_t mask = (1u << bits) - 1u;
    for (int64_t g = 0; g < groups; g++, c += 8, o += bits) {  /* 8 codes fill `bits` whole bytes */
        uint64_t word = 0;
        for (int j = 0; j < 8; j++) word |= ((uint64_t)c[j] & mask) << (bits * j);
        uint8_t bytes[8];
        for (int j = 0; j < 8; j++) bytes[j] = (uint8_t)(word >> (8 * j));
        memcpy(o, bytes, (size_t)bits);
    }
    uint64_t acc = 0;
    int fill = 0;
    for (int64_t j = 0; j < d - groups * 8; j++) {  /* the last d mod 8 codes */
        acc |= ((uint64_t)c[j] & mask) << fill;
        fill += (int)bits;
    }
    for (; fill > 0; fill -= 8, acc >>= 8) *o++ = (uint8_t)acc;
}

/* codes [n, d] uint8 -> out [n, ceil(d·bits/8)] uint8. Returns 0, or -1 for bits outside 1..8. */
int tq_pack(const uint8_t *codes, int64_t n, int64_t d, int64_t bits, uint8_t *out) {
    if (bits < 1 || bits > 8) return -1;
    int64_t row_bytes = (d * bits + 7) / 8;
    for (int64_t r = 0; r < n; r++) tq_pack_row(codes + r * d, d, bits, out + r * row_bytes);
    return 0;
}
