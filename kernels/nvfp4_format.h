// The NVFP4 / FP8 number formats of the MLA cache, written once for the CPU
// path and the CUDA kernel (every function here is __host__ __device__).
//
// SPEC.md ("Arithmetic") is the contract; each function names the rule it
// implements. Everything is float32 with IEEE round-to-nearest-even and no
// flush-to-zero. This header must never be compiled with fast-math or with
// floating-point contraction (the build sets -ffp-contract=off / --fmad=false),
// and the helpers below pin each rounding explicitly on the device.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define MLAKV_HD __host__ __device__ __forceinline__
#else
#define MLAKV_HD inline
#endif

// Fully unroll a short fixed loop on either compiler.
#if defined(__CUDACC__)
#define MLAKV_UNROLL _Pragma("unroll")
#else
#define MLAKV_UNROLL _Pragma("GCC unroll 16")
#endif

namespace mlakv::format {

inline constexpr int kCkvDim = 512;           // compressed-kv channels per row
inline constexpr int kKpeDim = 64;            // rope channels per row
inline constexpr int kBlock = 16;             // ckv channels per block scale
inline constexpr int kCkvBlocks = kCkvDim / kBlock;    // 32 scales per row
inline constexpr int kCkvPackedBytes = kCkvDim / 2;    // 256: two E2M1 per byte
inline constexpr int kCkvSfBytes = kCkvBlocks;         // 32
inline constexpr int kKpeBytes = kKpeDim;              // 64: one FP8 per channel
inline constexpr float kE4M3Max = 448.0f;

static_assert(kCkvDim % kBlock == 0, "ckv_dim must be a whole number of 16-channel blocks");
static_assert(kBlock % 2 == 0, "two E2M1 codes share a byte, so a block has an even channel count");

MLAKV_HD uint32_t FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

MLAKV_HD float BitsToFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// ---- correctly rounded float32 primitives ---------------------------------
// The device versions are the _rn intrinsics so that nvcc can neither contract
// them into an FMA nor substitute an approximate reciprocal. On the host, SSE
// scalar arithmetic is IEEE binary32 and the build forbids contraction.

// fl(a * b)
MLAKV_HD float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// fl(a + b)
MLAKV_HD float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// rcp_rn(x): the float32 nearest to 1/x (SPEC "Arithmetic").
MLAKV_HD float RcpRn(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}

// ---- fp16 / bf16 -> float32, exact (SPEC: subnormals kept) ----------------

MLAKV_HD float Bf16BitsToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

MLAKV_HD float HalfBitsToFloat(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));  // cvt.f32.f16 is exact
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return BitsToFloat(sign | 0x7F800000u | (mant << 13));  // inf / nan
  if (exp != 0) return BitsToFloat(sign | ((exp + 112u) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24 is exact in float32.
  const float mag = static_cast<float>(mant) * 5.9604644775390625e-08f;
  return BitsToFloat(sign | FloatBits(mag));
#endif
}

// ---- FP8 E4M3 (e4m3fn: bias 7, no infinities, 0x7F/0xFF are NaN) ---------

// e4m3(f): round to nearest even, saturating to +-448; NaN -> 0x7F, sign clear
// (SPEC "ckv" step 3, "kpe", "NaN and infinity").
MLAKV_HD uint8_t FloatToE4M3(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (a >= 0x43E00000u) return sign | 0x7E;  // |f| >= 448 (inf included) saturates to 448
  if (a < 0x3C800000u) {
    // |f| < 2^-6, the E4M3 subnormal range with step 2^-9. Adding 2^14 (whose
    // ulp is 2^-9) rounds |f| to that step, ties to even, in one IEEE add; the
    // low mantissa bits of the sum are then the code (0..8; 8 is 2^-6, the
    // smallest normal, whose encoding 0x08 follows on naturally).
    const float t = AddRn(BitsToFloat(a), 16384.0f);
    return sign | static_cast<uint8_t>(FloatBits(t) - 0x46800000u);
  }
  // Normal: keep 3 mantissa bits, round-half-even on the dropped 20 bits; a
  // carry out of the mantissa bumps the exponent, which is the right result.
  const uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);
  const uint32_t code = (rounded >> 20) - ((127u - 7u) << 3);
  return sign | static_cast<uint8_t>(code > 0x7Eu ? 0x7Eu : code);
}

// The float32 value of an E4M3 byte (exact).
MLAKV_HD float E4M3ToFloat(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t mant = b & 0x7u;
  if (exp == 0xF && mant == 0x7) return BitsToFloat(0x7FC00000u | sign);
  if (exp == 0) return BitsToFloat(sign | FloatBits(static_cast<float>(mant) * 0.001953125f));  // mant * 2^-9
  return BitsToFloat(sign | ((exp + 120u) << 23) | (mant << 20));
}

// ---- FP4 E2M1 -------------------------------------------------------------

// E2M1(v) (SPEC "E2M1"): sign 0x8 = signbit(v) except for NaN (the GPU's
// canonical NaN has its sign clear, so the host masks it the same way);
// magnitude code = how many of the ladder's thresholds |v| passes. Written
// branch-free, so that it vectorizes on the host and stays a straight line of
// compares on the device; NaN passes none of them and so gives 0.
MLAKV_HD uint8_t FloatToE2M1(float v) {
  const uint32_t u = FloatBits(v);
  const float m = BitsToFloat(u & 0x7FFFFFFFu);
  const uint32_t code = static_cast<uint32_t>(m > 0.25f) + static_cast<uint32_t>(m >= 0.75f) +
                        static_cast<uint32_t>(m > 1.25f) + static_cast<uint32_t>(m >= 1.75f) +
                        static_cast<uint32_t>(m > 2.5f) + static_cast<uint32_t>(m >= 3.5f) +
                        static_cast<uint32_t>(m > 5.0f);
  const uint32_t sign = (m == m) ? (u >> 28) & 0x8u : 0u;
  return static_cast<uint8_t>(sign | code);
}

// The float32 value of an E2M1 nibble.
MLAKV_HD float E2M1ToFloat(uint8_t nibble) {
  const uint32_t mag = nibble & 0x7u;
  // {0, 0.5, 1, 1.5, 2, 3, 4, 6}: exponent from bits 2..1, mantissa bit 0.
  const float value = mag < 2 ? 0.5f * static_cast<float>(mag)
                              : static_cast<float>((2u | (mag & 1u)) << ((mag >> 1) - 1)) * 0.5f;
  return (nibble & 0x8u) ? -value : value;
}

// ---- one ckv block and one kpe element -----------------------------------

// Per-layer constants derived once from the global decode scales.
struct ScaleConstants {
  float ckv_scale;  // global ckv decode scale
  float inv6g;      // rcp_rn(fl(6 * ckv_scale))          (SPEC ckv step 2)
  float inv_kpe;    // rcp_rn(kpe_scale)                  (SPEC kpe)
};

MLAKV_HD ScaleConstants MakeScaleConstants(float ckv_scale, float kpe_scale) {
  return ScaleConstants{ckv_scale, RcpRn(MulRn(6.0f, ckv_scale)), RcpRn(kpe_scale)};
}

// Steps 1-4 of SPEC "ckv" for one 16-channel block, given its amax.
// Returns the stored scale byte; *out_scale receives the element multiplier.
MLAKV_HD uint8_t CkvBlockScale(float amax, const ScaleConstants& k, float* out_scale) {
  const float sf = amax > 0.0f ? MulRn(amax, k.inv6g) : 0.0f;
  const uint8_t sf_byte = FloatToE4M3(sf);
  const float s = E4M3ToFloat(sf_byte);
  *out_scale = (amax > 0.0f && s > 0.0f) ? RcpRn(MulRn(s, k.ckv_scale)) : 0.0f;
  return sf_byte;
}

// Step 1: max |x| with NaN ignored. `x > acc` is false for NaN, which is the
// fmaxf rule for an accumulator that is never NaN itself.
MLAKV_HD float AbsMaxAccumulate(float acc, float x) {
  const float a = BitsToFloat(FloatBits(x) & 0x7FFFFFFFu);
  return a > acc ? a : acc;
}

// Step 5 for a pair of channels (2k, 2k+1) -> byte k: even channel in the low nibble.
MLAKV_HD uint8_t PackE2M1Pair(float even, float odd, float out_scale) {
  return static_cast<uint8_t>(FloatToE2M1(MulRn(even, out_scale)) |
                              (FloatToE2M1(MulRn(odd, out_scale)) << 4));
}

// SPEC "kpe": e4m3(fl(x * rcp_rn(kpe_scale))).
MLAKV_HD uint8_t QuantizeKpe(float x, const ScaleConstants& k) { return FloatToE4M3(MulRn(x, k.inv_kpe)); }

// Quantizes one whole 16-channel ckv block: 8 packed bytes and the scale byte.
MLAKV_HD uint8_t QuantizeCkvBlock(const float (&x)[kBlock], const ScaleConstants& k, uint8_t (&packed)[kBlock / 2]) {
  float amax = 0.0f;
MLAKV_UNROLL
  for (int c = 0; c < kBlock; ++c) amax = AbsMaxAccumulate(amax, x[c]);
  float out_scale;
  const uint8_t sf = CkvBlockScale(amax, k, &out_scale);
MLAKV_UNROLL
  for (int c = 0; c < kBlock / 2; ++c) packed[c] = PackE2M1Pair(x[2 * c], x[2 * c + 1], out_scale);
  return sf;
}

// Decoding (SPEC "Decoding"), float32: (e2m1 * block scale) * ckv_scale.
MLAKV_HD float DequantizeCkv(uint8_t nibble, uint8_t sf_byte, float ckv_scale) {
  return MulRn(MulRn(E2M1ToFloat(nibble), E4M3ToFloat(sf_byte)), ckv_scale);
}
MLAKV_HD float DequantizeKpe(uint8_t byte, float kpe_scale) { return MulRn(E4M3ToFloat(byte), kpe_scale); }

}  // namespace mlakv::format
