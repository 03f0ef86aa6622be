"""grpcurl-style `describe` from a server reflection answer fetched by buf curl.

buf curl has no describe verb, so the test calls the reflection service itself
(ServerReflectionInfo with file_containing_symbol) through buf curl and pipes
the JSON answer here; this prints the named symbol the way `grpcurl describe`
does, from the FileDescriptorProtos the server sent (nothing from proto/).

    buf curl ... -d '{"fileContainingSymbol":"mlakv.v1.KvCache"}' \
        http://HOST:PORT/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo \
      | python3 describe.py mlakv.v1.KvCache
"""

import base64
import json
import sys

from google.protobuf import descriptor_pb2

F = descriptor_pb2.FieldDescriptorProto
SCALARS = {
    F.TYPE_DOUBLE: "double", F.TYPE_FLOAT: "float", F.TYPE_INT64: "int64", F.TYPE_UINT64: "uint64",
    F.TYPE_INT32: "int32", F.TYPE_FIXED64: "fixed64", F.TYPE_FIXED32: "fixed32", F.TYPE_BOOL: "bool",
    F.TYPE_STRING: "string", F.TYPE_BYTES: "bytes", F.TYPE_UINT32: "uint32", F.TYPE_SFIXED32: "sfixed32",
    F.TYPE_SFIXED64: "sfixed64", F.TYPE_SINT32: "sint32", F.TYPE_SINT64: "sint64",
}


def files_from(answer):
    """FileDescriptorProtos of every response in a (possibly multi-document) JSON stream."""
    dec, pos, out = json.JSONDecoder(), 0, []
    answer = answer.strip()
    while pos < len(answer):
        doc, end = dec.raw_decode(answer, pos)
        pos = end
        while pos < len(answer) and answer[pos].isspace():
            pos += 1
        if "errorResponse" in doc:
            raise SystemExit("reflection error: %s" % doc["errorResponse"])
        for b64 in doc.get("fileDescriptorResponse", {}).get("fileDescriptorProto", []):
            fd = descriptor_pb2.FileDescriptorProto()
            fd.ParseFromString(base64.b64decode(b64))
            out.append(fd)
    return out


def field_line(f):
    label = "repeated " if f.label == F.LABEL_REPEATED else ""
    typ = SCALARS.get(f.type, f.type_name)
    return "  %s%s %s = %d;" % (label, typ, f.name, f.number)


def describe(files, symbol):
    for fd in files:
        pkg = fd.package + "." if fd.package else ""
        for svc in fd.service:
            if pkg + svc.name == symbol:
                lines = ["%s is a service:" % symbol, "service %s {" % svc.name]
                for m in svc.method:
                    lines.append("  rpc %s ( %s%s ) returns ( %s%s );" % (
                        m.name, "stream " if m.client_streaming else "", m.input_type,
                        "stream " if m.server_streaming else "", m.output_type))
                return lines + ["}"]
            for m in svc.method:
                if "%s%s.%s" % (pkg, svc.name, m.name) == symbol:
                    return ["%s is a method:" % symbol, "rpc %s ( %s%s ) returns ( %s%s );" % (
                        m.name, "stream " if m.client_streaming else "", m.input_type,
                        "stream " if m.server_streaming else "", m.output_type)]
        for msg in fd.message_type:
            if pkg + msg.name == symbol:
                return (["%s is a message:" % symbol, "message %s {" % msg.name]
                        + [field_line(f) for f in msg.field] + ["}"])
        for enum in fd.enum_type:
            if pkg + enum.name == symbol:
                return (["%s is an enum:" % symbol, "enum %s {" % enum.name]
                        + ["  %s = %d;" % (v.name, v.number) for v in enum.value] + ["}"])
    raise SystemExit("symbol %s not in the %d files the server sent" % (symbol, len(files)))


def main():
    if len(sys.argv) != 2:
        raise SystemExit("usage: describe.py SYMBOL < reflection-answer.json")
    files = files_from(sys.stdin.read())
    print("\n".join(describe(files, sys.argv[1])))


if __name__ == "__main__":
    main()
