// Order-preserving keys of every dtype hs.topk accepts, one traits type per
// dtype and direction (see hyscale_core/ops/topk/keys.py for the mapping).
//
// key(bits): an unsigned key whose order is the selection order (larger =
// taken first). Floats map every NaN above +inf (one key) and -0.0 onto
// +0.0; integers flip the sign bit; SMALLEST complements the key.
//
// For keys of up to 32 bits, pre(top) is a cheaper stand-in for the key
// (no NaN or zero folding) of the bits shifted to the top of a word:
//     key(b) >= t   implies   pre(b << TOP) - NNH >= bound(t) - NNH   (u32).
// The test may pass elements whose key is below t, never the reverse, so a
// pass runs the exact key only on the few elements that pass it.
#pragma once

#include "select.cuh"

namespace hs {

template <typename BitsT, typename KeyT, int WIDTH, bool FLOAT, u64 EXP_MASK, bool SMALLEST>
struct KeyTraits {
    typedef BitsT Bits;
    typedef KeyT K;
    static constexpr int W = WIDTH;                      // key bits
    static constexpr int VEC = 16 / (int)sizeof(Bits);   // elements per 16-byte vector
    static constexpr K ONES = (K)(~0ull >> (64 - WIDTH));
    static constexpr K SIGN = (K)(1ull << (WIDTH - 1));
    static constexpr K EXP = (K)EXP_MASK;
    static constexpr int TOP = WIDTH <= 32 ? 32 - WIDTH : 0;
    // pre() of -inf: below it pre() holds only negative NaNs.
    static constexpr u32 NNH = FLOAT && WIDTH <= 32 ? ~(u32)(((u64)SIGN | EXP_MASK) << TOP) : 0u;
    // pre() of the smallest positive NaN.
    static constexpr u32 NPL = FLOAT && WIDTH <= 32 ? ((u32)((EXP_MASK + 1) << TOP) | 0x80000000u) : 0xFFFFFFFFu;
    static_assert(sizeof(K) * 8 >= WIDTH && sizeof(Bits) * 8 == WIDTH, "bits and keys of the dtype's width");

    __host__ __device__ static K key(Bits bits) {
        K v = (K)bits;
        K k;
        if (FLOAT && (v & (ONES ^ SIGN)) > EXP) {
            k = ONES;
        } else {
            if (FLOAT && v == SIGN) v = 0;
            k = FLOAT ? ((v & SIGN) ? (K)(~v & ONES) : (K)(v | SIGN)) : (K)(v ^ SIGN);
        }
        return SMALLEST ? (K)(~k & ONES) : k;
    }

    // The bits a key came from; false where several do (NaN payloads, zeros).
    __host__ __device__ static bool bits_of(K key, Bits& bits) {
        const K k = SMALLEST ? (K)(~key & ONES) : key;
        if (FLOAT && (k == ONES || k == SIGN)) return false;
        bits = (Bits)(FLOAT ? ((k & SIGN) ? (K)(k ^ SIGN) : (K)(~k & ONES)) : (K)(k ^ SIGN));
        return true;
    }

    __host__ __device__ static u32 pre(u32 top) {
        const u32 v = FLOAT ? top ^ ((u32)((int)top >> 31) | 0x80000000u) : top ^ 0x80000000u;
        return SMALLEST ? ~v : v;
    }

    __host__ __device__ static u32 bound(K t) {
        const u32 kb = (u32)t << TOP;
        if (!FLOAT) return kb;
        // -0.0 pre()s just below +0.0; positive NaNs pre() from NPL up.
        const u32 l = kb <= 0x80000000u ? (kb < 0x7FFFFFFFu ? kb : 0x7FFFFFFFu) : (kb < NPL ? kb : NPL);
        return l > NNH ? l : NNH;
    }
};

template <bool S> using Float16 = KeyTraits<u16, u32, 16, true, 0x7C00ull, S>;
template <bool S> using BFloat16 = KeyTraits<u16, u32, 16, true, 0x7F80ull, S>;
template <bool S> using Float32 = KeyTraits<u32, u32, 32, true, 0x7F800000ull, S>;
template <bool S> using Float64 = KeyTraits<u64, u64, 64, true, 0x7FF0000000000000ull, S>;
template <bool S> using Int32 = KeyTraits<u32, u32, 32, false, 0ull, S>;
template <bool S> using Int64 = KeyTraits<u64, u64, 64, false, 0ull, S>;

}  // namespace hs
