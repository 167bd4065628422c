"""Generated from proto/rcoder/v1 by scripts/gen_proto.py; never edit by hand."""
