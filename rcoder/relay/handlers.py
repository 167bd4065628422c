"""A gRPC method handler made again around another behaviour, whatever its kind: what the relay's
interceptors do to a call (``rcoder.relay.secret`` refuses one without the secret,
``rcoder.relay.idle`` counts the calls in flight)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

_MAKERS = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def rewrapped(handler: grpc.RpcMethodHandler, wrap: Callable[[Any], Any]) -> grpc.RpcMethodHandler:
    """``handler`` with its behaviour ``b`` replaced by ``wrap(b)``, its (de)serializers kept."""
    for kind, make in _MAKERS.items():
        behavior = getattr(handler, kind, None)
        if behavior is not None:
            return make(wrap(behavior), request_deserializer=handler.request_deserializer,
                        response_serializer=handler.response_serializer)  # fmt: skip
    raise AssertionError(f"a gRPC handler of no known kind: {handler!r}")
