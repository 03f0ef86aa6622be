// The number-format helpers against references written independently of
// them (double arithmetic, nearest-value search), over exhaustive or dense
// sweeps. The whole kernel rests on these.
#include "kernels/nvfp4_format.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace mlakv::format {
namespace {

float F(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
uint32_t U(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Reference E4M3 decode: sign, 4-bit exponent (bias 7), 3-bit mantissa.
double RefE4M3Value(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, mant = b & 7;
  const double mag = exp == 0 ? std::ldexp(mant, -9) : std::ldexp(8 + mant, exp - 7 - 3);
  return sign ? -mag : mag;
}

// Reference E4M3 encode: nearest finite value (ties to the even code),
// saturating at 448; NaN -> 0x7F.
uint8_t RefE4M3(float f) {
  if (std::isnan(f)) return 0x7F;
  const double a = std::fabs(static_cast<double>(f));
  uint8_t best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int code = 0; code <= 0x7E; ++code) {
    const double err = std::fabs(RefE4M3Value(static_cast<uint8_t>(code)) - a);
    if (err < best_err || (err == best_err && (code % 2) == 0)) {
      best = static_cast<uint8_t>(code);
      best_err = err;
    }
  }
  if (a >= 448.0) best = 0x7E;
  return static_cast<uint8_t>((std::signbit(f) ? 0x80 : 0) | best);
}

// Reference E2M1: nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to even code, saturating.
uint8_t RefE2M1(float v) {
  if (std::isnan(v)) return 0;
  static const double kValues[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  const double a = std::fabs(static_cast<double>(v));
  int best = 0;
  double best_err = std::numeric_limits<double>::infinity();
  for (int code = 0; code < 8; ++code) {
    const double err = std::fabs(kValues[code] - a);
    if (err < best_err || (err == best_err && code % 2 == 0)) {
      best = code;
      best_err = err;
    }
  }
  if (a > 6.0) best = 7;
  return static_cast<uint8_t>((std::signbit(v) ? 8 : 0) | best);
}

TEST(E2M1, SpecExamples) {
  EXPECT_EQ(FloatToE2M1(0.25f), 0);
  EXPECT_EQ(FloatToE2M1(0.75f), 2);
  EXPECT_EQ(FloatToE2M1(1.25f), 2);
  EXPECT_EQ(FloatToE2M1(1.75f), 4);
  EXPECT_EQ(FloatToE2M1(2.5f), 4);
  EXPECT_EQ(FloatToE2M1(3.5f), 6);
  EXPECT_EQ(FloatToE2M1(5.0f), 6);
  EXPECT_EQ(FloatToE2M1(7.0f), 7);
  EXPECT_EQ(FloatToE2M1(-0.0f), 0x8);
  EXPECT_EQ(FloatToE2M1(-0.1f), 0x8);
  EXPECT_EQ(FloatToE2M1(std::numeric_limits<float>::infinity()), 0x7);
  EXPECT_EQ(FloatToE2M1(-std::numeric_limits<float>::infinity()), 0xF);
}

TEST(E2M1, NanEncodesAsPositiveZeroWhateverItsSign) {
  EXPECT_EQ(FloatToE2M1(F(0x7FC00000u)), 0);
  EXPECT_EQ(FloatToE2M1(F(0xFFC00000u)), 0);
  EXPECT_EQ(FloatToE2M1(F(0xFF800001u)), 0);
}

TEST(E2M1, MatchesNearestValueReferenceAroundEveryThreshold) {
  const float thresholds[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f, 6.0f, 0.5f, 1.0f, 2.0f, 4.0f};
  for (float t : thresholds) {
    float v = t;
    for (int i = 0; i < 4; ++i) v = std::nextafter(v, 0.0f);
    for (int i = 0; i < 9; ++i, v = std::nextafter(v, 100.0f)) {
      EXPECT_EQ(FloatToE2M1(v), RefE2M1(v)) << v;
      EXPECT_EQ(FloatToE2M1(-v), RefE2M1(-v)) << -v;
    }
  }
}

TEST(E2M1, MatchesReferenceOnRandomFloats) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> d(-8.0f, 8.0f);
  for (int i = 0; i < 200000; ++i) {
    const float v = d(rng);
    ASSERT_EQ(FloatToE2M1(v), RefE2M1(v)) << v;
  }
}

// The table form (E2M1TableIndex) against the arithmetic on every
// non-negative float32 bit pattern (the index ignores the sign, as the
// magnitude does): 2^31 patterns, every bucket, every threshold, NaN and inf.
TEST(E2M1, TableFormMatchesTheArithmeticOnEveryFloat) {
  std::vector<uint8_t> table(kE2M1TableSize);
  for (uint32_t i = 0; i < kE2M1TableSize; ++i) {
    table[i] = static_cast<uint8_t>(FloatToE2M1Magnitude(E2M1TableRepresentative(i)));
  }
  uint64_t mismatches = 0;
  uint32_t first_bad = 0;
  for (uint64_t u = 0; u <= 0x7FFFFFFFu; ++u) {
    const uint32_t bits = static_cast<uint32_t>(u);
    if (table[E2M1TableIndex(bits)] != FloatToE2M1Magnitude(BitsToFloat(bits))) {
      if (mismatches++ == 0) first_bad = bits;
    }
  }
  EXPECT_EQ(mismatches, 0u) << "first at bits 0x" << std::hex << first_bad;
  // The sign does not move a value to another bucket.
  for (uint32_t bits : {0x3E800000u, 0x3F400000u, 0x40A00001u, 0x7FC00000u, 0x7F800000u}) {
    EXPECT_EQ(E2M1TableIndex(bits), E2M1TableIndex(bits | 0x80000000u));
  }
}

TEST(E2M1, DecodesToTheGrid) {
  const float expect[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = E2M1ToFloat(static_cast<uint8_t>(c));
    EXPECT_EQ(v, c & 8 ? -expect[c & 7] : expect[c & 7]) << c;
    EXPECT_EQ(FloatToE2M1(v) & 7, c & 7) << "round trip of code " << c;
  }
}

TEST(E4M3, DecodeMatchesReferenceForAllBytes) {
  for (int b = 0; b < 256; ++b) {
    const float v = E4M3ToFloat(static_cast<uint8_t>(b));
    if ((b & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(v)) << b;
    } else {
      EXPECT_EQ(static_cast<double>(v), RefE4M3Value(static_cast<uint8_t>(b))) << b;
    }
  }
}

TEST(E4M3, EncodeRoundTripsEveryFiniteByte) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7F) == 0x7F) continue;
    EXPECT_EQ(FloatToE4M3(E4M3ToFloat(static_cast<uint8_t>(b))), b) << b;
  }
}

TEST(E4M3, EncodeMatchesReferenceAtEveryMidpoint) {
  // Midpoints between neighbours (ties), and one float either side of each.
  for (int b = 0; b < 0x7E; ++b) {
    const double mid = (RefE4M3Value(static_cast<uint8_t>(b)) + RefE4M3Value(static_cast<uint8_t>(b + 1))) / 2;
    const float m = static_cast<float>(mid);
    ASSERT_EQ(static_cast<double>(m), mid);
    for (float v : {std::nextafter(m, 0.0f), m, std::nextafter(m, 1000.0f)}) {
      EXPECT_EQ(FloatToE4M3(v), RefE4M3(v)) << v;
      EXPECT_EQ(FloatToE4M3(-v), RefE4M3(-v)) << -v;
    }
  }
}

TEST(E4M3, SaturatesAndHandlesNonFinite) {
  EXPECT_EQ(FloatToE4M3(448.0f), 0x7E);
  EXPECT_EQ(FloatToE4M3(463.99f), 0x7E);
  EXPECT_EQ(FloatToE4M3(464.0f), 0x7E);
  EXPECT_EQ(FloatToE4M3(1e30f), 0x7E);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::infinity()), 0x7E);
  EXPECT_EQ(FloatToE4M3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(FloatToE4M3(F(0x7FC00000u)), 0x7F);
  EXPECT_EQ(FloatToE4M3(F(0xFFC00000u)), 0x7F);
  EXPECT_EQ(FloatToE4M3(-0.0f), 0x80);
  EXPECT_EQ(FloatToE4M3(std::numeric_limits<float>::denorm_min()), 0x00);
}

TEST(E4M3, EncodeMatchesReferenceOnDenseSweepOfFloat32) {
  // Every 4099th bit pattern of the positive floats below 512 (and their
  // negatives): about a quarter million values across all exponents.
  for (uint32_t u = 0; u < U(512.0f); u += 4099) {
    const float v = F(u);
    ASSERT_EQ(FloatToE4M3(v), RefE4M3(v)) << v << " bits " << u;
    ASSERT_EQ(FloatToE4M3(-v), RefE4M3(-v)) << -v;
  }
}

TEST(HalfToFloat, AllBitPatternsMatchReference) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const int sign = h >> 15, exp = (h >> 10) & 31, mant = h & 1023;
    const float got = HalfBitsToFloat(static_cast<uint16_t>(h));
    if (exp == 31) {
      EXPECT_TRUE(mant ? std::isnan(got) : std::isinf(got)) << h;
      continue;
    }
    const double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
    EXPECT_EQ(static_cast<double>(got), sign ? -mag : mag) << h;
    EXPECT_EQ(std::signbit(got), sign == 1) << h;
  }
}

TEST(Bf16ToFloat, IsTheHighHalfOfFloat32) {
  EXPECT_EQ(Bf16BitsToFloat(0x3F80), 1.0f);
  EXPECT_EQ(Bf16BitsToFloat(0xC000), -2.0f);
  EXPECT_EQ(Bf16BitsToFloat(0x0001), F(0x00010000u));  // subnormal kept
}

TEST(RcpRn, IsCorrectlyRounded) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<uint32_t> bits(0x00800000u, 0x7F7FFFFFu);  // positive normals
  for (int i = 0; i < 100000; ++i) {
    const float x = F(bits(rng));
    const float r = RcpRn(x);
    // r*x in double is exact (24 x 24 bits); no neighbour of r may be closer to 1/x.
    const double err = std::fabs(static_cast<double>(r) * x - 1.0);
    for (float n : {std::nextafter(r, 0.0f), std::nextafter(r, std::numeric_limits<float>::infinity())}) {
      if (std::isinf(n) || n == 0.0f) continue;
      ASSERT_LE(err, std::fabs(static_cast<double>(n) * x - 1.0)) << "x=" << x;
    }
  }
}

TEST(CkvBlock, ScaleFollowsSpecSteps) {
  const ScaleConstants k = MakeScaleConstants(0.5f, 1.0f);
  float x[16] = {};
  x[3] = 12.0f;  // amax 12: sf = 12 / (6 * 0.5) = 4 -> e4m3 4.0 exactly
  x[4] = -3.0f;
  uint8_t packed[8];
  const uint8_t sf = QuantizeCkvBlock(x, k, packed);
  EXPECT_EQ(E4M3ToFloat(sf), 4.0f);
  // out_scale = 1 / (4 * 0.5) = 0.5: 12 -> 6 (code 7, odd channel 3 -> high nibble of byte 1),
  // -3 -> -1.5 (code 0xB, even channel 4 -> low nibble of byte 2).
  EXPECT_EQ(packed[1], 0x70);
  EXPECT_EQ(packed[2], 0x0B);
  EXPECT_EQ(packed[0], 0x00);
}

TEST(CkvBlock, AllZeroAndAllNanBlocksHaveZeroScale) {
  const ScaleConstants k = MakeScaleConstants(1.0f, 1.0f);
  float zeros[16] = {};
  float nans[16];
  for (float& v : nans) v = std::numeric_limits<float>::quiet_NaN();
  uint8_t packed[8];
  EXPECT_EQ(QuantizeCkvBlock(zeros, k, packed), 0);
  for (uint8_t b : packed) EXPECT_EQ(b, 0);
  EXPECT_EQ(QuantizeCkvBlock(nans, k, packed), 0);
  for (uint8_t b : packed) EXPECT_EQ(b, 0) << "NaN encodes as +0 even with out_scale 0";
}

TEST(CkvBlock, InfiniteElementSaturatesScale) {
  const ScaleConstants k = MakeScaleConstants(1.0f, 1.0f);
  float x[16] = {};
  x[0] = -std::numeric_limits<float>::infinity();
  x[1] = 1.0f;
  uint8_t packed[8];
  EXPECT_EQ(QuantizeCkvBlock(x, k, packed), 0x7E);
  EXPECT_EQ(packed[0] & 0xF, 0xF);  // -inf -> -6
}

}  // namespace
// ---- float32 -> bf16 / fp16 --------------------------------------------------

TEST(Bf16, EveryValueRoundTripsAndEveryMidpointRoundsToEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const uint32_t bits = h << 16;
    const float x = BitsToFloat(bits);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(Bf16BitsToFloat(FloatToBf16Bits(x)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToBf16Bits(x), h) << std::hex << h;
    if ((h & 0x7FFFu) >= 0x7F80u) continue;  // inf: no midpoint above it
    // Midpoint to the next pattern of larger magnitude: to even; above it: away.
    ASSERT_EQ(FloatToBf16Bits(BitsToFloat(bits | 0x8000u)), (h & 1u) ? h + 1 : h) << std::hex << h;
    ASSERT_EQ(FloatToBf16Bits(BitsToFloat(bits | 0x8001u)), h + 1) << std::hex << h;
    ASSERT_EQ(FloatToBf16Bits(BitsToFloat(bits | 0x7FFFu)), h) << std::hex << h;
  }
}

TEST(Half, EveryValueRoundTripsAndEveryMidpointRoundsToEven) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float x = HalfBitsToFloat(static_cast<uint16_t>(h));
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(HalfBitsToFloat(FloatToHalfBits(x)))) << std::hex << h;
      continue;
    }
    ASSERT_EQ(FloatToHalfBits(x), h) << std::hex << h;
    if ((h & 0x7FFFu) >= 0x7C00u) continue;  // inf
    // The next value of larger magnitude, subnormals included (after 65504 the
    // grid's next step would be 65536, so its midpoint is 65520, which rounds
    // to inf); the midpoint is exact in float32.
    const float next = (h & 0x7FFFu) == 0x7BFFu ? std::copysign(65536.0f, x)
                                                 : HalfBitsToFloat(static_cast<uint16_t>(h + 1));
    const float mid = (x + next) / 2;
    ASSERT_EQ(FloatToHalfBits(mid), (h & 1u) ? h + 1 : h) << std::hex << h;
    ASSERT_EQ(FloatToHalfBits(std::nextafter(mid, next)), h + 1) << std::hex << h;
    ASSERT_EQ(FloatToHalfBits(std::nextafter(mid, x)), h) << std::hex << h;
  }
  EXPECT_EQ(FloatToHalfBits(65519.996f), 0x7BFF);  // below the 65504 | inf midpoint
  EXPECT_EQ(FloatToHalfBits(65520.0f), 0x7C00);
  EXPECT_EQ(FloatToHalfBits(-std::numeric_limits<float>::infinity()), 0xFC00);
  EXPECT_EQ(FloatToHalfBits(std::numeric_limits<float>::denorm_min()), 0x0000);  // far under 2^-25
  EXPECT_EQ(FloatToHalfBits(-0.0f), 0x8000);
}

}  // namespace mlakv::format
