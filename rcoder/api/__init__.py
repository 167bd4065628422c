"""The gRPC edge: the only package that imports grpc or the generated code."""
