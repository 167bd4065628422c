"""Generated from proto/rcoder/relay/v1 by scripts/gen_proto.py; never edit by hand."""
