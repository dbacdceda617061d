"""The gRPC layer: protobuf in, domain calls to the engine, protobuf out; tenants, deadlines,
admission, metrics, streaming and undo of undelivered replies.  Imports no torch."""
