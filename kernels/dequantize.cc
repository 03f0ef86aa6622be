#include "kernels/dequantize.h"

#include "kernels/nvfp4_format.h"

namespace mlakv {

void DequantizeHost(const DequantizeParams& p) {
  using namespace format;
  for (int64_t i = 0; i < p.num_rows; ++i) {
    const uint8_t* packed = p.ckv_packed + i * kCkvPackedBytes;
    const uint8_t* sf = p.ckv_sf + i * kCkvSfBytes;
    float* ckv = p.out_ckv + i * kCkvDim;
    for (int c = 0; c < kCkvDim; ++c) {
      const uint8_t nibble = (packed[c / 2] >> (4 * (c % 2))) & 0xF;
      ckv[c] = DequantizeCkv(nibble, sf[c / kBlock], p.ckv_scale);
    }
    for (int c = 0; c < kKpeDim; ++c) p.out_kpe[i * kKpeDim + c] = DequantizeKpe(p.kpe[i * kKpeBytes + c], p.kpe_scale);
  }
}

}  // namespace mlakv
