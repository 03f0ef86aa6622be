// The NVFP4 / FP8 number formats of the MLA cache, written once for the CPU
// path and the CUDA kernel (every function here is __host__ __device__).
//
// docs/format.md ("Arithmetic") is the contract; each function names the rule it
// implements. Everything is float32 with IEEE round-to-nearest-even and no
// flush-to-zero. This header must never be compiled with fast-math or with
// floating-point contraction (the build sets -ffp-contract=off / --fmad=false),
// and the helpers below pin each rounding explicitly on the device.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
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
// Cache bytes of one token in one layer, over the three caches: 352.
inline constexpr int kEntryBytes = kCkvPackedBytes + kCkvSfBytes + kKpeBytes;
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

// rcp_rn(x): the float32 nearest to 1/x (docs/format.md "Arithmetic").
MLAKV_HD float RcpRn(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}

// max(a, b) where a NaN `a` loses (b is never NaN here): fmaxf semantics.
MLAKV_HD float MaxDroppingNan(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fmaxf(a, b);
#else
  return a > b ? a : b;  // compiles to maxss/maxps with the NaN-dropping operand order
#endif
}

// clamp(a, 0, 1) with NaN -> 0 (the GPU's .sat modifier).
MLAKV_HD float Saturate(float a) {
#if defined(__CUDA_ARCH__)
  return __saturatef(a);
#else
  const float lo = a > 0.0f ? a : 0.0f;  // NaN fails the test and becomes 0
  return lo < 1.0f ? lo : 1.0f;
#endif
}

// min(a, b) for non-NaN operands.
MLAKV_HD float MinOf(float a, float b) {
#if defined(__CUDA_ARCH__)
  return fminf(a, b);
#else
  return a < b ? a : b;
#endif
}

// ---- fp16 / bf16 -> float32, exact (docs/format.md: subnormals kept) ----------------

MLAKV_HD float Bf16BitsToFloat(uint16_t h) { return BitsToFloat(static_cast<uint32_t>(h) << 16); }

MLAKV_HD float HalfBitsToFloat(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));  // cvt.f32.f16 is exact
#else
  // Branch-free (every case computed, one selected) so that loops vectorize.
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t mant = h & 0x3FFu;
  const uint32_t normal = ((exp + 112u) << 23) | (mant << 13);
  const uint32_t inf_nan = 0x7F800000u | (mant << 13);
  // zero or subnormal: mant * 2^-24 is exact in float32.
  const uint32_t subnormal = FloatBits(static_cast<float>(static_cast<int32_t>(mant)) * 5.9604644775390625e-08f);
  return BitsToFloat(sign | (exp == 0x1Fu ? inf_nan : exp == 0u ? subnormal : normal));
#endif
}

// ---- float32 -> bf16 / fp16, round to nearest even (rows that tools and tests make) ----

// NaN stays a quiet NaN.
MLAKV_HD uint16_t FloatToBf16Bits(float f) {
  const uint32_t u = FloatBits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Subnormals kept; |f| >= 65520 (inf included) -> inf; NaN -> a quiet NaN.
MLAKV_HD uint16_t FloatToHalfBits(float f) {
  const uint32_t u = FloatBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // |f| < 2^-14 is fp16's subnormal range, step 2^-24: adding 0.5 (whose ulp
  // is 2^-24) rounds |f| to that step, ties to even, in one IEEE add, and the
  // sum's low mantissa bits are the code (1024 is the smallest normal, 0x0400).
  const uint32_t sub = FloatBits(AddRn(BitsToFloat(a < 0x38800000u ? a : 0u), 0.5f)) - 0x3F000000u;
  // Normal: keep 10 mantissa bits, round-half-even on the dropped 13; a carry
  // out of the mantissa bumps the exponent, which is the right result.
  const uint32_t normal = ((a + 0xFFFu + ((a >> 13) & 1u)) >> 13) - ((127u - 15u) << 10);
  uint32_t code = a < 0x38800000u ? sub : normal;
  code = a >= 0x477FF000u ? 0x7C00u : code;  // 65520 is the midpoint 65504 | inf: to even is inf
  return static_cast<uint16_t>(sign | (a > 0x7F800000u ? 0x7E00u : code));
}

// ---- FP8 E4M3 (e4m3fn: bias 7, no infinities, 0x7F/0xFF are NaN) ---------

// e4m3(f): round to nearest even, saturating to +-448; NaN -> 0x7F, sign clear
// (docs/format.md "ckv" step 3, "kpe", "NaN and infinity").
MLAKV_HD uint8_t FloatToE4M3(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // cvt.rn.satfinite.e4m3x2.f32: the same rounding, saturation and NaN -> 0x7F
  // in one instruction (the GPU tests compare it with the code below bit for bit).
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3));
#else
  // Branch-free (every path computed, one selected) so that host loops vectorize.
  const uint32_t u = FloatBits(f);
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t sign = (u >> 24) & 0x80u;
  // |f| < 2^-6 is E4M3's subnormal range, step 2^-9. Adding 2^14 (whose ulp is
  // 2^-9) rounds |f| to that step, ties to even, in one IEEE add; the sum's
  // low mantissa bits are then the code (0..8; 8 is 2^-6, the smallest normal,
  // whose encoding 0x08 follows on naturally).
  const bool is_subnormal = a < 0x3C800000u;
  const uint32_t sub = FloatBits(AddRn(BitsToFloat(is_subnormal ? a : 0u), 16384.0f)) - 0x46800000u;
  // Normal: keep 3 mantissa bits, round-half-even on the dropped 20 bits; a
  // carry out of the mantissa bumps the exponent, which is the right result.
  const uint32_t rounded = a + 0x7FFFFu + ((a >> 20) & 1u);
  const uint32_t normal = (rounded >> 20) - ((127u - 7u) << 3);
  uint32_t code = is_subnormal ? sub : normal;
  code = a >= 0x43E00000u ? 0x7Eu : code;  // |f| >= 448 (inf included) saturates to 448
  return static_cast<uint8_t>(a > 0x7F800000u ? 0x7Fu : (sign | code));  // NaN -> 0x7F, sign clear
#endif
}

// Two values at once (one instruction on the GPU): low byte = e4m3(lo).
MLAKV_HD uint16_t FloatPairToE4M3x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<uint16_t>(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3));
#else
  return static_cast<uint16_t>(FloatToE4M3(lo) | (FloatToE4M3(hi) << 8));
#endif
}

// The float32 value of an E4M3 byte (exact). NaN bytes give the GPU's
// canonical NaN 0x7FFFFFFF on the host; on the device a NaN's payload never
// matters because every use multiplies it, which canonicalizes it.
MLAKV_HD float E4M3ToFloat(uint8_t b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));  // e4m3 -> f16 -> f32, both exact
#else
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24;
  const uint32_t exp = (b >> 3) & 0xFu;
  const uint32_t mant = b & 0x7u;
  const uint32_t normal = ((exp + 120u) << 23) | (mant << 20);
  const uint32_t subnormal = FloatBits(static_cast<float>(static_cast<int32_t>(mant)) * 0.001953125f);  // mant * 2^-9
  const uint32_t bits = sign | (exp == 0u ? subnormal : normal);
  return BitsToFloat((b & 0x7Fu) == 0x7Fu ? 0x7FFFFFFFu : bits);
#endif
}

// ---- FP4 E2M1 -------------------------------------------------------------

// E2M1(v) (docs/format.md "ckv", E2M1): round-to-nearest-even onto {0, .5, 1, 1.5, 2, 3, 4,
// 6}, saturating at 6; sign 0x8 = signbit(v); NaN -> 0 with the sign clear.
// Written as one IEEE addition instead of docs/format.md's ladder of seven compares
// (the tests check it against the ladder's values). Work on m = |v| / 8,
// clamped to [0, 1] with NaN -> 0 (one saturating multiply on the GPU; exact,
// since values small enough for the division to round give code 0 anyway).
// The grid, divided by 8, has step 1/16 on [0, 1/4), 1/8 on [1/4, 1/2) and
// 1/4 on [1/2, 1]; adding C = 2^(19 + k), whose ulp is that step (k = 0, 1, 2
// for m's binade, clamped), rounds m to the grid ties-to-even in the adder,
// and the ulps of C in the sum are the code minus 2k.
MLAKV_HD uint32_t FloatToE2M1Magnitude(float v) {
  const float m = Saturate(MulRn(fabsf(v), 0.125f));
  constexpr uint32_t kLo = 0x3E000000u;      // 2^-3: binade of [0, 2) / 8, step 0.5 / 8
  constexpr uint32_t kHi = 0x3F000000u;      // 2^-1: binade of [4, 8] / 8, step 2 / 8
  constexpr uint32_t kShift = 22u << 23;     // times 2^22: C's ulp is the step
  uint32_t c = FloatBits(m) & 0x7F800000u;   // 2^exponent(m)
  c = (c < kLo ? kLo : c) + kShift;
  c = c > kHi + kShift ? kHi + kShift : c;   // C = 2^(19 + k), k in {0, 1, 2}
  const uint32_t ulps = FloatBits(AddRn(m, BitsToFloat(c))) - c;
  const uint32_t two_k = (c >> 22) - 2u * (127u + 19u);
  const uint32_t code = ulps + two_k;
  return code > 7u ? 7u : code;  // m == 1 (|v| >= 8) rounds to 8 = code 8
}

// The whole nibble: magnitude code and sign.
MLAKV_HD uint8_t FloatToE2M1(float v) {
  const uint32_t u = FloatBits(v);
#if defined(__CUDA_ARCH__)
  // v is always a __fmul_rn product on the device, whose NaN is canonical
  // (sign clear), so the sign bit can be taken as it is.
  const uint32_t sign = (u >> 28) & 0x8u;
#else
  const uint32_t sign = (v == v) ? (u >> 28) & 0x8u : 0u;
#endif
  return static_cast<uint8_t>(sign | FloatToE2M1Magnitude(v));
}

// E2M1 magnitude codes by table (the CUDA kernel's form for large launches):
// every float maps to one of 2048 buckets — its exponent, its top two
// mantissa bits, and whether any lower mantissa bit is set. Every E2M1
// rounding threshold (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) and grid point has
// at most two significant mantissa bits, so it is the first value of a bucket
// (sticky clear) and the rest of the bucket lies strictly between two
// thresholds: all floats of a bucket share FloatToE2M1Magnitude's code, NaN
// (exponent 255, mantissa non-zero) and infinity included. The table is
// filled from FloatToE2M1Magnitude itself on each bucket's first value, so
// the arithmetic still has one source; tests check every float against it.
constexpr int kE2M1TableSize = 2048;
MLAKV_HD uint32_t E2M1TableIndex(uint32_t bits) {
  const uint32_t rest = bits << 11;                           // the 21 lower mantissa bits
  return ((bits >> 20) & 0x7FEu) | (rest < 1u ? rest : 1u);  // exponent, 2 mantissa bits (no sign); sticky
}
// The first float of bucket `index` (the value the table is filled from).
MLAKV_HD float E2M1TableRepresentative(uint32_t index) { return BitsToFloat(((index >> 1) << 21) | (index & 1u)); }

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
  float inv6g;      // rcp_rn(fl(6 * ckv_scale))          (docs/format.md ckv step 2)
  float inv_kpe;    // rcp_rn(kpe_scale)                  (docs/format.md kpe)
};

MLAKV_HD ScaleConstants MakeScaleConstants(float ckv_scale, float kpe_scale) {
  return ScaleConstants{ckv_scale, RcpRn(MulRn(6.0f, ckv_scale)), RcpRn(kpe_scale)};
}

// Steps 2-3 of docs/format.md "ckv": the stored scale byte of a block with this amax.
// (docs/format.md's "else 0" needs no test: amax is never NaN and inv6g is always
// finite, since ckv_scale is a positive normal float32, so amax == 0 gives 0.)
MLAKV_HD uint8_t CkvScaleByte(float amax, const ScaleConstants& k) { return FloatToE4M3(MulRn(amax, k.inv6g)); }

// Step 4: the element multiplier for a stored scale byte. It depends on the
// byte alone (for one ckv_scale), so the GPU tabulates it once per launch.
// (s > 0 already implies amax > 0.) Branch-free, so that host loops vectorize.
MLAKV_HD float CkvOutScale(uint8_t sf_byte, const ScaleConstants& k) {
  const float s = E4M3ToFloat(sf_byte);
  const float inv = RcpRn(MulRn(s, k.ckv_scale));
  return s > 0.0f ? inv : 0.0f;
}

// Steps 2-4 together. Returns the stored scale byte; *out_scale receives the
// element multiplier.
MLAKV_HD uint8_t CkvBlockScale(float amax, const ScaleConstants& k, float* out_scale) {
  const uint8_t sf_byte = CkvScaleByte(amax, k);
  *out_scale = CkvOutScale(sf_byte, k);
  return sf_byte;
}

// Step 1: max |x| with NaN ignored (fmaxf: the accumulator is never NaN).
MLAKV_HD float AbsMaxAccumulate(float acc, float x) {
  return MaxDroppingNan(fabsf(x), acc);
}

// Step 5 for a pair of channels (2k, 2k+1) -> byte k: even channel in the low nibble.
MLAKV_HD uint8_t PackE2M1Pair(float even, float odd, float out_scale) {
  return static_cast<uint8_t>(FloatToE2M1(MulRn(even, out_scale)) |
                              (FloatToE2M1(MulRn(odd, out_scale)) << 4));
}

// docs/format.md "kpe": e4m3(fl(x * rcp_rn(kpe_scale))).
MLAKV_HD uint8_t QuantizeKpe(float x, const ScaleConstants& k) { return FloatToE4M3(MulRn(x, k.inv_kpe)); }
MLAKV_HD uint16_t QuantizeKpePair(float lo, float hi, const ScaleConstants& k) {
  return FloatPairToE4M3x2(MulRn(lo, k.inv_kpe), MulRn(hi, k.inv_kpe));
}

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

// Decoding (docs/format.md "Decoding"), float32: (e2m1 * block scale) * ckv_scale.
MLAKV_HD float DequantizeCkv(uint8_t nibble, uint8_t sf_byte, float ckv_scale) {
  return MulRn(MulRn(E2M1ToFloat(nibble), E4M3ToFloat(sf_byte)), ckv_scale);
}
MLAKV_HD float DequantizeKpe(uint8_t byte, float kpe_scale) { return MulRn(E4M3ToFloat(byte), kpe_scale); }

}  // namespace mlakv::format
