"""mlakv.Error: every failure of a Client call, with its gRPC status code."""

import grpc


class Error(Exception):
    """A failed call: `code` is a grpc.StatusCode, `message` the server's text.

    Input the client can reject before sending anything (an array of the wrong
    shape or dtype) raises Error with code INVALID_ARGUMENT and a message that
    starts with "client: ", so every mistake is caught by one `except`.
    """

    def __init__(self, code, message):
        super().__init__("%s: %s" % (code.name, message))
        self.code = code
        self.message = message

    @classmethod
    def from_rpc_error(cls, err):
        """Wraps a grpc.RpcError (raised by a stub call) into an Error."""
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "")


def client_error(message):
    """An INVALID_ARGUMENT found before anything was sent."""
    return Error(grpc.StatusCode.INVALID_ARGUMENT, "client: " + message)
