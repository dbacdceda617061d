"""The ferrum-rpc server: torch executors behind a grpc.aio servicer."""
