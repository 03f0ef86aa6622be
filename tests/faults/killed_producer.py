"""A producer that the fault test kills mid-stream: it opens an Append stream,
sends its first message, says so on stdout, then either keeps sending
messages of ~0.9 MB ("big", so the kill lands mid-message more often than
not) or stalls ("stall"). It never half-closes.

    killed_producer.py TARGET SEQUENCE big|stall
"""

import sys
import time

import grpc

import mlakv  # noqa: F401  (puts the generated stubs on the path)
from mlakv.v1 import kv_cache_pb2 as pb

BF16_ONE = b"\x80\x3f"


def rows(sequence, start, n):
    m = pb.AppendRequest(sequence=sequence, start=start, row_count=n, dtype=pb.ROW_DTYPE_BFLOAT16)
    m.layers.add(layer=0, ckv=BF16_ONE * 512 * n, kpe=BF16_ONE * 64 * n, ckv_scale=1.0, kpe_scale=1.0)
    return m.SerializeToString()


def main():
    target, sequence, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    channel = grpc.insecure_channel(target)
    append = channel.stream_unary("/mlakv.v1.KvCache/Append", request_serializer=None,
                                  response_deserializer=pb.AppendResponse.FromString)

    def messages():
        yield rows(sequence, 0, 4)
        sys.stdout.write("sent first message\n")
        sys.stdout.flush()
        start = 4
        while True:
            if mode == "big":
                yield rows("", start, 800)
                start += 800
            else:
                time.sleep(60)

    append(messages(), timeout=120)


if __name__ == "__main__":
    main()
