"""rcoder: a gRPC daemon that runs ACP coding agents and resumes their conversations."""

__version__ = "0.1.0"
