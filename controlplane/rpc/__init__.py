"""gRPC adapters: protobuf <-> domain, and error mapping in one place."""
