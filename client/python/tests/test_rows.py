"""Client-side row handling, no server: dtypes, shapes, byte order, chunk plan."""

import unittest

import grpc
import numpy as np

import mlakv
from mlakv import rows


class RowsTest(unittest.TestCase):
    def test_float16_is_little_endian_fp16(self):
        ckv = np.arange(3 * 512, dtype=np.float32).reshape(3, 512).astype(np.float16)
        kpe = np.ones((3, 64), np.float16)
        c, k, dtype, n = rows.prepare(ckv, kpe)
        self.assertEqual(dtype, mlakv.pb.ROW_DTYPE_FLOAT16)
        self.assertEqual(n, 3)
        self.assertEqual(c.tobytes(), ckv.tobytes())
        self.assertEqual(k.tobytes()[:2], b"\x00\x3c")  # 1.0 = 0x3C00, little-endian

    def test_big_endian_input_is_swapped(self):
        ckv = np.full((2, 512), 1.0, dtype=">f2")
        kpe = np.full((2, 64), 1.0, dtype=">u2")
        with self.assertRaises(mlakv.Error):  # f16 ckv with bf16 kpe
            rows.prepare(ckv, kpe)
        c, k, dtype, _ = rows.prepare(ckv, np.full((2, 64), 1.0, dtype=">f2"))
        self.assertEqual(c.tobytes()[:2], b"\x00\x3c")
        c, k, dtype, _ = rows.prepare(np.full((2, 512), 0x3F80, dtype=">u2"), kpe.astype(">u2"))
        self.assertEqual(dtype, mlakv.pb.ROW_DTYPE_BFLOAT16)
        self.assertEqual(c.tobytes()[:2], b"\x80\x3f")

    def test_uint16_is_bf16_bits(self):
        ckv = np.full((1, 512), 0x3F80, np.uint16)
        kpe = np.full((1, 64), 0x3F80, np.uint16)
        c, k, dtype, n = rows.prepare(ckv, kpe)
        self.assertEqual(dtype, mlakv.pb.ROW_DTYPE_BFLOAT16)
        self.assertEqual(c.tobytes(), b"\x80\x3f" * 512)

    def test_single_row_and_strided_input(self):
        big = np.zeros((4, 1024), np.float16)
        c, k, _, n = rows.prepare(big[:, ::2], np.zeros((4, 64), np.float16))  # non-contiguous view
        self.assertTrue(c.flags.c_contiguous)
        self.assertEqual(n, 4)
        c, k, _, n = rows.prepare(np.zeros(512, np.float16), np.zeros(64, np.float16))
        self.assertEqual((c.shape, n), ((1, 512), 1))

    def test_multi_layer_shape(self):
        c, k, _, n = rows.prepare(np.zeros((3, 5, 512), np.float16), np.zeros((3, 5, 64), np.float16), leading=(3,))
        self.assertEqual(n, 5)
        with self.assertRaises(mlakv.Error):
            rows.prepare(np.zeros((2, 5, 512), np.float16), np.zeros((2, 5, 64), np.float16), leading=(3,))

    def test_refusals_are_invalid_argument(self):
        good_kpe = np.zeros((2, 64), np.float16)
        cases = {
            "float32": (np.zeros((2, 512), np.float32), good_kpe),
            "int16": (np.zeros((2, 512), np.int16), good_kpe),
            "width": (np.zeros((2, 511), np.float16), good_kpe),
            "rank": (np.zeros((1, 2, 512), np.float16), good_kpe),
            "rows": (np.zeros((3, 512), np.float16), good_kpe),
            "list": ([[0.0] * 512], good_kpe),
        }
        for name, (ckv, kpe) in cases.items():
            with self.subTest(name):
                with self.assertRaises(mlakv.Error) as ctx:
                    rows.prepare(ckv, kpe)
                self.assertEqual(ctx.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertTrue(ctx.exception.message.startswith("client: "))

    def test_error_str_names_code(self):
        e = mlakv.Error(grpc.StatusCode.NOT_FOUND, "sequence 'x' not found")
        self.assertEqual(str(e), "NOT_FOUND: sequence 'x' not found")


if __name__ == "__main__":
    unittest.main()
